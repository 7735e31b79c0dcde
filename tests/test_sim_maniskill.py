"""ManiSkill adapter on the real simulator, CPU backends (physx_cpu + sapien_cpu on lavapipe),
and the motion-planning expert that ``rlvla3 sft`` clones.

Building a rendering ManiSkill env takes ~10 s on CPU, so one module-scoped env serves most checks.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mani_skill")

from workers.envs.base import make_env  # noqa: E402

pytestmark = pytest.mark.sim

OPTS = {"task": "PickCube-v1", "image_size": [96, 96], "max_episode_steps": 3, "state": "proprio",
        "render_every": 2, "show_goal": True}


@pytest.fixture(scope="module")
def env():
    e = make_env("maniskill", 2, options=OPTS)
    yield e
    e.close()


def test_spec_and_obs_shapes(env) -> None:
    assert env.spec.cameras == {"base_camera": (96, 96)} and env.spec.action_dim == 7
    assert env.spec.state_dim == 9 + 9 + 7  # proprio: qpos, qvel, TCP pose; no cube or goal
    obs = env.reset([0, 1], [1, 2])
    img = obs.images["base_camera"]
    assert img.shape == (2, 96, 96, 3) and img.dtype == np.uint8
    assert obs.state.shape == (2, env.spec.state_dim) and obs.state.dtype == np.float32
    np.testing.assert_allclose(obs.state[:, :9], np.stack([env.robot_qpos(0), env.robot_qpos(1)]), atol=1e-6)
    assert obs.instruction[0].startswith("pick up")
    # render_every 2: the frame after one step is the reset's; after the second, a new one
    moved = env.step([0, 1], np.ones((2, 7), np.float32))
    np.testing.assert_array_equal(moved.obs.images["base_camera"], img)
    assert not np.array_equal(moved.obs.state, obs.state)
    again = env.step([0, 1], np.ones((2, 7), np.float32))
    assert not np.array_equal(again.obs.images["base_camera"], img)


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


def _planner_missing() -> str | None:
    """Why mani_skill's motion planner cannot run here, or None."""
    import importlib.util

    from workers.envs.maniskill_expert import OVERLAY

    if importlib.util.find_spec("mplib") is None:
        return "mplib is not installed (mani_skill's motion-planning dependency)"
    if int(np.__version__.split(".")[0]) >= 2 and not (OVERLAY / "numpy").is_dir():
        return f"mplib needs NumPy < 2: no overlay at {OVERLAY} (RLVLA3_MPLIB=1 bash scripts/bootstrap.sh)"
    return None


@pytest.mark.skipif(_planner_missing() is not None, reason=str(_planner_missing()))
def test_motion_planning_expert_gives_successful_demos() -> None:
    """The recipe's expert (mani_skill's PickCube solution, planned in the NumPy-1 child, replayed
    closed loop in pd_joint_delta_pos) solves its episodes; sft keeps them as chunks of 8-d
    actions. State obs and no renderer keep it cheap: cameras are checked above."""
    from rlvla3.config import load
    from workers.sft import collect_demos

    cfg = load("maniskill_pickcube_oft_rgb.yaml", ["env.options.obs_mode=state", "env.options.render_backend=none"])
    demos = collect_demos(cfg, episodes=2, num_envs=1)
    assert sorted(set(demos["episode"].tolist())) == [0, 1]  # both solved and kept
    n = len(demos["state"])
    assert 2 * 12 <= n <= 2 * 25, n  # ~50-90 steps per solution, 4 per decision, minus success's early end
    assert demos["actions"].shape == (n, 4, 8) and demos["actions"].dtype == np.float32
    assert np.abs(demos["actions"]).max() <= 1.0 and set(np.unique(demos["actions"][..., 7])) <= {-1.0, 1.0}
    assert (demos["actions"][0, 0, 7] == 1.0) and (demos["actions"][-1, -1, 7] == -1.0)  # open, then holding
