"""Sample efficiency and wall-clock: sync vs async PPO on the synthetic task, several seeds.

Each (mode, seed) is a real ``rlvla3 run`` job, differing only in ``run.mode``; its
``metrics.jsonl`` (a line per progress tick, from STATUS) gives success and return against env
steps and seconds from the first env step (start-up is not charged). The claim checked
(RL-VLA^3, AReaL): async reaches the same success per env step (within seed noise: decoupled PPO
corrects staleness) and gets there sooner in seconds.

    python bench/jobs/learning.py --quick                 # synthetic, 1 seed, < 60 s, prints JSON last
    python bench/jobs/learning.py --seeds 0 1 2 --steps 12000 --out /tmp/learning

``--quick`` stops each job at the target. The JSON: ``sync_steps_to_target``,
``async_steps_to_target``, ``sync_seconds_to_target``, ``async_seconds_to_target`` (medians over
seeds; null if most never reached it), and ``curves``: per mode and seed, training success and the
eval slots' deterministic success against env steps and seconds.

Pixels (a tiny OpenVLA-OFT on Meta-World from a 64x64 camera, proprio state and the instruction):
Fig. 6 of the paper, with seeds:

    python bench/jobs/learning.py --config configs/metaworld_oft_rgb.yaml --seeds 0 1 2 --steps 120000 \
        --timeout 1500 --sft-episodes 18 --sft-epochs 24 --final-eval 100 --out bench/out/fig6_oft [--blank-images]

``--sft-episodes`` warm-starts once per seed with ``rlvla3 sft`` (not timed; both modes start from
it); ``--final-eval N`` scores the warm start and each job's last checkpoint on N held-out starts
(the eval slots' seeds); ``--blank-images``, the ablation: all-zero camera images throughout.
Modes alternate per seed, one job at a time. A warm start or job that finished leaves
``learning_done.json`` in its folder, and a rerun reads it instead of running it again
(``--fresh`` reruns), so a sweep resumes per seed and mode. ``fig6`` in the JSON holds the
issue's targets per mode: the sampled success of the episodes that ended in the last 10% of env
steps against those that ended in the first 5% (the broker's running episode and success counts),
per seed and mean;
whether any seed ended below its start; the held-out deterministic rise; async against sync's mean
+- 2 SE per tenth after the first 20% (``rlvla3/harness/seed_bands.py``); and the seconds async
takes to first show sync's final sampled success over sync's whole run (target <= 0.7), beside
async's whole run over sync's (``run_ratio``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from rlvla3.harness import seed_bands
from rlvla3.harness.bench import OUT_DIR, emit_to, parse_bench_args, save_figure, subplots
from rlvla3.harness.jobs import json_lines, run_cli, start_cli

ROOT = Path(__file__).resolve().parents[2]

MODES = ("sync", "async")
MIN_EPISODES = 200
"""The broker's success rate is over its last 200 episodes; before that many have finished it is
biased towards the episodes that ended first (the quick successes), so a hit needs a full window."""


def sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def run_job(mode: str, seed: int, steps: int, run_dir: Path, overrides: list[str], target: float | None,
            timeout_s: float, config: str = "synthetic.yaml") -> list[dict[str, Any]]:
    """One ``rlvla3 run``; with ``target``, interrupted (SIGINT, a clean stop) once it is reached."""
    if run_dir.exists():
        shutil.rmtree(run_dir)  # an unfinished job's metrics must not count
    args = ["run", config, "--steps", str(steps), "--run-dir", str(run_dir), *sets(f"run.mode={mode}", f"run.seed={seed}",
                                                                              "run.progress_every_s=0.5", *overrides)]
    proc = start_cli(*args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.send_signal(signal.SIGINT)
                break
            if target is not None and reached(json_lines(metrics), target) is not None:
                proc.send_signal(signal.SIGINT)
                break
            time.sleep(0.25)  # watching a file a separate process writes
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rows = json_lines(metrics)
    if not rows and proc.stderr is not None:  # the job never started: say why
        print(f"{mode} seed={seed}: the job wrote no metrics; its stderr ends:\n{proc.stderr.read()[-2000:]}", file=sys.stderr)
    return rows


EVAL_SEED = 1_500_000_000
"""First held-out start of simulator 0's eval slots (workers/simulator.py); ``--final-eval`` uses
the same starts, so its figure extends the eval curve's last point to more episodes."""


def warm_start(config: str, seed: int, out: Path, overrides: list[str], episodes: int, epochs: int, lr: float) -> dict[str, Any]:
    """``rlvla3 sft`` once for a seed; returns its figures (``sft.json``)."""
    args = ["sft", config, "--out", str(out), "--episodes", str(episodes),
            "--epochs", str(epochs), "--lr", str(lr), "--eval-episodes", "0", *sets(f"run.seed={seed}", *overrides)]
    done = run_cli(*args, timeout=None, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"rlvla3 sft exited with {done.returncode}; its stderr ends:\n{done.stderr[-2000:]}")
    return json.loads((out / "sft.json").read_text())


def job_config(config: str, overrides: list[str]) -> Any:
    """The config a job runs, read as the jobs (cwd: ROOT) read it, overrides applied."""
    from rlvla3.config import load

    return load(ROOT / config if (ROOT / config).is_file() else config, overrides)


def final_eval(config: str, checkpoint: Path, overrides: list[str], episodes: int) -> float:
    """Deterministic success of a checkpoint (a run folder or an ``rlvla3 sft`` folder) on the
    first ``episodes`` held-out starts of the eval slots."""
    import torch

    from workers.model import build_policy
    from workers.sft import evaluate_policy

    cfg = job_config(config, [*overrides, f"model.checkpoint={checkpoint}"])
    torch.set_num_threads(max(1, cfg.workers.torch_threads))
    return evaluate_policy(cfg, build_policy(cfg, device="cpu"), episodes, seed=EVAL_SEED)["success"]


DONE = "learning_done.json"
"""Left in a warm start's or a job's folder once it finished (with its held-out score): a rerun
of the bench reads it instead of running that part again, so a sweep resumes per seed and mode."""


def _done(folder: Path, fresh: bool) -> dict[str, Any] | None:
    path = folder / DONE
    return None if fresh or not path.is_file() else json.loads(path.read_text())


def _keep(folder: Path, figures: dict[str, Any]) -> None:
    (folder / DONE).write_text(json.dumps(figures))


def curve_json(c: dict[str, np.ndarray], rows: list[dict[str, Any]], points: int = 60) -> dict[str, Any]:
    """A curve for the JSON: at most ``points`` training points, and one point per eval round."""
    keep = np.unique(np.linspace(0, len(c["steps"]) - 1, min(points, len(c["steps"]))).astype(int)) if len(c["steps"]) else []
    t0 = next((r["elapsed_s"] for r in rows if r.get("env_steps", 0) > 0), 0.0)
    evals: dict[int, list[float]] = {}
    for r in rows:  # a round's success is over its episodes so far: keep its last (fullest) line
        if r.get("eval_version") is not None and r.get("eval_success") is not None:
            first = evals.get(r["eval_version"], [r["env_steps"], round(r["elapsed_s"] - t0, 1)])[:2]
            evals[r["eval_version"]] = [*first, r["eval_success"], r.get("eval_episodes", 0)]
    return {"steps": [int(c["steps"][i]) for i in keep], "seconds": [round(float(c["seconds"][i]), 1) for i in keep],
            "success": [round(float(c["success"][i]), 3) for i in keep],
            "steps_all": [int(x) for x in c["steps"]], "seconds_all": [round(float(x), 1) for x in c["seconds"]],
            "success_all": [round(float(x), 4) for x in c["success"]],
            "counts_all": [[r["env_steps"], r.get("episodes", 0), r["successes"]] for r in rows
                           if r.get("env_steps", 0) > 0 and r.get("successes") is not None],
            "eval": [[v, *evals[v]] for v in sorted(evals)]}  # [version, env steps, seconds, success, episodes]


def curve(rows: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """env steps, seconds since the first env step, success, return (rows with episodes only)."""
    rows = [r for r in rows if r.get("env_steps", 0) > 0]
    if not rows:
        return {k: np.zeros(0) for k in ("episodes", "steps", "seconds", "success", "return")}
    t0 = rows[0]["elapsed_s"]
    rows = [r for r in rows if r.get("success") is not None]
    return {
        "episodes": np.array([r.get("episodes", 0) for r in rows], float),
        "steps": np.array([r["env_steps"] for r in rows], float),
        "seconds": np.array([r["elapsed_s"] - t0 for r in rows], float),
        "success": np.array([r["success"] for r in rows], float),
        "return": np.array([r["return"] if r["return"] is not None else np.nan for r in rows], float),
    }


def reached(rows: list[dict[str, Any]], target: float) -> tuple[float, float] | None:
    """(env steps, seconds) at the first progress line with success >= target."""
    c = curve(rows)
    hit = np.flatnonzero((c["success"] >= target) & (c["episodes"] >= MIN_EPISODES))
    if not len(hit):
        return None
    return float(c["steps"][hit[0]]), float(c["seconds"][hit[0]])


def fig6_targets(curves: dict[str, list[dict[str, Any]]], warm: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Fig. 6's targets, per mode: sampled success over the last 10% of env steps against the first
    5% (each seed, and the mean over seeds), the held-out deterministic rise from the warm start,
    async inside sync's mean +- 2 SE at every tenth after the first 20% (``seed_bands``), and the
    wall-clock async takes to reach sync's final sampled success over sync's whole run."""
    start_eval = {w["seed"]: w.get("held_out_success") for w in warm}
    out: dict[str, Any] = {}
    tenths: dict[str, list[list[float | None]]] = {}
    for mode, runs in curves.items():
        per_seed = []
        for cj in runs:
            counts = cj["counts_all"]  # the episodes that ended in each window (broker's running counts)
            first, last = _ended_success(counts, 0, 0.05 * steps), _ended_success(counts, 0.9 * steps, None)
            row = {"seed": cj["seed"], "first_5pct": first, "last_10pct": last,
                   "held_out_start": start_eval.get(cj["seed"]), "held_out_end": cj.get("held_out_success"),
                   "seconds": float(cj["seconds_all"][-1]) if cj["seconds_all"] else None}
            row["ended_below_start"] = (None if row["first_5pct"] is None or row["last_10pct"] is None
                                        else bool(row["last_10pct"] < row["first_5pct"]))
            per_seed.append(row)
        tenths[mode] = [seed_bands.tenth_means(cj["steps_all"], cj["success_all"], steps) for cj in runs]
        first, last = _mean([r["first_5pct"] for r in per_seed]), _mean([r["last_10pct"] for r in per_seed])
        rises = [r["held_out_end"] - r["held_out_start"] for r in per_seed
                 if r["held_out_end"] is not None and r["held_out_start"] is not None]
        out[mode] = {"per_seed": per_seed, "first_5pct": first, "last_10pct": last,
                     "gain": None if first is None or last is None else round(last - first, 4),
                     "gain_met": None if first is None or last is None else bool(last >= first + 0.3),
                     "no_seed_below_start": _none_or(lambda: not any(r["ended_below_start"] for r in per_seed),
                                                     per_seed and all(r["ended_below_start"] is not None for r in per_seed)),
                     "held_out_rise": _mean(rises), "held_out_rise_met": bool(_mean(rises) >= 0.2) if rises else None}
    if "sync" in out and "async" in out:
        out["agreement"] = seed_bands.band_points(tenths["sync"], tenths["async"])
        out["wall_clock"] = _time_to_sync_final(curves)
    return out


def _ended_success(counts: list[list[int]], lo: float, hi: float | None) -> float | None:
    """Sampled success of the episodes that ended while the env-step count was in ``(lo, hi]``
    (``hi`` None: to the end), from ``[env steps, episodes, successes]`` running counts. The
    progress line's rolling window of 200 episodes reaches back ~20k env steps and shows nothing
    before 100 episodes (~11k steps on Meta-World), so near the start it mixes in the first few
    policy versions; these counts take the window's own episodes only."""
    def at(x: float) -> tuple[int, int]:  # the counts at the last line at or before env step x
        before = [c for c in counts if c[0] <= x]
        return (before[-1][1], before[-1][2]) if before else (0, 0)

    if not counts:  # a run folder from before the broker reported its success count
        return None
    e0, s0 = at(lo)
    e1, s1 = at(hi) if hi is not None else (counts[-1][1], counts[-1][2])
    return round((s1 - s0) / (e1 - e0), 4) if e1 > e0 else None


def _time_to_sync_final(curves: dict[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """Seconds until async's mean curve over seeds first shows sync's final sampled success, over
    sync's mean run length; the target is <= 0.7. Both sides read the progress line's rolling
    success (the curves the figure draws on the wall-clock axis): sync's final is the mean of its
    seeds' last points, and async's mean counts only where every seed has a point. The rolling
    window lags the ended-episode figure of the last 10% (``_ended_success``), so a rolling line
    held against that figure seldom reaches it, sync's own included. ``run_ratio`` (async's mean
    run over sync's) is the bound throughput sets: with curves equal per env step, async reaches
    sync's final near its own end, so ``ratio`` lands near ``run_ratio`` or reads seed noise."""
    lines = {m: [(np.asarray(cj["seconds_all"], float), np.asarray(cj["success_all"], float))
                 for cj in curves[m] if cj["seconds_all"]] for m in ("sync", "async")}
    if not lines["sync"] or not lines["async"]:
        return None
    target = float(np.mean([y[np.isfinite(y)][-1] for _, y in lines["sync"]]))
    sync_s = float(np.mean([t[-1] for t, _ in lines["sync"]]))
    async_s = float(np.mean([t[-1] for t, _ in lines["async"]]))
    grid = np.arange(0.0, min(t[-1] for t, _ in lines["async"]) + 1.0, 1.0)
    mean = np.mean([np.interp(grid, t[np.isfinite(y)], y[np.isfinite(y)], left=np.nan) for t, y in lines["async"]], axis=0)
    hits = grid[np.nan_to_num(mean, nan=-1.0) >= target]
    reach = float(hits[0]) if len(hits) else None
    ratio = None if reach is None else round(reach / sync_s, 3)
    return {"sync_final": round(target, 4), "sync_seconds": round(sync_s, 1), "async_seconds_to_it": reach,
            "ratio": ratio, "met": ratio is not None and ratio <= 0.7,
            "async_run_seconds": round(async_s, 1), "run_ratio": round(async_s / sync_s, 3)}


def _none_or(value: Any, known: Any) -> Any:
    return value() if known else None


def _mean(xs: Any) -> float | None:
    vals = [float(x) for x in xs if x is not None and np.isfinite(x)]
    return round(float(np.mean(vals)), 4) if vals else None


def seed_band(runs: list[dict[str, np.ndarray]], x: str, metric: str, points: int = 100) -> tuple[np.ndarray, ...]:
    """Mean over seeds and 2 standard errors of ``metric`` against ``x``, each seed's curve read
    (linearly, no extrapolation) on a grid up to where the shortest seed ends."""
    ends = [c[x][-1] for c in runs if len(c[x])]
    grid = np.linspace(0.0, min(ends) if ends else 0.0, points)
    ys = np.array([np.interp(grid, c[x], c[metric], left=np.nan) for c in runs if len(c[x])])
    ok = np.isfinite(ys)
    n = ok.sum(0)
    z = np.where(ok, ys, 0.0)
    mean = np.where(n > 0, z.sum(0) / np.maximum(n, 1), np.nan)
    var = np.where(n > 1, (np.where(ok, ys - mean, 0.0) ** 2).sum(0) / np.maximum(n - 1, 1), 0.0)
    return grid, mean, 2 * np.sqrt(var) / np.sqrt(np.maximum(n, 1))


def plot(curves: dict[str, list[dict[str, np.ndarray]]], target: float, out: Path, title: str = "synthetic reach",
         evals: dict[str, list[dict[str, Any]]] | None = None) -> list[Path]:
    """Success and return against env steps and seconds; ``evals`` (``curve_json``'s) adds the
    eval slots' deterministic success as markers."""
    paths = []
    for metric in ("success", "return"):
        fig, axes = subplots(1, 2, figsize=(11, 4))
        for mode, color in zip(MODES, ("tab:blue", "tab:orange")):
            runs = curves.get(mode, [])
            for i, c in enumerate(runs):
                for ax, x in zip(axes, ("steps", "seconds")):
                    ax.plot(c[x], c[metric], color=color, alpha=0.35 if len(runs) > 1 else 0.8, lw=0.8,
                            label=mode if i == 0 and len(runs) == 1 else None)
            for ax, x in zip(axes, ("steps", "seconds")) if len(runs) > 1 else ():
                grid, mean, half = seed_band(runs, x, metric)
                ax.plot(grid, mean, color=color, lw=2, label=f"{mode}: mean of {len(runs)} seeds")
                ax.fill_between(grid, mean - half, mean + half, color=color, alpha=0.2, label=f"{mode}: ± 2 SE")
            for i, cj in enumerate((evals or {}).get(mode, []) if metric == "success" else []):
                pts = np.array(cj["eval"], float).reshape(-1, 5)  # version, steps, seconds, success, episodes
                for ax, col in zip(axes, (1, 2)):
                    ax.plot(pts[:, col], pts[:, 3], "o--", color=color, ms=4, lw=0.8,
                            label=f"{mode} eval (deterministic)" if i == 0 else None)
        for ax, x in zip(axes, ("env steps", "wall-clock seconds (from first env step)")):
            ax.set(xlabel=x, ylabel=metric)
            if metric == "success":
                ax.axhline(target, color="grey", ls="--", lw=0.8)
            ax.legend()
            ax.grid(alpha=0.3)
        fig.suptitle(f"{title}: sync vs async ({metric})")
        paths.append(save_figure(fig, out / f"learning_{metric}.png", 110))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="synthetic.yaml",
                    help="job config (e.g. metaworld_default.yaml for the Meta-World task; needs Meta-World)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=12000, help="env steps per job")
    ap.add_argument("--target", type=float, default=0.9, help="success rate counted as reached")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra config override for every job")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per job at most")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="run.mode values to run, in order")
    ap.add_argument("--blank-images", action="store_true",
                    help="ablation: all-zero camera images for the warm start and RL (env.options.blank_images)")
    ap.add_argument("--sft-episodes", type=int, default=0, help="warm-start each seed once with `rlvla3 sft` on this many expert episodes")
    ap.add_argument("--sft-epochs", type=int, default=20, help="behaviour-cloning passes of the warm start")
    ap.add_argument("--sft-lr", type=float, default=1e-3, help="learning rate of the warm start")
    ap.add_argument("--fresh", action="store_true", help="run again the warm starts and jobs that already finished")
    ap.add_argument("--final-eval", type=int, default=0,
                    help="score the warm start and each job's last checkpoint on this many held-out starts")
    args = parse_bench_args(ap, "one seed, stop at target, < 60 s", out=f"{OUT_DIR}/learning",
                            smoke_help="tiny run for CI (no learning value): a few hundred steps per mode")

    overrides = list(args.overrides)
    if args.blank_images:
        overrides.append("env.options.blank_images=true")
    seeds, steps, timeout = args.seeds, args.steps, args.timeout
    if args.quick:
        seeds, steps, timeout = [0], 10_000, 27.0
        overrides = ["env.options.latency={kind: bimodal, mean_ms: 1.0, slow_ms: 20.0, slow_prob: 0.05}", *overrides]
    if args.smoke:  # both modes run a job and write a curve; the target is not expected
        seeds, steps, timeout = [0], 400, 120.0
    out = Path(args.out).resolve()  # the jobs run from the repository root
    out.mkdir(parents=True, exist_ok=True)

    curves: dict[str, list[dict[str, np.ndarray]]] = {m: [] for m in MODES}
    hits: dict[str, list[tuple[float, float] | None]] = {m: [] for m in MODES}
    curves_json: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    warm: list[dict[str, Any]] = []
    for seed in seeds:
        job_overrides = list(overrides)
        if args.sft_episodes > 0:
            sft_dir = out / f"sft-seed{seed}"
            fig = _done(sft_dir, args.fresh)
            if fig is None:
                fig = warm_start(args.config, seed, sft_dir, overrides, args.sft_episodes, args.sft_epochs, args.sft_lr)
                if args.final_eval:
                    fig["held_out_success"] = final_eval(args.config, sft_dir, overrides, args.final_eval)
                _keep(sft_dir, fig)
            warm.append({"seed": seed, **fig, "out": str(sft_dir)})  # the folder the jobs load (it may be a copy)
            print(f"warm start seed={seed}: {json.dumps(warm[-1])}", file=sys.stderr)
            job_overrides.append(f"model.checkpoint={sft_dir}")
        for mode in args.modes:
            run_dir = out / f"{mode}-seed{seed}"
            t = time.monotonic()
            kept = _done(run_dir, args.fresh)
            if kept is None:
                rows = run_job(mode, seed, steps, run_dir, job_overrides, args.target if args.quick else None, timeout, args.config)
                kept = {}
                if args.final_eval and (run_dir / "checkpoints" / "latest").is_file():
                    kept["held_out_success"] = final_eval(args.config, run_dir, overrides, args.final_eval)
                if rows:
                    _keep(run_dir, kept)
            rows = json_lines(run_dir / "metrics.jsonl")
            c = curve(rows)
            curves[mode].append(c)
            hits[mode].append(reached(rows, args.target))
            cj = {"seed": seed, **curve_json(c, rows), **kept}
            curves_json[mode].append(cj)
            print(f"{mode:5s} seed={seed}  final success={c['success'][-1] if len(c['success']) else None}  "
                  f"held_out={cj.get('held_out_success')}  reached={hits[mode][-1]}  job_s={time.monotonic() - t:.1f}",
                  file=sys.stderr)

    def median(mode: str, k: int) -> float | None:
        vals = [h[k] for h in hits[mode] if h is not None]
        if len(vals) < len(hits[mode]) / 2 or not vals:  # most seeds must reach it
            return None
        return round(float(np.median(vals)), 1)

    family = job_config(args.config, overrides).model.family  # the title names the family the jobs ran
    pngs = [str(p) for p in plot(curves, args.target, out, f"{Path(args.config).stem}, {family}", curves_json)]
    result = {
        "target_success": args.target, "seeds": seeds, "steps": steps,
        "sync_steps_to_target": median("sync", 0), "async_steps_to_target": median("async", 0),
        "sync_seconds_to_target": median("sync", 1), "async_seconds_to_target": median("async", 1),
        "per_seed": {m: [list(h) if h else None for h in hits[m]] for m in MODES},
        "blank_images": args.blank_images, "warm_start": warm, "final_eval_episodes": args.final_eval,
        "fig6": fig6_targets(curves_json, warm, steps),
        "curves": {m: [{k: v for k, v in cj.items() if not k.endswith("_all")} for cj in runs]  # the 60-point view
                   for m, runs in curves_json.items()},
        "out": str(out), "png": pngs,
    }
    emit_to(out, "results.json", result)


if __name__ == "__main__":
    main()
