"""A trainer rank's checkpoints: where it resumes from, which ranks save, and saving.

Rank 0 saves alone, unless the checkpoint is collective (FSDP shards, or DCP's sharded format
with several ranks): then every rank saves and loads its part, and every rank must see the
files. A trainer resumes from ``--resume RUN_DIR``, or, rejoining a running job, from its own
run folder's latest checkpoint.

A rank lost during a collective checkpoint (killed, or its host gone) leaves the others waiting
in a gather or barrier; each gives up after ``train.collective_timeout_s`` (the group's
timeout), logs ``checkpoint_group_lost`` and stops: a torch.distributed group cannot be formed
again around a lost rank. The checkpoint being written stays a temporary folder, the older ones
are whole, and the restarted group resumes from the newest.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch

from rlvla3.config import JobConfig

if TYPE_CHECKING:
    from workers.learner import Learner

log = structlog.get_logger()


class Checkpoints:
    def __init__(self, cfg: JobConfig, run_dir: Path | None, resume: str | None, rank: int, world: int) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.resume_from = resume
        self.rank = rank
        self.world = world
        self.group_lost = False  # a collective save failed: no collective may run again

    @property
    def collective(self) -> bool:
        """Every rank saves and loads (FSDP shards, or DCP's files); else rank 0 alone."""
        return self.cfg.train.fsdp or (self.world > 1 and self.cfg.train.checkpoint_format == "sharded")

    @property
    def saves(self) -> bool:
        """This rank writes checkpoints."""
        return self.rank == 0 or self.collective

    def due(self, version: int) -> bool:
        """A freshly trained ``version`` is checkpointed every ``algo.checkpoint_every`` versions."""
        every = self.cfg.algo.checkpoint_every
        return every > 0 and version % every == 0 and self.saves

    def resume(self, state: Any, version: int, learner: Learner) -> tuple[int, str | None]:
        """Load the checkpoint this rank resumes from, if any, into ``state`` and ``learner`` (its
        counters and reward normaliser); returns the version to continue from and the
        checkpoint's path (None: nothing loaded). Every rank takes rank 0's normaliser moments."""
        from workers.checkpoint import latest_checkpoint, load_checkpoint

        src = self.resume_from
        if src is None and version > 0 and self.run_dir is not None and latest_checkpoint(self.run_dir) is not None:
            src = str(self.run_dir)
        found = src is not None and latest_checkpoint(src) is not None
        if self.collective:  # every rank loads its part, so every rank must see the files
            flags = torch.tensor([int(src is not None), int(found)], dtype=torch.int64)
            lo = flags.clone()
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            torch.distributed.all_reduce(lo, op=torch.distributed.ReduceOp.MIN)
            if int(flags[0]) and not int(lo[1]):
                raise SystemExit(f"trainer rank {self.rank}: resuming a sharded/FSDP group needs the checkpoint on "
                                 f"every rank (a shared run folder); this rank sees {'it' if found else 'none'}")
            if not int(flags[0]):
                return version, None
        elif src is None:
            return version, None
        elif self.rank > 0 and not found:
            return version, None  # another host: rank 0's weights arrive by broadcast
        saved = load_checkpoint(src, state.policy, state.optimizer)
        learner.counters.restore(saved["counters"])
        if learner.reward_norm is not None and "reward_norm" in saved["learner"]:
            learner.reward_norm.restore(saved["learner"]["reward_norm"])
        return max(version, saved["version"]), str(saved["path"])

    def save(self, state: Any, version: int, learner: Learner) -> None:
        """Write ``version`` (weights, optimizer, counters, reward normaliser, config) into the run
        folder. A write
        the disk refuses (full, read-only) is one ``checkpoint_failed`` line, not the end of the
        job: the previous checkpoints are untouched, and the next due version tries again."""
        if self.run_dir is None or self.group_lost:
            return
        from torch.distributed.checkpoint.api import CheckpointException

        from workers.checkpoint import CHECKPOINTS, save_checkpoint

        keep = self.cfg.algo.keep_checkpoints or None
        fmt = self.cfg.train.checkpoint_format
        try:
            stats = {"reward_norm": learner.reward_norm.moments()} if learner.reward_norm is not None else {}
            path = save_checkpoint(self.run_dir, state.policy, state.optimizer, version, learner.counters.as_dict(),
                                   self.cfg.to_yaml(), keep_last=keep, fmt=fmt, learner=stats)
        except OSError as exc:  # a full or failing disk: the older checkpoints stay whole, training goes on
            where = next((d for d in (self.run_dir / CHECKPOINTS, self.run_dir) if d.exists()), None)
            free = shutil.disk_usage(where).free if where is not None else None
            log.error("checkpoint_failed", version=version, path=str(self.run_dir), error=exc.strerror or repr(exc),
                      errno=exc.errno, free_mb=None if free is None else round(free / 2**20, 1))
            return
        except (RuntimeError, CheckpointException) as exc:  # gloo/NCCL timeouts and closed peers; DCP wraps them
            if not (self.collective and self.world > 1):
                raise
            self.group_lost = True
            log.error("checkpoint_group_lost", rank=self.rank, version=version,
                      timeout_s=self.cfg.train.collective_timeout_s, error=repr(exc)[:500])
            raise SystemExit(f"trainer rank {self.rank}: another rank of the trainer group was lost during the "
                             f"collective checkpoint of version {version}; stopping (restart the group: it resumes "
                             "from the newest complete checkpoint)") from None
        if self.rank == 0:
            log.info("checkpoint_saved", version=version, path=str(path), format=fmt)
