"""Meta-World adapter on the real simulator (CPU). Rendered steps are kept few: CPU GL is slow."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("MUJOCO_GL", "egl")  # before mujoco is imported: headless GL on CPU
pytest.importorskip("metaworld")

from workers.envs.base import make_env  # noqa: E402
from workers.envs.metaworld import expert_action  # noqa: E402
from workers.envs.subproc import SubprocEnv  # noqa: E402

pytestmark = pytest.mark.sim


def _red_row(img: np.ndarray) -> float:
    """Mean image row of the (red) Sawyer arm's pixels."""
    r, g, b = (img[..., c].astype(int) for c in range(3))
    rows, _ = np.nonzero((r > 100) & (g < 60) & (b < 60))
    assert rows.size > 50, "arm not visible"
    return float(rows.mean())


def test_expert_episode_succeeds_and_terminates() -> None:
    env = make_env("metaworld", 2, options={"task": "reach-v3", "cameras": []})
    try:
        obs = env.reset([0, 1], [0, 1])
        assert obs.state.shape == (2, 39) and obs.state.dtype == np.float32
        assert obs.instruction == ["reach the goal position"] * 2
        done = np.zeros(2, bool)
        for _ in range(env.spec.max_episode_steps):
            res = env.step([0, 1], expert_action(env, [0, 1]))
            assert not res.truncated.any()
            done |= res.terminated
            if done.all():
                break
        assert done.all() and res.success.all()
    finally:
        env.close()


def test_episode_truncates_at_max_steps() -> None:
    env = make_env("metaworld", 1, options={"task": "push-v3", "cameras": [], "max_episode_steps": 3})
    try:
        env.reset([0], [0])
        flags = [env.step([0], np.zeros((1, 4), np.float32)).truncated[0] for _ in range(3)]
        assert flags == [False, False, True]
    finally:
        env.close()


def test_images_upright_at_configured_size() -> None:
    env = make_env("metaworld", 1, options={"task": "reach-v3", "cameras": ["corner", "topview"],
                                            "image_size": [64, 80]})
    try:
        obs = env.reset([0], [0])
        img = obs.images["corner"]
        assert img.shape == (1, 64, 80, 3) and img.dtype == np.uint8
        assert obs.images["topview"].shape == (1, 64, 80, 3)
        before = _red_row(img[0])
        down = np.array([[0, 0, -1, 0]], np.float32)  # lower the hand: the arm moves down the image
        for _ in range(15):
            res = env.step([0], down)
        after = _red_row(res.obs.images["corner"][0])
        assert after > before + 0.5, (before, after)
    finally:
        env.close()


def test_render_every_repeats_frames_between_decisions_and_blank_images_are_zero() -> None:
    opts = {"task": "reach-v3", "cameras": ["corner"], "image_size": [32, 32], "render_every": 3}
    env = make_env("metaworld", 1, options=opts)
    blank = make_env("metaworld", 1, options={**opts, "blank_images": True})
    try:
        first = env.reset([0], [0]).images["corner"][0]
        down = np.array([[0, 0, -1, 0]], np.float32)
        for _ in range(2):  # steps 1, 2: the reset frame again
            assert np.array_equal(env.step([0], down).obs.images["corner"][0], first)
        assert not np.array_equal(env.step([0], down).obs.images["corner"][0], first)  # step 3: rendered
        assert not blank.reset([0], [0]).images["corner"].any()
        assert not blank.step([0], down).obs.images["corner"].any()
    finally:
        env.close()
        blank.close()


@pytest.mark.parametrize("goal_mode", ["benchmark", "seeded"])
def test_same_seed_same_first_obs(goal_mode: str) -> None:
    opts = {"benchmark": "ML1", "task": "pick-place-v3", "goal_mode": goal_mode, "image_size": [32, 32]}
    a = make_env("metaworld", 2, options=opts)
    b = make_env("metaworld", 1, options=opts)
    try:
        oa = a.reset([0, 1], [7, 8])
        ob = b.reset([0], [7])
        np.testing.assert_array_equal(oa.state[0], ob.state[0])
        np.testing.assert_array_equal(oa.images["corner"][0], ob.images["corner"][0])
        assert not np.array_equal(oa.state[0], oa.state[1])
        a.step([0, 1], np.ones((2, 4), np.float32))
        np.testing.assert_array_equal(a.reset([0], [7]).state[0], ob.state[0])
    finally:
        a.close()
        b.close()


def test_mt10_tasks_and_instructions() -> None:
    env = make_env("metaworld", 10, options={"benchmark": "MT10", "cameras": []})
    try:
        obs = env.reset(list(range(10)), list(range(10)))
        assert len(set(obs.instruction)) == 10
        res = env.step(list(range(10)), np.zeros((10, 4), np.float32))
        assert res.reward.shape == (10,) and res.success.dtype == bool
    finally:
        env.close()


def test_metaworld_in_subprocess_matches_in_process() -> None:
    opts = {"task": "reach-v3", "cameras": ["corner"], "image_size": [32, 32]}
    sub = SubprocEnv("metaworld", 2, options=opts, step_timeout_s=60)
    ref = make_env("metaworld", 2, options=opts)
    try:
        o1, o2 = sub.reset([0, 1], [3, 4]), ref.reset([0, 1], [3, 4])
        np.testing.assert_array_equal(o1.images["corner"], o2.images["corner"])
        act = np.full((2, 4), 0.5, np.float32)
        r1, r2 = sub.step([0, 1], act), ref.step([0, 1], act)
        np.testing.assert_array_equal(r1.obs.state, r2.obs.state)
        np.testing.assert_array_equal(r1.reward, r2.reward)
    finally:
        sub.close()
        ref.close()
