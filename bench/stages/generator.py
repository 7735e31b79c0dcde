"""Generator throughput and latency against batch size for every VLA family's tiny config (CPU).

This is the curve ``max_batch`` is tuned against: where samples/s stops growing, a larger batch
only adds latency. Synthetic observations (two cameras, random pixels), ``act`` under
``torch.inference_mode`` as the generator worker calls it.

    python bench/stages/generator.py [--quick] [--out bench/out]

Prints one JSON object last: ``{family: {batch: samples_per_s}}``; writes ``generator.png`` and
``generator.json`` (latencies too) under ``--out`` (default ``bench/out``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from rlvla3.harness.act_timing import bench_family
from rlvla3.config import read_yaml
from rlvla3.harness.bench import parse_bench_args, save_figure, subplots
from workers.contract import EnvSpec

ROOT = Path(__file__).resolve().parents[2]

FAMILIES = ("openvla_oft", "pi0", "pi05", "gr00t_n15")


def tiny_preset(family: str) -> tuple[str, int, dict]:
    """The family's tiny config (``configs/models``) as ``bench/gpu/models.py`` takes a preset:
    (size, chunk_size, its other options)."""
    model = read_yaml(ROOT / "configs" / "models" / f"{family}_tiny.yaml")["model"]
    options = dict(model.get("options", {}))
    return options.pop("size"), model["chunk_size"], options


def plot(results: dict, path: Path) -> None:
    fig, (ax1, ax2) = subplots(1, 2, figsize=(11, 4))
    for fam, rows in results.items():
        bs = sorted(int(b) for b in rows)
        ax1.plot(bs, [rows[str(b)]["samples_per_s"] for b in bs], marker="o", label=fam)
        ax2.plot(bs, [rows[str(b)]["latency_ms"] for b in bs], marker="o", label=fam)
    for ax, yl in ((ax1, "samples / s"), (ax2, "latency per act (ms)")):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="batch size", ylabel=yl)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("Generator act() on CPU, tiny configs")
    save_figure(fig, path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--families", default=",".join(FAMILIES))
    args = parse_bench_args(ap, "small images, 2 reps: under 60 s on 2 cores",
                            smoke_help="tiny run for CI (no timing value): tiny images, batches 1-2")

    size = 64 if args.quick else 224
    reps = 3 if args.quick else 5
    if args.smoke:  # every family still builds and acts
        size, reps, args.max_batch = 32, 1, 2
    spec = EnvSpec(cameras={"front": (size, size), "wrist": (size, size)}, state_dim=8, action_dim=7,
                   max_episode_steps=100)
    batches = [2**i for i in range(0, 64) if 2**i <= args.max_batch]
    torch.manual_seed(0)
    results: dict[str, dict[str, dict[str, float]]] = {}
    t_start = time.perf_counter()
    for fam in args.families.split(","):
        row = bench_family(fam, tiny_preset(fam), spec, batches, torch.device("cpu"), "float32", reps)
        results[fam] = {b: {k: r[k] for k in ("latency_ms", "samples_per_s")} for b, r in row["batches"].items()}
    out = Path(args.out)
    plot(results, out / "generator.png")  # the folder made
    (out / "generator.json").write_text(json.dumps({"images": size, "reps": reps, "results": results}, indent=2))
    print(f"total {time.perf_counter() - t_start:.1f} s; wrote {out / 'generator.png'}", file=sys.stderr)
    print(json.dumps({f: {b: round(r["samples_per_s"], 2) for b, r in rows.items()} for f, rows in results.items()}))


if __name__ == "__main__":
    main()
