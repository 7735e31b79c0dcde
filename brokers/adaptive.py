"""Adaptive batching: tune ``max_batch`` and ``max_wait_ms`` online (``batching.adaptive``).

The paper tunes both by hand (its Fig. 8 is a manual sweep). Which point is best depends on the
simulators' step-time shape, the number of envs in the loop and the generator's cost per batch
(``a + c*b``), all of which the broker sees: this controller is fed what the dispatcher already
measures (envs arriving, each batch's size and queue wait, each batch's generator latency) and
moves the rule to where the served env rate is highest. Pure logic, time passed in, no sockets.

It hill-climbs one axis at a time in factor-of-2 steps, within the config's bounds: measure the
current point for a window, try a neighbour for a window, keep it if it served more (by more
than the noise margin ``tol``), else go back and turn. A step that batches do not need is skipped
(``max_batch`` above what ever queued). When neither axis improves it holds, and explores again
after ``hold_s`` or at once when the rate moves by more than ``drift`` (the load changed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

WAIT_STEP_S = 0.0005  # the smallest non-zero wait it tries when the lower bound is 0


@dataclass
class Bounds:
    min_batch: int
    max_batch: int
    min_wait_s: float
    max_wait_s: float

    def clamp(self, batch: int, wait_s: float) -> tuple[int, float]:
        return (min(self.max_batch, max(self.min_batch, int(batch))),
                min(self.max_wait_s, max(self.min_wait_s, float(wait_s))))


@dataclass
class _Window:
    """What happened since the window opened."""

    start: float
    served: int = 0  # envs whose RESULT came back
    arrived: int = 0  # envs queued
    batches: int = 0
    queue_wait_s: float = 0.0  # summed over batches
    sizes: list[int] = field(default_factory=list)  # generator latency against batch size
    latencies: list[float] = field(default_factory=list)


class AdaptiveBatching:
    def __init__(self, bounds: Bounds, batch: int, wait_s: float, window_s: float = 2.0,
                 tol: float = 0.03, drift: float = 0.2, hold_s: float = 20.0) -> None:
        self.bounds = bounds
        self.batch, self.wait_s = bounds.clamp(batch, wait_s)
        self.window_s, self.tol, self.drift, self.hold_s = window_s, tol, drift, hold_s
        self.phase = "base"  # base: measure the current point; trial: measure a neighbour; hold
        self.axis = 0  # 0: max_batch, 1: max_wait
        self.dirs = [1, -1]  # bigger batches and shorter waits first
        self.fails = 0  # trials in a row that did not improve
        self.base_rate = 0.0
        self.prev: tuple[int, float] | None = None  # the point a trial left (to go back to)
        self.hold_since = 0.0
        self.peak_queued = 0  # most envs seen waiting at once in the window
        self.win: _Window | None = None
        self.last: dict[str, Any] = {}  # the last window's figures (STATUS)
        self.moves = 0

    # ---- measurements in (from the dispatcher) ---------------------------------------------

    def on_arrival(self, envs: int, queued_envs: int) -> None:
        if self.win is not None:
            self.win.arrived += envs
            self.peak_queued = max(self.peak_queued, queued_envs)

    def on_batch(self, envs: int, queue_wait_s: float) -> None:
        if self.win is not None:
            self.win.batches += 1
            self.win.queue_wait_s += queue_wait_s

    def on_result(self, envs: int, generate_s: float) -> None:
        if self.win is not None:
            self.win.served += envs
            self.win.sizes.append(envs)
            self.win.latencies.append(generate_s)

    # ---- the rule out --------------------------------------------------------------------------

    def step(self, now: float) -> tuple[int, float] | None:
        """The new (max_batch, max_wait_s) when it moves, else ``None``. Call it every loop turn."""
        if self.win is None:
            self.win = _Window(now)
            self.hold_since = now
            return None
        w = self.win
        if now - w.start < self.window_s or w.served == 0 and now - w.start < 5 * self.window_s:
            return None
        rate = w.served / (now - w.start)
        self._record(w, rate, now)
        self.win = _Window(now)
        peak, self.peak_queued = self.peak_queued, 0
        if self.phase == "hold":
            if abs(rate - self.base_rate) > self.drift * max(self.base_rate, 1e-9) or now - self.hold_since >= self.hold_s:
                self.phase, self.fails = "base", 0
            else:
                self.base_rate = 0.8 * self.base_rate + 0.2 * rate
                return None
        if self.phase == "base":
            self.base_rate = rate
            return self._try(peak, now)
        # trial
        if rate > self.base_rate * (1 + self.tol):
            self.base_rate, self.fails = rate, 0
            return self._try(peak, now)  # same axis, same direction
        assert self.prev is not None
        self.batch, self.wait_s = self.prev
        self.dirs[self.axis] *= -1
        self.fails += 1
        self.axis ^= 1
        self.phase = "base"
        self.moves += 1
        return self.batch, self.wait_s

    def _try(self, peak_queued: int, now: float) -> tuple[int, float] | None:
        """Move to the next neighbour (this axis, else the other); hold when none is left."""
        for _ in range(4):
            if self.fails >= 4:
                break
            cand = self._neighbour(self.axis, self.dirs[self.axis], peak_queued)
            if cand is not None:
                self.prev = (self.batch, self.wait_s)
                self.batch, self.wait_s = cand
                self.phase = "trial"
                self.moves += 1
                return cand
            self.dirs[self.axis] *= -1  # at a bound (or a pointless step): turn, then try the other axis
            self.fails += 1
            self.axis ^= 1
        self.phase, self.hold_since, self.fails = "hold", now, 0
        return None

    def _neighbour(self, axis: int, sign: int, peak_queued: int) -> tuple[int, float] | None:
        b, lo_b, hi_b = self.batch, self.bounds.min_batch, self.bounds.max_batch
        if axis == 0:
            nb = min(hi_b, b * 2) if sign > 0 else max(lo_b, b // 2)
            if sign > 0 and peak_queued and b > peak_queued:
                return None  # batches never filled the current max_batch: a larger one changes nothing
            return None if nb == b else (nb, self.wait_s)
        lo, hi = self.bounds.min_wait_s, self.bounds.max_wait_s
        w = self.wait_s
        if sign > 0:
            nw = min(hi, max(w * 2, WAIT_STEP_S, lo))
        else:
            nw = max(lo, w / 2)
            if nw < WAIT_STEP_S:
                nw = lo
        return None if abs(nw - w) < 1e-9 else (self.batch, nw)

    def _record(self, w: _Window, rate: float, now: float) -> None:
        a = c = None
        if len(set(w.sizes)) >= 2:  # generator latency against batch size: least squares a + c*b
            c, a = np.polyfit(np.asarray(w.sizes, float), np.asarray(w.latencies, float), 1)
        self.last = {
            "served_per_s": round(rate, 2),
            "arrivals_per_s": round(w.arrived / max(now - w.start, 1e-9), 2),
            "mean_batch": round(w.served / len(w.sizes), 2) if w.sizes else None,
            "mean_queue_wait_ms": round(1e3 * w.queue_wait_s / w.batches, 3) if w.batches else None,
            "generate_ms_fit": None if a is None else {"a": round(1e3 * float(a), 3), "c": round(1e3 * float(c), 4)},
        }

    def figures(self) -> dict[str, Any]:
        return {"phase": self.phase, "axis": ("max_batch", "max_wait_ms")[self.axis], "moves": self.moves,
                "base_rate": round(self.base_rate, 2), **self.last}
