"""Running mean and variance of observations, kept as buffers so they travel with the weights.

The statistics are module buffers: checkpoints save them with the parameters (so evaluation and
export normalise as training did), and a policy lists them in ``live_buffers`` so every
published weight version carries the statistics the trainer trained that version with
(``rlvla3.weights``). Generators never update them: they see raw observations and normalise with
the version they serve; the trainer updates them after each update from the raw observations
of the batch (:meth:`workers.policies.base.Policy.update_statistics`).
"""

from __future__ import annotations

import torch
from torch import nn

EPS = 1e-8


class RunningNorm(nn.Module):
    """``clip((x - mean) / sqrt(var + eps), -clip, clip)`` with Chan et al.'s parallel update."""

    def __init__(self, dim: int, clip: float = 10.0) -> None:
        super().__init__()
        self.clip = float(clip)
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.full((), 1e-4))  # a tiny prior: the first batch dominates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = (x - self.mean.to(x.dtype)) / torch.sqrt(self.var.to(x.dtype) + EPS)
        return z.clamp(-self.clip, self.clip) if self.clip > 0 else z

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Fold a batch ``[N, dim]`` of raw observations into the statistics."""
        x = x.detach().to(torch.float64).reshape(-1, self.mean.shape[0])
        n = x.shape[0]
        if n == 0:
            return
        b_mean, b_var = x.mean(0), x.var(0, unbiased=False)
        mean, var, count = self.mean.double(), self.var.double(), self.count.double()
        total = count + n
        delta = b_mean - mean
        new_mean = mean + delta * n / total
        m2 = var * count + b_var * n + delta.pow(2) * count * n / total
        self.mean.copy_(new_mean.to(self.mean.dtype))
        self.var.copy_((m2 / total).to(self.var.dtype))
        self.count.copy_(total.to(self.count.dtype))
