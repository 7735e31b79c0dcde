"""ManiSkill 3 (SAPIEN) tasks as a batch of envs: one GPU-vectorised batch, or CPU envs.

With CUDA, all ``num_envs`` envs are one ``physx_cuda`` batch (slots are sub-batches of it;
partial resets go through ManiSkill's ``env_idx``). Without CUDA, ManiSkill's CPU backend allows
one env per scene, so the adapter holds ``num_envs`` single envs (put each slot in its own
SubprocEnv to use several cores) and renders with ``sapien_cpu``, which needs Mesa >= 25's
lavapipe Vulkan driver (see .ci/install_sims.sh).

Only asset-free tasks are supported out of the box; a task whose assets are not on disk fails
at build with a message naming them, instead of ManiSkill's interactive download prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import structlog

from rlvla3.observation import Observation
from workers.envs.base import EnvSpec, SimEnv, StepResult, episode_ends, register_env, reset_seeds

log = structlog.get_logger()

ASSET_FREE_TASKS = ("PickCube-v1", "PushCube-v1", "StackCube-v1", "PegInsertionSide-v1", "PushT-v1",
                    "PullCube-v1", "LiftPegUpright-v1", "PokeCube-v1", "PlaceSphere-v1", "RollBall-v1")

INSTRUCTIONS = {
    "PickCube-v1": "pick up the red cube and move it to the goal",
    "PushCube-v1": "push the cube to the goal region",
    "StackCube-v1": "stack the red cube on the green cube",
    "PegInsertionSide-v1": "insert the peg into the hole from the side",
    "PushT-v1": "push the T-shaped block onto the target",
    "PullCube-v1": "pull the cube to the goal region",
    "LiftPegUpright-v1": "lift the peg upright",
    "PokeCube-v1": "use the peg to poke the cube to the goal",
    "PlaceSphere-v1": "place the sphere into the bin",
    "RollBall-v1": "roll the ball to the goal region",
}


@dataclass
class ManiSkillOptions:
    task: str = "PickCube-v1"
    """ManiSkill env id; asset-free ones (PickCube, PushCube, StackCube, PegInsertionSide, PushT, ...)
    need no download."""
    obs_mode: str = "rgb"
    """'rgb': camera images + proprio/task state (agent qpos, qvel, extras); 'state': privileged
    flat state only (no images)."""
    state: str = "full"
    """rgb mode only. 'full': ManiSkill's agent and extra entries (PickCube's extras include the
    goal position and an is-grasped flag); 'proprio': the robot's own joint positions and
    velocities and its TCP pose, nothing about objects or goals."""
    show_goal: bool = False
    """Draw the objects the task hides from its cameras (PickCube's green goal sphere): with
    ``state: proprio`` the images are then the only place the goal is."""
    render_every: int = 1
    """Render the cameras only on an episode's first step, every ``render_every``-th step after
    it and when an episode ends; other steps repeat the last frame. Set it to
    ``model.chunk_size``: a policy reads images only at chunk starts, and CPU rendering
    (lavapipe, ~0.1 s a frame on a loaded core) is then paid once per decision."""
    cameras: list[str] = field(default_factory=lambda: ["base_camera"])
    """Sensor cameras to return in rgb mode (the task's sensor names, e.g. base_camera)."""
    image_size: list[int] = field(default_factory=lambda: [128, 128])
    """[height, width] of every camera image."""
    control_mode: str = "pd_ee_delta_pose"
    """ManiSkill controller; the delta controllers take actions in [-1, 1]."""
    robot_uids: str | None = None
    """Robot override (e.g. 'panda_wristcam' for a hand camera); None: the task's default."""
    max_episode_steps: int | None = None
    """Truncate after this many steps; None: the task's registered limit."""
    terminate_on_success: bool = True
    """End the episode (terminated) on the first successful step."""
    sim_backend: str = "auto"
    """'auto' (physx_cuda when CUDA is present, else physx_cpu), or a ManiSkill backend name."""
    render_backend: str = "auto"
    """'auto' (GPU renderer with CUDA, sapien_cpu otherwise), or a ManiSkill render backend."""


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - no torch / broken CUDA: CPU it is
        return False


def _check_assets(task: str) -> None:
    """Raise (instead of ManiSkill's stdin prompt) when a task's assets are not downloaded."""
    from mani_skill.utils import assets
    from mani_skill.utils.registration import REGISTERED_ENVS

    if task not in REGISTERED_ENVS:
        raise ValueError(f"maniskill: unknown task {task!r}; asset-free tasks: {list(ASSET_FREE_TASKS)}")
    missing = []
    for asset_id in REGISTERED_ENVS[task].asset_download_ids or []:
        ids = (assets.expand_data_group_into_individual_data_source_ids(asset_id)
               if asset_id in assets.DATA_GROUPS else [asset_id])
        missing += [a for a in ids if not assets.is_data_source_downloaded(a)]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise RuntimeError(
            f"maniskill: task {task!r} needs downloaded assets ({shown}); fetch them once with "
            f"`python -m mani_skill.utils.download_asset {task}` or pick an asset-free task: {list(ASSET_FREE_TASKS)}"
        )


def _np(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _copy_into(dst: np.ndarray, src: Any) -> None:
    """One copy of a ManiSkill tensor (CPU or CUDA) straight into ``dst`` (e.g. a shared-memory row)."""
    if hasattr(src, "detach"):
        import torch

        torch.from_numpy(dst).copy_(src.detach())
    else:
        np.copyto(dst, src)


@register_env("maniskill", options=ManiSkillOptions)
class ManiSkillEnv(SimEnv):
    """ManiSkill task envs; a GPU batch when CUDA is present, else one CPU env per index."""

    def __init__(self, num_envs: int, seed: int = 0, options: ManiSkillOptions | None = None) -> None:
        self.opts = o = options or ManiSkillOptions()
        self.num_envs = num_envs
        if o.obs_mode not in ("rgb", "state"):
            raise ValueError(f"maniskill: obs_mode must be 'rgb' or 'state', got {o.obs_mode!r}")
        if o.state not in ("full", "proprio"):
            raise ValueError(f"maniskill: state must be 'full' or 'proprio', got {o.state!r}")
        if o.render_every < 1:
            raise ValueError(f"maniskill: render_every must be >= 1, got {o.render_every}")
        try:
            import gymnasium as gym
            import mani_skill.envs  # noqa: F401 - registers the tasks
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                "mani_skill is not installed: pip install 'rlvla3[maniskill]' and, on CPU, Mesa >= 25 "
                "(.ci/install_sims.sh)", name=exc.name) from exc
        _check_assets(o.task)
        cuda = _cuda()
        sim = o.sim_backend if o.sim_backend != "auto" else ("physx_cuda" if cuda else "physx_cpu")
        render = o.render_backend if o.render_backend != "auto" else ("gpu" if cuda else "sapien_cpu")
        self.gpu = sim in ("physx_cuda", "gpu", "cuda")
        h, w = o.image_size
        kwargs: dict[str, Any] = dict(
            obs_mode="state" if o.obs_mode == "state" else "rgb",
            control_mode=o.control_mode,
            sim_backend=sim,
            render_backend=render,
            sensor_configs=dict(width=int(w), height=int(h)),
        )
        if o.robot_uids:
            kwargs["robot_uids"] = o.robot_uids
        if o.max_episode_steps:
            kwargs["max_episode_steps"] = o.max_episode_steps + 1  # our own counter truncates
        n_sims = 1 if self.gpu else num_envs
        per_sim = num_envs if self.gpu else 1
        self._envs = [gym.make(o.task, num_envs=per_sim, **kwargs) for _ in range(n_sims)]
        if o.obs_mode == "rgb":
            for e in self._envs:
                u = e.unwrapped
                # reset/step build no observation: observe() reads the robot and renders on demand
                u._obs_mode = "none"
                if o.show_goal:
                    for obj in u._hidden_objects:
                        obj.show_visual()
                    u._hidden_objects = []
        self._seeds = np.random.default_rng(seed).integers(2**31 - 1, size=num_envs)
        self._rng = np.random.default_rng(seed + 1)
        self._t = np.zeros(num_envs, np.int64)
        from mani_skill.utils.registration import REGISTERED_ENVS

        limit = o.max_episode_steps or REGISTERED_ENVS[o.task].max_episode_steps or 100
        # per ManiSkill env: its last (obs, info); reset() and step() set them
        self._out: list[tuple[Any, Any]] = [(None, None)] * n_sims
        self._out[0] = self._envs[0].reset(seed=[int(s) for s in self._seeds[:per_sim]])
        state_dim = self._state(0).shape[-1]
        act = self._envs[0].unwrapped.single_action_space
        self._act_low, self._act_high = act.low.astype(np.float32), act.high.astype(np.float32)
        self._scale = not (np.allclose(self._act_low, -1) and np.allclose(self._act_high, 1))
        cams = list(o.cameras) if o.obs_mode == "rgb" else []
        if cams:
            have = list(self._envs[0].unwrapped.scene.sensors)
            unknown = [c for c in cams if c not in have]
            if unknown:
                raise ValueError(f"maniskill: camera(s) {unknown} not in {o.task}; it has {have}")
        # the frame each env shows until it renders again, and whether its next observe renders
        self._frames = [{c: np.zeros((int(h), int(w), 3), np.uint8) for c in cams} for _ in range(num_envs)]
        self._fresh = np.ones(num_envs, bool)
        self.spec = EnvSpec(cameras={c: (int(h), int(w)) for c in cams}, state_dim=int(state_dim),
                            action_dim=int(act.shape[0]), max_episode_steps=int(limit))
        log.info("maniskill_ready", task=o.task, sim=sim, render=render, num_envs=num_envs,
                 state_dim=state_dim, action_dim=act.shape[0], render_every=o.render_every)

    # -- contract ----------------------------------------------------------------------------

    def _reset(self, ids: list[int], seeds: Sequence[int | None] | None) -> None:
        self._seeds[ids] = reset_seeds(ids, seeds, self._rng)
        self._t[ids] = 0
        self._fresh[ids] = True
        if self.gpu:
            import torch

            env = self._envs[0]
            self._out[0] = env.reset(seed=[int(s) for s in self._seeds],
                                     options={"env_idx": torch.tensor(ids, device=env.unwrapped.device)})
            return
        for i in ids:
            self._out[i] = self._envs[i].reset(seed=int(self._seeds[i]))

    def _step(self, ids: list[int], actions: np.ndarray) -> StepResult:
        a = np.clip(actions, -1.0, 1.0)
        if self._scale:
            a = self._act_low + (a + 1.0) * 0.5 * (self._act_high - self._act_low)
        n = len(ids)
        reward = np.zeros(n, np.float32)
        success = np.zeros(n, bool)
        if self.gpu:
            import torch

            env = self._envs[0]
            full = np.zeros((self.num_envs, a.shape[1]), np.float32)
            if self._scale:  # hold still where not stepped is not expressible: zero action
                full[:] = (self._act_low + self._act_high) / 2
            full[ids] = a
            obs, r, _, _, info = env.step(torch.from_numpy(full).to(env.unwrapped.device))
            # ManiSkill steps the whole GPU batch: unnamed envs advance too (documented limit).
            self._out[0] = (obs, info)
            reward[:] = _np(r)[ids]
            success[:] = _np(info.get("success", np.zeros(self.num_envs, bool)))[ids].astype(bool)
        else:
            for k, i in enumerate(ids):
                obs, r, _, _, info = self._envs[i].step(a[k : k + 1])
                self._out[i] = (obs, info)
                reward[k] = float(_np(r).reshape(-1)[0])
                success[k] = bool(_np(info.get("success", False)).reshape(-1)[0])
        self._t[ids] += 1
        terminated, truncated = episode_ends(self._t[ids], success, self.opts.terminate_on_success,
                                             self.spec.max_episode_steps)
        # render again at an episode's end or every render_every steps
        self._fresh[ids] = terminated | truncated | (self._t[ids] % self.opts.render_every == 0)
        return StepResult(reward, terminated, truncated, success)

    # -- helpers -----------------------------------------------------------------------------

    def _where(self, i: int) -> tuple[int, int]:
        """(ManiSkill env, row in its batch) of env ``i``."""
        return (0, i) if self.gpu else (i, 0)

    def _state(self, k: int) -> np.ndarray:
        """Flat float32 state [n, D] of ManiSkill env ``k``: its flat state obs, or in rgb mode
        the agent + extra entries ('full') or joint positions, velocities and TCP pose ('proprio')."""
        obs, info = self._out[k]
        if self.opts.obs_mode == "state":
            return _np(obs).astype(np.float32).reshape(_np(obs).shape[0], -1)
        u = self._envs[k].unwrapped
        agent = u._get_obs_agent()
        if self.opts.state == "proprio":
            groups = [{"qpos": agent["qpos"], "qvel": agent["qvel"]}, {"tcp_pose": u.agent.tcp.pose.raw_pose}]
        else:
            groups = [agent, u._get_obs_extra(info)]
        parts = []
        for group in groups:
            for _, v in sorted(group.items()):
                x = _np(v).astype(np.float32)
                parts.append(x.reshape(x.shape[0], -1))
        return np.concatenate(parts, axis=1)

    def robot_qpos(self, i: int) -> np.ndarray:
        """Env ``i``'s joint positions now (float32; arm joints first, then gripper)."""
        k, j = self._where(i)
        return _np(self._envs[k].unwrapped.agent.robot.get_qpos())[j].astype(np.float32)

    def sim_state(self, i: int) -> np.ndarray:
        """Env ``i``'s flat simulator state now (every actor's and articulation's pose and velocity)."""
        k, j = self._where(i)
        return _np(self._envs[k].unwrapped.get_state())[j].astype(np.float64)

    def joint_delta_limit(self) -> float:
        """The joint move (rad) of a +1 arm action under ``pd_joint_delta_pos``."""
        return float(self._envs[0].unwrapped.agent.controller.controllers["arm"].config.upper)

    def episode(self, i: int) -> tuple[int, int]:
        """(seed, steps taken) of env ``i``'s current episode."""
        return int(self._seeds[i]), int(self._t[i])

    def observe(self, ids: list[int], into: Observation, rows: Sequence[int]) -> None:
        instr = INSTRUCTIONS.get(self.opts.task, self.opts.task.split("-v")[0])
        states: dict[int, np.ndarray] = {}  # one state computation per ManiSkill env (batch)
        renders: dict[int, dict] = {}  # one render per ManiSkill env, if any of its envs needs it
        for i, row in zip(ids, rows):
            k, j = self._where(i)
            if k not in states:
                states[k] = self._state(k)
            into.state[row] = states[k][j]
            if self.spec.cameras and self._fresh[i]:
                if k not in renders:
                    renders[k] = self._envs[k].unwrapped._get_obs_sensor_data()
                for c in self.spec.cameras:  # ManiSkill hands over tensors: one copy into the frame
                    _copy_into(self._frames[i][c], renders[k][c]["rgb"][j])
            for c in self.spec.cameras:
                np.copyto(into.images[c][row], self._frames[i][c])
            into.instruction[row] = instr
