"""`rlvla3 eval` as a user runs it: a checkpoint through Meta-World's protocol (shortened with
--episodes), a per-task table in Markdown and JSON, and an MP4 and a GIF that decode to the
frames the episodes had."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from rlvla3.config import load
from rlvla3.lifetime import launcher_env
from tests.jobs import ProcessPool, video_frames

pytest.importorskip("metaworld")
pytestmark = pytest.mark.slow

OVERRIDES = ["env.options.cameras=[corner]", "env.options.image_size=[48,48]", "env.options.max_episode_steps=12",
             "model.options.use_images=false"]


def _checkpoint(tmp_path: Path) -> Path:
    """A run-folder checkpoint: model.safetensors + config.yaml, as `rlvla3 sft` writes one."""
    from safetensors.torch import save_model

    from workers.model import build_policy

    cfg = load("configs/metaworld_reach_mlp.yaml", OVERRIDES)
    out = tmp_path / "ckpt"
    out.mkdir()
    save_model(build_policy(cfg), str(out / "model.safetensors"))
    (out / "config.yaml").write_text(cfg.to_yaml())
    return out


def _eval_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlvla3", "eval", *args]


@pytest.fixture(scope="module")
def evals(tmp_path_factory):
    """The module's three ``rlvla3 eval`` processes, on one checkpoint, two at a time in the
    background (each is single-threaded start-up, env building and rollouts)."""
    tmp = tmp_path_factory.mktemp("eval")
    ckpt = _checkpoint(tmp)
    env = {**os.environ, **launcher_env(), "MUJOCO_GL": "egl", "PYOPENGL_PLATFORM": "egl"}
    pool = ProcessPool(2)
    for fmt in ("mp4", "gif"):
        pool.add(fmt, _eval_argv(str(ckpt), "--episodes", "3", "--envs-per-task", "2", "--video", str(tmp / fmt),
                                 "--video-format", fmt, "--video-episodes", "2"), env=env)
    pool.add("no-cameras", _eval_argv(str(ckpt), "--episodes", "1", "--video", str(tmp / "none"),
                                      "--set", "env.options.cameras=[]"), env=env)
    yield tmp, pool
    pool.close()


@pytest.mark.parametrize("fmt", ["mp4", "gif"])
def test_eval_writes_per_task_table_and_video(evals, fmt: str):
    tmp, pool = evals
    returncode, _, stderr = pool.result(fmt, timeout=300)
    assert returncode == 0, stderr[-3000:]
    table = json.loads((tmp / fmt / "eval.json").read_text())
    assert table["shortened"] is True and table["starts_per_task"] == 3 and table["episodes"] == 3
    assert [t["task"] for t in table["tasks"]] == ["reach-v3"]
    row = table["tasks"][0]
    assert row["episodes"] == 3 and 0.0 <= row["success"] <= 1.0 and 1 <= row["length"] <= 12
    md = (tmp / fmt / "eval.md").read_text()
    assert "| reach-v3 | 3 |" in md and "Shortened" in md and "Meta-World MT1" in md
    assert len(table["videos"]) == 2
    for v in table["videos"]:
        path = Path(v["path"])
        assert path.suffix == f".{fmt}" and path.is_file()
        if fmt == "mp4":
            assert video_frames(path) == v["frames"]  # the initial frame plus one per env step
        else:  # Pillow merges identical consecutive GIF frames (a still arm), so at most that many
            assert 1 <= video_frames(path) <= v["frames"]
        assert 2 <= v["frames"] <= 13


def test_eval_refuses_video_without_cameras(evals):
    returncode, _, stderr = evals[1].result("no-cameras", timeout=300)
    assert returncode != 0 and "videos need camera images" in stderr
