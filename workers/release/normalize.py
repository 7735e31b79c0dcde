"""A release's normalisation statistics turned into the affine pairs a policy holds.

Every release normalises the proprio state on the way in and un-normalises the action on the
way out, each with its own statistics file (LeRobot's processor safetensors, OpenVLA-OFT's
``dataset_statistics.json``, GR00T's ``metadata.json``). All of their modes are affine maps, so
each side comes down to one ``(shift, scale)`` pair, which the policy's
:class:`workers.policies.stats_norm.StatsNorm` keeps.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from workers.policies.stats_norm import Affine

# Which pair of statistics bounds each range mode (LeRobot's NormalizationMode names).
_RANGE_STATS = {"MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90")}


def affine_from_stats(mode: str, stats: Mapping[str, Any], dim: int, eps: float, inverse: bool) -> Affine:
    """``(shift, scale)`` reproducing LeRobot's NormalizerProcessorStep (``inverse`` = un-normalise).

    MEAN_STD divides by ``std + eps`` but multiplies back by ``std``; the range modes map
    ``[lo, hi]`` to ``[-1, 1]`` and use ``eps`` where ``hi == lo``.
    """
    t = lambda name: torch.as_tensor(np.asarray(stats[name], dtype=np.float32)).reshape(-1)  # noqa: E731
    if mode == "IDENTITY":
        return torch.zeros(dim), torch.ones(dim)
    if mode == "MEAN_STD":
        mean, std = t("mean"), t("std")
        return mean, (std if inverse else std + eps)
    if mode in _RANGE_STATS:
        lo, hi = (t(n) for n in _RANGE_STATS[mode])
        half = torch.where(hi - lo == 0, torch.full_like(lo, eps), hi - lo) / 2
        return lo + half, half
    raise ValueError(f"normalisation mode {mode!r} is not one of IDENTITY, MEAN_STD, {', '.join(_RANGE_STATS)}")


def mean_std_stats(pair: Affine) -> dict[str, torch.Tensor]:
    """An affine pair written as MEAN_STD statistics (exact when read back with ``eps = 0``)."""
    shift, scale = pair
    return {"mean": shift.float().contiguous(), "std": scale.float().contiguous()}


def concat_stats(parts: Sequence[Mapping[str, Any]], names: Sequence[str]) -> dict[str, np.ndarray]:
    """Per-key statistics (GR00T keeps one entry per state/action key) joined in order."""
    return {n: np.concatenate([np.asarray(p[n], dtype=np.float32).reshape(-1) for p in parts]) for n in names}
