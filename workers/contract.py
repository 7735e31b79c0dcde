"""What an env and a policy agree on, held apart from both so neither imports the other.

An env adapter describes its observations and actions with an :class:`EnvSpec`; a policy is
built for one. Both take their own options as a dict from the job config and validate it with
:func:`parse_options`, so a mistyped key names itself the same way on either side.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EnvSpec:
    """What a policy and the wire need to know about an env's observations and actions."""

    cameras: dict[str, tuple[int, int]]
    """Camera name -> (height, width) of its uint8 RGB image."""
    state_dim: int
    """Length of the float32 proprio state vector."""
    action_dim: int
    """Length of one action (one step of a chunk)."""
    max_episode_steps: int
    """Env steps after which an episode is truncated."""
    action_low: float = -1.0
    """Lower bound of every action component."""
    action_high: float = 1.0
    """Upper bound of every action component."""
    action_choices: int = 0
    """A discrete action space: the number of actions (an action is one float holding the
    index, ``action_dim == 1``); 0: continuous."""


def parse_options(cls: type | None, options: dict[str, Any] | None, where: str) -> Any:
    """Validate a dict into an options dataclass, naming any unknown or missing key."""
    options = dict(options or {})
    if cls is None:
        if options:
            raise ValueError(f"{where}: this env takes no options, got {sorted(options)}")
        return None
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown option(s) {unknown}; known: {sorted(known)}")
    try:
        return cls(**options)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None
