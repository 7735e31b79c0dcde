"""act() timed as a generator calls it (``torch.inference_mode``, after a warm-up, the fastest
of a few calls): the VLA families' throughput and peak memory, for ``bench/gpu/models.py`` at
release size on a GPU and ``bench/stages/generator.py`` on the tiny configs on CPU."""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch

from rlvla3.harness.bench import random_observation
from workers.contract import EnvSpec
from workers.policies.base import make_policy


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_family(family: str, preset: tuple, spec: EnvSpec, batches: list[int], device: torch.device,
                 dtype: str, reps: int) -> dict:
    """``family`` built at ``preset`` (size, chunk_size, options) on ``device`` in ``dtype``, then
    timed at each batch size: build time, parameters, samples/s, latency and peak GPU memory."""
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
    row["batches"] = time_act(policy, spec, batches, device, reps)
    del policy
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def time_act(policy, spec: EnvSpec, batches: list[int], device: torch.device, reps: int,
             instruction: str = "put the bowl on the plate and close the drawer") -> dict:
    """``policy.act`` on random observations of ``spec`` at each batch size, after a warm-up:
    the fastest of ``reps`` calls as samples/s and latency, and peak GPU memory."""
    rows: dict = {}
    for b in batches:
        obs = random_observation(spec, b, np.random.default_rng(b), instruction)
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
            rows[str(b)] = {"samples_per_s": round(b / lat, 2), "latency_ms": round(lat * 1e3, 1),
                            "peak_mem_gib": None if peak is None else round(peak, 2)}
        except torch.OutOfMemoryError:
            rows[str(b)] = {"error": "out of memory"}
            torch.cuda.empty_cache()
        print(f"  batch {b:3d}: {rows[str(b)]}", file=sys.stderr)
    return rows


def device_or_exit(name: str, script: str) -> torch.device:
    """The device to run on; without CUDA where CUDA was asked, a JSON error line and exit 2."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"{script}: CUDA is not available on this machine; run it where a GPU is (or --device cpu --tiny).",
              file=sys.stderr)
        print(json.dumps({"error": "CUDA not available"}))
        sys.exit(2)
    return device
