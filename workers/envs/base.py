"""The env-adapter contract: every simulator looks the same to the simulator worker.

An adapter owns ``num_envs`` environments that the simulator worker steps together as one
*slot*. It never auto-resets: the worker decides when an env starts a new episode,
and with which seed / init state, so GRPO groups and evaluation can replay the same start.

Observations are :class:`rlvla3.observation.Observation` batches: a uint8 ``[n, H, W, 3]`` image
per camera (upright), a float32 ``[n, state_dim]`` state and ``n`` instructions. The simulator
worker hands ``reset``/``step`` its slot's shared-memory block as ``into`` (row ``i`` is env
``i``), and the simulator renders and writes each env's observation straight into its row: the
generator reads that block, so nothing is copied on the way from renderer to policy (a simulator
that hands over a fresh array, such as robosuite's flipped images or ManiSkill's tensors, costs
one copy into the block). Without ``into`` the call returns a new batch of the envs named, in
the order named (evaluation, demos, tests).

Adapters register themselves with ``@register_env("name")`` and are built from the job config
by :func:`make_env`; one outside this package registers when ``env.plugins`` names its module.
An adapter's own options arrive as a dict (``env.options`` in YAML) and are validated into that
adapter's options dataclass, so a mistyped key names itself.
"""

from __future__ import annotations

import os
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from rlvla3.observation import Observation
from workers.contract import EnvSpec, parse_options


@dataclass
class StepResult:
    """One env step for the envs named in the call, in the order named (``obs``: see
    :meth:`EnvAdapter.step`)."""

    reward: np.ndarray  # float32 [n]
    terminated: np.ndarray  # bool [n]
    truncated: np.ndarray  # bool [n]
    success: np.ndarray  # bool [n]
    info: dict[str, Any] = field(default_factory=dict)
    obs: Observation | None = None


class EnvAdapter(ABC):
    """A batch of ``num_envs`` envs of one simulator, stepped by index."""

    spec: EnvSpec
    num_envs: int
    _envs: Sequence[Any] = ()
    """The simulator's own env objects, where the adapter holds them in this process."""

    @abstractmethod
    def reset(self, ids: Sequence[int], seeds: Sequence[int | None] | None = None,
              into: Observation | None = None) -> Observation:
        """Start a new episode in each env of ``ids``; ``seeds[i]`` fixes its initial state.
        Returns ``into`` with env ``i``'s first observation written into row ``i`` (for each
        ``i`` in ``ids``; other rows untouched), or without ``into`` a new batch of ``ids``."""

    @abstractmethod
    def step(self, ids: Sequence[int], actions: np.ndarray, into: Observation | None = None) -> StepResult:
        """Apply ``actions[i]`` (float32 [action_dim]) to env ``ids[i]``, one physics step each.
        The result's ``obs`` is ``into`` written in place as :meth:`reset` writes it, or a new
        batch of ``ids``."""

    def blank(self, n: int | None = None) -> Observation:
        """A zeroed batch of ``n`` envs (default all of them) in this env's shapes."""
        return Observation.zeros(self.spec.cameras, self.spec.state_dim, self.num_envs if n is None else n)

    def close(self) -> None:
        """Release simulator resources: closes every env in ``_envs`` (an adapter that holds
        more, such as renderers or subprocesses, releases those too)."""
        for env in self._envs:
            env.close()
        self._envs = []


class SimEnv(EnvAdapter):
    """An adapter whose simulator lives in this process: moving the simulator and writing its
    observations are separate, so that every observation is written once, where it is read.

    A subclass moves its envs in ``_reset``/``_step`` and writes their current observations in
    :meth:`observe`, rendering into the caller's rows where its renderer can.
    """

    @abstractmethod
    def _reset(self, ids: list[int], seeds: Sequence[int | None] | None) -> None:
        """Start a new episode in each env of ``ids`` (``seeds`` as in :meth:`reset`)."""

    @abstractmethod
    def _step(self, ids: list[int], actions: np.ndarray) -> StepResult:
        """One physics step of each env of ``ids``; the result without ``obs``."""

    @abstractmethod
    def observe(self, ids: list[int], into: Observation, rows: Sequence[int]) -> None:
        """Write env ``ids[j]``'s current observation (images, state, instruction) into row
        ``rows[j]`` of ``into``, in place."""

    def reset(self, ids: Sequence[int], seeds: Sequence[int | None] | None = None,
              into: Observation | None = None) -> Observation:
        ids = [int(i) for i in ids]
        self._reset(ids, seeds)
        return self._observed(ids, into)

    def step(self, ids: Sequence[int], actions: np.ndarray, into: Observation | None = None) -> StepResult:
        ids = [int(i) for i in ids]
        res = self._step(ids, np.asarray(actions, np.float32))
        res.obs = self._observed(ids, into)
        return res

    def _observed(self, ids: list[int], into: Observation | None) -> Observation:
        if into is None:
            out = self.blank(len(ids))
            self.observe(ids, out, range(len(ids)))
            return out
        self.observe(ids, into, ids)
        return into


def reset_seeds(ids: Sequence[int], seeds: Sequence[int | None] | None, rng: np.random.Generator) -> list[int]:
    """The seed of each env of ``ids`` being reset: the caller's where given, else a draw from the
    adapter's own ``rng`` (drawn in order, so the same adapter seed replays the same starts)."""
    return [int(rng.integers(2**31 - 1)) if s is None else int(s)
            for s in (seeds[k] if seeds is not None else None for k in range(len(ids)))]


def episode_ends(t: np.ndarray, success: np.ndarray, terminate_on_success: bool,
                 max_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(terminated, truncated): success ends an episode if asked; the time limit truncates the rest."""
    terminated = success.copy() if terminate_on_success else np.zeros(len(success), bool)
    return terminated, (t >= max_steps) & ~terminated


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

EnvFactory = Callable[..., EnvAdapter]
_ENVS: dict[str, tuple[EnvFactory, type | None]] = {}


def register_env(name: str, options: type | None = None) -> Callable[[EnvFactory], EnvFactory]:
    """Register an adapter class (or factory) under ``name`` with its options dataclass."""

    def deco(factory: EnvFactory) -> EnvFactory:
        _ENVS[name] = (factory, options)
        return factory

    return deco


def _import_adapters(plugins: Sequence[str] = ()) -> None:
    # Importing the modules registers them; heavy simulator imports stay inside the adapters,
    # so these imports succeed whether or not a simulator is installed. ``plugins``
    # (``env.plugins``) register adapters that live outside this package.
    import importlib

    for mod in ("synthetic", "metaworld", "libero", "maniskill", "robocasa", "gymnasium"):
        importlib.import_module(f"workers.envs.{mod}")
    if plugins and "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # as in the workers, which run as `python -m rlvla3`
    for mod in plugins:
        try:
            importlib.import_module(mod)
        except Exception as exc:  # a plug-in's own failure, named as the config's
            raise ImportError(f"env.plugins: importing {mod!r} failed: {exc!r}") from exc


def require_simulator(name: str, plugins: Sequence[str] = ()) -> None:
    """Raise ModuleNotFoundError, with install instructions, when env ``name``'s simulator is not
    installed here: an adapter module may define ``require_installed()`` (Meta-World's does);
    ImportError when a plug-in fails to import, and ValueError when no adapter registers as
    ``name`` once ``plugins`` are imported."""
    import importlib

    _registered(name, plugins)
    module = f"workers.envs.{name}"
    try:
        check = getattr(importlib.import_module(module), "require_installed", None)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return
        raise
    if check is not None:
        check()


def make_env(name: str, num_envs: int, seed: int = 0, options: dict[str, Any] | None = None,
             plugins: Sequence[str] = ()) -> EnvAdapter:
    """Build the adapter registered as ``name`` with ``num_envs`` envs."""
    factory, opt_cls = _registered(name, plugins)
    opts = parse_options(opt_cls, options, f"env.options for {name!r}")
    return factory(num_envs=num_envs, seed=seed, options=opts)


def _registered(name: str, plugins: Sequence[str]) -> tuple[EnvFactory, type | None]:
    _import_adapters(plugins)
    if name not in _ENVS:
        raise ValueError(f"unknown env {name!r}; registered: {sorted(_ENVS)} (an adapter outside "
                         f"workers.envs registers itself when env.plugins names its module)")
    return _ENVS[name]


def env_spec(name: str, options: dict[str, Any] | None = None, plugins: Sequence[str] = ()) -> EnvSpec:
    """The spec of an env without building a simulator (adapters may override ``spec_for``)."""
    factory, opt_cls = _registered(name, plugins)
    opts = parse_options(opt_cls, options, f"env.options for {name!r}")
    spec_for = getattr(factory, "spec_for", None)
    if spec_for is not None:
        return spec_for(opts)
    env = factory(num_envs=1, seed=0, options=opts)
    try:
        return env.spec
    finally:
        env.close()

