"""RoboCasa kitchen tasks (robosuite >= 1.5) as a batch of envs.

RoboCasa is not on the package registry and needs robosuite >= 1.5.2 while LIBERO pins 1.4, plus
several GB of kitchen assets fetched by its own script. So it lives in its own virtualenv and
runs as a separate simulator worker that joins the same broker (the process boundary is the
dependency boundary). Without the package or its assets, building this env raises
:class:`RoboCasaUnavailable` with the install steps.
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

os.environ.setdefault("MUJOCO_GL", "egl")

INSTALL_HELP = """\
RoboCasa runs in its own virtualenv (it needs robosuite>=1.5.2; LIBERO pins robosuite 1.4.0),
as a separate simulator worker joining the same broker:

    python3 -m venv /opt/venv-robocasa
    /opt/venv-robocasa/bin/pip install torch==2.13.0 -e <rlvla3 checkout>
    git clone https://github.com/ARISE-Initiative/robosuite && /opt/venv-robocasa/bin/pip install -e robosuite
    git clone https://github.com/robocasa/robocasa && /opt/venv-robocasa/bin/pip install -e robocasa
    /opt/venv-robocasa/bin/python -m robocasa.scripts.download_kitchen_assets   # several GB
    /opt/venv-robocasa/bin/python -m robocasa.scripts.setup_macros

then start that venv's simulator worker with an env.name: robocasa config."""


class RoboCasaUnavailable(RuntimeError):
    """RoboCasa, a new enough robosuite, or its kitchen assets are missing here."""


@dataclass
class RoboCasaOptions:
    task: str = "PnPCounterToCab"
    """RoboCasa env name (e.g. PnPCounterToCab, OpenDrawer, OpenDoor, TurnOnSinkFaucet)."""
    robot: str = "PandaOmron"
    """Robot (RoboCasa's default mobile manipulator)."""
    cameras: list[str] = field(default_factory=lambda: ["robot0_agentview_left", "robot0_eye_in_hand"])
    """robosuite camera names to render."""
    image_size: list[int] = field(default_factory=lambda: [128, 128])
    """[height, width] of every camera image."""
    max_episode_steps: int = 500
    """Steps after which an episode is truncated."""
    terminate_on_success: bool = True
    """End the episode (terminated) on the first successful step."""
    layout_ids: list[int] | None = None
    """Kitchen layouts to draw from; None: RoboCasa's default set."""
    style_ids: list[int] | None = None
    """Kitchen styles to draw from; None: RoboCasa's default set."""


# The asset packs RoboCasa's download script fetches (robocasa/scripts/download_kitchen_assets.py).
# The registry's code redistributions (rlinf-robocasa365, praxis-robocasa) ship none of them.
ASSET_PACKS = {
    "textures": "models/assets/textures",
    "generative_textures": "models/assets/generative_textures",
    "fixtures_lightwheel": "models/assets/fixtures/sinks",  # one of its folders (sinks, stoves, fridges...)
    "objaverse": "models/assets/objects/objaverse",
    "aigen_objs": "models/assets/objects/aigen_objs",
    "objects_lightwheel": "models/assets/objects/lightwheel",
}


def missing_assets(root: Path) -> list[str]:
    """The asset packs absent under a robocasa package root, as ``name (path)``."""
    return [f"{name} ({(root / rel).resolve()})" for name, rel in ASSET_PACKS.items()
            if not (root / rel).is_dir() or not any((root / rel).iterdir())]


def robosuite_api_gap(root: Path) -> str | None:
    """Why this robosuite cannot build this robocasa's kitchens, or None.

    RoboCasa's Kitchen passes ``load_model_on_init`` to robosuite's ManipulationEnv, an argument
    only robosuite's development branch takes (1.5.2, the newest release, does not): every
    kitchen task then fails in its constructor, before any asset is read.
    """
    kitchen = root / "environments" / "kitchen" / "kitchen.py"
    if not kitchen.is_file() or "load_model_on_init" not in kitchen.read_text():
        return None
    import inspect

    from robosuite.environments.manipulation.manipulation_env import ManipulationEnv

    if "load_model_on_init" in inspect.signature(ManipulationEnv.__init__).parameters:
        return None
    return ("this robocasa passes load_model_on_init to robosuite's ManipulationEnv, which the "
            "installed robosuite does not accept (robosuite's development branch does; no release does)")


def check_available() -> None:
    """Raise :class:`RoboCasaUnavailable` naming what is missing unless robocasa can build envs here."""
    if importlib.util.find_spec("robocasa") is None:
        raise RoboCasaUnavailable("robocasa is not installed in this environment.\n" + INSTALL_HELP)
    try:
        from importlib.metadata import version

        rs = version("robosuite")
    except Exception:  # noqa: BLE001
        rs = "missing"
    parts = tuple(int(p) for p in rs.split(".")[:2] if p.isdigit()) if rs != "missing" else ()
    if parts < (1, 5):
        raise RoboCasaUnavailable(f"robocasa needs robosuite>=1.5.2, found {rs}.\n" + INSTALL_HELP)
    spec = importlib.util.find_spec("robocasa")
    root = Path(next(iter(spec.submodule_search_locations or [""])))  # type: ignore[union-attr]
    problems = []
    gap = robosuite_api_gap(root)
    if gap:
        problems.append(f"robosuite {rs}: {gap}")
    missing = missing_assets(root)
    if missing:
        problems.append("kitchen asset packs missing: " + ", ".join(missing))
    if problems:
        raise RoboCasaUnavailable("robocasa cannot build kitchens here:\n  - " + "\n  - ".join(problems)
                                  + "\n" + INSTALL_HELP)


@register_env("robocasa", options=RoboCasaOptions)
class RoboCasaEnv(RobosuiteAdapter):
    """RoboCasa kitchen envs (one robosuite env each), stepped in this process."""

    def __init__(self, num_envs: int, seed: int = 0, options: RoboCasaOptions | None = None) -> None:
        self.opts = o = options or RoboCasaOptions()
        self.num_envs = num_envs
        check_available()
        import robocasa  # noqa: F401 - registers the kitchen envs with robosuite
        import robosuite
        from robosuite.controllers import load_composite_controller_config

        h, w = o.image_size
        extra: dict[str, Any] = {}
        if o.layout_ids is not None:
            extra["layout_ids"] = o.layout_ids
        if o.style_ids is not None:
            extra["style_ids"] = o.style_ids
        self._envs = [
            robosuite.make(
                env_name=o.task, robots=o.robot,
                controller_configs=load_composite_controller_config(robot=o.robot),
                has_renderer=False, has_offscreen_renderer=bool(o.cameras), use_camera_obs=bool(o.cameras),
                camera_names=list(o.cameras) or None, camera_heights=int(h), camera_widths=int(w),
                ignore_done=True, reward_shaping=False, control_freq=20, seed=seed + i, **extra,
            )
            for i in range(num_envs)
        ]
        low, high = self._envs[0].action_spec
        self._low, self._high = np.asarray(low, np.float32), np.asarray(high, np.float32)
        self._rng = np.random.default_rng(seed)
        self._t = np.zeros(num_envs, np.int64)
        self._instr = [""] * num_envs
        self._last: list[dict[str, Any]] = [{} for _ in range(num_envs)]
        self._reset_one(0, seed)
        self.spec = EnvSpec(cameras={c: (int(h), int(w)) for c in o.cameras}, state_dim=int(self._state(self._last[0]).size),
                            action_dim=int(self._low.size), max_episode_steps=o.max_episode_steps)
        log.info("robocasa_ready", task=o.task, robot=o.robot, num_envs=num_envs, action_dim=self.spec.action_dim)

    def _reset_one(self, i: int, seed: int) -> None:
        env = self._envs[i]
        if hasattr(env, "set_ep_meta"):
            env.set_ep_meta({})  # fresh layout/style/object draw from the seeded RNG
        env.rng = np.random.default_rng(seed)  # robocasa draws kitchens and objects from env.rng
        np.random.seed(seed % 2**32)
        self._last[i] = env.reset()
        self._t[i] = 0
        meta = env.get_ep_meta() if hasattr(env, "get_ep_meta") else {}
        self._instr[i] = str(meta.get("lang", self.opts.task))

    def _reset(self, ids: list[int], seeds: Sequence[int | None] | None) -> None:
        for i, s in zip(ids, reset_seeds(ids, seeds, self._rng)):
            self._reset_one(i, s)

    def _scale_action(self, a: np.ndarray) -> np.ndarray:
        return self._low + (a + 1.0) * 0.5 * (self._high - self._low)  # [-1, 1] -> robosuite's bounds

    @staticmethod
    def _success(env: Any) -> bool:
        return env._check_success()

    @staticmethod
    def _state(raw: dict[str, Any]) -> np.ndarray:
        keys = [k for k in ("robot0_base_pos", "robot0_base_quat", "robot0_eef_pos", "robot0_eef_quat",
                            "robot0_gripper_qpos") if k in raw]
        return np.concatenate([np.asarray(raw[k], np.float32).reshape(-1) for k in keys])

    def _instruction(self, i: int) -> str:
        return self._instr[i]

    @staticmethod
    def _image_key(camera: str) -> str:
        return f"{camera}_image"


if __name__ == "__main__":  # `python -m workers.envs.robocasa`: can this environment build kitchens?
    try:
        check_available()
    except RoboCasaUnavailable as e:
        print(e)
        raise SystemExit(1) from None
    print("robocasa: kitchens can be built here")
