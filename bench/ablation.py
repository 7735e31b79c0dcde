"""The paper's ablation on this machine: sync vs async_rollout vs async, side by side, on the
synthetic task with a long-tailed step-time profile, plus each stage measured alone.

Each mode is a real job (broker + 2 simulators + 1 generator + 1 trainer, separate processes).
Throughput is env steps per second over a window after warm-up. ``bottleneck_sps`` is the
slowest stage's throughput when it runs alone (simulator slots stepping with no policy in the
loop; the generator's batched forward with no env; the trainer's update with no I/O): the
ceiling that a perfectly overlapped pipeline reaches.

    python bench/ablation.py --quick            # < 60 s; writes bench/out/ablation.png
    python bench/ablation.py --window 30 --out /tmp/ablation

The generator's forward pass sleeps ``--forward-ms`` per batch (``model.options.forward_delay_ms``):
the stand-in for a VLA's GPU inference, so the three stages have comparable costs on 2 cores.
The default layout (2 simulators x 48 envs in slots of 2) keeps enough envs in flight for the
slowest stage to always find a full batch waiting: with fewer, async is bounded by the closed
loop's depth (32 envs per simulator measured 74% of the bottleneck, 48 measured 96%).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlvla3.config import load  # noqa: E402
from rlvla3.observation import Observation  # noqa: E402

from _common import OUT_DIR, local_job  # noqa: E402  (bench/, the script's folder, is first on sys.path)

MODES = ("sync", "async_rollout", "async")


def job_overrides(args: argparse.Namespace) -> list[str]:
    lat = f"{{kind: bimodal, mean_ms: {args.step_ms}, slow_ms: {args.slow_ms}, slow_prob: {args.slow_prob}}}"
    return [
        f"env.num_envs={args.envs}", f"env.slots={args.slots}", "env.fragment_len=16",
        f"env.options.latency={lat}", "env.options.image_size=16",
        f"model.options.forward_delay_ms={args.forward_ms}", "model.options.hidden=64",
        f"batching.max_batch={args.max_batch}", "batching.max_wait_ms=5", "batching.credits=2",
        f"algo.batch_steps={args.batch_steps}", "algo.epochs=2", "algo.minibatch_size=128",
        "algo.max_staleness=1000000", f"workers.simulators={args.sims}", "workers.generators=1", "workers.trainers=1",
        "run.progress_every_s=1",
    ]


# ---------------------------------------------------------------------------------------------
# Each mode as a real job
# ---------------------------------------------------------------------------------------------


def measure_mode(mode: str, args: argparse.Namespace, root: Path) -> dict:
    cfg = load("synthetic.yaml", [*job_overrides(args), f"run.mode={mode}"])
    job = local_job(cfg, root / mode)
    try:
        job.start_all()
        deadline = time.monotonic() + 60
        fig = job.status()
        while fig["env_steps"] < args.warmup_steps:  # warm: every process up, first updates done
            if time.monotonic() > deadline:
                raise RuntimeError(f"{mode}: no progress; logs in {job.run_dir}")
            time.sleep(0.2)
            fig = job.status()
        t0, s0 = time.monotonic(), fig["env_steps"]
        time.sleep(args.window)
        fig = job.status()
        t1, s1 = time.monotonic(), fig["env_steps"]
        return {
            "sps": (s1 - s0) / (t1 - t0), "versions": fig["policy_version"],
            "batch_p50": fig["batch_size"].get("p50"), "queue_wait_p50_us": fig["queue_wait_us"].get("p50"),
            "generate_p50_us": fig["generate_us"].get("p50"),
        }
    finally:
        job.stop()


# ---------------------------------------------------------------------------------------------
# Each stage alone
# ---------------------------------------------------------------------------------------------


def sim_stage_alone(args: argparse.Namespace, seconds: float) -> float:
    """All simulator slots stepping with random actions, no policy: env steps/s."""
    from workers.envs.base import make_env

    cfg = load("synthetic.yaml", job_overrides(args))
    k = args.envs // args.slots
    counts = [0] * (args.sims * args.slots)
    stop = time.monotonic() + seconds

    def slot(i: int) -> None:
        env = make_env("synthetic", k, seed=i, options=cfg.env.options)
        rng = np.random.default_rng(i)
        ids = list(range(k))
        env.reset(ids, None)
        while time.monotonic() < stop:
            res = env.step(ids, rng.uniform(-1, 1, (k, 2)).astype(np.float32))
            counts[i] += k
            done = [j for j in ids if res.terminated[j] or res.truncated[j]]
            if done:
                env.reset(done, None)

    threads = [threading.Thread(target=slot, args=(i,)) for i in range(len(counts))]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.monotonic() - t0)


def generator_stage_alone(args: argparse.Namespace, seconds: float) -> float:
    """Batched forward passes of max_batch envs, no env: env steps/s (chunk 1)."""
    import torch

    from workers.model import build_policy

    cfg = load("synthetic.yaml", job_overrides(args))
    policy = build_policy(cfg).eval()
    n = args.max_batch
    obs = Observation({"top": np.zeros((n, 16, 16, 3), np.uint8)}, np.zeros((n, 4), np.float32), ["reach the red dot"] * n)
    done, t0 = 0, time.monotonic()
    with torch.inference_mode():
        while time.monotonic() - t0 < seconds:
            policy.act(obs)
            done += n
    return done / (time.monotonic() - t0)


def trainer_stage_alone(args: argparse.Namespace, seconds: float) -> float:
    """PPO updates on batch_steps decisions, no I/O: decision steps/s."""
    import torch

    from workers.algorithms.ppo import make_optimizer, ppo_update
    from workers.model import build_policy

    cfg = load("synthetic.yaml", job_overrides(args))
    policy = build_policy(cfg).train()
    opt = make_optimizer(policy.parameters(), cfg.algo)
    n = args.batch_steps
    rng = np.random.default_rng(0)
    batch = {
        "obs": Observation({"top": rng.integers(0, 255, (n, 16, 16, 3), dtype=np.uint8)},
                           rng.random((n, 4), dtype=np.float32), ["x"] * n),
        "actions": torch.randn(n, 1, 2), "replay": {}, "behav_logprob": torch.zeros(n, 1) - 1.0,
        "advantages": torch.randn(n), "returns": torch.randn(n), "values": torch.zeros(n),
    }
    done, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        ppo_update(policy, opt, dict(batch), cfg.algo)
        done += n
    return done / (time.monotonic() - t0)


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["sync_sps", "async_rollout_sps", "async_sps", "bottleneck_sps"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([k.replace("_sps", "") for k in keys], [result[k] for k in keys], color=["#999", "#69c", "#36a", "#c63"])
    ax.set_ylabel("env steps / s")
    ax.set_title("synthetic task, long-tailed step times")
    fig.tight_layout()
    fig.savefig(out / "ablation.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short windows: under 60 s in all")
    ap.add_argument("--window", type=float, default=20.0, help="seconds measured per mode")
    ap.add_argument("--warmup-steps", type=int, default=600)
    ap.add_argument("--sims", type=int, default=2)
    ap.add_argument("--envs", type=int, default=48, help="envs per simulator")
    ap.add_argument("--slots", type=int, default=24, help="slots per simulator")
    ap.add_argument("--step-ms", type=float, default=4.0, help="usual step time")
    ap.add_argument("--slow-ms", type=float, default=80.0, help="long-tail step time")
    ap.add_argument("--slow-prob", type=float, default=0.05, help="probability of a long-tail step")
    ap.add_argument("--forward-ms", type=float, default=20.0, help="generator forward time per batch")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--batch-steps", type=int, default=512)
    ap.add_argument("--out", default=OUT_DIR, help="folder for ablation.png (default: ./bench/out)")
    ap.add_argument("--smoke", action="store_true", help="tiny run for CI (no timing value)")
    args = ap.parse_args()
    if args.quick:
        args.window, args.warmup_steps = 6.0, 300
    stage_s = 2.0 if args.quick else 5.0
    if args.smoke:  # one small simulator, a short window: every mode and stage still runs
        args.window, args.warmup_steps, stage_s = 1.0, 64, 0.3
        args.sims, args.envs, args.slots, args.max_batch, args.batch_steps = 1, 8, 4, 8, 128
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(1)  # as every worker process runs (workers.torch_threads)

    result: dict = {"window_s": args.window}
    with tempfile.TemporaryDirectory(prefix="rlvla3-ablation-") as tmp:
        for mode in MODES:
            r = measure_mode(mode, args, Path(tmp))
            result[f"{mode}_sps"] = round(r["sps"], 1)
            result[f"{mode}_detail"] = r
            print(f"{mode:>14}: {r['sps']:8.1f} env steps/s", file=sys.stderr)
    stages = {
        "simulators": sim_stage_alone(args, stage_s),
        "generator": generator_stage_alone(args, stage_s),
        "trainer": trainer_stage_alone(args, stage_s),
    }
    result["stages_sps"] = {k: round(v, 1) for k, v in stages.items()}
    rollout = {k: stages[k] for k in ("simulators", "generator")}
    # Env steps flow through simulators and generator; the trainer consumes at its own pace
    # (admission control throttles rollouts only when staleness would pass max_staleness).
    result["bottleneck_stage"] = min(rollout, key=rollout.get)
    result["bottleneck_sps"] = round(min(rollout.values()), 1)
    result["trainer_sps"] = round(stages["trainer"], 1)
    result["async_over_sync"] = round(result["async_sps"] / max(result["sync_sps"], 1e-9), 2)
    result["async_of_bottleneck"] = round(result["async_sps"] / max(result["bottleneck_sps"], 1e-9), 3)
    plot(result, out)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
