"""Each VLA family at a realistic size (random weights) on one CUDA GPU: act() throughput and
peak memory at batch 1, 8, 32, 64.

    python bench/gpu/models.py [--batches 1,8,32,64] [--families pi0,pi05,gr00t_n15,openvla_oft]

Weights are created directly on the GPU in bf16 (no download, no CPU copy of a 7B model).
Prints one JSON object last: ``{family: {"params_b": .., "build_s": .., "batches": {batch:
{"samples_per_s", "latency_ms", "peak_mem_gib"}}}}``, and the figures so far after each family
(the last line wins: ``bench/gpu/check.sh`` keeps them when a run is cut short). Without CUDA
it says so and exits 2.
``--device cpu --tiny`` runs the same code on the tiny configs (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from rlvla3.harness.bench import random_observation
from workers.envs.base import EnvSpec
from workers.policies.base import make_policy

# family -> (size preset, chunk_size, extra options): release-like settings.
REAL = {
    "pi0": ("3b", 50, {"num_steps": 10}),
    "pi05": ("3b", 50, {"num_steps": 10}),
    "gr00t_n15": ("3b", 16, {"num_steps": 4}),
    "openvla_oft": ("7b", 8, {"n_bins": 256}),
}
TINY = {f: ("tiny", 4, {}) for f in REAL}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_family(family: str, preset: tuple, spec: EnvSpec, batches: list[int], device: torch.device,
                 dtype: str, reps: int) -> dict:
    size, chunk, extra = preset
    opts = {"size": size, "chunk_size": chunk, "device": str(device), "dtype": dtype, **extra}
    t0 = time.perf_counter()
    prev = torch.get_default_dtype()
    try:
        # Create parameters on the device in the target dtype: no fp32 CPU copy of billions of weights.
        if dtype == "bfloat16":
            torch.set_default_dtype(torch.bfloat16)
        with torch.device(device):
            policy = make_policy(family, opts, spec)
    finally:
        torch.set_default_dtype(prev)
    sync(device)
    row: dict = {"size": size, "chunk_size": chunk, "build_s": round(time.perf_counter() - t0, 1),
                 "params_b": round(sum(p.numel() for p in policy.parameters()) / 1e9, 3), "batches": {}}
    print(f"{family}: {row['params_b']} B params, built in {row['build_s']} s", file=sys.stderr)
    for b in batches:
        obs = random_observation(spec, b, np.random.default_rng(b), "put the bowl on the plate and close the drawer")
        try:
            with torch.inference_mode():
                policy.act(obs)  # warm-up (kernels, allocator)
                sync(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                times = []
                for _ in range(reps):
                    t = time.perf_counter()
                    policy.act(obs)
                    sync(device)
                    times.append(time.perf_counter() - t)
            lat = min(times)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            row["batches"][str(b)] = {"samples_per_s": round(b / lat, 2), "latency_ms": round(lat * 1e3, 1),
                                      "peak_mem_gib": None if peak is None else round(peak, 2)}
        except torch.OutOfMemoryError:
            row["batches"][str(b)] = {"error": "out of memory"}
            torch.cuda.empty_cache()
        print(f"  batch {b:3d}: {row['batches'][str(b)]}", file=sys.stderr)
    del policy
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def device_or_exit(name: str, script: str) -> torch.device:
    """The device to run on; without CUDA where CUDA was asked, a JSON error line and exit 2."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"{script}: CUDA is not available on this machine; run it where a GPU is (or --device cpu --tiny).",
              file=sys.stderr)
        print(json.dumps({"error": "CUDA not available"}))
        sys.exit(2)
    return device


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
