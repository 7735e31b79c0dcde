"""Measured simulator step latencies, saved by ``bench/sim_latency.py`` and replayed by the
synthetic env (``latency: {replay: FILE}``), so ablations run on real latency shapes.

A profile file is JSON, one of:

* a list of per-step latencies in seconds: ``[0.0123, 0.0119, ...]``;
* an object with ``"samples_s"`` (that list) and free metadata (``"sim"``, ``"num_envs"``, ...);
* an object with ``"hdr"``: an HdrHistogram encoded with ``HdrHistogram.encode()`` whose values
  are in ``"unit"`` (``"us"`` default, or ``"ns"``, ``"ms"``, ``"s"``), expanded to its samples.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "rlvla3-latency-profile/1"
_UNIT_S = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_MAX_EXPANDED = 1_000_000  # a histogram is expanded to at most this many samples (proportionally)


def load_latency_profile(path: str | Path) -> np.ndarray:
    """Per-step latencies in seconds (float64, non-empty, all >= 0) from a profile file."""
    with open(path) as f:
        data: Any = json.load(f)
    if isinstance(data, dict):
        if "samples_s" in data:
            samples = np.asarray(data["samples_s"], np.float64)
        elif "hdr" in data:
            samples = _expand_hdr(data["hdr"], _UNIT_S[data.get("unit", "us")])
        else:
            raise ValueError(f"{path}: latency profile needs 'samples_s' or 'hdr', got keys {sorted(data)}")
    elif isinstance(data, list):
        samples = np.asarray(data, np.float64)
    else:
        raise ValueError(f"{path}: latency profile must be a JSON list or object")
    samples = samples.reshape(-1)
    if samples.size == 0 or not np.all(np.isfinite(samples)) or np.any(samples < 0):
        raise ValueError(f"{path}: latency profile must hold finite, non-negative seconds")
    return samples


def save_latency_profile(path: str | Path, samples_s: np.ndarray | list[float], **meta: Any) -> None:
    """Write per-step latencies (seconds) in the format :func:`load_latency_profile` reads."""
    obj = {"format": FORMAT, **meta, "samples_s": [float(x) for x in np.asarray(samples_s).reshape(-1)]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f)


def _expand_hdr(encoded: str, unit_s: float) -> np.ndarray:
    from hdrh.histogram import HdrHistogram

    hist = HdrHistogram.decode(encoded)
    values, counts = [], []
    for item in hist.get_recorded_iterator():
        values.append(item.value_iterated_to)
        counts.append(item.count_at_value_iterated_to)
    counts_a = np.asarray(counts, np.int64)
    total = int(counts_a.sum())
    if total > _MAX_EXPANDED:
        counts_a = np.maximum(1, counts_a * _MAX_EXPANDED // total)
    return np.repeat(np.asarray(values, np.float64) * unit_s, counts_a)
