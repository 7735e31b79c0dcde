"""Live figures the broker answers STATUS with: counts, rates and latency parts (time is passed in)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hdrh.histogram import HdrHistogram


STALL_WINDOW_S = 10
"""``loop_stall_ms_recent`` in STATUS: the longest loop turn of the last this many seconds."""
EVAL_VERSIONS_KEPT = 64
"""Evaluated versions whose figures the broker keeps (STATUS shows the newest 20)."""


def _hist() -> HdrHistogram:
    return HdrHistogram(1, 60_000_000, 3)  # 1 us .. 60 s


_TABLES: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _tables(h: HdrHistogram) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per counts-array index: lowest, highest and median equivalent value (once per geometry)."""
    key = (h.counts_len, h.sub_bucket_half_count_magnitude)
    if key not in _TABLES:  # hdrh's get_value_from_index, vectorised; ranges are contiguous
        i = np.arange(h.counts_len, dtype=np.int64)
        half = h.sub_bucket_half_count
        bucket, sub = (i >> h.sub_bucket_half_count_magnitude) - 1, (i & (half - 1)) + half
        sub = np.where(bucket < 0, sub - half, sub)
        low = sub << (np.maximum(bucket, 0) + h.unit_magnitude)
        high = np.append(low[1:] - 1, 2 * low[-1] - low[-2] - 1)
        _TABLES[key] = (low, high, (low + (high - low + 1) // 2).astype(np.float64))
    return _TABLES[key]


def record_many(h: HdrHistogram, values: list[int]) -> None:
    """``h.record_value(max(1, v))`` for every value, in numpy: hdrh's own costs 1.5 us a value
    in Python, and the broker records one per request. Values past the histogram are dropped, as
    hdrh drops them."""
    v = np.clip(np.asarray(values, dtype=np.int64), 1, 1 << 40)
    mag, unit = h.sub_bucket_half_count_magnitude, h.unit_magnitude
    # hdrh's _get_bucket_index and _counts_index, per value
    bucket = np.floor(np.log2(v | h.sub_bucket_mask)).astype(np.int64) + 1 - unit - (mag + 1)
    index = ((bucket + 1) << mag) + (v >> (bucket + unit)) - h.sub_bucket_half_count
    kept = v[index < h.counts_len]
    if len(kept):
        np.add.at(np.frombuffer(h.counts, dtype=np.uint64, count=h.counts_len), index[index < h.counts_len], 1)
        h.total_count += len(kept)
        h.min_value, h.max_value = min(h.min_value, int(kept.min())), max(h.max_value, int(kept.max()))


def _pcts(h: HdrHistogram) -> dict[str, float]:
    """The figures of ``hdrh``'s own percentile and mean methods, in numpy (theirs loop in
    Python over every bucket: ~0.3 s for a well-filled histogram, too long for the loop)."""
    total = h.get_total_count()
    if total == 0:
        return {"count": 0}
    low, high, mid = _tables(h)
    counts = np.frombuffer(h.counts, dtype=np.uint64, count=h.counts_len).astype(np.float64)
    cum = np.cumsum(counts)

    def at(p: float) -> int:
        target = max(int(p * total / 100 + 0.5), 1)
        return int(high[int(np.searchsorted(cum, target))])

    return {
        "count": total,
        "p50": at(50),
        "p90": at(90),
        "p99": at(99),
        "max": h.get_max_value(),
        "mean": round(float((counts * mid).sum()) / total, 1),  # not @: BLAS threads stall on a busy host
    }


@dataclass
class BrokerStats:
    started: float = 0.0  # the broker's clock when it started
    env_steps: int = 0
    decision_steps: int = 0
    requests: int = 0
    batches: int = 0
    errors: int = 0
    requeued: int = 0
    duplicates: int = 0  # re-sent OBS of a request already taken (not served again)
    requests_unreadable: int = 0  # requests a generator could not read (left out of its batch alone)
    bundles: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("in", "in_parts", "out", "out_parts"), 0))
    """BUNDLEs received and sent, and the messages they held (``rlvla3.bundle``)."""
    traj_received: int = 0
    traj_delivered: int = 0
    traj_acked: int = 0
    traj_requeued: int = 0
    traj_dropped: int = 0
    traj_duplicates: int = 0  # re-sent TRAJ of a fragment already taken (not routed again)
    episodes: int = 0
    successes: int = 0
    env_restarts: int = 0
    batch_size: HdrHistogram = field(default_factory=_hist)
    queue_wait_us: HdrHistogram = field(default_factory=_hist)
    batch_form_us: HdrHistogram = field(default_factory=_hist)
    generate_us: HdrHistogram = field(default_factory=_hist)
    staleness: HdrHistogram = field(default_factory=_hist)
    _recent_returns: deque = field(default_factory=lambda: deque(maxlen=200))
    _recent_success: deque = field(default_factory=lambda: deque(maxlen=200))
    _rate_window: deque = field(default_factory=lambda: deque(maxlen=64))
    status_cpu_us: HdrHistogram = field(default_factory=_hist)  # the loop's CPU time to answer one STATUS
    peer_turn_us: HdrHistogram = field(default_factory=_hist)
    """Per loop turn and peer with messages in it: the loop thread's CPU time handling that peer's
    messages and sending the answers."""
    peer_turns_cut: int = 0  # turns that left a peer's messages for the next (brokers.broker.PEER_TURN_S)
    max_loop_stall_ms: float = 0.0  # the longest the broker's loop went without polling
    _stalls: deque = field(default_factory=lambda: deque(maxlen=STALL_WINDOW_S))  # [second, longest turn ms, its cpu ms]
    trainer: dict[str, Any] = field(default_factory=dict)
    evals: dict[int, list[float]] = field(default_factory=dict)  # version -> [episodes, successes, return sum]
    eval_rounds: dict[int, dict[bytes, int]] = field(default_factory=dict)  # version -> simulator -> its round's episodes
    _slow: dict[str, Any] = field(default_factory=dict)  # percentiles and means, refreshed once a second
    _slow_at: float = float("-inf")
    _slow_shape: tuple = ()
    _later: dict[str, list[int]] = field(default_factory=dict)  # histogram name -> values not yet in it

    def record(self, name: str, values: list[int]) -> None:
        """Values for the histogram ``name`` (per request or per batch: the loop's hot path),
        recorded in bulk (``record_many``) every 1024 values and before every snapshot."""
        pending = self._later.setdefault(name, [])
        pending += values
        if len(pending) >= 1024:
            record_many(getattr(self, name), pending)
            pending.clear()

    def _flush(self) -> None:
        for name, pending in self._later.items():
            if pending:
                record_many(getattr(self, name), pending)
                pending.clear()

    def add_eval(self, version: int, success: bool, ret: float, simulator: bytes, round_episodes: int) -> None:
        """One finished evaluation episode. A version's round is whole once it holds the episodes
        of every simulator that evaluates it: episodes that succeed end first, so a part of a
        round overstates its success."""
        e = self.evals.setdefault(version, [0, 0, 0.0])
        e[0] += 1
        e[1] += int(success)
        e[2] += ret
        self.eval_rounds.setdefault(version, {})[simulator] = round_episodes
        if len(self.evals) > EVAL_VERSIONS_KEPT:  # one version more than kept: the oldest goes
            oldest = min(self.evals)
            del self.evals[oldest]
            self.eval_rounds.pop(oldest, None)

    def add_episodes(self, returns: list[float], successes: list[bool]) -> None:
        self.episodes += len(returns)
        self.successes += sum(bool(s) for s in successes)
        self._recent_returns.extend(float(r) for r in returns)
        self._recent_success.extend(1.0 if s else 0.0 for s in successes)

    def env_steps_per_s(self, now: float) -> float:
        self._rate_window.append((now, self.env_steps))
        while len(self._rate_window) > 2 and now - self._rate_window[0][0] > 10.0:
            self._rate_window.popleft()
        t0, s0 = self._rate_window[0]
        return (self.env_steps - s0) / (now - t0) if now > t0 else 0.0

    def loop_turn(self, busy_s: float, cpu_s: float, now: float) -> None:
        """One turn of the loop (read messages, run timers) took ``busy_s`` of wall time, of which
        ``cpu_s`` on the loop's thread: the longest since the start (wall), and per second for the
        last ``STALL_WINDOW_S`` seconds (``loop_stall_ms_recent``, ``loop_stall_cpu_ms_recent``: on
        a crowded machine the wall time also counts the time the scheduler kept the broker off)."""
        ms, cpu_ms = busy_s * 1000.0, cpu_s * 1000.0
        self.max_loop_stall_ms = max(self.max_loop_stall_ms, ms)
        sec = int(now)
        if self._stalls and self._stalls[-1][0] == sec:
            last = self._stalls[-1]
            last[1], last[2] = max(last[1], ms), max(last[2], cpu_ms)
        else:
            self._stalls.append([sec, ms, cpu_ms])

    def recent_stall_ms(self, now: float, cpu: bool = False) -> float:
        return max((e[2 if cpu else 1] for e in self._stalls if e[0] > now - STALL_WINDOW_S), default=0.0)

    def snapshot(self, now: float) -> dict[str, Any]:
        """Counters (histogram counts too) as they are now; percentiles, means and rates as of at
        most a second ago, so that answering STATUS often stays cheap for the loop. A figure that
        was empty at the last refresh and no longer is triggers a refresh at once."""
        self._flush()
        hists = {"batch_size": self.batch_size, "queue_wait_us": self.queue_wait_us,
                 "batch_form_us": self.batch_form_us, "generate_us": self.generate_us, "staleness": self.staleness,
                 "status_cpu_us": self.status_cpu_us, "peer_turn_us": self.peer_turn_us}
        counts = {name: h.get_total_count() for name, h in hists.items()}
        shape = (tuple(c > 0 for c in counts.values()), bool(self._recent_returns), len(self.evals))
        if now - self._slow_at >= 1.0 or shape != self._slow_shape:
            self._slow_at, self._slow_shape = now, shape
            rr, rs = self._recent_returns, self._recent_success
            self._slow = {
                "env_steps_per_s": round(self.env_steps_per_s(now), 2),
                "success_rate_recent": round(sum(rs) / len(rs), 4) if rs else None,
                "return_recent": round(sum(rr) / len(rr), 4) if rr else None,
                **{name: _pcts(h) for name, h in hists.items()},
                "eval": {str(v): {"episodes": e[0], "round": sum(self.eval_rounds.get(v, {}).values()),
                                  "success": round(e[1] / e[0], 4), "return": round(e[2] / e[0], 4)}
                         for v, e in sorted(self.evals.items())[-20:]},
            }
        fresh = {name: {**self._slow[name], "count": c} for name, c in counts.items()}
        return {
            "uptime_s": round(now - self.started, 3),
            "env_steps": self.env_steps,
            "decision_steps": self.decision_steps,
            "requests": self.requests,
            "batches": self.batches,
            "errors": self.errors,
            "requeued": self.requeued,
            "duplicates": self.duplicates,
            "requests_unreadable": self.requests_unreadable,
            "bundles": dict(self.bundles),
            "peer_turns_cut": self.peer_turns_cut,
            "traj": {
                "received": self.traj_received, "delivered": self.traj_delivered,
                "acked": self.traj_acked, "requeued": self.traj_requeued, "dropped": self.traj_dropped,
                "duplicates": self.traj_duplicates,
            },
            "episodes": self.episodes,
            "successes": self.successes,
            "env_restarts": self.env_restarts,
            "max_loop_stall_ms": round(self.max_loop_stall_ms, 3),
            "loop_stall_ms_recent": round(self.recent_stall_ms(now), 3),
            "loop_stall_cpu_ms_recent": round(self.recent_stall_ms(now, cpu=True), 3),
            "trainer": dict(self.trainer),
            **self._slow,
            **fresh,
        }
