"""The alternating modes' pause: in ``sync`` and ``async_rollout`` rollouts and training take
turns; in ``async`` they overlap, and only a late start (below) pauses. No I/O, no clock.

Rollouts pause once a batch of finished training steps waits for the trainer, and stay paused
while it updates; they resume when the update is over (its weights are announced before the
trainer reports the end) and less than a batch waits. The account is of steps, not of events:
steps that arrive during an update count toward the next batch, so a trainer that already holds
the next batch when it finishes keeps the rollouts paused and trains again. (Counting from zero
at every new version would let such steps slip past the count, and the modes drift into overlap.)

Late start (``async`` with ``weights.in_flight`` and ``weights.collect_after_epochs`` K): while an
update runs, rollouts wait until it has published its weights after K of its epochs. When the
simulators outrun the trainer they otherwise collect the next batch at the update's start, with
the weights it started from, so every sample trains a whole version stale; started late, they
act with weights K epochs into the update. The wait always ends: an update's end lifts it.
"""

from __future__ import annotations


class Alternation:
    """Rollout / training turns of the alternating modes, and async's late start.

    ``waiting``: training steps received from simulators and not yet taken into an update nor
    given up (evaluation steps never count). ``updating``: a trainer said it began an update
    and has not reported its end. Alternating: paused iff ``waiting >= batch_steps`` or
    ``updating``. Async: paused iff ``updating`` and the update has published fewer than
    ``late_epochs`` epochs (never, when that is 0).
    """

    def __init__(self, batch_steps: int, enabled: bool, late_epochs: int, per_version: int) -> None:
        self.batch_steps = int(batch_steps)
        self.enabled = enabled
        self.waiting = 0
        self.updating = False
        # Late start (async): publication ``v * per_version + k`` is version v after k epochs.
        self.late_epochs = 0 if enabled else int(late_epochs)
        self.per_version = max(1, int(per_version))
        self.update_from = 0  # the version the running update started from
        self.published = -1  # the newest publication number
        self.late_waits = 0  # updates during which rollouts waited for their epochs
        self.late_whole = 0  # updates whose wait lasted to their end (no K-th epoch was published)
        self._late_counted = False
        self._whole_told = False

    @property
    def paused(self) -> bool:
        if self.enabled:
            return self.updating or self.waiting >= self.batch_steps
        return self.late_pause

    @property
    def late_pause(self) -> bool:
        """The running update has not yet published its weights after ``late_epochs`` epochs."""
        epochs_done = self.published - self.update_from * self.per_version
        return self.late_epochs > 0 and self.updating and epochs_done < self.late_epochs

    def on_trajectory(self, steps: int) -> None:
        """A simulator sent ``steps`` training steps."""
        self.waiting += int(steps)

    def on_begin(self, taken: int | None, version: int) -> None:
        """A trainer began an update from ``version`` with ``taken`` steps (several ranks report
        after the update, each its own share)."""
        self.updating = True
        self.update_from = int(version)
        self._late_counted = False
        if taken:
            self._drop(taken)

    def on_published(self, publication: int) -> None:
        """Weights were announced under ``publication`` (``rlvla3.weights.announce``). The
        update's own end (``(v + 1) * per_version``) lifts a late start's wait too; if it is what
        lifts it, no K-th epoch came (a critic warm-up, a ``target_kl`` stop, a trainer run with
        fewer epochs) and the rollouts waited for the whole update."""
        self.late_whole += self.late_pause and publication >= (self.update_from + 1) * self.per_version
        self.published = max(self.published, int(publication))

    def holds(self) -> bool:
        """Whether queued rollouts wait now (``paused``); a late start's waits are counted once
        per update."""
        if self.enabled:
            return self.paused
        late = self.late_pause  # once per broker loop pass: one reading
        if late and not self._late_counted:
            self.late_waits += 1
            self._late_counted = True
        return late

    def on_end(self) -> bool:
        """A trainer finished an update (its weights, when due, were announced just before).
        True once: at the end of the first update a late start held to its end."""
        self.late_whole += self.late_pause  # an update that published nothing at all
        self.updating = False
        first = self.late_whole > 0 and not self._whole_told
        self._whole_told = self._whole_told or first
        return first

    def on_given_up(self, steps: int) -> None:
        """Steps that will never be taken: discarded, unreadable, lost with a trainer."""
        self._drop(steps)

    def on_trainer_gone(self, lost: int) -> None:
        """A trainer left, maybe mid-update: what it held is lost and its update never ends."""
        self.updating = False
        self._drop(lost)

    def on_starved(self) -> None:
        """A GRPO trainer holds a batch of steps in groups that are not complete: it cannot
        train on them, so they stop counting and rollouts go on until the groups complete."""
        self.waiting = 0

    def _drop(self, steps: int) -> None:
        # Steps already forgotten (``on_starved``) may be taken later: never below zero.
        self.waiting = max(0, self.waiting - int(steps))

    def figures(self) -> dict[str, int | bool]:
        out: dict[str, int | bool] = {"waiting": self.waiting, "updating": self.updating}
        if self.late_epochs:
            out.update(late_epochs=self.late_epochs, late_waits=self.late_waits, late_whole=self.late_whole)
        return out
