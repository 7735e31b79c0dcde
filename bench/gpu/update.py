"""One PPO and one GRPO update of each family at release size on one CUDA GPU: time and peak
memory, through the trainer's own path (the ``update`` stage of ``bench/gpu/check.sh``;
bench/gpu/README.md names each piece it runs).

    python bench/gpu/update.py --updates 1     # --families pi0,openvla_oft --algos ppo,grpo; --device cpu --tiny

Per (family, algo): ``update_s`` of each update (the first also allocates the optimizer state),
``peak_mem_gib``, ``state_mem_gib`` (weights + optimizer state after it), ``samples``. The figures
so far are printed after each case; the last line is the complete result. Without CUDA (and no
``--device cpu``) it exits 2.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlvla3.harness.act_timing import device_or_exit, sync
from rlvla3.config import from_dict, read_yaml
from rlvla3.harness.bench import random_observation
from rlvla3.observation import Observation
from workers.algorithms.memory import enable_gradient_checkpointing
from workers.algorithms.update import TrainState, update
from workers.contract import EnvSpec
from workers.learner import Fragment, Learner, build_batch
from workers.model import build_policy
from workers.trajectory import EnvTrajectory, StepRecord

ROOT = Path(__file__).resolve().parents[2]

RELEASE = {"pi0": ("pi0_3b.yaml", False), "openvla_oft": ("openvla_oft_7b.yaml", True)}
"""family -> (its release model config under configs/models, LoRA on)."""
SPEC = EnvSpec(cameras={"front": (224, 224), "wrist": (224, 224)}, state_dim=8, action_dim=7, max_episode_steps=400)
TINY_SPEC = EnvSpec(cameras={"front": (32, 32)}, state_dim=8, action_dim=7, max_episode_steps=400)


def job_config(family: str, algo: str, args: argparse.Namespace) -> Any:
    """The trainer's config: the release model section (or the tiny one), the bench's algo."""
    model_file, lora = RELEASE[family]
    if args.tiny:
        model_file = f"{family}_tiny.yaml"
    model = read_yaml(ROOT / "configs" / "models" / model_file)["model"]
    model["lora"] = {"enabled": lora}
    return from_dict({
        "model": model,
        "env": {"group_size": args.group_size if algo == "grpo" else 1, "fragment_len": args.fragment_len},
        "algo": {"name": algo, "batch_steps": args.batch_steps, "minibatch_size": args.minibatch, "epochs": 1,
                 "max_staleness": 4, "grpo_reward": "return", "lr": 1e-5},
        "train": {"gradient_checkpointing": family in args.grad_ckpt.split(",")},
        "workers": {"device": args.device},
    })


def behaviour(policy: torch.nn.Module, spec: EnvSpec, n: int, seed: int) -> tuple[Observation, dict[str, np.ndarray]]:
    """``n + 1`` observations and the policy's act() outputs for them (as a generator sends)."""
    obs = random_observation(spec, n + 1, np.random.default_rng(seed), "pick up the puck and place it at the goal")
    outs: dict[str, list[np.ndarray]] = {}
    policy.eval()  # as a generator serves it; the trainer's update runs in train mode
    with torch.inference_mode():
        for lo in range(0, n, 16):  # in batches of 16, as a generator serves them
            out = policy.act(obs.select(slice(lo, min(n, lo + 16))))
            part = {"actions": out.actions, "logprob": out.logprob, "value": out.value,
                    **{f"replay/{k}": v for k, v in out.replay.items()}}
            for k, v in part.items():
                outs.setdefault(k, []).append(v.float().cpu().numpy() if v.is_floating_point() else v.cpu().numpy())
    policy.train()
    return obs, {k: np.concatenate(v) for k, v in outs.items()}


def fragments(obs: Observation, acts: dict[str, np.ndarray], algo: str, length: int, group: int,
              chunk: int) -> list[Fragment]:
    """Slot trajectories over the rows: PPO cuts an episode every ``length`` steps (not done,
    bootstrapped), GRPO ends an episode there, ``group`` episodes sharing a seed."""
    rng = np.random.default_rng(1)
    n = len(acts["value"])
    out = []
    for e, lo in enumerate(range(0, n, length)):
        hi = min(n, lo + length)
        traj = EnvTrajectory(env=e)
        traj.begin_episode("pick up the puck and place it at the goal", seed=e // group if algo == "grpo" else e)
        for i in range(lo, hi):
            last = algo == "grpo" and i == hi - 1
            traj.add(StepRecord(obs=obs.select(slice(i, i + 1)), actions=acts["actions"][i], logprob=acts["logprob"][i],
                                value=float(acts["value"][i]),
                                replay={k[len("replay/"):]: v[i] for k, v in acts.items() if k.startswith("replay/")},
                                version=0, reward=float(rng.normal()),
                                steps=chunk, terminated=last))
        header, tensors = traj.fragment(obs.select(slice(hi, hi + 1)), success=bool(rng.integers(2)))
        out.append(Fragment(header, tensors))
    return out


def gib(n: int) -> float:
    return round(n / 2**30, 2)


def run_case(policy: Any, family: str, algo: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    cfg = job_config(family, algo, args)
    spec = TINY_SPEC if args.tiny else SPEC
    state = TrainState.build(policy, cfg.algo)
    obs, acts = behaviour(policy, spec, cfg.algo.batch_steps, seed=0)
    frags = fragments(obs, acts, algo, cfg.env.fragment_len, cfg.env.group_size, cfg.model.chunk_size)
    learner = Learner(cfg)
    row: dict[str, Any] = {"update_s": [], "samples": [], "peak_mem_gib": None, "state_mem_gib": None}
    for k in range(args.updates):
        for f in frags:  # the same samples each time: fresh ones would cost act() time, not update time
            learner.add(Fragment(dict(f.header), f.arrays))
        units = learner.take(cfg.algo.batch_steps)
        if not units:
            raise RuntimeError(f"{algo}: the learner made no unit of {len(frags)} fragments")
        batch = build_batch(units, 0, cfg)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        t0 = time.perf_counter()
        result = update(state, batch, cfg.algo)
        sync(device)
        row["update_s"].append(round(time.perf_counter() - t0, 3))
        row["samples"].append(result.samples)
        if not result.trained:
            raise RuntimeError(f"{algo}: update {k} trained on nothing")
        row["policy_loss"] = round(float(result.diagnostics.get("policy_loss", float("nan"))), 5)
    if device.type == "cuda":
        row["peak_mem_gib"] = gib(torch.cuda.max_memory_allocated(device))
        row["state_mem_gib"] = gib(torch.cuda.memory_allocated(device))
    row["batch_steps"], row["minibatch"], row["units"] = cfg.algo.batch_steps, cfg.algo.minibatch_size, len(units)
    del state, learner, batch
    return row


def run_family(family: str, algos: list[str], args: argparse.Namespace, device: torch.device,
               results: dict[str, Any]) -> None:
    """Build once, then each algo's case on a fresh optimizer; ``results[family]`` is printed
    (with everything before it) after the build and after each case."""
    cfg = job_config(family, algos[0], args)
    t0 = time.perf_counter()
    policy = build_policy(cfg, TINY_SPEC if args.tiny else SPEC, device=str(device))
    policy.train()
    if cfg.train.gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    sync(device)
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    fam: dict[str, Any] = {"build_s": round(time.perf_counter() - t0, 1), "lora": cfg.model.lora.enabled,
                           "params_m": round(sum(p.numel() for p in policy.parameters()) / 1e6, 3),
                           "trainable_m": round(trainable / 1e6, 3), "dtype": str(next(policy.parameters()).dtype),
                           "gradient_checkpointing": cfg.train.gradient_checkpointing}
    print(f"{family}: {fam}", file=sys.stderr, flush=True)
    results[family] = fam
    print(json.dumps(results), flush=True)
    for algo in algos:
        try:
            fam[algo] = run_case(policy, family, algo, args, device)
        except torch.OutOfMemoryError as exc:
            fam[algo] = {"error": f"out of memory: {str(exc)[:300]}"}
        except Exception as exc:  # one case failing must not hide the others' figures
            fam[algo] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        print(f"  {algo}: {fam[algo]}", file=sys.stderr, flush=True)
        for p in policy.parameters():
            p.grad = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(json.dumps(results), flush=True)  # the figures so far: a run cut short keeps them


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="pi0,openvla_oft")
    ap.add_argument("--algos", default="ppo,grpo")
    ap.add_argument("--updates", type=int, default=2, help="updates per case (the first also allocates optimizer state)")
    ap.add_argument("--batch-steps", type=int, default=64, help="decisions per update")
    ap.add_argument("--minibatch", type=int, default=16, help="decisions per gradient step")
    ap.add_argument("--fragment-len", type=int, default=8, help="decisions per fragment / GRPO episode")
    ap.add_argument("--group-size", type=int, default=4, help="GRPO: episodes per group")
    ap.add_argument("--grad-ckpt", default="pi0,openvla_oft",
                    help="families trained with train.gradient_checkpointing (comma list; empty: none)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny configs (a smoke test of this script)")
    args = ap.parse_args()
    device = device_or_exit(args.device, "gpu_update")
    results: dict[str, Any] = {"_device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    for family in args.families.split(","):
        try:
            run_family(family, args.algos.split(","), args, device, results)
        except Exception as exc:
            results[family] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            print(f"{family}: FAILED {exc!r}", file=sys.stderr, flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(json.dumps(results), flush=True)  # the figures so far: a run cut short keeps them


if __name__ == "__main__":
    main()
