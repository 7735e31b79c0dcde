"""What the trainer counts and writes: totals, evaluation success per version, and the metrics
sink (JSONL and TensorBoard) on a thread of its own."""

from __future__ import annotations

import json
import math
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

log = structlog.get_logger()


@dataclass
class Counters:
    """Totals since the trainer started (or resumed: they are checkpointed)."""

    updates: int = 0
    samples_trained: int = 0
    env_steps_consumed: int = 0
    dropped_stale: int = 0
    groups_complete: int = 0
    groups_filtered_zero_variance: int = 0
    groups_dropped_stale: int = 0
    eval_episodes: int = 0
    eval_fragments: int = 0
    unreadable: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    def restore(self, saved: dict[str, Any]) -> None:
        """Counters from a checkpoint's ``state.json`` (unknown names are ignored)."""
        for k, v in saved.items():
            if hasattr(self, k):
                setattr(self, k, int(v))


@dataclass
class EvalTally:
    """Success of evaluation episodes per policy version (from fragments with ``eval: true``)."""

    per_version: dict[int, list[int]] = field(default_factory=dict)  # version -> [episodes, successes]
    fresh: set[int] = field(default_factory=set)

    def add(self, version: int, success: bool) -> None:
        n = self.per_version.setdefault(version, [0, 0])
        n[0] += 1
        n[1] += int(bool(success))
        self.fresh.add(version)

    def take_fresh(self) -> dict[str, dict[str, float]]:
        out = {str(v): {"episodes": self.per_version[v][0], "success": self.per_version[v][1] / self.per_version[v][0]}
               for v in sorted(self.fresh)}
        self.fresh.clear()
        return out


def update_row(result: Any, version: int, rank: int, counters: Counters, elapsed_s: float,
               groups_pending: int | None) -> dict[str, Any]:
    """The figures of one update (an ``UpdateResult``) with the running totals: what rank 0
    sends the broker in TRAIN ``end`` and every rank writes to its JSONL."""
    from workers.algorithms.staleness import staleness_histogram

    c = counters
    row: dict[str, Any] = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in result.figures().items()}
    row.update({
        "version": version, "rank": rank, "dropped_stale_total": c.dropped_stale,
        "staleness_counts": {str(k): v for k, v in staleness_histogram(torch.as_tensor(result.staleness)).items()},
        "env_steps_consumed": c.env_steps_consumed,
        "env_steps_per_s": round(c.env_steps_consumed / max(elapsed_s, 1e-9), 2),
    })
    if groups_pending is not None:  # GRPO
        row.update(groups_complete=c.groups_complete, groups_filtered_zero_variance=c.groups_filtered_zero_variance,
                   groups_dropped_stale=c.groups_dropped_stale, groups_pending=groups_pending)
    return row


class MetricsSink:
    """JSONL and TensorBoard writing on a thread of its own: importing TensorBoard takes seconds
    and event files are I/O, neither belongs on the socket thread or in the trainer's start-up."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        suffix = "" if rank == 0 else f".rank{rank}"
        self.jsonl = open(run_dir / f"trainer_metrics{suffix}.jsonl", "a", buffering=1)
        self.tb_dir = run_dir / "tb" if rank == 0 else None
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="metrics", daemon=True)
        self.thread.start()

    def put(self, row: dict[str, Any], staleness: np.ndarray, evals: dict[str, dict[str, float]]) -> None:
        self.q.put((row, staleness, evals))

    def close(self, timeout: float = 10.0) -> None:
        self.q.put(None)
        self.thread.join(timeout)

    def _loop(self) -> None:
        tb = None
        if self.tb_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                tb = SummaryWriter(str(self.tb_dir))
            except ImportError as exc:  # JSONL still works
                log.warning("tensorboard_unavailable", error=str(exc))
        try:
            while True:
                item = self.q.get()
                if item is None:
                    return
                row, staleness, evals = item
                self.jsonl.write(json.dumps(row) + "\n")
                if tb is None:
                    continue
                step = int(row["version"])
                for k, v in row.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("version", "rank", "t") and math.isfinite(v):
                        tb.add_scalar(f"train/{k}", v, step)
                if len(staleness):
                    tb.add_histogram("train/staleness", np.asarray(staleness, np.int64), step)
                for v, e in evals.items():
                    tb.add_scalar("eval/success", e["success"], int(v))
        finally:
            self.jsonl.close()
            if tb is not None:
                tb.close()
