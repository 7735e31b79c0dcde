"""A stochastic flow-matching sampler whose every step has a Gaussian density (piRL-style).

Convention (pi0's): time runs from t=1 (pure noise) to t=0 (action) in ``K`` equal steps,
``x_{k+1} = x_k + dt * v(x_k, t_k)`` with ``dt = -1/K``; the chain is ``x_0`` (noise) .. ``x_K``
(the action chunk). RL needs ``log p(actions)``, which an ODE does not have, so some steps are
made stochastic:

* ``ode`` - no noise; log-prob 0. Deterministic evaluation.
* ``sde`` - Flow-SDE: the ODE is turned into the SDE with the same marginals,
  ``mean = x + dt * (v + sigma_t^2 / (2t) * (x + (1 - t) v))``, ``std = sigma_t * sqrt(-dt)``,
  ``sigma_t = a * sqrt(t / (1 - t))``, whose first step (``t = 1``) takes ``1 - t`` at the next
  time, ``1/K`` (RLinf's pi0 / pi0.5 ``flow_sde``: ``sigma_1 = a * sqrt(K)``).
  Noise goes into ``all`` steps or ``one`` random step per sample.
* ``noise`` - Flow-Noise: ODE mean plus a learned, bounded std from a noise head that reads the
  action expert's features.

The log-prob of a chain is the sum of the Gaussian log-densities of its stochastic transitions.
``act`` returns the whole chain and the mask of stochastic steps as replay, so ``score`` recomputes
exactly the same densities with gradients: every transition is conditioned on the stored ``x_k``.
Only the first ``score_dims`` action dims get noise and are scored (checkpoints pad actions).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from rlvla3.observation import Observation
from workers.policies.base import ActOutput, EvalOutput, Policy

MODES = ("ode", "sde", "noise")

# v(x_t [B,T,D], t [B]) -> (velocity [B,T,D], features [B,T,H] or None for the noise head)
VelocityFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class SamplerConfig:
    mode: str = "sde"
    num_steps: int = 4
    noise_level: float = 0.5
    stochastic_steps: str = "all"
    noise_std_min: float = 0.08
    noise_std_max: float = 0.16

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"sampler mode {self.mode!r} not in {MODES}")
        if self.stochastic_steps not in ("all", "one"):
            raise ValueError(f"stochastic_steps {self.stochastic_steps!r} not in ('all', 'one')")
        if self.num_steps < 1:
            raise ValueError("num_steps must be >= 1")


@dataclass
class ChainResult:
    actions: torch.Tensor  # float32 [B, T, D] (= chain[:, -1])
    chain: torch.Tensor  # float32 [B, K+1, T, D]
    mask: torch.Tensor  # bool [B, K]: which transitions were stochastic
    logprob: torch.Tensor  # float32 [B, T]
    entropy: torch.Tensor  # float32 [B, T]


def gaussian_logpdf(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Elementwise log N(x; mean, std^2)."""
    return -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)


def gaussian_entropy(std: torch.Tensor) -> torch.Tensor:
    return 0.5 * math.log(2 * math.pi * math.e) + torch.log(std)


class FlowSampler(nn.Module):
    """Runs and scores the denoising chain; owns the Flow-Noise head when ``mode == 'noise'``."""

    def __init__(self, cfg: SamplerConfig, feature_dim: int, action_dim: int, score_dims: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.score_dims = score_dims
        self.noise_head = nn.Linear(feature_dim, action_dim) if cfg.mode == "noise" else None

    def times(self, device: torch.device) -> torch.Tensor:
        k = self.cfg.num_steps
        return 1.0 - torch.arange(k, device=device, dtype=torch.float32) / k

    def sde_sigma(self, t: float) -> float:
        """Flow-SDE's ``sigma_t = a * sqrt(t / (1 - t))`` with ``1 - t`` floored at ``1/K``, so the
        first step (``t = 1``) is finite: ``a * sqrt(K)`` there, as RLinf computes it."""
        return self.cfg.noise_level * math.sqrt(t / max(1.0 - t, 1.0 / self.cfg.num_steps))

    def transition(
        self, x: torch.Tensor, v: torch.Tensor, feat: torch.Tensor | None, t: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ODE step, stochastic mean and std of the step from time ``t`` (all float32)."""
        dt = -1.0 / self.cfg.num_steps
        v = v.float()
        ode = x + dt * v
        if self.cfg.mode == "sde":
            sigma = self.sde_sigma(t)
            mean = x + dt * (v + sigma**2 / (2 * t) * (x + (1.0 - t) * v))
            std = torch.full_like(x, sigma * math.sqrt(-dt))
        elif self.cfg.mode == "noise":
            assert self.noise_head is not None and feat is not None, "noise mode needs expert features"
            lo, hi = self.cfg.noise_std_min, self.cfg.noise_std_max
            std = lo + (hi - lo) * torch.sigmoid(self.noise_head(feat.to(self.noise_head.weight.dtype)).float())
            mean = ode
        else:
            mean, std = ode, torch.ones_like(x)
        return ode, mean, std

    def _score_step(self, x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.score_dims
        lp = gaussian_logpdf(x_next[..., :d], mean[..., :d], std[..., :d]).sum(-1)
        ent = gaussian_entropy(std[..., :d]).sum(-1)
        return lp, ent

    def _step_mask(self, batch: int, device: torch.device, deterministic: bool) -> torch.Tensor:
        k = self.cfg.num_steps
        if deterministic or self.cfg.mode == "ode":
            return torch.zeros(batch, k, dtype=torch.bool, device=device)
        if self.cfg.stochastic_steps == "all":
            return torch.ones(batch, k, dtype=torch.bool, device=device)
        pick = torch.randint(0, k, (batch,), device=device)
        return torch.arange(k, device=device)[None] == pick[:, None]

    def sample(self, velocity: VelocityFn, x0: torch.Tensor, deterministic: bool) -> ChainResult:
        """Denoise ``x0`` (noise, [B, T, D]); deterministic follows the ODE and scores nothing."""
        b = x0.shape[0]
        mask = self._step_mask(b, x0.device, deterministic)
        x = x0.float()
        chain = [x]
        lp = torch.zeros(b, x0.shape[1], device=x0.device)
        ent = torch.zeros_like(lp)
        d = self.score_dims
        for k, t in enumerate(self.times(x0.device).tolist()):
            v, feat = velocity(x, torch.full((b,), t, device=x0.device))
            ode, mean, std = self.transition(x, v, feat, t)
            m = mask[:, k].view(b, 1, 1)
            nxt = ode.clone()
            noisy = mean[..., :d] + std[..., :d] * torch.randn_like(mean[..., :d])
            nxt[..., :d] = torch.where(m, noisy, ode[..., :d])
            nxt[..., d:] = torch.where(m, mean[..., d:], ode[..., d:])
            slp, sent = self._score_step(nxt, mean, std)
            lp = lp + mask[:, k, None] * slp
            ent = ent + mask[:, k, None] * sent
            x = nxt
            chain.append(x)
        chain_t = torch.stack(chain, dim=1)
        return ChainResult(chain_t[:, -1], chain_t, mask, lp, ent)

    def score(self, velocity: VelocityFn, chain: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Differentiable log-prob and entropy ``[B, T]`` of a stored chain (replay from ``sample``)."""
        b, _, tlen, _ = chain.shape
        chain = chain.float()
        lp = torch.zeros(b, tlen, device=chain.device)
        ent = torch.zeros_like(lp)
        if self.cfg.mode == "ode" or not bool(mask.any()):
            return lp, ent
        for k, t in enumerate(self.times(chain.device).tolist()):
            if not bool(mask[:, k].any()):
                continue
            v, feat = velocity(chain[:, k], torch.full((b,), t, device=chain.device))
            _, mean, std = self.transition(chain[:, k], v, feat, t)
            slp, sent = self._score_step(chain[:, k + 1], mean, std)
            m = mask[:, k, None].float()
            lp = lp + m * slp
            ent = ent + m * sent
        return lp, ent


@dataclass
class FlowOptions:
    """Sampler fields shared by the flow-matching families' option dataclasses."""

    sampler: str = "sde"
    """``ode`` (no log-probs), ``sde`` (Flow-SDE) or ``noise`` (Flow-Noise, learned std)."""
    num_steps: int = 4
    """Denoising steps K."""
    noise_level: float = 0.5
    """Flow-SDE ``a`` in ``sigma_t = a * sqrt(t / (1 - t))``."""
    stochastic_steps: str = "all"
    """Flow-SDE noise in ``all`` steps or ``one`` random step per sample."""
    noise_std_min: float = 0.08
    """Flow-Noise lower bound on the learned std."""
    noise_std_max: float = 0.16
    """Flow-Noise upper bound on the learned std."""

    def sampler_config(self) -> SamplerConfig:
        return SamplerConfig(
            mode=self.sampler,
            num_steps=self.num_steps,
            noise_level=self.noise_level,
            stochastic_steps=self.stochastic_steps,
            noise_std_min=self.noise_std_min,
            noise_std_max=self.noise_std_max,
        )


class FlowPolicy(Policy):
    """``act`` / ``evaluate`` of the flow-matching families (pi0, pi0.5, GR00T).

    A family builds ``self.sampler`` and ``self.model_action_dim`` and supplies ``_context`` (the
    observation encoded once, with the critic's ``"value"`` ``[B]``) and ``_velocity_fn`` (the
    velocity the sampler integrates). ``act`` samples a chain from noise; ``evaluate`` replays it.
    """

    logprob_level = "action"
    sampler: FlowSampler
    model_action_dim: int
    norm: Any  # workers.release.normalize.StatsNorm: the release's state-in / action-out maps

    @abstractmethod
    def _context(self, obs: Observation) -> dict[str, Any]:
        """Per-observation tensors every denoising step reads, including ``"value"``."""

    @abstractmethod
    def _velocity_fn(self, ctx: dict[str, Any]) -> VelocityFn:
        """The velocity ``v(x_t, t)`` (pi0's time convention) given the context."""

    _eval_noise: torch.Generator | None = None

    def seed_eval(self, seed: int) -> None:
        """Restart the stream the deterministic chain's starts are drawn from."""
        self._eval_noise = torch.Generator().manual_seed(int(seed))

    def act(self, obs: Observation, deterministic: bool = False, noise: torch.Tensor | None = None) -> ActOutput:
        """``noise`` ``[B, T, model_action_dim]`` is the chain's start (parity tests); by default a
        prior draw. ``deterministic`` follows the ODE from a draw of its own seeded CPU stream
        (:meth:`seed_eval`), as openpi's, LeRobot's and GR00T's inference start from the prior:
        from ``x0 = 0``, a point the prior never draws, a policy trained by RL on the chain scored
        half its success on the synthetic reach (docs/architecture.md, "Pixels to success"). A
        fixed draw is no better: one draw scored 0.0 and another 0.55 on the same checkpoint."""
        with torch.no_grad():
            ctx = self._context(self.norm.state_in(obs))
            shape = (ctx["value"].shape[0], self.chunk_size, self.model_action_dim)
            if noise is not None:
                if tuple(noise.shape) != shape:
                    raise ValueError(f"{self.family}: initial noise of shape {tuple(noise.shape)}; expected {shape}")
                x0 = noise.to(self.device, torch.float32)
            else:
                x0 = self._eval_start(shape) if deterministic else torch.randn(shape, device=self.device)
            res = self.sampler.sample(self._velocity_fn(ctx), x0, deterministic)
        actions = self.norm.action_out(res.actions[..., : self.action_dim])
        return ActOutput(actions=actions.contiguous(), logprob=res.logprob,
                         value=ctx["value"], replay={"chain": res.chain, "stochastic": res.mask})

    def _eval_start(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self._eval_noise is None:
            self.seed_eval(0)
        return torch.randn(shape, generator=self._eval_noise).to(self.device)

    def sample_time(self, batch: int) -> torch.Tensor:
        """Training times (1 = noise): openpi's and LeRobot's ``Beta(1.5, 1) * 0.999 + 0.001``."""
        return torch.distributions.Beta(1.5, 1.0).sample((batch,)) * 0.999 + 0.001

    def sft_loss(self, obs: Observation, actions: torch.Tensor, noise: torch.Tensor | None = None,
                 time: torch.Tensor | None = None) -> torch.Tensor:
        """Flow matching on expert chunks ``[B, T, A]`` (env space): the normalised, zero-padded
        chunk noised to ``x_t = t * noise + (1 - t) * actions`` at times from :meth:`sample_time`,
        the velocity regressed onto ``noise - actions`` (mean squared error over the env's action
        dims, as LeRobot's loss). The critic and the noise head get no gradient."""
        ctx = self._context(self.norm.state_in(obs))
        target = self.norm.action_in(actions.to(self.device).float())
        b, d = target.shape[0], self.action_dim
        chunk = torch.zeros(b, self.chunk_size, self.model_action_dim, device=self.device)
        chunk[..., :d] = target
        noise = torch.randn_like(chunk) if noise is None else noise.to(chunk)
        t = (self.sample_time(b) if time is None else time).to(chunk)[:, None, None]
        v, _ = self._velocity_fn(ctx)(t * noise + (1 - t) * chunk, t[:, 0, 0])
        return ((v.float() - (noise - chunk))[..., :d] ** 2).mean()

    def evaluate(self, obs: Observation, actions: torch.Tensor, replay: dict[str, torch.Tensor]) -> EvalOutput:
        ctx = self._context(self.norm.state_in(obs))
        chain = replay["chain"].to(self.device).clone()  # clone: may come from inference_mode
        lp, ent = self.sampler.score(self._velocity_fn(ctx), chain, replay["stochastic"].to(self.device))
        return EvalOutput(logprob=lp, entropy=ent, value=ctx["value"])
