"""The paper's Table 1 on this machine: sync vs async_rollout vs async, side by side on one
simulator, plus each stage alone (simulators, generator, trainer).

Each mode is a real job (broker, simulators, one generator, one trainer: separate processes);
throughput is env steps per second (the paper's samples/s) over a window that starts once the
trainer has made its first update. ``stages_sps``, each in env steps/s: the simulator slots
stepping random actions (resets included) with no policy; the generator's batched forward with
no env; the trainer's update with no I/O. The slowest, ``bottleneck_sps``, is what a perfectly
overlapped pipeline reaches.

    python bench/jobs/ablation.py --quick                 # synthetic, < 60 s
    python bench/jobs/ablation.py --sim libero --window 60

Each ``--sim`` has its own default layout (``LAYOUTS``; flags override it). ``synthetic``'s long
step-time tail (4 ms, 5% at 80 ms) with enough envs in flight keeps a full batch for the slowest
stage; LIBERO's real resets (1-3 s) are its long tail, its episodes cut at 64 steps so that they
recur within a window.

Stand-ins for a VLA's cost on 2 CPU cores: the generator's forward pass sleeps ``--forward-ms``
per batch (``model.options.forward_delay_ms``), and every update lasts at least ``--train-cost``
seconds (``train.min_update_s``); by default as long as the generator alone needs to produce one
training batch, measured in the same run. ``train_cost_kind`` says whether the update was padded
with a sleep or its real compute was already longer.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("MUJOCO_GL", "egl")

from rlvla3.config import JobConfig, load
from rlvla3.harness.bench import emit_to, load_avg, note, parse_bench_args, random_observation, save_figure, subplots
from rlvla3.harness.jobs import start_job

MODES = ("sync", "async_rollout", "async")
STAGES = ("simulators", "generator", "trainer")
WARM_STEPS = 3
"""Steps each simulator slot takes before the stage's clock starts."""


BIMODAL = {"kind": "bimodal", "mean_ms": 4.0, "slow_ms": 80.0, "slow_prob": 0.05}
LAYOUTS: dict[str, dict[str, Any]] = {  # each simulator's config and its defaults (flags of those names override them)
    "synthetic": dict(config="synthetic.yaml", sims=2, envs=48, slots=24, max_batch=32, batch_steps=512, window=20.0,
                      stage_s=5.0, env_options={"latency": BIMODAL, "image_size": 16}),
    "metaworld": dict(config="metaworld_ml1_pickplace_rgb.yaml", sims=1, envs=4, slots=4, max_batch=4, batch_steps=32,
                      window=60.0, stage_s=30.0),
    "libero": dict(config="libero_spatial_rgb.yaml", sims=1, envs=4, slots=4, max_batch=4, batch_steps=8, window=60.0,
                   stage_s=30.0, env_options={"max_episode_steps": 64}),
    "maniskill": dict(config="maniskill_pickcube_rgb.yaml", sims=1, envs=2, slots=2, max_batch=2, batch_steps=16,
                      window=60.0, stage_s=30.0),
}


def job_config(args: argparse.Namespace, mode: str = "async", train_cost_s: float = 0.0) -> JobConfig:
    layout = LAYOUTS[args.sim]
    sets = [f"env.options.{k}={v}" for k, v in layout.get("env_options", {}).items()]
    return load(layout["config"], [
        *sets, f"env.num_envs={args.envs}", f"env.slots={args.slots}", "env.fragment_len=16",
        "model.family=mlp", f"model.options={{forward_delay_ms: {args.forward_ms}, hidden: 64}}",
        f"batching.max_batch={args.max_batch}", "batching.max_wait_ms=5", "batching.credits=2",
        f"algo.batch_steps={args.batch_steps}", "algo.epochs=2", f"algo.minibatch_size={min(128, args.batch_steps)}",
        f"algo.max_staleness={args.max_staleness}", "algo.checkpoint_every=0",
        f"workers.simulators={args.sims}", "workers.generators=1", "workers.trainers=1",
        f"train.min_update_s={train_cost_s}", f"run.mode={mode}", "run.progress_every_s=1",
    ])


def measure_mode(mode: str, job: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Wait until the trainer made its first update (every process up, the loop has turned
    once), then count env steps over ``args.window`` seconds. A window shorter than one sync
    round (``--smoke``'s, or any on a loaded machine) can fall inside an update, where a sync job
    steps no env: it then runs on until it holds an update and some env steps."""
    job.wait(lambda f: f.get("trainer_version", 0) >= 1, args.warmup_s, f"{mode}: a first update")
    load0 = load_avg()[0]
    window = job.rate(args.window)
    first, fig, seconds = window["first"], window["last"], window["window_s"]
    if fig["trainer_version"] == first["trainer_version"] or window["count"] == 0:
        t = time.monotonic()
        fig = job.wait(lambda f: f["trainer_version"] > first["trainer_version"] and f["env_steps"] > first["env_steps"],
                       args.warmup_s, f"{mode}: an update and env steps inside the window")
        seconds += time.monotonic() - t
    trainer = fig.get("trainer") or {}
    return {
        "sps": round((fig["env_steps"] - first["env_steps"]) / seconds, 2), "window_s": round(seconds, 2),
        "updates": fig["trainer_version"] - first["trainer_version"],
        "versions": fig["policy_version"], "batch_p50": fig["batch_size"].get("p50"),
        "queue_wait_p50_us": fig["queue_wait_us"].get("p50"), "generate_p50_us": fig["generate_us"].get("p50"),
        "update_s": trainer.get("update_s"), "compute_s": trainer.get("compute_s"),
        "admission_waits": fig.get("admission_waits"), "dropped_stale": fig.get("dropped_stale"),
        "load": [load0, load_avg()[0]],
    }


def run_modes(args: argparse.Namespace, train_cost_s: float) -> dict[str, dict[str, Any]]:
    """One job per mode, measured one after the other. The next job starts while the last one
    stops (neither is being measured then); a window begins only once the last job is gone.
    ``--smoke`` starts the three at once (no timing value there, and start-up is most of it)."""
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="rlvla3-ablation-") as tmp:
        jobs: dict[str, Any] = {}
        stopping: threading.Thread | None = None
        try:
            for mode in MODES if args.smoke else ():
                jobs[mode] = start_job(job_config(args, mode, train_cost_s), Path(tmp) / mode)
            for mode in MODES:
                if mode not in jobs:
                    jobs[mode] = start_job(job_config(args, mode, train_cost_s), Path(tmp) / mode)
                if stopping is not None:
                    stopping.join()
                out[mode] = measure_mode(mode, jobs[mode], args)
                note(f"{mode:>14}: {out[mode]['sps']:8.1f} env steps/s (load {out[mode]['load']})")
                if not args.smoke:  # stopping only signals and waits: a thread may do it
                    stopping = threading.Thread(target=jobs.pop(mode).stop, name=f"stop-{mode}")
                    stopping.start()
        finally:
            stops = [threading.Thread(target=job.stop) for job in jobs.values()]
            for t in stops:
                t.start()
            for t in [*stops, *([stopping] if stopping is not None else [])]:
                t.join()
    return out


def sim_stage_alone(cfg: JobConfig, seconds: float) -> float:
    """Every simulator slot stepping random actions, no policy: env steps/s. Slots are built
    first (not timed); an episode that ends is reset inside the timed loop, as in a job."""
    from workers.slots import slot_adapter

    k = cfg.env.num_envs // cfg.env.slots
    n_slots = cfg.workers.simulators * cfg.env.slots
    counts = [0] * n_slots
    built = threading.Barrier(n_slots + 1)
    go = threading.Event()
    t_end = [0.0]

    def slot(i: int) -> None:
        env = None
        try:
            env = slot_adapter(cfg.env, k, seed=i)
            rng = np.random.default_rng(i)
            ids = list(range(k))
            env.reset(ids, None)
            for _ in range(WARM_STEPS):  # first renders are slow (contexts, shaders): not timed
                env.step(ids, rng.uniform(-1, 1, (k, env.spec.action_dim)).astype(np.float32))
        finally:
            built.wait()
        go.wait()
        try:
            while time.monotonic() < t_end[0]:
                res = env.step(ids, rng.uniform(-1, 1, (k, env.spec.action_dim)).astype(np.float32))
                counts[i] += k
                done = [j for j in ids if res.terminated[j] or res.truncated[j]]
                if done:
                    env.reset(done, None)
        finally:
            env.close()

    threads = [threading.Thread(target=slot, args=(i,), daemon=True) for i in range(n_slots)]
    for t in threads:
        t.start()
    built.wait()
    t0 = time.monotonic()
    t_end[0] = t0 + seconds
    go.set()
    for t in threads:
        t.join()
    return sum(counts) / (time.monotonic() - t0)


def generator_stage_alone(cfg: JobConfig, seconds: float) -> float:
    """Batched forward passes of ``max_batch`` envs, no env: decisions/s."""
    import torch

    from workers.model import build_policy, job_spec

    policy = build_policy(cfg).eval()
    n = cfg.batching.max_batch
    obs = random_observation(job_spec(cfg), n, np.random.default_rng(0))
    done, t0 = 0, time.monotonic()
    with torch.inference_mode():
        while time.monotonic() - t0 < seconds:
            policy.act(obs)
            done += n
    return done / (time.monotonic() - t0)


def trainer_stage_alone(cfg: JobConfig, seconds: float) -> tuple[float, float]:
    """The trainer's update (``workers.algorithms.update``, ``train.min_update_s`` included) on
    ``batch_steps`` decisions, no I/O: (decisions/s, the update's compute time without pad)."""
    import torch

    from workers.algorithms.update import TrainBatch, TrainState, update
    from workers.model import build_policy, job_spec

    policy = build_policy(cfg).train()
    state = TrainState.build(policy, cfg.algo)
    n, frag, chunk = cfg.algo.batch_steps, cfg.env.fragment_len, cfg.model.chunk_size
    spec, rng = job_spec(cfg), np.random.default_rng(0)
    lengths = [min(frag, n - i) for i in range(0, n, frag)]
    act = policy.act(random_observation(spec, 1, rng)).actions
    samples = {"obs": random_observation(spec, n, rng), "actions": torch.randn(n, *act.shape[1:]), "replay": {},
               "behav_logprob": torch.zeros(n, chunk) - 1.0, "values": torch.zeros(n)}
    bootstrap = {"obs": random_observation(spec, len(lengths), rng), "actions": torch.randn(len(lengths), *act.shape[1:]),
                 "replay": {}}
    batch = TrainBatch(samples=samples, keep=np.ones(n, bool), staleness=np.zeros(n, np.int64),
                       rewards=torch.randn(n), terminated=torch.zeros(n, dtype=torch.bool), lengths=lengths,
                       bootstrap=bootstrap, advantages=None, env_steps=n * chunk)
    done, compute, t0 = 0, [], time.monotonic()
    while time.monotonic() - t0 < seconds or not compute:
        result = update(state, batch, cfg.algo, min_s=cfg.train.min_update_s)
        compute.append(result.compute_s)
        done += n
    return done / (time.monotonic() - t0), float(np.median(compute))


def plot(result: dict[str, Any], path: Path) -> None:
    rows = [("sync", result["sync_sps"], "#999999"), ("async rollout", result["async_rollout_sps"], "#6699cc"),
            ("async", result["async_sps"], "#3366aa")]
    rows += [(f"{s} alone", result["stages_sps"][s], "#cc6633") for s in STAGES]
    fig, ax = subplots(figsize=(7, 3.8))
    ys = np.arange(len(rows))[::-1]
    ax.barh(ys, [r[1] for r in rows], color=[r[2] for r in rows])
    ax.set_yticks(ys, [r[0] for r in rows])
    top = max(r[1] for r in rows)
    for y, (name, v, _) in zip(ys, rows):
        label = f"{v:,.1f}"
        if name in ("async rollout", "async"):
            label += f"  ({v / max(result['sync_sps'], 1e-9):.2f}x sync)"
        ax.text(v + top * 0.01, y, label, va="center", fontsize=8)
    ax.set_xlim(0, top * 1.3)
    ax.set_xlabel("samples / s (env steps)")
    ax.set_title(f"{result['sim']}: train cost {result['train_cost_s']:.3f} s ({result['train_cost_kind']}), "
                 f"load {result['load'][0]}-{result['load'][1]}", fontsize=9)
    save_figure(fig, path, 120)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sim", choices=sorted(LAYOUTS), default="synthetic")
    ap.add_argument("--train-cost", default="auto",
                    help="seconds every update lasts at least (train.min_update_s); 'auto': the generator's "
                         "time for one batch alone, measured first; 0: the real update only")
    ap.add_argument("--window", type=float, help="seconds measured per mode (default: the simulator's)")
    ap.add_argument("--stage-s", type=float, help="seconds per stage alone (default: the simulator's)")
    ap.add_argument("--warmup-s", type=float, default=900.0, help="most seconds a job may take to its first update")
    ap.add_argument("--sims", type=int, help="simulator workers")
    ap.add_argument("--envs", type=int, help="envs per simulator")
    ap.add_argument("--slots", type=int, help="slots per simulator")
    ap.add_argument("--max-batch", type=int)
    ap.add_argument("--batch-steps", type=int, help="decisions per update")
    ap.add_argument("--max-staleness", type=int, default=4)
    ap.add_argument("--forward-ms", type=float, default=20.0, help="generator forward time per batch")
    args = parse_bench_args(ap, "short windows: under 60 s in all (synthetic)")
    for key in ("window", "stage_s", "sims", "envs", "slots", "max_batch", "batch_steps"):
        if getattr(args, key) is None:
            setattr(args, key, LAYOUTS[args.sim][key])
    if args.quick:
        args.window, args.stage_s = 5.0, 1.5
    if args.smoke:  # one small simulator, a short window: every mode and stage still runs
        args.window, args.stage_s, args.warmup_s = 0.5, 0.2, 120.0
        args.sims, args.envs, args.slots, args.max_batch, args.batch_steps = 1, 8, 4, 8, 32
    return args


def main() -> None:
    from workers.model import job_spec

    args = parse_args()
    out = Path(args.out)
    import torch

    torch.set_num_threads(1)  # as every worker process runs (workers.torch_threads)
    load0 = load_avg()[0]
    cfg = job_config(args)
    chunk = cfg.model.chunk_size

    # ---- the generator alone fixes the trainer's cost ------------------------------------------
    gen = generator_stage_alone(cfg, args.stage_s)
    train_cost_s = args.batch_steps / gen if args.train_cost == "auto" else float(args.train_cost)
    cfg = job_config(args, train_cost_s=train_cost_s)
    trainer, compute_s = trainer_stage_alone(cfg, args.stage_s)
    sims = sim_stage_alone(cfg, args.stage_s)
    stages = {"simulators": sims, "generator": gen * chunk, "trainer": trainer * chunk}
    note(f"stages alone (env steps/s): {', '.join(f'{k} {v:.1f}' for k, v in stages.items())}; "
         f"train cost {train_cost_s:.3f} s, compute {compute_s:.3f} s")

    # ---- the three modes -----------------------------------------------------------------------
    modes = run_modes(args, train_cost_s)

    sps = {mode: round(modes[mode]["sps"], 1) for mode in MODES}
    bottleneck = round(min(stages.values()), 1)
    result: dict[str, Any] = {
        "sim": args.sim, "window_s": args.window,
        **{f"{mode}_sps": sps[mode] for mode in MODES}, **{f"{mode}_detail": modes[mode] for mode in MODES},
        "stages_sps": {k: round(v, 1) for k, v in stages.items()},
        "bottleneck_stage": min(stages, key=stages.get), "bottleneck_sps": bottleneck,
        "trainer_sps": round(stages["trainer"], 1),
        "train_cost_s": round(train_cost_s, 4), "train_cost_kind": "sleep" if train_cost_s > compute_s else "compute",
        "train_compute_s": round(compute_s, 4),
        "async_over_sync": round(sps["async"] / max(sps["sync"], 1e-9), 2),
        "async_over_async_rollout": round(sps["async"] / max(sps["async_rollout"], 1e-9), 2),
        "async_of_bottleneck": round(sps["async"] / max(bottleneck, 1e-9), 3),
        "layout": {"sims": args.sims, "envs": args.envs, "slots": args.slots, "max_batch": args.max_batch,
                   "batch_steps": args.batch_steps, "chunk": chunk, "max_staleness": args.max_staleness,
                   "forward_ms": args.forward_ms, "cameras": sorted(job_spec(cfg).cameras)},
        "load": [load0, load_avg()[0]],
    }
    plot(result, out / f"ablation_{args.sim}.png")
    emit_to(out, f"ablation_{args.sim}.json", result)


if __name__ == "__main__":
    main()
