"""Each VLA family at a realistic size (random weights) on one CUDA GPU: act() throughput and
peak memory at batch 1, 8, 32, 64. Weights are created directly on the GPU in bf16 (no download,
no CPU copy of a 7B model).

    python bench/gpu/models.py [--batches 1,8,32,64] [--families pi0,pi05,gr00t_n15,openvla_oft]

Prints the figures so far after each family (the last line wins: ``bench/gpu/check.sh`` keeps
them when a run is cut short). Without CUDA it says so and exits 2; ``--device cpu --tiny`` runs
the same code on the tiny configs (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from rlvla3.harness.act_timing import bench_family, device_or_exit
from workers.contract import EnvSpec

# family -> (size preset, chunk_size, extra options): release-like settings.
REAL = {
    "pi0": ("3b", 50, {"num_steps": 10}),
    "pi05": ("3b", 50, {"num_steps": 10}),
    "gr00t_n15": ("3b", 16, {"num_steps": 4}),
    "openvla_oft": ("7b", 8, {"n_bins": 256}),
}
TINY = {f: ("tiny", 4, {}) for f in REAL}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="pi0,pi05,gr00t_n15,openvla_oft")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny configs (smoke test of this script)")
    args = ap.parse_args()
    device = device_or_exit(args.device, "gpu_models")
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    spec = EnvSpec(cameras={"front": (224, 224), "wrist": (224, 224)}, state_dim=8, action_dim=7,
                   max_episode_steps=100)
    presets = TINY if args.tiny else REAL
    batches = [int(b) for b in args.batches.split(",")]
    results = {}
    if device.type == "cuda":
        results["_device"] = torch.cuda.get_device_name(device)
    for fam in args.families.split(","):
        try:
            results[fam] = bench_family(fam, presets[fam], spec, batches, device, dtype, args.reps)
        except Exception as exc:  # one family failing must not hide the others' figures
            results[fam] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            print(f"{fam}: FAILED {exc!r}", file=sys.stderr)
        print(json.dumps(results), flush=True)  # the figures so far: a run cut short keeps them


if __name__ == "__main__":
    main()
