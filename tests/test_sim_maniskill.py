"""ManiSkill adapter on the real simulator, CPU backends (physx_cpu + sapien_cpu on lavapipe).

Building a ManiSkill env takes ~10 s on CPU, so one module-scoped env serves most checks.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mani_skill")

from workers.envs.base import make_env  # noqa: E402

pytestmark = pytest.mark.sim

OPTS = {"task": "PickCube-v1", "image_size": [96, 96], "max_episode_steps": 3}


@pytest.fixture(scope="module")
def env():
    e = make_env("maniskill", 2, options=OPTS)
    yield e
    e.close()


def test_spec_and_obs_shapes(env) -> None:
    assert env.spec.cameras == {"base_camera": (96, 96)} and env.spec.action_dim == 7
    obs = env.reset([0, 1], [1, 2])
    img = obs.images["base_camera"]
    assert img.shape == (2, 96, 96, 3) and img.dtype == np.uint8
    assert obs.state.shape == (2, env.spec.state_dim) and obs.state.dtype == np.float32
    assert obs.instruction[0].startswith("pick up")


def test_same_seed_same_first_obs(env) -> None:
    a = env.reset([0, 1], [5, 5])
    np.testing.assert_array_equal(a.state[0], a.state[1])
    np.testing.assert_array_equal(a.images["base_camera"][0], a.images["base_camera"][1])
    env.step([0, 1], np.ones((2, 7), np.float32))
    b = env.reset([0, 1], [5, 6])
    np.testing.assert_array_equal(a.state[0], b.state[0])
    assert not np.array_equal(b.state[0], b.state[1])


def test_episode_steps_and_truncates(env) -> None:
    env.reset([0, 1], [3, 4])
    for t in range(3):
        res = env.step([0, 1], np.zeros((2, 7), np.float32))
        assert res.success.dtype == bool and res.reward.dtype == np.float32
        np.testing.assert_array_equal(res.terminated, res.success)
    assert (res.truncated | res.terminated).all()


def test_image_upright_cube_where_projected(env) -> None:
    """The red cube's pixels sit where the camera model projects the cube (rows not flipped)."""
    obs = env.reset([0], [11])
    img = obs.images["base_camera"][0].astype(int)
    mask = (img[..., 0] > 120) & (img[..., 1] < 60) & (img[..., 2] < 60)
    assert mask.sum() >= 3, "cube not visible"
    row = np.nonzero(mask)[0].mean()
    uw = env._envs[0].unwrapped
    params = uw.scene.sensors["base_camera"].get_params()
    ext = np.asarray(params["extrinsic_cv"][0].cpu())
    K = np.asarray(params["intrinsic_cv"][0].cpu())
    p = np.asarray(uw.cube.pose.p[0].cpu())
    uvw = K @ (ext[:, :3] @ p + ext[:, 3])
    v = uvw[1] / uvw[2]  # OpenCV row of the cube centre
    assert abs(row - v) < 6 and abs(row - (95 - v)) > abs(row - v), (row, v)


def test_task_needing_download_fails_clearly() -> None:
    with pytest.raises(RuntimeError, match="needs downloaded assets.*asset-free"):
        make_env("maniskill", 1, options={"task": "PickSingleYCB-v1"})
