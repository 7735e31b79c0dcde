"""The paper's Fig. 8 on this machine, then the adaptive controller on the same job.

One real job (separate processes) is started once; the sweep reconfigures it live
(``rlvla3.app.launch.request_tune``: a TUNE from a ``client``) to each ``max_batch`` x
``max_wait_ms`` grid point and measures env steps/s over a window. Then it sets the worst grid
point, turns ``batching.adaptive`` on within the grid's bounds, and measures what the controller
reaches (median of ``--adaptive-runs`` runs, each from the worst point; how fast it re-adapts when
the load changes is ``tests/test_adaptive.py``'s). Writes ``batching_sweep.png`` (the heat map)
and ``batching_sweep.json`` under ``--out``.

    python bench/broker/batching_sweep.py --quick                    # 3x3 grid + adaptive, < 3 min
    python bench/broker/batching_sweep.py --profile replay:bench/out/profile.json

The generator's forward pass costs ``a + c*b`` ms for a batch of b envs (``--fwd-a``, ``--fwd-c``),
the shape ``bench/stages/generator.py`` measures: pi0's tiny config on this CPU took ~126 ms +
22 ms/env for batches 2-8; the defaults keep that ratio at a tenth of the scale so that a window
holds hundreds of batches. ``--profile``: ``bimodal`` (configs/synthetic.yaml's), ``constant``,
``lognormal``, or ``replay:FILE`` (``bench/stages/sim_latency.py --save-profile FILE``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from rlvla3.app.launch import request_tune
from rlvla3.config import load
from rlvla3.harness.bench import BenchRun, emit_to, note, parse_bench_args, save_figure, subplots
from rlvla3.harness.jobs import Job, start_job

PROFILES = {
    "bimodal": "{kind: bimodal, mean_ms: 2.0, slow_ms: 40.0, slow_prob: 0.05}",
    "constant": "{kind: constant, mean_ms: 3.0}",
    "lognormal": "{kind: lognormal, mean_ms: 3.0, sigma: 1.0}",
}


def latency_option(profile: str) -> str:
    if profile.startswith("replay:"):
        path = Path(profile.split(":", 1)[1]).resolve()
        if not path.exists():
            raise SystemExit(f"--profile {profile}: no such file (write one with bench/stages/sim_latency.py --save-profile)")
        return f"{{kind: replay, replay: '{path}'}}"
    if profile not in PROFILES:
        raise SystemExit(f"--profile {profile!r}: one of {sorted(PROFILES)} or replay:FILE")
    return PROFILES[profile]


def job_overrides(args: argparse.Namespace) -> list[str]:
    b, w = args.batches, args.waits
    return [
        f"env.num_envs={args.envs}", f"env.slots={args.slots}", "env.fragment_len=16",
        f"env.options.latency={latency_option(args.profile)}", "env.options.image_size=16",
        f"model.options.forward_delay_ms={args.fwd_a}", f"model.options.forward_per_env_ms={args.fwd_c}",
        "model.options.hidden=32", "run.mode=async", "run.progress_every_s=5", "run.total_env_steps=1000000000",
        f"batching.max_batch={b[0]}", f"batching.max_wait_ms={w[-1]}", "batching.credits=2",
        f"batching.adaptive_min_batch={min(b)}", f"batching.adaptive_max_batch={max(b)}",
        f"batching.adaptive_min_wait_ms={min(w)}", f"batching.adaptive_max_wait_ms={max(w)}",
        f"batching.adaptive_window_s={args.adaptive_window}",
        "algo.batch_steps=2048", "algo.epochs=1", "algo.minibatch_size=1024", "algo.max_staleness=1000000",
        f"workers.simulators={args.sims}", "workers.generators=1", "workers.trainers=1",
    ]


def sweep(job: Job, args: argparse.Namespace) -> dict[str, float]:
    grid: dict[str, float] = {}
    for b in args.batches:
        for w in args.waits:
            request_tune(job.endpoint, max_batch=b, max_wait_ms=w, adaptive=False)
            time.sleep(args.settle)  # the queue drains into the new rule
            grid[f"{b}x{w}"] = round(job.rate(args.window)["rate"], 1)
            note(f"grid max_batch={b:3d} max_wait_ms={w:5g}: {grid[f'{b}x{w}']:8.1f} env steps/s")
    return grid


def follow(job: Job, seconds: float) -> list[dict]:
    """The 2 s served rate and the batching rule in force, for ``seconds``."""
    t0, curve = time.monotonic(), []
    while time.monotonic() - t0 < seconds:
        window = job.rate(2.0)
        sps, fig = window["rate"], window["last"]["batching"]
        curve.append({"t_s": round(time.monotonic() - t0, 1), "sps": round(sps, 1),
                      "max_batch": fig["max_batch"], "max_wait_ms": fig["max_wait_ms"]})
    return curve


def adaptive_run(job: Job, args: argparse.Namespace, worst: tuple[int, float]) -> dict:
    """From the worst grid point, controller on: the rate after ``--converge`` s, and the curve."""
    request_tune(job.endpoint, max_batch=worst[0], max_wait_ms=worst[1], adaptive=True)
    curve = follow(job, args.converge)
    window = job.rate(args.window)
    sps, fig = window["rate"], window["last"]["batching"]
    return {"sps": round(sps, 1), "final": {"max_batch": fig["max_batch"], "max_wait_ms": fig["max_wait_ms"]},
            "controller": fig.get("controller"), "curve": curve}


def plot(grid: dict[str, float], batches: list[int], waits: list[float], adaptive_sps: float | None, path: Path) -> None:
    import numpy as np

    z = np.array([[grid[f"{b}x{w}"] for w in waits] for b in batches])
    fig, ax = subplots(figsize=(1.3 * len(waits) + 3, 0.8 * len(batches) + 2))
    im = ax.imshow(z, cmap="viridis", origin="lower", aspect="auto")
    for i in range(len(batches)):
        for j in range(len(waits)):
            ax.text(j, i, f"{z[i, j]:.0f}", ha="center", va="center", color="w", fontsize=9)
    ax.set_xticks(range(len(waits)), [f"{w:g}" for w in waits])
    ax.set_yticks(range(len(batches)), [str(b) for b in batches])
    adaptive = "" if adaptive_sps is None else f"; adaptive: {adaptive_sps:.0f}"
    ax.set(xlabel="max_wait_ms", ylabel="max_batch", title=f"env steps/s{adaptive}")
    fig.colorbar(im, ax=ax)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="bimodal", help="bimodal | constant | lognormal | replay:FILE")
    ap.add_argument("--batches", default="2,4,8,16,32", help="max_batch grid")
    ap.add_argument("--waits", default="1,4,16,32", help="max_wait_ms grid")
    ap.add_argument("--fwd-a", type=float, default=12.0, help="forward cost per batch (ms)")
    ap.add_argument("--fwd-c", type=float, default=2.0, help="forward cost per env in the batch (ms)")
    ap.add_argument("--sims", type=int, default=2)
    ap.add_argument("--envs", type=int, default=16, help="envs per simulator")
    ap.add_argument("--slots", type=int, default=8, help="slots per simulator")
    ap.add_argument("--window", type=float, default=6.0, help="seconds measured per point")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds after a reconfiguration before measuring")
    ap.add_argument("--adaptive-runs", type=int, default=3)
    ap.add_argument("--adaptive-window", type=float, default=2.0, help="batching.adaptive_window_s")
    ap.add_argument("--converge", type=float, default=24.0, help="seconds the controller gets before measuring")
    args = parse_bench_args(ap, "3x3 grid, one adaptive run: under 3 minutes",
                            smoke_help="tiny run for CI (no timing value): 2x1 grid, short windows")
    if args.quick:
        args.batches, args.waits, args.window, args.adaptive_runs, args.converge = "2,8,32", "1,8,32", 4.0, 1, 24.0
    if args.smoke:
        args.batches, args.waits, args.window, args.settle, args.adaptive_runs, args.converge = "2,8", "2", 1.0, 0.3, 1, 2.0
        args.adaptive_window, args.sims = 0.5, 1
    args.batches = [int(x) for x in str(args.batches).split(",")]
    args.waits = [float(x) for x in str(args.waits).split(",")]

    t_start = time.monotonic()
    cfg = load("synthetic.yaml", job_overrides(args))
    with BenchRun("batching_sweep") as run:
        job = start_job(cfg, run.dir)
        run.callback(job.stop)
        warm_steps = 100 if args.smoke else 500
        job.wait_status(lambda f: f["env_steps"] > warm_steps, 120.0, f"the job's first {warm_steps} env steps")
        grid = sweep(job, args)
        best_key = max(grid, key=grid.get)
        worst_key = min(grid, key=grid.get)
        b, w = worst_key.split("x")
        runs = [adaptive_run(job, args, (int(b), float(w))) for _ in range(args.adaptive_runs)]
        run.ok = True
    adaptive_sps = statistics.median(r["sps"] for r in runs)
    out = Path(args.out)
    plot(grid, args.batches, args.waits, adaptive_sps, out / "batching_sweep.png")
    bb, bw = best_key.split("x")
    result = {
        "profile": args.profile, "forward_ms": {"a": args.fwd_a, "c": args.fwd_c},
        "layout": {"simulators": args.sims, "envs": args.envs, "slots": args.slots},
        "grid": grid, "best_grid": {"max_batch": int(bb), "max_wait_ms": float(bw)},
        "best_grid_sps": grid[best_key], "worst_grid": {"max_batch": int(b), "max_wait_ms": float(w)},
        "worst_grid_sps": grid[worst_key], "spread": round(grid[best_key] / max(grid[worst_key], 1e-9), 3),
        "adaptive_sps": adaptive_sps, "adaptive_vs_best": round(adaptive_sps / max(grid[best_key], 1e-9), 3),
        "adaptive_runs": runs, "window_s": args.window, "elapsed_s": round(time.monotonic() - t_start, 1),
    }
    emit_to(out, "batching_sweep.json", result)


if __name__ == "__main__":
    main()
