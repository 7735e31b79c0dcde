"""What the trainer counts and writes: totals, evaluation success per version, and the metrics
sink (JSONL, TensorBoard, and a few evaluation videos per round) on a thread of its own."""

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

EVAL_VIDEOS_PER_ROUND = 2
"""Evaluation episodes filmed per policy version: GIFs of their decision-step frames (one per
action chunk: small and low-rate) in ``<run>/videos`` and TensorBoard's image tab."""
EVAL_VIDEO_FPS = 5.0


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
    duplicates: int = 0
    """Fragments re-sent after a broker restart that this trainer already held: never trained twice."""

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
        "version": version, "rank": rank, "dropped_stale_total": c.dropped_stale, "duplicates": c.duplicates,
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

    def put_eval_fragment(self, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """An evaluation fragment: its camera frames may become one of the round's videos."""
        if self.tb_dir is not None:
            images = {k[len("obs/images/"):]: v for k, v in arrays.items() if k.startswith("obs/images/")}
            if images:
                self.q.put(("video", header, images))

    def close(self, timeout: float = 10.0) -> None:
        self.q.put(None)
        self.thread.join(timeout)

    def _loop(self) -> None:
        tb = None
        films = EvalFilms(self.tb_dir.parent / "videos") if self.tb_dir is not None else None
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
                if item[0] == "video":
                    films.add(*item[1:], tb)
                    continue
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


class EvalFilms:
    """Frames of the first ``EVAL_VIDEOS_PER_ROUND`` evaluation episodes of each version, joined
    across fragments, written as GIFs when the episode ends."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.open: dict[tuple[int, Any, Any], list[np.ndarray]] = {}
        self.started: dict[int, int] = {}

    def add(self, header: dict[str, Any], images: dict[str, np.ndarray], tb: Any) -> None:
        version, env = int(header.get("eval_version", -1)), header.get("env")
        key = (version, env, header.get("episode"))  # fragments of one episode arrive in order
        if key not in self.open:
            if self.started.get(version, 0) >= EVAL_VIDEOS_PER_ROUND:
                return
            self.started[version] = self.started.get(version, 0) + 1
            self.open[key] = []
        row = np.concatenate([images[c] for c in sorted(images)], axis=2)  # cameras side by side
        frames = self.open[key]
        frames.extend(row[:-1] if not header.get("done") else row)  # the last obs opens the next fragment
        if header.get("done"):
            self._write(version, env, self.open.pop(key), bool(header.get("episode_success")), tb)

    def _write(self, version: int, env: Any, frames: list[np.ndarray], success: bool, tb: Any) -> None:
        import io

        from PIL import Image

        from workers.videos import write_video

        path = write_video(self.out_dir / f"eval_v{version:05d}_env{env}_{'success' if success else 'fail'}.gif",
                           frames, EVAL_VIDEO_FPS)
        log.info("eval_video_written", path=str(path), frames=len(frames), version=version)
        if tb is not None:  # TensorBoard's own add_video needs moviepy; its summary is a GIF image
            from tensorboard.compat.proto.summary_pb2 import Summary

            buf = io.BytesIO()
            imgs = [Image.fromarray(f) for f in frames]
            imgs[0].save(buf, format="GIF", save_all=True, append_images=imgs[1:], duration=int(1000 / EVAL_VIDEO_FPS), loop=0)
            h, w = frames[0].shape[:2]
            img = Summary.Image(height=h, width=w, colorspace=3, encoded_image_string=buf.getvalue())
            tb._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=f"eval/video_env{env}", image=img)]), version)
