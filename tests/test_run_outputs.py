"""What a short `rlvla3 run` leaves behind for users: an evaluation round in the progress line,
curves.png redrawn from metrics.jsonl, evaluation GIFs in the run folder and TensorBoard, and
with --record a LeRobot v3.0 dataset whose files parse and whose frame counts agree."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from rlvla3.harness.jobs import run_cli
from tests.jobs import video_frames

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytestmark = pytest.mark.slow


def test_run_shows_eval_round_curves_videos_and_records_a_dataset(tmp_path: Path):
    run_dir, ds = tmp_path / "run", tmp_path / "ds"
    r = run_cli("run", "configs/synthetic.yaml", "--steps", "3000", "--run-dir", str(run_dir), "--record", str(ds),
                "--record-slots", "0", "--set", "workers.simulators=1", "--set", "env.eval_slots=1",
                "--set", "env.eval_every=1", "--set", "env.eval_episodes=2", "--set", "run.progress_every_s=1", timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    # The live line shows the newest evaluated version: with a round every version, v1's can land
    # before the first line that would have shown v0's.
    assert re.search(r" eval\(v\d+\)=", r.stdout), r.stdout[-2000:]

    # -- curves and evaluation videos ---------------------------------------------------------
    png = (run_dir / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(row["eval_version"] is not None for row in rows)
    gifs = sorted((run_dir / "videos").glob("eval_v*_env*.gif"))
    assert gifs and all(video_frames(g) >= 1 for g in gifs)  # Pillow merges identical consecutive GIF frames
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    assert any(t.startswith("eval/video_env") for t in acc.Tags()["images"])

    # -- the recorded dataset -----------------------------------------------------------------
    info = json.loads((ds / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["total_episodes"] >= 1
    data = pq.read_table(ds / info["data_path"].format(chunk_index=0, file_index=0)).to_pydict()
    eps = pq.read_table(ds / "meta" / "episodes" / "chunk-000" / "file-000.parquet").to_pydict()
    tasks = pq.read_table(ds / "meta" / "tasks.parquet").to_pydict()
    n = info["total_frames"]
    assert len(data["index"]) == n == sum(eps["length"]) == eps["dataset_to_index"][-1]
    assert len(eps["episode_index"]) == info["total_episodes"] and len(tasks["task_index"]) == info["total_tasks"]
    assert data["index"] == list(range(n))
    for k in ("observation.state", "action", "next.reward", "next.done", "next.success", "policy_version"):
        assert k in info["features"] and len(data[k]) == n
    assert len(data["observation.state"][0]) == info["features"]["observation.state"]["shape"][0]
    assert sum(data["next.done"]) == info["total_episodes"]  # one last frame per episode
    assert np.all(np.asarray(data["policy_version"]) >= -1)
    cams = [k for k, f in info["features"].items() if f["dtype"] == "video"]
    assert cams
    for cam in cams:
        video = ds / info["video_path"].format(video_key=cam, chunk_index=0, file_index=0)
        assert video_frames(video) == n
        assert eps[f"videos/{cam}/to_timestamp"][-1] == pytest.approx(n / info["fps"])
    stats = json.loads((ds / "meta" / "stats.json").read_text())
    assert stats["action"]["count"] == [n]
