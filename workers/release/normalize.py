"""State and action normalisation taken from a release's statistics.

Every release normalises the proprio state on the way in and un-normalises the action on the
way out, each with its own statistics file (LeRobot's processor safetensors, OpenVLA-OFT's
``dataset_statistics.json``, GR00T's ``metadata.json``). All of their modes are affine maps, so
a policy holds one ``(shift, scale)`` pair per side - ``state_in = (state - shift) / scale`` and
``action_out = action * scale + shift`` - as persistent buffers: they travel with the weights,
the run's checkpoints and every export.
"""

from __future__ import annotations

import dataclasses

from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from rlvla3.observation import Observation

Affine = tuple[torch.Tensor, torch.Tensor]

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


class StatsNorm(nn.Module):
    """The policy's state-in / action-out affine maps; identity until a release sets them."""

    def __init__(self, state_dim: int, action_dim: int) -> None:
        super().__init__()
        self.register_buffer("state_shift", torch.zeros(state_dim))
        self.register_buffer("state_scale", torch.ones(state_dim))
        self.register_buffer("action_shift", torch.zeros(action_dim))
        self.register_buffer("action_scale", torch.ones(action_dim))

    def _apply(self, fn: Any, recurse: bool = True) -> "StatsNorm":
        """Follow the policy's device moves but stay float32: a bf16 policy keeps exact statistics."""
        for name, buf in self._buffers.items():
            if buf is not None:
                self._buffers[name] = buf.to(device=fn(buf[:0]).device, dtype=torch.float32)
        return self

    def set(self, state: Affine | None = None, action: Affine | None = None) -> None:
        """Install release statistics; a width that differs from the env's is a clear error."""
        for side, pair in (("state", state), ("action", action)):
            if pair is None:
                continue
            for part, value in zip(("shift", "scale"), pair):
                buf = getattr(self, f"{side}_{part}")
                value = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
                if value.shape != buf.shape:
                    raise ValueError(f"release {side} statistics have {value.numel()} dims; the env's {side} has {buf.numel()}")
                buf.copy_(value.to(buf.device, buf.dtype))

    def state_in(self, obs: Observation) -> Observation:
        """``obs`` with its ``state`` normalised (float32 numpy, as adapters give it); images are shared."""
        shift = self.state_shift.detach().float().cpu().numpy()
        scale = self.state_scale.detach().float().cpu().numpy()
        state = ((np.asarray(obs.state, dtype=np.float32) - shift) / scale).astype(np.float32)
        return dataclasses.replace(obs, state=state)

    def action_out(self, actions: torch.Tensor) -> torch.Tensor:
        """Model-space actions ``[..., A]`` -> env actions."""
        return actions * self.action_scale.float() + self.action_shift.float()

    def affines(self) -> tuple[Affine, Affine]:
        """``((state_shift, state_scale), (action_shift, action_scale))`` as float32 CPU tensors."""
        f = lambda b: b.detach().float().cpu().clone()  # noqa: E731
        return (f(self.state_shift), f(self.state_scale)), (f(self.action_shift), f(self.action_scale))


def mean_std_stats(pair: Affine) -> dict[str, torch.Tensor]:
    """An affine pair written as MEAN_STD statistics (exact when read back with ``eps = 0``)."""
    shift, scale = pair
    return {"mean": shift.float().contiguous(), "std": scale.float().contiguous()}


def concat_stats(parts: Sequence[Mapping[str, Any]], names: Sequence[str]) -> dict[str, np.ndarray]:
    """Per-key statistics (GR00T keeps one entry per state/action key) joined in order."""
    return {n: np.concatenate([np.asarray(p[n], dtype=np.float32).reshape(-1) for p in parts]) for n in names}
