"""The ``gymnasium`` env family's settings (``env.options`` when ``env.name: gymnasium``) and the
check that refuses an env this family cannot run, at config load, before any worker starts.

The adapter (``workers/envs/gymnasium.py``) reads the same dataclass, so the keys, their
defaults and their docstrings live here once. Gymnasium is imported only when the job names
this family: a config of another family never needs it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rlvla3.scale_config import ConfigError

INSTALL_HINT = "pip install -e .[gymnasium] (MuJoCo envs: pip install -e .[gymnasium-mujoco])"


@dataclass
class GymnasiumOptions:
    id: str = "CartPole-v1"
    """Any registered Gymnasium id (``module:Name-v0`` imports ``module`` first, as
    ``gymnasium.make`` does)."""
    make_kwargs: dict = field(default_factory=dict)
    """Keyword arguments for ``gymnasium.make`` (e.g. ``{ctrl_cost_weight: 0.1}``)."""
    max_episode_steps: int = 0
    """Time limit (a truncation: its value is bootstrapped); 0 keeps the id's own limit."""


@dataclass(frozen=True)
class GymSpaces:
    """What the check found: the flat observation size and the action space's shape."""

    obs_dim: int
    action_dim: int
    """Box: its size; Discrete: 1 (the action is an index)."""
    choices: int
    """Discrete: number of actions; Box: 0."""
    low: list[float]
    high: list[float]
    max_episode_steps: int


def parse_gymnasium_options(options: dict[str, Any] | None) -> GymnasiumOptions:
    """``env.options`` as :class:`GymnasiumOptions`, naming any unknown key."""
    options = dict(options or {})
    known = {f.name for f in dataclasses.fields(GymnasiumOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"env.options: unknown key(s) {unknown} for env.name=gymnasium; known: {sorted(known)}")
    if not isinstance(options.get("make_kwargs", {}), dict):
        raise ConfigError("env.options.make_kwargs: expected a mapping")
    opts = GymnasiumOptions(**options)
    if not isinstance(opts.id, str) or not opts.id:
        raise ConfigError("env.options.id: a registered Gymnasium id is needed (e.g. CartPole-v1)")
    if not isinstance(opts.max_episode_steps, int) or opts.max_episode_steps < 0:
        raise ConfigError(f"env.options.max_episode_steps: expected an integer >= 0, got {opts.max_episode_steps!r}")
    return opts


def make_gymnasium_env(opts: GymnasiumOptions) -> Any:
    """``gymnasium.make`` with the options' time limit; errors become :class:`ConfigError`."""
    try:
        import gymnasium
    except ModuleNotFoundError:
        raise ConfigError(f"env.name=gymnasium: gymnasium is not installed; {INSTALL_HINT}") from None
    try:
        if ":" not in opts.id:  # "module:Name-v0" registers itself when make imports the module
            gymnasium.spec(opts.id)
    except gymnasium.error.Error as exc:
        raise ConfigError(f"env.options.id {opts.id!r} is not a registered Gymnasium id: {exc}") from None
    kwargs = dict(opts.make_kwargs)
    if opts.max_episode_steps:
        kwargs["max_episode_steps"] = opts.max_episode_steps
    try:
        return gymnasium.make(opts.id, **kwargs)
    except gymnasium.error.DependencyNotInstalled as exc:
        raise ConfigError(f"env.options.id {opts.id!r} needs an extra that is not installed ({exc}); {INSTALL_HINT}") from None
    except ModuleNotFoundError as exc:
        raise ConfigError(f"env.options.id {opts.id!r}: module {exc.name!r} is not installed; {INSTALL_HINT}") from None
    except gymnasium.error.Error as exc:
        raise ConfigError(f"env.options.id {opts.id!r}: {exc}") from None
    except TypeError as exc:
        raise ConfigError(f"env.options.make_kwargs for {opts.id!r}: {exc}") from None


def gym_spaces(env: Any, opts: GymnasiumOptions) -> GymSpaces:
    """The env's spaces as this family supports them: a Box (or Discrete) observation, a 1-D
    Box or a Discrete action; anything else (Dict, Tuple, MultiBinary, ...) is refused."""
    from gymnasium import spaces

    obs, act = env.observation_space, env.action_space
    if not isinstance(obs, (spaces.Box, spaces.Discrete)):
        raise ConfigError(f"env.options.id {opts.id!r}: observation space {type(obs).__name__} is not supported "
                          f"(Box or Discrete; wrap the env to flatten it)")
    obs_dim = int(spaces.flatdim(obs))
    if isinstance(act, spaces.Discrete):
        adim, choices, low, high = 1, int(act.n), [0.0], [float(act.n - 1)]
    elif isinstance(act, spaces.Box) and len(act.shape) == 1:
        adim, choices = int(act.shape[0]), 0
        low, high = [float(x) for x in act.low], [float(x) for x in act.high]
    else:
        raise ConfigError(f"env.options.id {opts.id!r}: action space {act} is not supported (a 1-D Box or Discrete)")
    limit = opts.max_episode_steps or int(getattr(env.spec, "max_episode_steps", None) or 0) or 1_000_000
    return GymSpaces(obs_dim, adim, choices, low, high, limit)


def check_gymnasium(options: dict[str, Any] | None) -> GymSpaces:
    """Build the env once and look at its spaces: an unknown id, a missing extra or an
    unsupported space is a :class:`ConfigError` naming it."""
    opts = parse_gymnasium_options(options)
    env = make_gymnasium_env(opts)
    try:
        return gym_spaces(env, opts)
    finally:
        env.close()
