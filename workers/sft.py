"""Warm start: behaviour cloning from a scripted expert (or recorded demonstrations).

Real VLA RL starts from a supervised checkpoint, not from scratch. ``rlvla3 sft CONFIG``:

  1. collects demonstrations: the env's scripted expert drives in-process envs (Meta-World ships
     one per task; ManiSkill ships motion-planning solutions, see workers/envs/maniskill_expert.py;
     the synthetic reach task's is a straight line to the goal), one decision per
     ``model.chunk_size`` expert actions - or reads recorded ones (``--demos FILE.npz``);
  2. trains the job's policy on the expert chunks by its family's own loss (``Policy.sft_loss``):
     the log-prob of the chunk for ``mlp`` (Gaussian NLL of the mean with the exploration std
     held fixed, so RL still explores afterwards) and OpenVLA-OFT; flow matching for pi0, pi0.5
     and GR00T (``FlowPolicy.sft_loss``);
  3. writes ``OUT/model.safetensors`` (+ ``config.yaml``, ``sft.json``), which ``rlvla3 run``
     starts from with ``model.checkpoint: OUT`` (``workers.model.load_checkpoint_weights``).

Demonstration file (``.npz``), N decisions, chunk T, action dim A::

    state [N, D] float32     images/<cam> [N, H, W, 3] uint8 (one per camera)
    actions [N, T, A] float32     instruction [N] str     episode [N] int64

(the observation's arrays are named as on the wire: ``Observation.to_tensors``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import structlog
import torch

from rlvla3.config import JobConfig
from rlvla3.observation import Observation
from workers.envs.base import EnvAdapter, make_env

log = structlog.get_logger()

ExpertFn = Callable[[EnvAdapter, list[int], Observation], np.ndarray]
"""(env, ids, obs of those ids) -> expert actions [n, A] for one env step."""


# ---------------------------------------------------------------------------------------------
# Experts
# ---------------------------------------------------------------------------------------------


def synthetic_expert(env: EnvAdapter, ids: list[int], obs: Observation) -> np.ndarray:
    """Straight to the goal at full speed: state is (pos, goal)."""
    state = np.asarray(obs.state, np.float32)
    speed = float(getattr(getattr(env, "opts", None), "speed", 0.1))
    return np.clip((state[:, 2:4] - state[:, 0:2]) / speed, -1.0, 1.0).astype(np.float32)


def metaworld_expert(env: EnvAdapter, ids: list[int], obs: Observation) -> np.ndarray:
    from workers.envs.metaworld import expert_action

    return expert_action(env, ids)


def maniskill_expert(cfg: JobConfig) -> ExpertFn:
    """mani_skill's shipped motion-planning solution, planned per episode in a child process."""
    from workers.envs.maniskill_expert import ManiSkillExpert

    return ManiSkillExpert()


EXPERTS: dict[str, Callable[[JobConfig], ExpertFn]] = {
    "synthetic": lambda cfg: synthetic_expert,
    "metaworld": lambda cfg: metaworld_expert,
    "maniskill": maniskill_expert,
}
"""Per env name: the expert for a job (an expert with a ``close()`` is closed after collecting)."""


def expert_for(cfg: JobConfig) -> ExpertFn:
    if cfg.env.name not in EXPERTS:
        raise SystemExit(f"sft: env {cfg.env.name!r} has no scripted expert (have: {sorted(EXPERTS)}); "
                         "record demonstrations and pass --demos FILE.npz")
    return EXPERTS[cfg.env.name](cfg)


# ---------------------------------------------------------------------------------------------
# Collecting demonstrations
# ---------------------------------------------------------------------------------------------


def collect_demos(cfg: JobConfig, episodes: int, seed: int = 12345, num_envs: int = 4) -> dict[str, np.ndarray]:
    """Roll the scripted expert in ``num_envs`` in-process envs for ``episodes`` episodes.

    One decision = the observation at a chunk's start and the next ``chunk_size`` expert
    actions (an episode ending mid-chunk repeats its last action to fill the chunk). Episodes
    the expert failed are left out: the warm start clones success only.
    """
    expert = expert_for(cfg)
    T = cfg.model.chunk_size
    env = make_env(cfg.env.name, num_envs=num_envs, seed=seed, options=cfg.env.options, plugins=cfg.env.plugins)
    kept_obs: list[Observation] = []  # one row per decision
    rows: dict[str, list] = {"actions": [], "episode": []}
    started, kept, successes = 0, 0, 0
    try:
        ids = list(range(num_envs))
        seeds = [seed + k for k in ids]
        started = num_envs
        ep_of = list(range(num_envs))
        obs = env.reset(ids, seeds)
        open_eps: dict[int, list[tuple]] = {i: [] for i in ids}
        active = set(ids)
        while active:
            live = sorted(active)
            starts = {i: obs.select([k]) for k, i in enumerate(live)}
            chunk = {i: np.zeros((T, env.spec.action_dim), np.float32) for i in live}
            done: dict[int, bool] = {}
            cur_ids = list(live)
            cur_obs = obs
            for t in range(T):
                a = expert(env, cur_ids, cur_obs)
                res = env.step(cur_ids, a)
                still, keep_rows = [], []
                for k, i in enumerate(cur_ids):
                    chunk[i][t] = a[k]
                    if res.terminated[k] or res.truncated[k]:
                        chunk[i][t + 1:] = a[k]
                        done[i] = bool(res.success[k])
                    else:
                        still.append(i)
                        keep_rows.append(k)
                cur_obs = res.obs.select(keep_rows)
                if not still:
                    break
                cur_ids = still
            for i in live:
                open_eps[i].append((starts[i], chunk[i]))
            # finished episodes: keep the successful ones, restart the env while episodes remain
            restart = []
            for i, success in done.items():
                successes += int(success)
                if success:
                    kept += 1
                    for row_obs, acts in open_eps[i]:
                        kept_obs.append(row_obs)
                        rows["actions"].append(acts)
                        rows["episode"].append(ep_of[i])
                open_eps[i] = []
                if started < episodes:
                    ep_of[i] = started
                    started += 1
                    restart.append(i)
                else:
                    active.discard(i)
            continuing = [i for i in live if i not in done]
            nxt_ids = continuing + restart
            if not nxt_ids:
                break
            parts = []
            if continuing:
                pos = {i: k for k, i in enumerate(cur_ids)}
                parts.append(cur_obs.select([pos[i] for i in continuing]))
            if restart:
                parts.append(env.reset(restart, [seed + ep_of[i] for i in restart]))
            obs = Observation.concat(parts).select(np.argsort(nxt_ids))
    finally:
        env.close()
        getattr(expert, "close", lambda: None)()
    log.info("sft_demos_collected", episodes=started, kept=kept, expert_success=successes / max(started, 1),
             decisions=len(kept_obs))
    if not kept_obs:
        raise SystemExit("sft: the expert produced no usable episode")
    demo_obs = Observation.concat(kept_obs)
    return {
        **demo_obs.to_tensors(),
        "actions": np.stack(rows["actions"]).astype(np.float32),
        "instruction": np.asarray(demo_obs.instruction),
        "episode": np.asarray(rows["episode"], np.int64),
    }


def save_demos(path: str | Path, demos: dict[str, np.ndarray]) -> None:
    np.savez_compressed(path, **demos)


def load_demos(path: str | Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as f:
        demos = {k: f[k] for k in f.files}
    for k in ("state", "actions", "instruction"):
        if k not in demos:
            raise SystemExit(f"sft: {path} lacks {k!r} (see workers/sft.py for the format)")
    return demos


# ---------------------------------------------------------------------------------------------
# Behaviour cloning
# ---------------------------------------------------------------------------------------------


def behaviour_clone(policy: torch.nn.Module, demos: dict[str, np.ndarray], epochs: int, lr: float = 1e-3,
                    minibatch_size: int = 128, seed: int = 0) -> list[float]:
    """Minimise the policy's ``sft_loss`` on the expert chunks; returns the loss per epoch.

    Parameters named ``log_std`` are held fixed: NLL would shrink the exploration noise towards
    the (deterministic) expert's, and RL after the warm start needs it.
    """
    params = [p for n, p in policy.named_parameters() if p.requires_grad and not n.endswith("log_std")]
    opt = torch.optim.Adam(params, lr=lr)
    n = len(demos["state"])
    rng = np.random.default_rng(seed)
    actions_all = torch.as_tensor(demos["actions"])
    obs_all = Observation.from_tensors(demos, [str(s) for s in demos["instruction"]])
    losses = []
    policy.train()
    for _ in range(epochs):
        perm = rng.permutation(n)
        total, count = 0.0, 0
        for s in range(0, n, minibatch_size):
            idx = perm[s:s + minibatch_size]
            loss = policy.sft_loss(obs_all.select(idx), actions_all[idx].to(policy.device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            total += float(loss.detach()) * len(idx)
            count += len(idx)
        losses.append(total / count)
        if len(losses) % max(1, epochs // 10) == 0 or len(losses) == epochs:  # ten lines a warm start, not one per epoch
            log.info("sft_epoch", epoch=len(losses), epochs=epochs, loss=round(losses[-1], 5))
    return losses


def evaluate_policy(cfg: JobConfig, policy: torch.nn.Module, episodes: int, seed: int = 777, num_envs: int = 4) -> dict[str, float]:
    """Deterministic success rate and mean return over ``episodes`` held-out starts (seeds
    ``seed..seed+episodes-1``), run by ``workers.evaluation.run_protocol`` as ``rlvla3 eval`` does."""
    from workers.evaluation import Protocol, run_protocol

    proto = Protocol(f"{cfg.env.name}: seeds {seed}..{seed + episodes - 1}", 1, [seed + i for i in range(episodes)],
                     dict(cfg.env.options))
    try:
        eps = run_protocol(cfg, policy, proto, envs_per_task=num_envs)
    finally:
        policy.train()
    return {"success": float(np.mean([e.success for e in eps])), "return": float(np.mean([e.ret for e in eps])),
            "episodes": len(eps)}


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def run_sft(cfg: JobConfig, out: str | Path, episodes: int = 128, epochs: int = 50, demos_path: str | None = None,
            save_demos_to: str | None = None, eval_episodes: int = 32, lr: float = 3e-3,
            minibatch_size: int = 64) -> dict[str, Any]:
    """Collect (or read) demonstrations, clone them, write ``out/model.safetensors``; returns figures."""
    from safetensors.torch import save_model

    from workers.model import build_policy

    t0 = time.monotonic()
    torch.set_num_threads(max(1, cfg.workers.torch_threads))
    demos = load_demos(demos_path) if demos_path else collect_demos(cfg, episodes, seed=cfg.run.seed * 7919 + 12345)
    if save_demos_to:
        save_demos(save_demos_to, demos)
    t_collect = time.monotonic() - t0
    policy = build_policy(cfg, device="cpu")
    before = evaluate_policy(cfg, policy, eval_episodes) if eval_episodes else {}
    losses = behaviour_clone(policy, demos, epochs, lr=lr, minibatch_size=minibatch_size, seed=cfg.run.seed)
    after = evaluate_policy(cfg, policy, eval_episodes) if eval_episodes else {}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_model(policy, str(out / "model.safetensors"), metadata={"sft_decisions": str(len(demos["state"]))})
    (out / "config.yaml").write_text(cfg.to_yaml())
    figures = {
        "out": str(out), "decisions": int(len(demos["state"])), "demo_episodes": int(len(np.unique(demos.get("episode", [0])))),
        "epochs": epochs, "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
        "success_before": before.get("success"), "success_after": after.get("success"),
        "return_before": before.get("return"), "return_after": after.get("return"),
        "collect_s": round(t_collect, 1), "seconds": round(time.monotonic() - t0, 1),
    }
    (out / "sft.json").write_text(json.dumps(figures, indent=1))
    log.info("sft_done", **figures)
    return figures
