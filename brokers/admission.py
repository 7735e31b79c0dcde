"""Admission control: the broker's one account of rollout work handed out and not yet trained.

Everything the capacity rule needs lives here: the counters of the rule, which queued requests
were already admitted (a re-queued request is not counted twice), how many admitted decision
steps each simulator still owes, and whether work is being held back. No I/O, no clock.
"""

from __future__ import annotations

from typing import Iterable, Protocol


class Admissible(Protocol):
    """What admission reads of a request (``brokers.queue.PendingRequest``)."""

    sim: bytes
    slot: int
    req_id: int
    n: int
    header: dict


def admission_lag(algo) -> int:
    """Batches of rollout work admitted ahead of the trainer: ``algo.admission_lag``, by default
    the staleness filter's bound ``algo.max_staleness``."""
    return algo.max_staleness if algo.admission_lag is None else algo.admission_lag


def _key(req: Admissible) -> tuple[bytes, int, int]:
    return (req.sim, req.slot, req.req_id)


class AdmissionController:
    """Decides whether the broker may start new rollout work (AReaL's capacity rule).

    Units: one *unit* is whatever the trainer's batch is counted in (decision steps:
    ``algo.batch_steps`` of them make one update), and the trainer version ``v`` counts updates
    done, so ``v * batch_size`` units have been consumed.

    Rule. Count every unit ever admitted and not discarded:
    ``admitted = consumed + finished (not yet trained) + in_flight``. A start of ``n`` more
    units is allowed iff

        admitted + n <= (lag + v + 1) * batch_size

    equivalently ``finished + in_flight + n <= (lag + 1) * batch_size`` once
    ``consumed = v * batch_size``. ``lag`` is ``algo.admission_lag``, by default
    ``algo.max_staleness``.

    Why it bounds staleness: the unit admitted as number ``k`` (1-based) while the version is
    ``v_s`` satisfies ``k <= (lag + v_s + 1) * B``. If units are trained in the order
    they were admitted, it lands in batch ``ceil(k / B) - 1`` (0-based), which the trainer
    consumes at version ``ceil(k / B) - 1 <= lag + v_s``; its staleness is therefore
    at most ``lag``. Units that finish out of order (a slow episode overtaken by
    later ones, or a PPO fragment whose first steps wait for its last) can exceed it; the
    trainer keeps them up to ``max_staleness`` and drops the rest, and decisions inside a long
    episode taken with newer weights are fresher than its start. The bound is relative to the
    version the generator held when the unit started: if generators lag the trainer's weights,
    their lag adds to it.

    A rule that only caps staleness is also its typical value once simulators outrun the
    trainer: they fill every admitted unit, so each sample trains ``lag`` versions late. A lag
    below ``max_staleness`` keeps those samples fresh while stragglers still count.

    ``lag=None`` (sync mode, which alternates instead) admits everything and keeps
    no account. On resume the counters restart empty while the version does not:
    ``follow_trainer`` sets ``consumed`` to ``version * batch_size`` so the capacity resumes
    where it was instead of jumping by ``version`` batches.
    """

    def __init__(self, lag: int | None, batch_size: int, version: int = 0) -> None:
        if (lag is not None and lag < 0) or batch_size < 1:
            raise ValueError(f"need lag >= 0 and batch_size >= 1, got {lag}, {batch_size}")
        self.enabled = lag is not None
        self.lag = int(lag or 0)
        self.batch_size = int(batch_size)
        self.version = int(version)
        self.consumed = self.version * self.batch_size
        self.in_flight = 0
        self.finished = 0
        self.waits = 0  # times work was held back (not loop turns)
        self._held = False
        self._admitted: set[tuple[bytes, int, int]] = set()  # requests counted in in_flight
        self._owed: dict[bytes, int] = {}  # simulator -> admitted steps it has not returned

    # ---- The rule ----------------------------------------------------------------------------

    @property
    def admitted(self) -> int:
        return self.consumed + self.finished + self.in_flight

    def capacity(self) -> int:
        """How many more units may start now (may be negative after a version rollback)."""
        return (self.lag + self.version + 1) * self.batch_size - self.admitted

    def grant(self, minimum: int) -> int | None:
        """How many units may start now (``None``: no limit). While fewer than a batch are
        finished the trainer cannot update, and units in flight may sit in open fragments that
        only further steps complete: holding back then would deadlock, so at least ``minimum``
        is granted."""
        if not self.enabled:
            return None
        cap = self.capacity()
        return max(cap, minimum) if self.finished < self.batch_size else cap

    def budget(self, minimum: int) -> int | None:
        """``grant(minimum)`` for one dispatch pass; a pass that gets nothing counts one wait
        (once per stretch of holding back)."""
        granted = self.grant(minimum)
        held = granted is not None and granted <= 0
        if held and not self._held:
            self.waits += 1
        self._held = held
        return granted

    def window(self, minimum: int) -> int | None:
        """The most units any one grant can ever be (``None``: no limit): a request larger than
        this would wait forever, so the broker refuses it on arrival."""
        return None if not self.enabled else max((self.lag + 1) * self.batch_size, minimum)

    def cost(self, req: Admissible) -> int:
        """Units a request takes from the grant: none when evaluating or already admitted."""
        if not self.enabled or req.header.get("eval") or (req.sim, req.slot, req.req_id) in self._admitted:
            return 0  # (_key's key written out: asked per queued request whenever a batch forms)
        return req.n

    # ---- Events from the broker's handlers -----------------------------------------------------

    def on_dispatched(self, reqs: Iterable[Admissible]) -> None:
        """Requests went out in a batch: each not yet admitted starts ``n`` units."""
        for r in reqs:
            cost = self.cost(r)
            if cost:
                self._admitted.add(_key(r))
                self.in_flight += cost
                self._owed[r.sim] = self._owed.get(r.sim, 0) + cost

    def on_settled(self, reqs: Iterable[Admissible]) -> None:
        """Requests were answered (or given up): they are never re-queued again. Their units
        stay in flight until their simulator returns the trajectory steps."""
        for r in reqs:
            self._admitted.discard(_key(r))

    def on_trajectory(self, sim: bytes, steps: int) -> None:
        """A simulator returned ``steps`` training steps: that many of its units finished."""
        if not self.enabled:
            return
        n = min(int(steps), self._owed.get(sim, 0))
        self._owed[sim] = self._owed.get(sim, 0) - n
        self._take("in_flight", n)
        self.finished += n

    def on_simulator_gone(self, sim: bytes) -> None:
        """A simulator left: the units it owed are lost and free their capacity."""
        self._take("in_flight", self._owed.pop(sim, 0))
        self._admitted = {k for k in self._admitted if k[0] != sim}

    def on_discarded(self, n: int) -> None:
        """Finished units will never be trained (dropped as stale, incomplete group)."""
        if self.enabled and n > 0:
            self._take("finished", min(int(n), self.finished))

    def on_train(self, version: int, steps: int | None) -> None:
        """A trainer reported ``version`` and, when it began an update, the ``steps`` it took."""
        if not self.enabled:
            return
        self.follow_trainer(version)
        if steps is not None:
            self.on_batch_taken(steps)

    def on_batch_taken(self, steps: int) -> None:
        """A trainer took ``steps`` finished units into the batch for version ``v + 1``. Trainers
        that take whole fragments overshoot ``batch_size``; the rule still counts exactly one
        batch (idempotent across the ranks of one update), so overshoot never shrinks capacity."""
        self._take("finished", min(int(steps), self.finished))
        self.consumed = max(self.consumed, (self.version + 1) * self.batch_size)

    def follow_trainer(self, version: int) -> None:
        """The trainer is at ``version`` and batches are counted whole (``on_batch_taken``): at
        least ``version`` batches are consumed, also when the broker met the trainer mid-run."""
        self.version = int(version)
        self.consumed = max(self.consumed, self.version * self.batch_size)

    def figures(self) -> dict | None:
        """The STATUS view (``None`` when admission is off)."""
        if not self.enabled:
            return None
        return {"capacity": self.capacity(), "in_flight": self.in_flight, "finished": self.finished,
                "consumed": self.consumed, "version": self.version, "lag": self.lag}

    def _take(self, counter: str, n: int) -> None:
        value = getattr(self, counter)
        if n > value:
            raise ValueError(f"{counter} would go negative: {value} - {n}")
        setattr(self, counter, value - n)

    def __repr__(self) -> str:
        return (f"AdmissionController(v={self.version}, consumed={self.consumed}, finished={self.finished}, "
                f"in_flight={self.in_flight}, capacity={self.capacity()})")
