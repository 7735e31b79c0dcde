"""The alternating modes' pause: in ``sync`` and ``async_rollout`` rollouts and training take
turns; in ``async`` they overlap and nothing here pauses. No I/O, no clock.

Rollouts pause once a batch of finished training steps waits for the trainer, and stay paused
while it updates; they resume when the update is over (its weights are announced before the
trainer reports the end) and less than a batch waits. The account is of steps, not of events:
steps that arrive during an update count toward the next batch, so a trainer that already holds
the next batch when it finishes keeps the rollouts paused and trains again. (Counting from zero
at every new version would let such steps slip past the count, and the modes drift into overlap.)
"""

from __future__ import annotations


class Alternation:
    """Rollout / training turns of the alternating modes.

    ``waiting``: training steps received from simulators and not yet taken into an update nor
    given up (evaluation steps never count). ``updating``: a trainer said it began an update
    and has not reported its end. Paused iff ``waiting >= batch_steps`` or ``updating``.
    """

    def __init__(self, batch_steps: int, enabled: bool) -> None:
        self.batch_steps = int(batch_steps)
        self.enabled = enabled
        self.waiting = 0
        self.updating = False

    @property
    def paused(self) -> bool:
        return self.enabled and (self.updating or self.waiting >= self.batch_steps)

    def on_trajectory(self, steps: int) -> None:
        """A simulator sent ``steps`` training steps."""
        self.waiting += int(steps)

    def on_begin(self, taken: int | None) -> None:
        """A trainer began an update with ``taken`` steps (several ranks report after the update,
        each its own share)."""
        self.updating = True
        if taken:
            self._drop(taken)

    def on_end(self) -> None:
        """A trainer finished an update (its weights, when due, were announced just before)."""
        self.updating = False

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
        return {"waiting": self.waiting, "updating": self.updating}
