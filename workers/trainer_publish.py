"""Rank 0's weights out: each version written into its shared-memory weight store
(:class:`~rlvla3.weights.publisher.WeightPublisher`, which also serves other hosts over its
stream) and the announcement the trainer sends the broker (version + manifest + where the bytes
are), never the bytes.

Version 0 (or the resumed version) is written right after set-up; later versions at the end of
the update job, on the update thread, where no optimizer step runs, every ``publish_every``
updates. With FSDP every rank gathers the whole tensors (a collective) and rank 0 writes them.

``weights.in_flight`` (async): rank 0 also writes the weights between two epochs of an update,
still on the update thread, as publication ``v * S + k`` acting as policy version ``v``
(``publications_per_version``); version ``v`` itself is publication ``v * S``.
"""

from __future__ import annotations

from typing import Any

from rlvla3.config import JobConfig
from rlvla3.weights.announce import publications_per_version


class Publishing:
    def __init__(self, cfg: JobConfig, rank: int, job: JobConfig) -> None:
        """``cfg``: this trainer's config (its own ``--set`` included: where its store and stream
        are); ``job``: the broker's, which numbers publications as the broker checks them."""
        self.cfg = cfg
        self.rank = rank
        self.publisher: Any = None  # rank 0's WeightPublisher
        self.announcement: dict[str, Any] | None = None
        """The last WEIGHTS fields sent (sent again to a restarted broker)."""
        self.per_version = publications_per_version(job)
        self.in_flight = job.weights.in_flight and job.run.mode == "async" and rank == 0
        """Publish between epochs: only where simulators run during an update, and on rank 0."""

    def gathered(self, state: Any, everything: bool) -> list | None:
        """FSDP: the whole tensors rank 0 publishes (a collective, every rank calls it); None for
        an unsharded policy (the publisher reads the module itself)."""
        if not self.cfg.train.fsdp:
            return None
        from workers.algorithms.distributed import gather_tensors

        return gather_tensors(state.policy, keep=self.rank == 0, everything=everything)

    def open(self, state: Any, run_id: str, host: str, version: int) -> None:
        """Write the first version (every rank gathers under FSDP; rank 0 opens the store)."""
        first = self.gathered(state, everything=True)
        if self.rank == 0:
            from rlvla3.weights.publisher import WeightPublisher

            w = self.cfg.weights
            self.publisher = WeightPublisher(state.policy, run_id, shm=w.shm, stream_bind=w.stream_bind,
                                             advertise_host=w.advertise_host, host=host, copy_threads=w.copy_threads,
                                             tensors=first, cuda_ipc=w.cuda_ipc, delta=w.delta)
            self.announcement = self.publisher.publish(version * self.per_version, first, version)

    def due(self, updates: int) -> bool:
        """The update that makes the ``updates + 1``-th is published (``algo.publish_every``)."""
        return (updates + 1) % max(1, self.cfg.algo.publish_every) == 0

    def publish(self, state: Any, version: int) -> dict[str, Any] | None:
        """On the update thread, after a trained update that is due: write ``version``; returns
        the announcement to send (None on ranks other than 0)."""
        gathered = self.gathered(state, everything=False)
        if self.publisher is None:
            return None
        return self.publisher.publish(version * self.per_version, gathered, version)

    def between_epochs(self, version: int, epoch: int) -> dict[str, Any]:
        """On the update thread, after ``epoch`` (0-based, not the last) of the update that
        started at ``version``: write the weights as they are now; returns the announcement."""
        return self.publisher.publish(version * self.per_version + epoch + 1, None, version)

    def close(self, finished: bool) -> None:
        """Generators keep what they copied; with an update still running the store is unlinked
        but kept mapped, since the update thread may still write into it."""
        if self.publisher is None:
            return
        if finished:
            self.publisher.close()
        else:
            self.publisher.store.shm.unlink()
