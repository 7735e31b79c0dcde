"""Recording rollouts: a simulator stages the finished episodes of chosen slots as ``.npz`` files.

Fragments of one episode arrive in order; the recorder joins them and, when the episode ends,
writes ``<record_dir>/staging/<worker>-e<env>-<episode>.npz`` (written to a temporary name and
renamed, so a reader never sees half a file). ``workers/lerobot_dataset.py`` turns the staged
episodes into a LeRobot dataset when the run ends. One frame is one decision: the observation a
chunk was chosen from, the chunk, the reward it earned, and the policy version that chose it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import structlog

log = structlog.get_logger()

STAGING = "staging"


class EpisodeRecorder:
    def __init__(self, record_dir: str | Path, worker: str, slots: list[int]) -> None:
        self.dir = Path(record_dir) / STAGING
        self.dir.mkdir(parents=True, exist_ok=True)
        self.worker = worker
        self.slots = set(int(s) for s in slots)
        self.open: dict[tuple[Any, Any], list[dict[str, np.ndarray]]] = {}
        self.written = 0

    def wants(self, slot: int) -> bool:
        return not self.slots or slot in self.slots

    def add(self, header: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
        """One fragment; the episode is written when its last fragment arrives."""
        key = (header.get("env"), header.get("episode"))
        n = int(tensors["reward"].shape[0])
        part = {k: np.asarray(v[:n]) for k, v in tensors.items() if k.startswith("obs/")}  # drop the bootstrap obs
        part.update({k: np.asarray(tensors[k]) for k in ("actions", "reward", "terminated", "truncated", "version")})
        self.open.setdefault(key, []).append(part)
        if not header.get("done"):
            return
        parts = self.open.pop(key)
        ep = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        success = np.zeros(len(ep["reward"]), bool)
        success[-1] = bool(header.get("episode_success"))
        ep["success"] = success
        ep["instruction"] = np.asarray(str(header.get("instruction", "")))
        ep["seed"] = np.asarray(-1 if header.get("seed") is None else int(header["seed"]), np.int64)
        name = f"{self.worker}-e{key[0]}-{key[1]:06d}" if isinstance(key[1], int) else f"{self.worker}-e{key[0]}-{key[1]}"
        tmp = self.dir / f".{name}.tmp.npz"
        np.savez(tmp, **ep)
        tmp.replace(self.dir / f"{name}.npz")
        self.written += 1
        log.debug("episode_recorded", name=name, frames=len(ep["reward"]), success=bool(success[-1]))
