"""Tensor names on the wire: one scheme for every message, built and parsed only here.

A tensor name is parts joined by "/". The prefixes in use:

    images/<camera>, state               an observation (OBS; see rlvla3.observation)
    r<i>/<name>                          request i of a BATCH (a RESULT is stacked: no prefix)
    replay/<key>                         the policy's replay data (RESULT, ACT, TRAJ)
    obs/images/<camera>, obs/state       a fragment's observations (TRAJ)
"""

from __future__ import annotations

from typing import Any

from rlvla3.protocol import E_TENSOR, ProtocolError

NAME_SEP = "/"
REPLAY = "replay"
"""Prefix of the policy's replay tensors."""
FRAGMENT_OBS = "obs"
"""Prefix of a trajectory fragment's observations."""


def tensor_name(*parts: str) -> str:
    """``parts`` joined into one tensor name; empty parts (no prefix) are left out."""
    return NAME_SEP.join(p for p in parts if p)


def with_prefix(prefix: str, tensors: dict[str, Any]) -> dict[str, Any]:
    """The same tensors, each named ``prefix/<name>`` (as ``tensor_name`` joins them, written
    out here because the broker renames every request's tensors in every BATCH and RESULT)."""
    if not prefix:
        return {tensor_name(k): v for k, v in tensors.items()}
    head = prefix + NAME_SEP
    return {(head + k if k else prefix): v for k, v in tensors.items()}


def under_prefix(prefix: str, tensors: Any) -> dict[str, Any]:
    """The tensors named ``prefix/<rest>``, keyed by ``<rest>`` (the others are left out)."""
    head = prefix + NAME_SEP
    return {k[len(head):]: v for k, v in tensors.items() if k.startswith(head)}


def request_prefix(index: int) -> str:
    """The prefix of request ``index``'s tensors in a BATCH or RESULT."""
    return f"r{index}"


def by_request(tensors: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Group BATCH tensors named ``r<index>/<name>`` by request index, in one pass."""
    out: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        head, sep, name = key.partition(NAME_SEP)
        if not sep or head[:1] != "r" or not head[1:].isdigit():
            raise ProtocolError(E_TENSOR, f"tensor {key!r} is not named r<index>/<name>")
        out.setdefault(int(head[1:]), {})[name] = value
    return out
