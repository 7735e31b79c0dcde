"""Watching a running job from outside: poll until a condition holds or a deadline passes, and
a counter's rate over a window. Core, so that the ``run`` controller's progress line and the
harness of tests and benches read a broker's figures the same way."""

from __future__ import annotations

import time
from typing import Any, Callable


def built_after(fig: dict[str, Any], gap_s: float = 0.3) -> Callable[[dict[str, Any]], bool]:
    """A poll's condition: STATUS figures the broker built at least ``gap_s`` after ``fig``. The
    broker answers STATUS from figures it rebuilds every ``brokers.status.STATUS_REFRESH_S``
    (0.25 s), so two answers read back to back may be one build: figures that must show what
    happened after a moment (a stop, a pause) are asked for by their own build time."""
    return lambda f: f["uptime_s"] >= fig["uptime_s"] + gap_s


class DeadlinePassed(AssertionError, TimeoutError):
    """A poll's condition did not hold in time. Both an ``AssertionError`` (a test's failure, not
    its error) and a ``TimeoutError`` (what a caller that retries catches)."""


def wait_until(fn: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Call ``fn`` until it returns something truthy (that value), or raise naming ``what``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)  # polling with a deadline, not synchronising on a guess
    raise DeadlinePassed(f"timed out after {timeout:.0f} s waiting for {what}; last={last!r}")


def rate_over(read: Callable[[], dict[str, Any]], seconds: float, key: str = "env_steps") -> dict[str, Any]:
    """``read()`` (a broker's figures) at both ends of a ``seconds`` window: ``key`` per second
    over it (``rate``), the window's length and count, and the figures at both ends."""
    a, t0 = read(), time.monotonic()
    time.sleep(seconds)  # the measurement window itself
    b, t1 = read(), time.monotonic()
    return {"rate": (b[key] - a[key]) / (t1 - t0), "window_s": t1 - t0, "count": b[key] - a[key], "first": a, "last": b}
