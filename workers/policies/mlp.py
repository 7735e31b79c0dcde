"""A small actor-critic over images and state: the fabric's test and benchmark policy, and the
continuous-control PPO agent of "The 37 Implementation Details of PPO" when its options say so
(``separate_critic``, ``ortho_init``, ``norm_obs``, ``init_log_std: 0``).

Continuous actions are Gaussian with a state-independent log-std; a discrete action space
(``EnvSpec.action_choices``) gets a categorical head whose sampled index travels as one float.
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
from workers.policies.running_norm import RunningNorm


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
    separate_critic: bool = False
    """The value head reads its own trunk (same shape as the actor's), so value-loss gradients
    never move the policy's features (CleanRL's continuous-control agent)."""
    ortho_init: bool = False
    """Orthogonal initialisation: gain sqrt(2) on hidden layers, 1 on the value output, 0.01 on
    the action output (biases zero)."""
    norm_obs: bool = False
    """Normalise the state by running mean and std (statistics updated by the trainer, published
    with every version and saved in checkpoints)."""
    obs_clip: float = 10.0
    """With ``norm_obs``: clip normalised state components to +-this (0: no clip)."""


class MLPPolicy(Policy):
    family = "mlp"
    logprob_level = "action"

    def __init__(self, cfg: MLPConfig, spec: EnvSpec) -> None:
        super().__init__(spec, cfg.chunk_size)
        self.cfg = cfg
        h = cfg.hidden
        feat = spec.state_dim
        self.choices = int(spec.action_choices)
        if self.choices and self.action_dim != 1:
            raise ValueError(f"mlp: a discrete action space needs action_dim 1, got {self.action_dim}")
        self.obs_norm = RunningNorm(spec.state_dim, cfg.obs_clip) if cfg.norm_obs else None
        if cfg.norm_obs:
            self.live_buffers = tuple(f"obs_norm.{n}" for n, _ in self.obs_norm.named_buffers())
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
        self.value_trunk = (nn.Sequential(nn.Linear(feat, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh())
                            if cfg.separate_critic else None)
        self.mu = nn.Linear(h, self.chunk_size * (self.choices or self.action_dim))
        self.value_head = nn.Linear(h, 1)
        if not self.choices:
            self.log_std = nn.Parameter(torch.full((self.chunk_size, self.action_dim), cfg.init_log_std))
        if cfg.ortho_init:
            for trunk in (self.trunk, self.value_trunk):
                for layer in trunk or ():
                    if isinstance(layer, nn.Linear):
                        nn.init.orthogonal_(layer.weight, math.sqrt(2))
                        nn.init.zeros_(layer.bias)
            nn.init.orthogonal_(self.value_head.weight, 1.0)
            nn.init.zeros_(self.value_head.bias)
        nn.init.orthogonal_(self.mu.weight, 0.01)
        nn.init.zeros_(self.mu.bias)

    def _features(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor]:
        """(actor features, critic features): the same tensor unless ``separate_critic``."""
        o = obs.to_torch(self.device, cameras=[self.camera] if self.camera is not None else [])
        state = o.state if self.obs_norm is None else self.obs_norm(o.state)
        parts = [state]
        if self.camera is not None:
            img = o.images[self.camera].permute(0, 3, 1, 2).float() / 255.0
            parts.append(self.cnn(img))
        x = torch.cat(parts, dim=1)
        z = self.trunk(x)
        return z, (z if self.value_trunk is None else self.value_trunk(x))

    def _dist(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(mean [B,T,A] and std, or logits [B,T,choices] and None; value [B])."""
        z, zv = self._features(obs)
        value = self.value_head(zv).squeeze(-1)
        if self.choices:
            return self.mu(z).view(-1, self.chunk_size, self.choices), None, value
        mu = self.mu(z).view(-1, self.chunk_size, self.action_dim)
        return mu, self.log_std.exp().expand_as(mu), value

    def update_statistics(self, obs: Observation) -> None:
        if self.obs_norm is not None:
            self.obs_norm.update(torch.as_tensor(obs.state, device=self.device))

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
        if std is None:  # discrete: the index, as a float [B, T, 1]
            dist = torch.distributions.Categorical(logits=mu.float())
            idx = mu.argmax(-1) if deterministic else dist.sample()
            return ActOutput(actions=idx.unsqueeze(-1).to(mu.dtype), logprob=dist.log_prob(idx), value=value, replay={})
        actions = mu if deterministic else mu + std * torch.randn_like(mu)
        return ActOutput(actions=actions, logprob=self._logprob(actions, mu, std), value=value, replay={})

    def evaluate(self, obs: Observation, actions: torch.Tensor, replay: dict[str, torch.Tensor]) -> EvalOutput:
        mu, std, value = self._dist(obs)
        if std is None:
            dist = torch.distributions.Categorical(logits=mu.float())
            idx = actions.to(mu.device)[..., 0].round().long().clamp(0, self.choices - 1)
            return EvalOutput(logprob=dist.log_prob(idx), entropy=dist.entropy(), value=value)
        actions = actions.to(mu.device, mu.dtype)
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + std.log()).sum(-1)
        return EvalOutput(logprob=self._logprob(actions, mu, std), entropy=entropy, value=value)


@register_policy("mlp", config=MLPConfig)
def build_mlp(cfg: MLPConfig, spec: EnvSpec) -> Policy:
    return MLPPolicy(cfg, spec)
