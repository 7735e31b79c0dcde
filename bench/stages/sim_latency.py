"""Per-step and per-chunk latency of every installed simulator, state and rendered, 1 and N envs.

Real physics is long-tailed and differs by simulator; this measures it so the synthetic env can
replay it (``--save-profile FILE`` -> ``latency: {replay: FILE}``). Writes a percentile plot
(log axes), the JSON and the raw histograms to ``--out`` (default ``bench/out``); the last stdout
line is one JSON object ``{case: {p50_ms, p99_ms, steps_per_s, ...}}``, cases not installed carry
``{"skipped": why}``.

    python bench/stages/sim_latency.py [--quick] [--out /tmp/simlat] [--num-envs 4] [--save-profile p.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np

from rlvla3.harness.bench import emit_to, new_hist, parse_bench_args, percentile_plot

CHUNK = 8
"""Action chunk length of the per-chunk latency (``chunk_p50_ms``): steps summed per chunk."""
CASE_BUDGET_S = 20.0
"""Most seconds measured per case (without ``--quick``)."""

# case -> (adapter, python package it needs, adapter options)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "metaworld_state": ("metaworld", "metaworld", {"task": "reach-v3", "cameras": []}),
    "metaworld_rgb": ("metaworld", "metaworld", {"task": "reach-v3", "cameras": ["corner"], "image_size": [128, 128]}),
    "maniskill_state": ("maniskill", "mani_skill", {"task": "PickCube-v1", "obs_mode": "state"}),
    "libero_state": ("libero", "libero", {"suite": "spatial", "task_ids": [0], "cameras": [], "settle_steps": 0}),
    "maniskill_rgb": ("maniskill", "mani_skill", {"task": "PickCube-v1", "obs_mode": "rgb", "image_size": [128, 128]}),
    "libero_rgb": ("libero", "libero", {"suite": "spatial", "task_ids": [0], "image_size": [128, 128],
                                        "settle_steps": 0}),
    "robocasa_rgb": ("robocasa", "robocasa", {"image_size": [128, 128]}),
}


def measure(adapter: str, options: dict[str, Any], num_envs: int, steps: int, budget_s: float) -> tuple[dict[str, Any], np.ndarray, Any]:
    """Step ``num_envs`` envs with random actions; per-call latency (s) and a summary."""
    from workers.envs.base import make_env

    t0 = time.perf_counter()
    env = make_env(adapter, num_envs, seed=0, options=options)
    ids = list(range(num_envs))
    try:
        env.reset(ids, ids)
        build_s = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        hist, chunk_hist = new_hist(), new_hist()
        lat: list[float] = []
        deadline = time.perf_counter() + budget_s
        acc = 0.0
        start = time.perf_counter()
        for k in range(steps):
            a = rng.uniform(-1, 1, (num_envs, env.spec.action_dim)).astype(np.float32)
            t = time.perf_counter()
            res = env.step(ids, a)
            dt = time.perf_counter() - t
            lat.append(dt)
            hist.record_value(max(1, int(dt * 1e6)))
            acc += dt
            if (k + 1) % CHUNK == 0:
                chunk_hist.record_value(max(1, int(acc * 1e6)))
                acc = 0.0
            done = [i for i, d in zip(ids, res.terminated | res.truncated) if d]
            if done:
                env.reset(done)  # reset time is not a step: kept out of the step histogram
            if time.perf_counter() > deadline and k >= 10:
                break
        wall = time.perf_counter() - start
    finally:
        env.close()
    arr = np.asarray(lat)
    summary = {
        "p50_ms": round(hist.get_value_at_percentile(50) / 1e3, 3),
        "p99_ms": round(hist.get_value_at_percentile(99) / 1e3, 3),
        "max_ms": round(hist.get_max_value() / 1e3, 3),
        "chunk_p50_ms": round(chunk_hist.get_value_at_percentile(50) / 1e3, 3) if chunk_hist.get_total_count() else None,
        "chunk_p99_ms": round(chunk_hist.get_value_at_percentile(99) / 1e3, 3) if chunk_hist.get_total_count() else None,
        "steps_per_s": round(num_envs * len(lat) / wall, 1),
        "num_envs": num_envs,
        "steps": len(lat),
        "build_reset_s": round(build_s, 2),
    }
    return summary, arr, hist


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-envs", type=int, default=4, help="N for the N-envs-per-worker run")
    ap.add_argument("--steps", type=int, default=300, help="step calls per case (time-capped)")
    ap.add_argument("--save-profile", type=Path, default=None,
                    help="write the first measured rgb case's per-step latencies for the synthetic env")
    args = parse_bench_args(ap, "few steps, 1 env, state + Meta-World rgb; < 60 s",
                            smoke_help="tiny run for CI (no timing value): one case, a dozen steps")
    args.out = Path(args.out)

    from workers.envs.latency_profile import save_latency_profile

    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    total_budget = 35.0 if args.quick else float("inf")
    steps = 60 if args.quick else args.steps
    budget = 3.0 if args.quick else CASE_BUDGET_S
    counts = [1] if args.quick else sorted({1, args.num_envs})
    quick_cases = ["metaworld_state", "metaworld_rgb", "maniskill_state", "libero_state"]
    if args.smoke:  # the first quick case only, a dozen steps: the script end to end
        total_budget, steps, budget, counts = 20.0, 12, 1.0, [1]
        quick_cases = quick_cases[:1]
    wanted = quick_cases if args.quick or args.smoke else list(CASES)
    results: dict[str, Any] = {}
    samples: dict[str, np.ndarray] = {}
    hists: dict[str, Any] = {}
    for case in wanted:
        adapter, package, options = CASES[case]
        for n in counts:
            key = case if n == 1 else f"{case}_n{n}"
            if importlib.util.find_spec(package) is None:
                results[key] = {"skipped": f"{package} not installed"}
                continue
            if time.perf_counter() - t_start > total_budget:
                results[key] = {"skipped": "--quick time budget"}
                continue
            try:
                summary, arr, hist = measure(adapter, options, n, steps, budget)
            except Exception as exc:  # noqa: BLE001 - one broken simulator must not hide the others
                results[key] = {"skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
                continue
            results[key] = summary
            samples[key], hists[key] = arr, hist
            (args.out / f"{key}.hdr").write_bytes(hist.encode())
    if samples:
        percentile_plot(hists, args.out / "sim_latency.png", "simulator step latency (CPU; one call over all envs)")
    if args.save_profile is not None and samples:
        pick = next((k for k in samples if "rgb" in k), next(iter(samples)))
        save_latency_profile(args.save_profile, samples[pick], sim=pick, **{
            k: v for k, v in results[pick].items() if k in ("num_envs", "p50_ms", "p99_ms")})
    emit_to(args.out, "sim_latency.json", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
