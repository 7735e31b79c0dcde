"""The per-peer message-rate cap: a token bucket per ROUTER identity, refilled at
``broker.max_peer_msgs_per_s`` and holding ``BURST_S`` seconds of it. No I/O; the time is
passed in.

The broker's shell takes one token per message it reads, a BUNDLE's parts each counting as one
message, before it decodes them: a peer over its cap has the rest dropped unread (never answered:
an answer per dropped message would cost what the cap saves). What a peer sends over the cap was
never acknowledged, so nothing acknowledged is lost; a real worker re-sends what it still holds
(requests after ``env.obs_resend_s``, fragments until their TRAJ_ACK).

Logs stay bounded under any flood: one ``peer_throttled`` line per peer per
``LOG_WINDOW_S``, carrying how many of its messages were dropped since its last line.
"""

from __future__ import annotations

import structlog

from rlvla3 import protocol as P

log = structlog.get_logger()

BURST_S = 0.5
"""A bucket holds this many seconds of its rate (and at least two full BUNDLEs): a worker that
wakes up and sends what it gathered meanwhile is never throttled for the burst."""
LOG_WINDOW_S = 10.0
"""At most one ``peer_throttled`` line per peer per this many seconds."""
MAX_PEERS = 4096
"""Buckets kept at most; a full bucket (a peer idle for ``BURST_S``) holds nothing to remember
and goes first, so a peer that connects under many identities cannot grow the broker."""


class PeerRates:
    """Token buckets per peer, and the STATUS figures of what was dropped."""

    def __init__(self, per_s: int) -> None:
        self.per_s = float(per_s)
        self.burst = max(per_s * BURST_S, 2.0 * P.MAX_BUNDLE_PARTS)
        self._buckets: dict[bytes, list[float]] = {}  # peer -> [tokens, refilled at]
        self._logged: dict[bytes, list[float]] = {}  # peer -> [last line at, dropped since]
        self.dropped = 0  # messages dropped over the cap, since the start
        self.peers_throttled = 0  # log windows in which some peer went over its cap

    def take(self, peer: bytes, n: int, now: float) -> int:
        """How many of ``n`` messages of ``peer`` read at ``now`` are within its cap (the first
        ones: the rest are dropped, counted and logged here)."""
        b = self._buckets.get(peer)
        if b is None:
            if len(self._buckets) >= MAX_PEERS:
                self._forget(now)
            b = self._buckets[peer] = [self.burst, now]
        else:
            b[0] = min(self.burst, b[0] + (now - b[1]) * self.per_s)
            b[1] = now
        if b[0] >= n:
            b[0] -= n
            return n
        kept = max(0, int(b[0]))
        b[0] -= kept
        self.drop(peer, n - kept, now)
        return kept

    def drop(self, peer: bytes, n: int, now: float) -> None:
        """``n`` messages of ``peer`` dropped over its cap (or over ``burst`` waiting in the shell)."""
        self.dropped += n
        entry = self._logged.get(peer)
        if entry is None or now - entry[0] >= LOG_WINDOW_S:
            since = n + (entry[1] if entry is not None else 0)
            if entry is None and len(self._logged) >= MAX_PEERS:
                self._logged.clear()  # a flood of identities: the next line of each comes at once
            self._logged[peer] = [now, 0]
            self.peers_throttled += 1
            log.warning("peer_throttled", peer=peer.hex()[:16], dropped=since, per_s=int(self.per_s),
                        window_s=LOG_WINDOW_S)
        else:
            entry[1] += n

    def _forget(self, now: float) -> None:
        """Make room: drop the buckets that refilled, or else the oldest half."""
        full = [p for p, (tokens, at) in self._buckets.items() if tokens + (now - at) * self.per_s >= self.burst]
        for p in full or list(self._buckets)[:MAX_PEERS // 2]:
            del self._buckets[p]

    def figures(self) -> dict[str, int]:
        return {"per_s": int(self.per_s), "dropped": self.dropped, "throttled_windows": self.peers_throttled}
