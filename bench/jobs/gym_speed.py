"""Env steps/s of rlvla3's PPO against a reference PPO script, one run after the other.

The PPO parity issue asks for async at >= 1.5x the env steps/s of CleanRL's
``ppo_continuous_action.py`` on Hopper-v4, measured one run at a time, alternating, on a quiet
machine. The reference stays outside the project: ``--reference`` is a command run in its own
environment, with ``{steps}`` and ``{seed}`` filled in, that prints CleanRL's progress line
``SPS: N`` (its env steps per second since its loop began); its last such line is its rate. Ours
is the same ``rlvla3 run`` that ``gym_parity.py`` starts, its rate taken from its first env step
to its last (process start-up is not charged to either side). Each round runs the reference, then
each of our modes, so load on a shared machine falls on all of them.

    python bench/jobs/gym_speed.py --reference "/path/to/cleanrl-venv/bin/python ppo_continuous_action.py \\
        --env-id Hopper-v4 --no-cuda --total-timesteps {steps} --seed {seed}" [--env hopper] \\
        [--steps 200000] [--rounds 3] [--modes async sync]

Prints one JSON object last: every round's env steps/s per side, the medians, and each mode's
median over the reference's (``over_reference``); ``gym_speed.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import re
import shlex
import statistics
import subprocess
import time
from pathlib import Path

from rlvla3.harness.bench import OUT_DIR, emit_to, load_avg, note, parse_bench_args
from rlvla3.harness.gym_runs import ENVS, MODES, run_one

ROOT = Path(__file__).resolve().parents[2]

SPS_LINE = re.compile(r"^SPS:\s*([0-9.]+)\s*$", re.M)


def reference_rate(cmd: str, steps: int, seed: int, folder: Path, timeout_s: float) -> float:
    """Run the reference once (in ``folder``: CleanRL writes its TensorBoard files beside it)."""
    folder.mkdir(parents=True, exist_ok=True)
    argv = shlex.split(cmd.format(steps=steps, seed=seed))
    done = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=timeout_s)
    (folder / "reference.log").write_text(done.stdout + done.stderr)
    rates = SPS_LINE.findall(done.stdout)
    if done.returncode != 0 or not rates:
        raise SystemExit(f"reference command failed (rc {done.returncode}, {len(rates)} 'SPS:' lines): "
                         f"{shlex.join(argv)}\n{done.stderr[-2000:]}")
    return float(rates[-1])


def median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 1) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", required=True, help="the reference command ({steps}, {seed} filled in)")
    ap.add_argument("--env", default="hopper", choices=sorted(ENVS))
    ap.add_argument("--modes", nargs="+", default=["async"], choices=MODES)
    ap.add_argument("--steps", type=int, default=200_000, help="env steps per run, each side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    args = parse_bench_args(ap, None, smoke_help="one round of two updates' worth of steps (no timing value)",
                            out=f"{OUT_DIR}/gym_speed")
    if args.smoke:
        args.rounds, args.steps = 1, 4096
    out = Path(args.out).resolve()
    ref: list[float] = []
    ours: dict[str, list[float]] = {m: [] for m in args.modes}
    loads = []
    for r in range(args.rounds):
        loads.append(load_avg()[0])
        t0 = time.monotonic()
        ref.append(reference_rate(args.reference, args.steps, r, out / f"round{r}" / "reference", args.timeout))
        note(f"round {r}: reference {ref[-1]:.0f} env steps/s ({time.monotonic() - t0:.0f} s)")
        for mode in args.modes:
            run = run_one(ROOT, args.env, mode, r, args.steps, out / f"round{r}" / mode, args.timeout, fresh=True)
            if run["rc"] != 0 or not run["steps_per_s"]:
                raise SystemExit(f"{mode} run failed (rc {run['rc']}): {out / f'round{r}' / mode / 'run.log'}")
            ours[mode].append(run["steps_per_s"])
            note(f"round {r}: {mode} {run['steps_per_s']:.0f} env steps/s ({run['wall_s']:.0f} s with start-up)")
    ref_median = median(ref)
    emit_to(out, "gym_speed.json", {
        "env": ENVS[args.env], "steps": args.steps, "rounds": args.rounds, "load_avg_1m_before_rounds": loads,
        "reference": {"per_round": ref, "median": ref_median, "command": args.reference},
        "ours": {m: {"per_round": v, "median": median(v),
                     "over_reference": round(median(v) / ref_median, 3) if ref_median else None}
                 for m, v in ours.items()}})


if __name__ == "__main__":
    main()
