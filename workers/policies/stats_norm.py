"""The policy's state-in / action-out normalisation, kept as buffers that travel with its weights.

Every release's normalisation modes are affine maps, so a policy holds one ``(shift, scale)``
pair per side - ``state_in = (state - shift) / scale`` and ``action_out = action * scale +
shift`` - as persistent buffers: they travel with the weights, the run's checkpoints and every
export. ``workers.release.normalize`` computes the pairs from a release's statistics files.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch import nn

from rlvla3.observation import Observation

Affine = tuple[torch.Tensor, torch.Tensor]


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

    def action_in(self, actions: torch.Tensor) -> torch.Tensor:
        """Env actions ``[..., A]`` -> model space (the inverse of :meth:`action_out`; training targets)."""
        return (actions - self.action_shift.float()) / self.action_scale.float()

    def affines(self) -> tuple[Affine, Affine]:
        """``((state_shift, state_scale), (action_shift, action_scale))`` as float32 CPU tensors."""
        f = lambda b: b.detach().float().cpu().clone()  # noqa: E731
        return (f(self.state_shift), f(self.state_scale)), (f(self.action_shift), f(self.action_scale))
