"""Who may do what at the broker: roles bound to CURVE key names, shared-memory segments bound
to the worker that wrote them, WEIGHTS only from trainer rank 0 in sane version steps, and a
rejection log that a flood cannot grow without bound.

Role rule (CURVE on, ``broker.keys_dir`` set): the ZAP handler names each peer by the file its
public key came from (``DIR/clients/NAME.key``, see ``rlvla3.auth``). A peer may join as role
``R`` only when ``NAME`` starts with ``R`` (``trainer``, ``trainer0``, ``trainer-a`` may join as
trainer; ``client`` may only ask STATUS). Every later message must come with the key it joined
with, so a peer that copies another's ROUTER identity is refused.

Without CURVE nothing authenticates a peer, so there is no token: one handed out in the READY
reply would go to whoever asks. Such a broker binds only loopback or owner-only ipc:// unless
``--insecure`` is given (``rlvla3.auth.check_bind``); on a shared machine, use ``--auth``.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import structlog

from brokers.registry import Worker
from rlvla3 import protocol as P

log = structlog.get_logger()


def role_allowed(key_name: str | None, role: str) -> bool:
    """With CURVE on, a key named ``role*`` may join as ``role``."""
    return bool(key_name) and str(key_name).startswith(role)


@functools.lru_cache(maxsize=4096)
def _segments_of(pid: int, suffix: str) -> re.Pattern[str]:
    """The names of worker ``pid``'s segments of one kind (compiled once per pid: checked on
    every OBS)."""
    return re.compile(rf"{re.escape(P.SHM_PREFIX)}[A-Za-z0-9]+_{pid}_{suffix}")


def _own_segment(w: Worker, what: str, seg: str, host: str, suffix: str) -> None:
    """``seg`` on ``host`` must be a segment this worker created: on its host, named
    ``rlvla3_<any run id>_<its pid>_<suffix>`` (``rlvla3.shm``; a worker's segments outlive a
    broker restart, which starts a new run id)."""
    if host != w.host:
        raise P.ProtocolError(P.E_AUTH, f"{what}: segment on host {host!r}, the worker is on {w.host!r}")
    if not _segments_of(w.pid, suffix).fullmatch(seg):
        raise P.ProtocolError(P.E_AUTH, f"{what}: segment {seg!r} is not one of this worker's "
                                        f"(rlvla3_<run>_{w.pid}_...)")


MAX_KNOWN_SEGMENTS = 64
"""Segment names remembered per worker as checked (a worker has a few pools; past this many the
memory starts over, so a peer cannot grow it)."""


def check_segments(w: Worker, tensors: dict[str, Any]) -> None:
    """Every shared-memory reference must name one of this worker's pools (``ShmPool``:
    ``rlvla3_<run>_<pid>_<n>``). Bounds are checked where the bytes are read
    (``ShmAttachments.array``). A name that passed once is remembered (``Worker.segments``):
    the same few pools come back in every OBS."""
    known = w.segments
    for name, t in tensors.items():
        if type(t) is P.ShmRef and (t.seg not in known or t.host != w.host):
            _own_segment(w, f"tensor {name!r}", t.seg, t.host, r"\d+")
            if len(known) >= MAX_KNOWN_SEGMENTS:
                known.clear()
            known.add(t.seg)


def check_version_step(version: int, newest: int | None, max_step: int, what: str) -> None:
    """A version report may move the job's version at most ``max_step`` past the newest the broker
    knows (``None``: it knows none yet, a fresh broker, and takes the first report as it is: a
    resumed trainer may be far ahead of it). One rule for WEIGHTS, TRAIN and a trainer's READY,
    so a peer cannot jump the job to version 2^50 and make every later real version look old."""
    if newest is not None and version > max(newest, 0) + max_step:
        raise P.ProtocolError(P.E_VERSION, f"{what} version {version} is more than broker.max_version_step="
                                           f"{max_step} past the newest known ({newest})")


def check_weights(w: Worker, version: int, policy: int | None, per_version: int, newest: int | None, max_step: int,
                  store: Any) -> None:
    """WEIGHTS comes from trainer rank 0, in a sane version step, and a weight store it names
    must be rank 0's own segment (``WeightStore``: ``rlvla3_<run>_<pid>_w<k>``): generators map
    what the announcement names, so nobody may point them at another process's memory. Its
    publication number must lie in its policy version's span (``publications_per_version``), so
    the step rule on the policy version bounds the publication number too."""
    if w.rank != 0:
        raise P.ProtocolError(P.E_ROLE, f"WEIGHTS comes from trainer rank 0, not rank {w.rank}")
    policy = version if policy is None else policy  # an integer: the wire checked its type
    if version // per_version != policy:
        raise P.ProtocolError(P.E_FIELD, f"WEIGHTS publication {version} is not in policy version {policy!r}'s span "
                                         f"of {per_version} (weights.in_flight)")
    check_version_step(policy, newest, max_step, "WEIGHTS")
    if isinstance(store, dict):  # its shape is checked by the announcement rule (rlvla3.weights.announce)
        _own_segment(w, "WEIGHTS store", str(store.get("seg")), str(store.get("host")), r"w\d+")


def manifest_spec(manifest: Any) -> tuple | None:
    """The model spec a manifest describes: (name, dtype, shape, trainable) of every tensor, or
    ``None`` when there is no readable one (the weights module checks the rest)."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("entries"), list):
        return None
    try:
        return tuple((e[0], e[1], tuple(e[2]), bool(e[8])) for e in manifest["entries"])
    except (TypeError, IndexError, KeyError):
        return None


class RejectLog:
    """At most ``per_s`` ``message_rejected`` lines per peer per second; the rest of that second
    is summed into one ``message_rejections_suppressed`` line when the next second begins."""

    MAX_PEERS = 4096

    def __init__(self, per_s: int) -> None:
        self.per_s = per_s
        self._window: dict[bytes, list[float | int]] = {}  # peer -> [second start, logged, suppressed]

    def __call__(self, identity: bytes, now: float, **fields: Any) -> None:
        win = self._window.get(identity)
        if win is None or now - win[0] >= 1.0:
            if win is not None and win[2]:
                log.warning("message_rejections_suppressed", peer=identity.hex()[:16], count=win[2])
            if win is None and len(self._window) >= self.MAX_PEERS:
                self._flush(now)
            win = self._window[identity] = [now, 0, 0]
        if win[1] < self.per_s:
            win[1] += 1
            log.warning("message_rejected", peer=identity.hex()[:16], **fields)
        else:
            win[2] += 1

    def _flush(self, now: float) -> None:
        for peer, win in list(self._window.items()):
            if now - win[0] >= 1.0 or len(self._window) >= self.MAX_PEERS:
                if win[2]:
                    log.warning("message_rejections_suppressed", peer=peer.hex()[:16], count=win[2])
                del self._window[peer]
