"""The policy contract shared by generators (``act``) and trainers (``evaluate``).

Every family - the small ``mlp`` policy, OpenVLA-OFT, pi0, pi0.5, GR00T N1.5 - is a
``torch.nn.Module`` with the same two calls, so the generator worker and the PPO/GRPO code
never know which model they drive:

* ``act(obs, deterministic)`` samples an action chunk and returns its log-probability, a value
  estimate and the *replay* data needed to score exactly that sample again (token ids for
  autoregressive heads; the sampler's noise chain and which denoising steps were stochastic for
  flow-matching heads). Replay travels with the trajectory to the trainer.
* ``evaluate(obs, actions, replay)`` recomputes differentiable log-probs, entropy and values for
  given actions. ``evaluate`` on the output of ``act`` reproduces ``act``'s log-probs (to 1e-5 in
  float32): PPO's importance ratio depends on it.

Log-probs come as ``[B, L]``: one entry per unit of ``logprob_level`` - ``token`` (L = tokens
per chunk), ``action`` (L = chunk length, one per step) or ``chunk`` (L = 1). The trainer sums
or keeps them per unit as the algorithm asks.

Observations are :class:`rlvla3.observation.Observation` batches, as the env adapters return
them and the generator gathers them: images uint8 ``[B, H, W, 3]`` per camera, ``state`` float32
``[B, D]``, ``instruction`` list of B strings. A family reads them on its device through
``Observation.to_torch``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from rlvla3.observation import Observation
from workers.contract import EnvSpec, parse_options

LOGPROB_LEVELS = ("token", "action", "chunk")


@dataclass
class ActOutput:
    """What a generator returns for one batch."""

    actions: torch.Tensor  # float32 [B, T, A]
    logprob: torch.Tensor  # float32 [B, L]
    value: torch.Tensor  # float32 [B] (zeros when the family has no value head)
    replay: dict[str, torch.Tensor] = field(default_factory=dict)  # each [B, ...]


@dataclass
class EvalOutput:
    """What the trainer gets back when it re-scores actions."""

    logprob: torch.Tensor  # [B, L], differentiable
    entropy: torch.Tensor  # [B, L] or [B], differentiable
    value: torch.Tensor  # [B], differentiable


class Policy(nn.Module, ABC):
    """Base class of every policy family."""

    family: ClassVar[str] = ""
    logprob_level: ClassVar[str] = "chunk"
    live_buffers: tuple[str, ...] = ()
    """Buffers that change during training (observation statistics): published with every
    weight version like trainable parameters, not once like frozen tensors."""

    def __init__(self, spec: EnvSpec, chunk_size: int) -> None:
        super().__init__()
        self.spec = spec
        self.chunk_size = int(chunk_size)
        self.action_dim = int(spec.action_dim)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @abstractmethod
    def act(self, obs: Observation, deterministic: bool = False) -> ActOutput:
        """Sample one action chunk per env; ``deterministic`` adds no exploration noise (the
        mode, or the flow families' ODE from a seeded prior draw)."""

    @abstractmethod
    def evaluate(self, obs: Observation, actions: torch.Tensor, replay: dict[str, torch.Tensor]) -> EvalOutput:
        """Differentiable log-probs, entropy and values of given actions."""

    def seed_eval(self, seed: int) -> None:
        """Restart the noise a deterministic ``act`` draws (the flow families' chain start), so
        an evaluation repeats; families whose deterministic action is a mode draw none."""

    def update_statistics(self, obs: Observation) -> None:
        """Fold the raw observations of a trained batch into statistics the policy keeps (the
        trainer calls it after each update; families without statistics keep nothing)."""

    def sft_loss(self, obs: Observation, actions: torch.Tensor) -> torch.Tensor:
        """The supervised warm start's loss on expert chunks ``[B, T, A]`` (env space): the negative
        log-prob of the chunk; families with a training objective of their own override it."""
        return -self.evaluate(obs, actions, {}).logprob.float().sum(-1).mean()


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

PolicyBuilder = Callable[[Any, EnvSpec], Policy]
_POLICIES: dict[str, tuple[PolicyBuilder, type]] = {}


def register_policy(family: str, config: type) -> Callable[[PolicyBuilder], PolicyBuilder]:
    """Register a builder ``(config, spec) -> Policy`` with its config dataclass."""

    def deco(builder: PolicyBuilder) -> PolicyBuilder:
        _POLICIES[family] = (builder, config)
        return builder

    return deco


_FAMILY_MODULES = {"mlp": "mlp", "openvla_oft": "openvla_oft", "pi0": "pi0", "pi05": "pi05", "gr00t_n15": "gr00t"}


def _import_builtin_policies(family: str | None = None) -> None:
    """Import the family's module (all of them when ``family`` is None): VLA modules pull in
    transformers, which takes seconds, so a job imports only what it runs."""
    import importlib

    mods = [_FAMILY_MODULES[family]] if family in _FAMILY_MODULES else list(_FAMILY_MODULES.values())
    for mod in mods:
        try:
            importlib.import_module(f"workers.policies.{mod}")
        except ModuleNotFoundError as exc:
            if exc.name == f"workers.policies.{mod}":
                continue
            raise


def policy_families() -> list[str]:
    _import_builtin_policies()
    return sorted(_POLICIES)


def make_policy(family: str, options: dict[str, Any] | None, spec: EnvSpec) -> Policy:
    """Build the family's policy from its options dict (validated into its config dataclass)."""
    _import_builtin_policies(family)
    if family not in _POLICIES:
        raise ValueError(f"unknown model family {family!r}; registered: {policy_families()}")
    builder, cfg_cls = _POLICIES[family]
    cfg = parse_options(cfg_cls, options, f"model.options for {family!r}")
    policy = builder(cfg, spec)
    if policy.logprob_level not in LOGPROB_LEVELS:
        raise ValueError(f"{family}: logprob_level {policy.logprob_level!r} not in {LOGPROB_LEVELS}")
    return policy


def options_class(family: str) -> type | None:
    """The options dataclass of ``family`` (None when no such family is registered)."""
    _import_builtin_policies(family)
    entry = _POLICIES.get(family)
    return entry[1] if entry else None
