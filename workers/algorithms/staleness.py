"""Staleness: how many trainer updates behind the policy that produced a sample is.

``staleness = trainer_version - behaviour_version``, where a version counts the trainer's
optimizer updates (one per consumed batch). Two mechanisms keep it at or under
``max_staleness``:

1. **Admission control** (:class:`AdmissionController`, run by the broker): new work is handed
   out only while the work already admitted cannot outrun the trainer by more than
   ``max_staleness`` batches (AReaL's capacity rule, derived below).
2. **Filtering** (:func:`filter_stale`, run by the trainer): a straggler that still arrives too
   stale is dropped and counted.
"""

from __future__ import annotations

from collections import Counter

import torch


def staleness(behaviour_versions: torch.Tensor, trainer_version: int) -> torch.Tensor:
    """Per-sample staleness ``[N]`` (int64)."""
    return int(trainer_version) - behaviour_versions.to(torch.int64)


def filter_stale(
    behaviour_versions: torch.Tensor, trainer_version: int, max_staleness: int | None
) -> tuple[torch.Tensor, int]:
    """Keep mask ``[N]`` of samples with staleness <= ``max_staleness`` and how many were dropped.

    ``max_staleness=None`` keeps everything. A sample from the *future* (negative staleness)
    means a version counter went wrong, so it raises instead of being trained on.
    """
    s = staleness(behaviour_versions, trainer_version)
    if bool((s < 0).any()):
        raise ValueError(f"behaviour version ahead of trainer version {trainer_version}: {behaviour_versions.max()}")
    if max_staleness is None:
        return torch.ones_like(s, dtype=torch.bool), 0
    keep = s <= int(max_staleness)
    return keep, int((~keep).sum())


def staleness_histogram(staleness_values: torch.Tensor) -> dict[int, int]:
    """Count of samples per staleness value, for the metrics log."""
    return dict(sorted(Counter(int(x) for x in staleness_values.flatten().tolist()).items()))


class AdmissionController:
    """Decides whether the broker may start new rollout work (pure bookkeeping, no I/O).

    Units: one *unit* is whatever the trainer's batch is counted in (episodes for GRPO, fixed
    length fragments for PPO); ``batch_size`` units make one update, and the trainer version
    ``v`` counts updates done, so ``v * batch_size`` units have been consumed.

    Rule (AReaL's capacity rule). Count every unit ever admitted and not discarded:
    ``admitted = consumed + finished (not yet trained) + in_flight``. A start of ``n`` more
    units is allowed iff

        admitted + n <= (max_staleness + v + 1) * batch_size

    equivalently ``finished + in_flight + n <= (max_staleness + v + 1) * batch_size - consumed``
    (with ``consumed = v * batch_size`` this is ``(max_staleness + 1) * batch_size``).

    Why it bounds staleness: the unit admitted as number ``k`` (1-based) while the version is
    ``v_s`` satisfies ``k <= (max_staleness + v_s + 1) * B``. If units are trained in the order
    they were admitted, it lands in batch ``ceil(k / B) - 1`` (0-based), which the trainer
    consumes at version ``ceil(k / B) - 1 <= max_staleness + v_s``; its staleness is therefore
    at most ``max_staleness``. Units that finish out of order (a slow episode overtaken by
    later ones) can exceed it; :func:`filter_stale` catches those, and decisions inside a long
    episode taken with newer weights are fresher than its start. The bound is relative to the
    version the generator held when the unit started: if generators lag the trainer's weights,
    their lag adds to it.

    On resume the counters restart empty while the version does not: ``consumed`` defaults to
    ``version * batch_size`` so the capacity resumes where it was instead of jumping by
    ``version`` batches.
    """

    def __init__(
        self,
        max_staleness: int,
        batch_size: int,
        version: int = 0,
        consumed: int | None = None,
        max_in_flight: int | None = None,
    ) -> None:
        if max_staleness < 0 or batch_size < 1:
            raise ValueError(f"need max_staleness >= 0 and batch_size >= 1, got {max_staleness}, {batch_size}")
        self.max_staleness = int(max_staleness)
        self.batch_size = int(batch_size)
        self.max_in_flight = max_in_flight
        self.version = int(version)
        self.consumed = int(version) * self.batch_size if consumed is None else int(consumed)
        self.in_flight = 0
        self.finished = 0

    # ---- The rule ----------------------------------------------------------------------------

    @property
    def admitted(self) -> int:
        return self.consumed + self.finished + self.in_flight

    def capacity(self) -> int:
        """How many more units may start now (may be negative after a version rollback)."""
        cap = (self.max_staleness + self.version + 1) * self.batch_size - self.admitted
        if self.max_in_flight is not None:
            cap = min(cap, self.max_in_flight - self.in_flight)
        return cap

    def can_start(self, n: int = 1) -> bool:
        return n <= self.capacity()

    # ---- Events --------------------------------------------------------------------------------

    def on_started(self, n: int = 1) -> None:
        """``n`` units were handed to generators."""
        self.in_flight += n

    def on_finished(self, n: int = 1, accepted: bool = True) -> None:
        """``n`` in-flight units ended; ``accepted=False`` (lost, rejected) frees their capacity."""
        self._take("in_flight", n)
        if accepted:
            self.finished += n

    def on_discarded(self, n: int = 1) -> None:
        """``n`` finished units will never be trained (dropped as stale, incomplete group)."""
        self._take("finished", n)

    def on_consumed(self, n: int) -> None:
        """The trainer took ``n`` finished units into a batch."""
        self._take("finished", n)
        self.consumed += n

    def on_batch_taken(self, steps: int) -> None:
        """A trainer took ``steps`` finished units into the batch for version ``v + 1``. Trainers
        that take whole fragments overshoot ``batch_size``; the rule still counts exactly one
        batch (idempotent across the ranks of one update), so overshoot never shrinks capacity."""
        self._take("finished", min(int(steps), self.finished))
        self.consumed = max(self.consumed, (self.version + 1) * self.batch_size)

    def follow_trainer(self, version: int) -> None:
        """The trainer is at ``version`` and batches are counted whole (``on_batch_taken``): at
        least ``version`` batches are consumed, also when the broker met the trainer mid-run."""
        self.on_version(version)
        self.consumed = max(self.consumed, self.version * self.batch_size)

    def grant(self, minimum: int) -> int:
        """How many units may start now. While fewer than a batch are finished the trainer cannot
        update, and units in flight may sit in open fragments that only further steps complete:
        holding back then would deadlock, so at least ``minimum`` is granted."""
        cap = self.capacity()
        return max(cap, minimum) if self.finished < self.batch_size else cap

    def on_version(self, version: int) -> None:
        """The trainer's version is now ``version``."""
        self.version = int(version)

    def _take(self, counter: str, n: int) -> None:
        value = getattr(self, counter)
        if n > value:
            raise ValueError(f"{counter} would go negative: {value} - {n}")
        setattr(self, counter, value - n)

    def __repr__(self) -> str:
        return (
            f"AdmissionController(v={self.version}, consumed={self.consumed}, finished={self.finished}, "
            f"in_flight={self.in_flight}, capacity={self.capacity()})"
        )
