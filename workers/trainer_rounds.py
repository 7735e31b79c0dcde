"""Several trainer ranks (``workers.trainers`` > 1): joining the group, and the rounds in which
the ranks decide together when to update.

The broker hands each trainer a rank; every trainer announces a rendezvous address in READY and
the broker passes rank 0's to the others. At most every ``ROUND_EVERY_S`` each rank offers its
share of the batch (``distributed.agree_to_update``), and all train once the shares add up to
``batch_steps``; a round that does not update gives its units back to the learner.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import structlog

from workers.learner import Learner, Unit

log = structlog.get_logger()

ROUND_EVERY_S = 0.05
"""Several ranks: at most this often a rank starts a collective 'shall we update?' round."""


@dataclass
class Deferred:
    """Several ranks: the round did not update; the units go back to the learner."""

    units: list[Unit]
    decision: str  # "wait" or "stop"
    taken: list[int]


def join_group(rank: int, world: int, own_address: dict[str, Any], welcome: dict[str, Any], device: Any,
               cfg: Any) -> None:
    """Join the torch.distributed group at rank 0's rendezvous address (rank 0: its own), waiting
    up to ``workers.broker_wait_s`` for the other ranks; then each collective waits at most
    ``train.collective_timeout_s``."""
    from workers.algorithms.distributed import init_trainer_group

    dist_info = own_address if rank == 0 else welcome.get("dist")
    if not dist_info:
        # The broker gives the lowest free rank, so a rank > 0 exists only beside a rank 0
        # that announced its address; a missing one means rank 0 left: start again.
        raise SystemExit(f"trainer rank {rank}: the broker has no rendezvous address of rank 0; restart this trainer")
    log.info("trainer_group_joining", rank=rank, world_size=world, **dist_info)
    init_trainer_group(rank, world, dist_info["addr"], int(dist_info["port"]), device=device,
                       timeout_s=cfg.train.collective_timeout_s, rendezvous_s=cfg.workers.broker_wait_s)


class Rounds:
    """One rank's part in the rounds (every rank takes part in every round, so rounds pair up
    across ranks)."""

    def __init__(self, world: int, batch_steps: int) -> None:
        self.world = world
        self.batch_steps = batch_steps
        self.last_round = 0.0
        self.offered = 0
        """Decision steps this rank offered in the current round."""
        self.last_wait_log = time.monotonic()

    def offer(self, learner: Learner, now: float, stopping: bool) -> tuple[list[Unit], tuple[int, bool]] | None:
        """The units this rank offers now and what the round is told (steps available here, and
        whether this rank is stopping); None until the next round is due. A rank offers its share
        of the global batch; the update goes ahead once the ranks together hold ``batch_steps``
        (a sync-mode broker pauses at exactly that, however unevenly split)."""
        if now - self.last_round < ROUND_EVERY_S:
            return None
        self.last_round = now
        units = learner.take(math.ceil(self.batch_steps / self.world))
        self.offered = sum(u.steps for u in units)
        return units, (learner.ready_steps + self.offered, stopping)

    def agree(self, units: list[Unit], round_: tuple[int, bool]) -> tuple[Deferred | None, int | None]:
        """On the update thread, with every rank: ``(Deferred, None)`` when the round does not
        update, else ``(None, the batch length every rank pads to)``."""
        from workers.algorithms.distributed import agree_to_update

        available, stopping = round_
        agreed = agree_to_update(sum(u.steps for u in units), available, stopping, self.batch_steps)
        if agreed.decision != "update":
            return Deferred(units, agreed.decision, agreed.taken), None
        return None, agreed.pad_to

    def deferred(self, done: Deferred, learner: Learner, last_update: float) -> bool:
        """A round that did not update: its units go back; True when the ranks agreed to stop."""
        now = time.monotonic()
        if now - last_update > 10.0 and now - self.last_wait_log > 10.0:
            self.last_wait_log = now
            log.info("trainer_round_waiting", taken=done.taken, ready_steps=learner.ready_steps)
        learner.put_back(done.units)
        return done.decision == "stop"
