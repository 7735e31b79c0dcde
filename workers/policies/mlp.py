"""A small Gaussian actor-critic over images and state: the fabric's test and benchmark policy.

Log-probs are per action step (``logprob_level = "action"``): a chunk of T actions gives [B, T].
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from rlvla3.observation import Observation
from workers.contract import EnvSpec
from workers.policies.base import ActOutput, EvalOutput, Policy, register_policy


@dataclass
class MLPConfig:
    hidden: int = 64
    """Width of the hidden layers."""
    use_images: bool = True
    """Encode the first camera with a small CNN (else state only)."""
    init_log_std: float = -0.5
    """Initial log standard deviation of the action distribution."""
    chunk_size: int = 1
    """Actions per decision."""
    forward_delay_ms: float = 0.0
    """Sleep this long in each ``act``: stands in for a large model's forward time, so benchmarks
    on a CPU machine can give the generator stage a VLA's cost without burning cores."""
    forward_per_env_ms: float = 0.0
    """Plus this much per env in the batch: a forward pass of ``a + c*b`` ms (a =
    ``forward_delay_ms``, c = this), the shape ``bench/generator.py`` measures for VLAs."""


class MLPPolicy(Policy):
    family = "mlp"
    logprob_level = "action"

    def __init__(self, cfg: MLPConfig, spec: EnvSpec) -> None:
        super().__init__(spec, cfg.chunk_size)
        self.cfg = cfg
        h = cfg.hidden
        feat = spec.state_dim
        self.camera = next(iter(spec.cameras), None) if cfg.use_images else None
        if self.camera is not None:
            ch, cw = spec.cameras[self.camera]
            self.cnn = nn.Sequential(
                nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
                nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),
                nn.AdaptiveAvgPool2d(4), nn.Flatten(),
            )
            feat += 8 * 16
        self.trunk = nn.Sequential(nn.Linear(feat, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh())
        self.mu = nn.Linear(h, self.chunk_size * self.action_dim)
        self.value_head = nn.Linear(h, 1)
        self.log_std = nn.Parameter(torch.full((self.chunk_size, self.action_dim), cfg.init_log_std))
        nn.init.orthogonal_(self.mu.weight, 0.01)
        nn.init.zeros_(self.mu.bias)

    def _features(self, obs: Observation) -> torch.Tensor:
        o = obs.to_torch(self.device, cameras=[self.camera] if self.camera is not None else [])
        parts = [o.state]
        if self.camera is not None:
            img = o.images[self.camera].permute(0, 3, 1, 2).float() / 255.0
            parts.append(self.cnn(img))
        return self.trunk(torch.cat(parts, dim=1))

    def _dist(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        z = self._features(obs)
        mu = self.mu(z).view(-1, self.chunk_size, self.action_dim)
        std = self.log_std.exp().expand_as(mu)
        return mu, std, self.value_head(z).squeeze(-1)

    @staticmethod
    def _logprob(actions: torch.Tensor, mu: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        var = std * std
        lp = -((actions - mu) ** 2) / (2 * var) - std.log() - 0.5 * math.log(2 * math.pi)
        return lp.sum(-1)  # [B, T]

    def act(self, obs: Observation, deterministic: bool = False) -> ActOutput:
        delay_ms = self.cfg.forward_delay_ms + self.cfg.forward_per_env_ms * len(obs.state)
        if delay_ms > 0:
            time.sleep(delay_ms / 1000.0)
        mu, std, value = self._dist(obs)
        actions = mu if deterministic else mu + std * torch.randn_like(mu)
        return ActOutput(actions=actions, logprob=self._logprob(actions, mu, std), value=value, replay={})

    def evaluate(self, obs: Observation, actions: torch.Tensor, replay: dict[str, torch.Tensor]) -> EvalOutput:
        mu, std, value = self._dist(obs)
        actions = actions.to(mu.device, mu.dtype)
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + std.log()).sum(-1)
        return EvalOutput(logprob=self._logprob(actions, mu, std), entropy=entropy, value=value)


@register_policy("mlp", config=MLPConfig)
def build_mlp(cfg: MLPConfig, spec: EnvSpec) -> Policy:
    return MLPPolicy(cfg, spec)
