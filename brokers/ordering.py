"""Ordering functions for the broker's request queue: ``key(request) -> sortable``.

Smaller keys are served first. Built-ins are registered with ``@register_ordering``; a config
(``batching.ordering``) may also name any ``module:function`` with the same signature.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Protocol


class Request(Protocol):
    """What an ordering function may read of a queued OBS request."""

    arrival: float  # time.monotonic() when the broker received it
    slot: int
    n: int  # envs in the request
    episode_step: list[int]  # decision steps already taken in each env's episode
    version: int  # oldest policy version among the envs' current episodes (-1 if fresh)


OrderingFn = Callable[[Any], Any]
_ORDERINGS: dict[str, OrderingFn] = {}


def register_ordering(name: str) -> Callable[[OrderingFn], OrderingFn]:
    def deco(fn: OrderingFn) -> OrderingFn:
        _ORDERINGS[name] = fn
        return fn

    return deco


@register_ordering("arrival")
def arrival(req: Request) -> Any:
    """Oldest request first (FIFO)."""
    return req.arrival


@register_ordering("episode_progress")
def episode_progress(req: Request) -> Any:
    """Envs furthest into their episodes first: finishing episodes shortens the rollout tail."""
    return (-max(req.episode_step, default=0), req.arrival)


@register_ordering("policy_version")
def policy_version(req: Request) -> Any:
    """Episodes begun under the oldest policy first, so they finish before growing staler."""
    return (req.version, req.arrival)


def get_ordering(name: str) -> OrderingFn:
    """A built-in by name, or ``package.module:function``."""
    if name in _ORDERINGS:
        return _ORDERINGS[name]
    if ":" in name:
        mod_name, _, fn_name = name.partition(":")
        try:
            fn = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"batching.ordering {name!r}: {exc}") from None
        if not callable(fn):
            raise ValueError(f"batching.ordering {name!r} is not callable")
        return fn
    raise ValueError(f"batching.ordering {name!r}: not one of {sorted(_ORDERINGS)} nor module:function")
