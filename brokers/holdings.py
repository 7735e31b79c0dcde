"""What each simulator holds at the broker, counted in one place: its queued requests, its
fragments waiting for a trainer, the inline bytes of both, and its slot blocks; and the
per-peer caps (``broker.max_peer_requests``, ``max_peer_trajs``, ``max_peer_bytes``) checked
against them before a message is kept. No I/O, no clock.

The request queue and the trajectory router report what enters and leaves them
(:meth:`PeerHoldings.request` / :meth:`PeerHoldings.fragment`); the broker's handlers ask
:meth:`PeerHoldings.admit_obs`, :meth:`admit_block` and :meth:`admit_traj` once per message.
"""

from __future__ import annotations

from typing import Any

from rlvla3 import protocol as P

BLOCK_BYTES = 1024
"""What one slot block's two descriptors cost the broker (measured: 140 MB for 131,072), counted
against its simulator's ``broker.max_peer_bytes``."""


def inline_bytes(tensors: dict[str, Any]) -> int:
    """Bytes a message's tensors hold in the broker's memory (shared-memory ones hold none)."""
    return sum(t.nbytes for t in tensors.values() if isinstance(t, P.InlineTensor))


class PeerHoldings:
    """Per simulator: ``[requests queued, fragments queued, inline bytes of both]``."""

    def __init__(self, max_requests: int | None = None, max_trajs: int | None = None, max_bytes: int | None = None) -> None:
        self.max_requests = max_requests
        self.max_trajs = max_trajs
        self.max_bytes = max_bytes
        self._held: dict[bytes, list[int]] = {}

    # ---- what enters and leaves the queues --------------------------------------------------

    def request(self, sim: bytes, sign: int, nbytes: int) -> None:
        """A request of ``sim`` entered (``sign`` 1) or left (-1) the request queue."""
        self._change(sim, 0, sign, nbytes)

    def fragment(self, sim: bytes, sign: int, nbytes: int) -> None:
        """A fragment of ``sim`` entered (1) or left (-1) the queue of fragments for trainers."""
        self._change(sim, 1, sign, nbytes)

    def _change(self, sim: bytes, kind: int, sign: int, nbytes: int) -> None:
        held = self._held.get(sim)
        if held is None:
            held = self._held[sim] = [0, 0, 0]
        held[kind] += sign
        held[2] += sign * nbytes
        if not held[0] and not held[1]:
            del self._held[sim]

    def requests(self, sim: bytes) -> int:
        held = self._held.get(sim)
        return held[0] if held else 0

    def fragments(self, sim: bytes) -> int:
        held = self._held.get(sim)
        return held[1] if held else 0

    def nbytes(self, sim: bytes) -> int:
        """Inline bytes of ``sim``'s queued requests and fragments."""
        held = self._held.get(sim)
        return held[2] if held else 0

    # ---- the caps ---------------------------------------------------------------------------

    def admit_obs(self, sim: bytes, blocks: int, nbytes: int) -> None:
        """A new request of ``nbytes`` inline bytes from ``sim`` (holding ``blocks`` slot blocks)."""
        queued = self.requests(sim)
        if self.max_requests is not None and queued >= self.max_requests:
            raise P.ProtocolError(P.E_LIMIT, f"{queued} requests of this simulator queued: broker.max_peer_requests")
        self._admit_bytes(sim, blocks, nbytes)

    def admit_block(self, sim: bytes, blocks: int, slots: int) -> None:
        """A new slot block of ``sim``: at most two per slot (its front and back)."""
        most = 2 * max(slots, 1)
        if blocks >= most:
            raise P.ProtocolError(P.E_LIMIT, f"more than {most} blocks (two per slot)")
        self._admit_bytes(sim, blocks, BLOCK_BYTES)

    def admit_traj(self, sim: bytes, blocks: int, nbytes: int) -> None:
        """A new fragment of ``nbytes`` inline bytes from ``sim``."""
        waiting = self.fragments(sim)
        if self.max_trajs is not None and waiting >= self.max_trajs:
            raise P.ProtocolError(P.E_LIMIT, f"{waiting} fragments of this simulator wait for a trainer: "
                                             "broker.max_peer_trajs")
        self._admit_bytes(sim, blocks, nbytes)

    def _admit_bytes(self, sim: bytes, blocks: int, more: int) -> None:
        held = self.nbytes(sim) + blocks * BLOCK_BYTES + more
        if self.max_bytes is not None and held > self.max_bytes:
            raise P.ProtocolError(P.E_LIMIT, f"this peer's queued messages would hold {held} bytes at the broker: "
                                             f"broker.max_peer_bytes={self.max_bytes}")
