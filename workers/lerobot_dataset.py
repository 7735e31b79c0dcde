"""Staged rollouts -> a LeRobot dataset in its v3.0 layout (read from the LeRobot 0.4 wheel's
``lerobot/datasets/utils.py`` and ``lerobot_dataset.py``; LeRobot itself is not a dependency):

    meta/info.json                                  codebase_version v3.0, fps, features, paths
    meta/stats.json                                 min/max/mean/std/count per feature
    meta/tasks.parquet                              task_index, indexed by the task string
    meta/episodes/chunk-000/file-000.parquet        one row per episode: length, tasks, indices,
                                                    data file, video files and time spans
    data/chunk-000/file-000.parquet                 one row per frame
    videos/observation.images.<cam>/chunk-000/file-000.mp4   all episodes, back to back

A frame is one decision (see ``workers/recorder.py``): ``observation.images.<cam>``,
``observation.state``, ``action`` (the chunk, flattened to chunk_size x action_dim),
``next.reward``, ``next.done``, ``next.success`` and ``policy_version``. Parquet needs pyarrow
(``pip install -e .[record]``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from workers.recorder import STAGING
from workers.videos import write_video

log = structlog.get_logger()

CODEBASE_VERSION = "v3.0"
RECORD_FPS = 10
"""Frames (decisions) per second written into info.json and the videos."""
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-000/file-000.parquet"


def require_pyarrow() -> None:
    """Fail before a run starts when its dataset could not be written at the end."""
    import importlib.util

    if importlib.util.find_spec("pyarrow") is None:
        raise ModuleNotFoundError("recording a LeRobot dataset needs pyarrow (parquet): pip install -e .[record]",
                                  name="pyarrow")


def _stats(x: np.ndarray, axes: tuple[int, ...]) -> dict[str, Any]:
    x = x.astype(np.float64)
    return {"min": x.min(axes).tolist(), "max": x.max(axes).tolist(), "mean": x.mean(axes).tolist(),
            "std": x.std(axes).tolist(), "count": [int(x.shape[0])]}


def write_dataset(record_dir: str | Path, robot_type: str = "") -> dict[str, Any]:
    """Write every staged episode under ``record_dir`` as one dataset there; returns a summary."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(record_dir)
    staged = sorted((root / STAGING).glob("*.npz"))
    if not staged:
        return {"dataset": str(root), "episodes": 0, "frames": 0}
    eps = [dict(np.load(p)) for p in staged]
    cams = sorted(k[len("obs/images/"):] for k in eps[0] if k.startswith("obs/images/"))
    tasks: dict[str, int] = {}
    cols: dict[str, list] = {k: [] for k in ("observation.state", "action", "next.reward", "next.done", "next.success",
                                             "policy_version", "timestamp", "frame_index", "episode_index", "index", "task_index")}
    ep_rows: dict[str, list] = {k: [] for k in ("episode_index", "tasks", "length", "data/chunk_index", "data/file_index",
                                                "dataset_from_index", "dataset_to_index", "success", "seed",
                                                "meta/episodes/chunk_index", "meta/episodes/file_index")}
    for cam in cams:
        for k in ("chunk_index", "file_index", "from_timestamp", "to_timestamp"):
            ep_rows[f"videos/observation.images.{cam}/{k}"] = []
    frames: dict[str, list[np.ndarray]] = {c: [] for c in cams}
    total = 0
    for e, ep in enumerate(eps):
        n = len(ep["reward"])
        task = str(ep["instruction"])
        ti = tasks.setdefault(task, len(tasks))
        cols["observation.state"] += list(ep["obs/state"].astype(np.float32))
        cols["action"] += list(ep["actions"].reshape(n, -1).astype(np.float32))
        cols["next.reward"] += ep["reward"].astype(np.float32).tolist()
        done = np.zeros(n, bool)
        done[-1] = True
        cols["next.done"] += done.tolist()
        cols["next.success"] += ep["success"].tolist()
        cols["policy_version"] += ep["version"].astype(np.int64).tolist()
        cols["timestamp"] += (np.arange(n, dtype=np.float32) / RECORD_FPS).tolist()
        cols["frame_index"] += list(range(n))
        cols["episode_index"] += [e] * n
        cols["index"] += list(range(total, total + n))
        cols["task_index"] += [ti] * n
        for cam in cams:
            ep_rows[f"videos/observation.images.{cam}/chunk_index"].append(0)
            ep_rows[f"videos/observation.images.{cam}/file_index"].append(0)
            ep_rows[f"videos/observation.images.{cam}/from_timestamp"].append(total / RECORD_FPS)
            ep_rows[f"videos/observation.images.{cam}/to_timestamp"].append((total + n) / RECORD_FPS)
            frames[cam] += list(ep[f"obs/images/{cam}"])
        for k, v in (("episode_index", e), ("tasks", [task]), ("length", n), ("data/chunk_index", 0), ("data/file_index", 0),
                     ("dataset_from_index", total), ("dataset_to_index", total + n), ("success", bool(ep["success"][-1])),
                     ("seed", int(ep["seed"])), ("meta/episodes/chunk_index", 0), ("meta/episodes/file_index", 0)):
            ep_rows[k].append(v)
        total += n

    # -- data and episodes (parquet) ----------------------------------------------------------
    vec = pa.list_(pa.float32())
    types = {"observation.state": vec, "action": vec, "next.reward": pa.float32(), "next.done": pa.bool_(),
             "next.success": pa.bool_(), "policy_version": pa.int64(), "timestamp": pa.float32(),
             "frame_index": pa.int64(), "episode_index": pa.int64(), "index": pa.int64(), "task_index": pa.int64()}
    data = pa.table({k: pa.array([np.asarray(x).tolist() for x in v] if types[k] == vec else v, type=types[k])
                     for k, v in cols.items()})
    path = root / DATA_PATH.format(chunk_index=0, file_index=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(data, path)
    (root / EPISODES_PATH).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(ep_rows), root / EPISODES_PATH)
    _write_tasks(tasks, root / "meta" / "tasks.parquet")

    # -- videos -------------------------------------------------------------------------------
    for cam in cams:
        write_video(root / VIDEO_PATH.format(video_key=f"observation.images.{cam}", chunk_index=0, file_index=0),
                    frames[cam], RECORD_FPS)

    # -- meta: features, stats, info ----------------------------------------------------------
    state_dim, act_dim = len(cols["observation.state"][0]), len(cols["action"][0])
    features: dict[str, Any] = {}
    for cam in cams:
        h, w = frames[cam][0].shape[:2]
        features[f"observation.images.{cam}"] = {
            "dtype": "video", "shape": [h, w, 3], "names": ["height", "width", "channels"],
            "info": {"video.height": h, "video.width": w, "video.codec": "h264", "video.pix_fmt": "yuv420p",
                     "video.is_depth_map": False, "video.fps": RECORD_FPS, "video.channels": 3, "has_audio": False}}
    features.update({
        "observation.state": {"dtype": "float32", "shape": [state_dim], "names": None},
        "action": {"dtype": "float32", "shape": [act_dim], "names": None},
        "next.reward": {"dtype": "float32", "shape": [1], "names": None},
        "next.done": {"dtype": "bool", "shape": [1], "names": None},
        "next.success": {"dtype": "bool", "shape": [1], "names": None},
        "policy_version": {"dtype": "int64", "shape": [1], "names": None},
        "timestamp": {"dtype": "float32", "shape": [1], "names": None},
        "frame_index": {"dtype": "int64", "shape": [1], "names": None},
        "episode_index": {"dtype": "int64", "shape": [1], "names": None},
        "index": {"dtype": "int64", "shape": [1], "names": None},
        "task_index": {"dtype": "int64", "shape": [1], "names": None},
    })
    stats = {k: _stats(np.asarray(cols[k], np.float64).reshape(total, -1), (0,)) for k in cols}
    for cam in cams:  # per channel, in [0, 1], shaped (3, 1, 1) as LeRobot's image stats
        s = _stats(np.stack(frames[cam]).reshape(-1, 3) / 255.0, (0,))
        stats[f"observation.images.{cam}"] = {k: ([[[x]] for x in v] if k != "count" else [total]) for k, v in s.items()}
    (root / "meta" / "stats.json").write_text(json.dumps(stats, indent=1))
    info = {"codebase_version": CODEBASE_VERSION, "robot_type": robot_type or None, "total_episodes": len(eps),
            "total_frames": total, "total_tasks": len(tasks), "chunks_size": 1000, "data_files_size_in_mb": 100,
            "video_files_size_in_mb": 200, "fps": RECORD_FPS, "splits": {"train": f"0:{len(eps)}"},
            "data_path": DATA_PATH, "video_path": VIDEO_PATH if cams else None, "features": features}
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=4))
    summary = {"dataset": str(root), "episodes": len(eps), "frames": total, "tasks": len(tasks), "cameras": cams}
    log.info("dataset_written", **summary)
    return summary


def _write_tasks(tasks: dict[str, int], path: Path) -> None:
    """``meta/tasks.parquet`` as pandas writes LeRobot's: column task_index, index named by the task."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"task_index": pa.array(list(tasks.values()), pa.int64()), "__index_level_0__": list(tasks)})
    pandas_meta = {"index_columns": ["__index_level_0__"], "column_indexes": [], "pandas_version": "2.2.3",
                   "columns": [{"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
                                "numpy_type": "int64", "metadata": None},
                               {"name": None, "field_name": "__index_level_0__", "pandas_type": "unicode",
                                "numpy_type": "object", "metadata": None}],
                   "creator": {"library": "pyarrow", "version": pa.__version__}}
    pq.write_table(table.replace_schema_metadata({b"pandas": json.dumps(pandas_meta).encode()}), path)
