"""The fate of every acknowledged trajectory step, counted in decision steps.

A trainer acknowledges a fragment on receipt (the simulator may then free it), so from that
moment the broker can no longer re-deliver it: each step ends in exactly one category.

    evaluation          an evaluation fragment (measured, never trained on)
    trained             in an update's batch, not masked (the trainer reports it in TRAJ_ACK)
    stale               dropped or masked as too stale (TRAJ_ACK ``dropped_stale``)
    discarded           never trainable for another reason, e.g. a zero-variance GRPO group
    unreadable          the trainer could not read it
    duplicate           a copy of a fragment the trainer already held (re-sent to a new broker
                        whose predecessor was killed with the first copy's ack in flight): the
                        first copy's fate is its steps' fate, reported once
    lost_with_trainer   acknowledged by a trainer that left before it reported a fate
    held_by_trainers    acknowledged by a live trainer, fate not reported yet

so that ``acked`` equals the sum of the other eight at every moment (``bench/faults/soak.py`` checks it).
A trainer's remainder becomes ``lost_with_trainer`` when it leaves; one that is killed loses at
most what it held: the admission window bounds that (``brokers/admission.py``).
"""

from __future__ import annotations

from typing import Any

FIELD_OF = {"trained": "trained", "stale": "dropped_stale", "discarded": "discarded", "unreadable": "unreadable",
            "duplicate": "duplicate"}
"""Each fate a trainer reports, and its TRAJ_ACK field."""
FATES = tuple(FIELD_OF)
ACKED_PARTS = ("evaluation", *FATES, "lost_with_trainer", "held_by_trainers")
"""The figures (``AckLedger.figures``, STATUS ``acked_steps``) that add up to ``acked``."""


class AckLedger:
    def __init__(self) -> None:
        self.acked = 0
        self.evaluation = 0
        self.reported = dict.fromkeys(FATES, 0)
        self.lost_with_trainer = 0
        self.trainers_lost = 0
        self.over_reported = 0
        self._held: dict[bytes, int] = {}  # trainer -> acknowledged training steps without a reported fate

    def on_acked(self, trainer: bytes, steps: int, evaluation: bool) -> None:
        self.acked += steps
        if evaluation:
            self.evaluation += steps
        else:
            self._held[trainer] = self._held.get(trainer, 0) + steps

    def on_report(self, trainer: bytes, ack: dict[str, Any]) -> dict[str, int]:
        """A trainer's TRAJ_ACK fields: steps that met each fate since its previous report.
        Returns them by fate, capped at what that trainer holds: a trainer that reports more than
        it was given (a bug, or a hostile peer) cannot move other trainers' steps or push the
        ledger off its sum; the excess is counted in ``over_reported``."""
        held = self._held.get(trainer, 0)
        fates = {}
        for fate, field in FIELD_OF.items():
            asked = int(ack.get(field, 0))
            fates[fate] = n = max(0, min(asked, held))
            self.over_reported += asked - n
            self.reported[fate] += n
            held -= n
        self._held[trainer] = held
        return fates

    def held(self, trainer: bytes) -> int:
        return self._held.get(trainer, 0)

    def trainer_gone(self, trainer: bytes) -> int:
        """A trainer left: what it held is lost. Returns those steps."""
        held = self._held.pop(trainer, 0)
        self.lost_with_trainer += held
        self.trainers_lost += 1
        return held

    def figures(self) -> dict[str, Any]:
        return {"acked": self.acked, "evaluation": self.evaluation, **self.reported,
                "lost_with_trainer": self.lost_with_trainer, "held_by_trainers": sum(self._held.values()),
                "trainers_lost": self.trainers_lost, "over_reported": self.over_reported}
