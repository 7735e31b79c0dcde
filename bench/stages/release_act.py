"""A released checkpoint folder's act() speed against its reference implementation, side by side.

The issues on models as released ask for ``act()`` samples/s at least equal to the upstream
call (LeRobot's ``predict_action_chunk``, N1.5's ``get_action``, OFT's ``predict_action``) on the
same weights, batch sizes, threads and denoising steps. The upstream code stays outside the
project: ``--reference`` is a command run in its own environment that appends
``BATCHES THREADS REPS`` to its arguments, times the upstream call (its pre- and post-processing
included, as ours is) and prints ``{batch: samples_per_s}`` as its last line. Rounds alternate
reference and ours, so load on a shared machine falls on both.

    python bench/stages/release_act.py FOLDER --family pi05 --cameras front:48x64,wrist:40x40 \\
        [--reference "CMD"] [--batches 1,8] [--threads 2] [--rounds 2] [--tokenizer DIR] [--option KEY=VALUE]

Prints one JSON object last: per batch, every round's samples/s for each side and the ratio of
the medians (ours / reference); ``release_act.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys

import torch
import yaml

from rlvla3.harness.act_timing import time_act
from rlvla3.harness.bench import emit_to, parse_bench_args
from workers.contract import EnvSpec
from workers.release.layouts import load_release


def cameras(text: str) -> dict[str, tuple[int, int]]:
    """``front:48x64,wrist:40x40`` -> ``{"front": (48, 64), ...}`` (height x width)."""
    out = {}
    for part in text.split(","):
        name, _, hw = part.partition(":")
        h, _, w = hw.partition("x")
        out[name] = (int(h), int(w))
    return out


def reference_round(cmd: str, batches: list[int], threads: int, reps: int) -> dict[str, float]:
    argv = shlex.split(cmd) + [",".join(map(str, batches)), str(threads), str(reps)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise SystemExit(f"reference command failed (rc {done.returncode}): {done.stderr[-2000:]}")
    return {str(k): float(v) for k, v in json.loads(lines[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", help="the released (or upstream-written) checkpoint folder")
    ap.add_argument("--family", required=True)
    ap.add_argument("--cameras", required=True, help="name:HxW,... the env's cameras, in the folder's order")
    ap.add_argument("--state-dim", type=int, default=8)
    ap.add_argument("--action-dim", type=int, default=7)
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a model option over the folder's own (e.g. action_head=tokens for OFT's token head)")
    ap.add_argument("--tokenizer", default="", help="model.tokenizer, for folders that ship none (GR00T N1.5)")
    ap.add_argument("--reference", default="", help="command timing the upstream call (see above)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    args = parse_bench_args(ap, None, smoke_help="one round, batch 1, one call (no timing value)")
    if args.smoke:
        args.batches, args.reps, args.rounds = "1", 1, 1
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    spec = EnvSpec(cameras=cameras(args.cameras), state_dim=args.state_dim, action_dim=args.action_dim,
                   max_episode_steps=100)
    options = {k: yaml.safe_load(v) for k, _, v in (o.partition("=") for o in args.option)}
    policy = load_release(args.folder, args.family, spec, {"device": "cpu", "dtype": "float32", **options}, args.tokenizer)
    policy.eval()
    ours: dict[str, list[float]] = {str(b): [] for b in batches}
    ref: dict[str, list[float]] = {str(b): [] for b in batches}
    for r in range(args.rounds):
        if args.reference:
            for b, sps in reference_round(args.reference, batches, args.threads, args.reps).items():
                ref[b].append(sps)
        for b, row in time_act(policy, spec, batches, torch.device("cpu"), args.reps).items():
            ours[b].append(row["samples_per_s"])
        print(f"round {r}: ours {ours} reference {ref}", file=sys.stderr)
    ratio = {b: round(statistics.median(ours[b]) / statistics.median(ref[b]), 3) for b in ours if ref[b]}
    emit_to(args.out, "release_act.json", {"family": args.family, "options": options, "threads": args.threads, "ours": ours,
                                      "reference": ref, "ratio": ratio})


if __name__ == "__main__":
    main()
