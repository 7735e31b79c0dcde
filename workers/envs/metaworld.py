"""Meta-World (MT1 / MT10 / ML1) as a batch of MuJoCo envs, with fast upright camera images.

Each env of the batch is its own Meta-World task env (class chosen round-robin over the
benchmark's tasks). A reset seed picks the start: in ``goal_mode="benchmark"`` it indexes the
benchmark's fixed goal list (MT1/MT10 evaluation semantics), in ``"seeded"`` it seeds the env's
random goal/object placement. Either way the same seed gives the same first observation.

mujoco / metaworld are imported only when an env is built; the module imports without them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import structlog

from rlvla3.observation import Observation
from workers.envs.base import EnvSpec, SimEnv, StepResult, episode_ends, register_env, reset_seeds

log = structlog.get_logger()

DEFAULT_MUJOCO_GL = "egl"
"""EGL on Mesa's llvmpipe renders headless on CPU (~110 rendered steps/s at 128x128);
``osmesa`` works too, ~20% slower; mujoco's default, glfw, needs a display."""

INSTRUCTIONS: dict[str, str] = {
    "reach-v3": "reach the goal position",
    "push-v3": "push the puck to the goal",
    "pick-place-v3": "pick up the puck and place it at the goal",
    "door-open-v3": "open the door",
    "door-close-v3": "close the door",
    "drawer-open-v3": "open the drawer",
    "drawer-close-v3": "close the drawer",
    "button-press-topdown-v3": "press the button from the top",
    "button-press-v3": "press the button",
    "peg-insert-side-v3": "insert the peg into the hole from the side",
    "window-open-v3": "slide the window open",
    "window-close-v3": "slide the window closed",
    "basketball-v3": "dunk the basketball into the hoop",
    "coffee-push-v3": "push the mug under the coffee machine",
    "faucet-open-v3": "turn the faucet on",
    "faucet-close-v3": "turn the faucet off",
    "lever-pull-v3": "pull the lever up",
    "plate-slide-v3": "slide the plate into the cabinet",
    "shelf-place-v3": "place the puck on the shelf",
    "sweep-into-v3": "sweep the puck into the hole",
}


def instruction_for(task: str) -> str:
    """Instruction text of a Meta-World task (hand-written for common ones, else from its name)."""
    if task in INSTRUCTIONS:
        return INSTRUCTIONS[task]
    return task.removesuffix("-v3").removesuffix("-v2").replace("-", " ")


def ensure_mujoco_gl() -> None:
    """Choose a headless GL before mujoco is first imported."""
    os.environ.setdefault("MUJOCO_GL", DEFAULT_MUJOCO_GL)
    if os.environ["MUJOCO_GL"] in ("egl", "osmesa"):
        os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])


ensure_mujoco_gl()  # cheap, and must precede any import of mujoco by whoever imports us next


@dataclass
class MetaWorldOptions:
    benchmark: str = "MT1"
    """MT1, MT10 or ML1. MT10 spreads its 10 tasks round-robin over the batch."""
    task: str = "reach-v3"
    """Meta-World task name for MT1 / ML1 (ignored by MT10)."""
    split: str = "train"
    """ML1 only: 'train' or 'test' goal set."""
    goal_mode: str = "benchmark"
    """'benchmark': reset seed indexes the benchmark's 50 fixed goals per task; 'seeded': the
    seed draws goal and object placement afresh (unbounded distinct starts)."""
    cameras: list[str] = field(default_factory=lambda: ["corner"])
    """Cameras to render (corner, corner2, corner3, corner4, topview, behindGripper, gripperPOV);
    empty for state-only (fastest)."""
    image_size: list[int] = field(default_factory=lambda: [128, 128])
    """[height, width] of every camera image."""
    state: str = "full"
    """'full': Meta-World's 39-d observation (hand, gripper, objects, previous frame, goal);
    'proprio': hand xyz + gripper opening (4-d)."""
    max_episode_steps: int = 200
    """Steps after which an episode is truncated (Meta-World's own limit is 500)."""
    terminate_on_success: bool = True
    """End the episode (terminated) on the first successful step."""
    success_bonus: float = 0.0
    """Added to the reward of an episode's first successful step (0: Meta-World's dense reward
    only). For PPO on the dense reward: with ``terminate_on_success`` an episode ends at success,
    so hovering short of it earns more dense reward (up to 10 per step) than reaching it; only a
    bonus near ``10 * max_episode_steps`` outweighs lingering. PPO on the dense reward instead runs
    episodes to the time limit (``configs/metaworld_reach_ppo.yaml``); GRPO on
    ``algo.grpo_reward: success`` (the default config) needs none."""
    dense_reward: bool = True
    """False: Meta-World's shaped reward is dropped, so an episode's only reward is
    ``success_bonus`` on its first successful step (RLinf's Meta-World reward, ``reward_coef`` x
    success). PPO then estimates the chance of success instead of a return that hovering near
    the goal can earn."""
    benchmark_seed: int = 0
    """Seed of the benchmark's goal list, so goal k is the same on every machine."""
    render_every: int = 1
    """Render the cameras only on an episode's first step and every ``render_every``-th step
    after it (and when an episode ends); other steps repeat the last frame. Set it to
    ``model.chunk_size``: a policy reads images only at chunk starts, which are exactly these
    steps, and software GL (~25-40 ms per 64x64 frame on CPU) is then paid once per decision."""
    blank_images: bool = False
    """Return all-zero camera images (nothing rendered): the ablation that shows whether a
    policy uses its cameras."""


class _FastRenderer:
    """Renders named cameras of one MuJoCo model upright, without MSAA, shadows or reflections.

    These extras cost ~8x on a software GL and add nothing a policy needs; ``offsamples`` must be
    zero before the GL context is made. Fixed cameras whose image-up axis points down in the
    world (Meta-World's ``corner*``) are flipped.
    """

    def __init__(self, model: Any, data: Any, cameras: Sequence[str], height: int, width: int) -> None:
        import mujoco

        self._mj = mujoco
        for cam in cameras:
            if mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, cam) < 0:
                raise ValueError(f"metaworld: camera {cam!r} not in the model")
        model.vis.quality.offsamples = 0
        model.vis.global_.offwidth = max(int(model.vis.global_.offwidth), width)
        model.vis.global_.offheight = max(int(model.vis.global_.offheight), height)
        self._renderer = mujoco.Renderer(model, height, width)
        flags = self._renderer.scene.flags
        flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
        flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        self.cameras = list(cameras)
        self.flip = {c for c in self.cameras if camera_is_upside_down(model, data, c)}
        self._scratch = np.empty((height, width, 3), np.uint8)

    def render_into(self, data: Any, out: dict[str, np.ndarray]) -> None:
        """Render each camera straight into ``out[camera]`` (a C-contiguous uint8 ``[H, W, 3]``,
        e.g. a row of a shared-memory block). GL reads pixels bottom row first: that is the upright
        image of an upside-down camera, read in place; any other camera is read into a scratch
        buffer and written flipped (one copy, as mujoco's own ``Renderer.render`` flips)."""
        mj, r = self._mj, self._renderer
        for cam in self.cameras:
            r.update_scene(data, camera=cam)
            if r._gl_context:  # mujoco.Renderer's own steps, minus its flip of the pixels
                r._gl_context.make_current()
            mj.mjr_render(r._rect, r._scene, r._mjr_context)
            if cam in self.flip:
                mj.mjr_readPixels(out[cam], None, r._rect, r._mjr_context)
            else:
                mj.mjr_readPixels(self._scratch, None, r._rect, r._mjr_context)
                np.copyto(out[cam], self._scratch[::-1])

    def close(self) -> None:
        self._renderer.close()


def camera_is_upside_down(model: Any, data: Any, camera: str) -> bool:
    """True when a camera's image-up axis points down in the world frame."""
    import mujoco

    cid = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, camera)
    mujoco.mj_kinematics(model, data)
    mujoco.mj_camlight(model, data)
    up = data.cam_xmat[cid].reshape(3, 3)[:, 1]  # camera y axis = image up
    return bool(up[2] < -0.1)


INSTALL_HINT = ("Meta-World is not installed in this Python environment ({python}): install it with "
                "`pip install -e .[metaworld]` from the repository root, or run `bash scripts/run.sh`, "
                "which installs it and then runs `rlvla3 run`")


def require_installed() -> None:
    """Raise ModuleNotFoundError naming how to install Meta-World when metaworld or mujoco is
    missing (cheap: finds the packages without importing them). ``rlvla3 run`` / ``sft`` call
    this before starting anything."""
    import importlib.util
    import sys

    for mod in ("mujoco", "metaworld"):
        if importlib.util.find_spec(mod) is None:
            raise ModuleNotFoundError(f"{mod} is missing. " + INSTALL_HINT.format(python=sys.executable), name=mod)


def _import_metaworld() -> Any:
    ensure_mujoco_gl()
    try:
        import metaworld
    except ModuleNotFoundError as exc:
        import sys

        raise ModuleNotFoundError(f"{exc.name} is missing. " + INSTALL_HINT.format(python=sys.executable),
                                  name=exc.name) from exc
    return metaworld


@register_env("metaworld", options=MetaWorldOptions)
class MetaWorldEnv(SimEnv):
    """A batch of Meta-World task envs stepped in this process (wrap in SubprocEnv for cores)."""

    def __init__(self, num_envs: int, seed: int = 0, options: MetaWorldOptions | None = None) -> None:
        self.opts = o = options or MetaWorldOptions()
        self.num_envs = num_envs
        self.spec = self.spec_for(o)
        mw = _import_metaworld()
        bench = o.benchmark.upper()
        if bench == "MT1":
            b = mw.MT1(o.task, seed=o.benchmark_seed)
            classes, tasks = b.train_classes, b.train_tasks
        elif bench == "MT10":
            b = mw.MT10(seed=o.benchmark_seed)
            classes, tasks = b.train_classes, b.train_tasks
        elif bench == "ML1":
            b = mw.ML1(o.task, seed=o.benchmark_seed)
            classes, tasks = (b.train_classes, b.train_tasks) if o.split == "train" else (b.test_classes, b.test_tasks)
        else:
            raise ValueError(f"metaworld: benchmark must be MT1, MT10 or ML1, got {o.benchmark!r}")
        if o.render_every < 1:
            raise ValueError(f"metaworld: render_every must be >= 1, got {o.render_every}")
        if o.goal_mode not in ("benchmark", "seeded"):
            raise ValueError(f"metaworld: goal_mode must be 'benchmark' or 'seeded', got {o.goal_mode!r}")
        names = list(classes)
        self.task_names = [names[i % len(names)] for i in range(num_envs)]
        self._tasks = {n: [t for t in tasks if t.env_name == n] for n in names}
        self._rng = np.random.default_rng(seed)
        self._envs = []
        self._renderers: list[_FastRenderer | None] = []
        h, w = o.image_size
        for name in self.task_names:
            env = classes[name]()
            env.set_task(self._tasks[name][0])  # any task, so reset works; reset() sets the real one
            env.max_path_length = max(env.max_path_length, o.max_episode_steps + 1)
            env.reset()
            self._envs.append(env)
            self._renderers.append(_FastRenderer(env.model, env.data, o.cameras, h, w)
                                   if o.cameras and not o.blank_images else None)
        self._frames: list[dict[str, np.ndarray]] = [{c: np.zeros((h, w, 3), np.uint8) for c in o.cameras}
                                                     for _ in range(num_envs)]  # last rendered, per env
        self._t = np.zeros(num_envs, np.int64)
        self._fresh = np.ones(num_envs, bool)  # render this env's cameras at its next observation
        self._succeeded = np.zeros(num_envs, bool)  # this episode has succeeded (success_bonus paid)
        self._raw = [np.zeros(39)] * num_envs  # last unmasked observation, for the expert
        self._last = [np.zeros(39)] * num_envs  # last observation as the env returned it
        self._experts: dict[str, Any] = {}
        log.info("metaworld_ready", benchmark=bench, tasks=sorted(set(self.task_names)), num_envs=num_envs,
                 cameras=o.cameras, flipped=sorted(self._renderers[0].flip) if self._renderers[0] else [],
                 render_every=o.render_every, blank_images=o.blank_images)

    @staticmethod
    def spec_for(o: MetaWorldOptions) -> EnvSpec:
        h, w = o.image_size
        return EnvSpec(
            cameras={c: (int(h), int(w)) for c in o.cameras},
            state_dim=39 if o.state == "full" else 4,
            action_dim=4,
            max_episode_steps=o.max_episode_steps,
        )

    # -- contract ----------------------------------------------------------------------------

    def _reset(self, ids: list[int], seeds: Sequence[int | None] | None) -> None:
        for i, seed in zip(ids, reset_seeds(ids, seeds, self._rng)):
            env = self._envs[i]
            tasks = self._tasks[self.task_names[i]]
            env.set_task(tasks[seed % len(tasks)])
            if self.opts.goal_mode == "seeded":
                env._freeze_rand_vec = False
                env.seeded_rand_vec = True
                env.seed(seed)
            raw, _ = env.reset()
            self._t[i] = 0
            self._succeeded[i] = False
            self._fresh[i] = True
            self._remember(i, raw)

    def _step(self, ids: list[int], actions: np.ndarray) -> StepResult:
        actions = np.clip(actions, -1.0, 1.0)
        n = len(ids)
        reward = np.zeros(n, np.float32)
        success = np.zeros(n, bool)
        for k, i in enumerate(ids):
            raw, r, _, _, info = self._envs[i].step(actions[k])
            self._t[i] += 1
            reward[k] = r if self.opts.dense_reward else 0.0
            success[k] = bool(info.get("success", 0.0))
            if success[k] and not self._succeeded[i]:
                self._succeeded[i] = True
                reward[k] += self.opts.success_bonus
            self._remember(i, raw)
        terminated, truncated = episode_ends(self._t[ids], success, self.opts.terminate_on_success,
                                             self.opts.max_episode_steps)
        for i, end in zip(ids, terminated | truncated):  # render again at an episode's end or every render_every steps
            self._fresh[i] = bool(end or self._t[i] % self.opts.render_every == 0)
        return StepResult(reward, terminated, truncated, success)

    def close(self) -> None:
        for r in self._renderers:
            if r is not None:
                r.close()
        self._renderers = []
        super().close()

    # -- helpers -----------------------------------------------------------------------------

    def _remember(self, i: int, raw: np.ndarray) -> None:
        self._last[i] = raw
        full = np.array(raw, np.float64)
        env = self._envs[i]
        if not np.any(full[-3:]) and getattr(env, "_target_pos", None) is not None:
            full[-3:] = env._target_pos  # ML1 hides the goal; the expert still needs it
        self._raw[i] = full

    def observe(self, ids: list[int], into: Observation, rows: Sequence[int]) -> None:
        d = self.spec.state_dim
        for i, row in zip(ids, rows):
            into.state[row] = np.asarray(self._last[i], np.float32).reshape(-1)[:d]
            views = {c: into.images[c][row] for c in self.opts.cameras}
            r = self._renderers[i]
            if r is not None and self._fresh[i]:
                r.render_into(self._envs[i].data, views)
                if self.opts.render_every > 1:  # kept for the steps that show it again
                    for c, v in views.items():
                        np.copyto(self._frames[i][c], v)
            else:  # blank_images (zeros), or a step between renders: the last frame again
                for c, v in views.items():
                    np.copyto(v, self._frames[i][c])
            into.instruction[row] = instruction_for(self.task_names[i])

    def expert_policy(self, i: int) -> Any:
        """Meta-World's scripted policy for env ``i``'s task (cached per task)."""
        name = self.task_names[i]
        if name not in self._experts:
            from metaworld.policies import ENV_POLICY_MAP

            if name not in ENV_POLICY_MAP:
                raise KeyError(f"metaworld: no scripted policy for {name!r}")
            self._experts[name] = ENV_POLICY_MAP[name]()
        return self._experts[name]


def expert_action(env: MetaWorldEnv, ids: Sequence[int]) -> np.ndarray:
    """Scripted expert actions (float32 [n, 4]) for envs ``ids`` at their current state.

    For behaviour cloning and as a known-good policy in tests: call between steps of an
    in-process :class:`MetaWorldEnv` (the expert reads the unmasked simulator observation).
    """
    out = np.zeros((len(ids), 4), np.float32)
    for k, i in enumerate(ids):
        out[k] = np.clip(env.expert_policy(int(i)).get_action(env._raw[int(i)]), -1.0, 1.0)
    return out
