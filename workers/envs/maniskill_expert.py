"""ManiSkill's shipped motion-planning solutions as the scripted expert of ``rlvla3 sft``.

mani_skill ships a solution per Panda task (``mani_skill.examples.motionplanning.panda``): it
plans with mplib and steps one env in ``pd_joint_pos`` to the end of the task. Two things keep
it out of the adapter's own process:

* mplib (0.1.1, which mani_skill pins, and 0.2.1, the newest) is built against NumPy 1's C API
  and segfaults under NumPy 2 while it builds its planner. The solutions therefore run in a
  child process whose ``PYTHONPATH`` puts a NumPy 1 overlay (``.mplib-numpy1`` in the checkout,
  made by ``RLVLA3_MPLIB=1 bash scripts/bootstrap.sh``) ahead of the venv.
* A solution drives its env itself, all the way, with no say for the caller.

So, per episode, the child resets a state-only twin of the task with the episode's seed, runs
the solution there and sends back the joint targets it commanded and the twin's first sim
state. The expert checks that the adapter's env started from that same state, then replays the
targets in the adapter's control mode, ``pd_joint_delta_pos``: each step, the difference between
the next target and the joint positions now (closed loop), with the gripper command as is.
Episodes the solution fails end unsolved, and ``rlvla3 sft`` keeps only successful ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

log = structlog.get_logger()

OVERLAY = Path(__file__).resolve().parents[2] / ".mplib-numpy1"
"""NumPy 1 installed with ``pip install --target`` (see scripts/bootstrap.sh): mplib's numpy."""

CONTROL_MODE = "pd_joint_delta_pos"
"""The adapter control mode the expert replays plans in."""


@dataclass
class Plan:
    seed: int
    solved: bool
    state0: np.ndarray
    """The twin env's flat sim state after reset (actors and robot)."""
    targets: np.ndarray
    """[T, 8] pd_joint_pos commands: 7 arm joint targets and the gripper command (-1..1)."""


class PlannerProcess:
    """The child that runs mani_skill's motion-planning solution of one task, one seed at a time."""

    def __init__(self, task: str, robot_uids: str | None = None) -> None:
        env = dict(os.environ)
        if int(np.__version__.split(".")[0]) >= 2:
            if not (OVERLAY / "numpy").is_dir():
                raise RuntimeError(
                    f"maniskill expert: mplib needs NumPy < 2 and this venv has {np.__version__}; "
                    f"make the overlay once with `RLVLA3_MPLIB=1 bash scripts/bootstrap.sh` (it installs "
                    f"numpy 1.26 into {OVERLAY} for the planner process only)")
            repo = str(OVERLAY.parent)
            env["PYTHONPATH"] = os.pathsep.join([str(OVERLAY), repo, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        args = [sys.executable, "-m", "workers.envs.maniskill_expert", task] + ([robot_uids] if robot_uids else [])
        self._err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                     env=env, text=True, cwd=str(OVERLAY.parent))

    def plan(self, seed: int) -> Plan:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"seed": int(seed)}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise RuntimeError(f"maniskill expert: the planner process ended (rc={self.proc.poll()}): {self._stderr_tail()}")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"maniskill expert: {msg['error']}")
        return Plan(int(msg["seed"]), bool(msg["solved"]), np.asarray(msg["state0"], np.float64),
                    np.asarray(msg["targets"], np.float32).reshape(-1, 8))

    def _stderr_tail(self, n: int = 1500) -> str:
        self._err.seek(0)
        return self._err.read()[-n:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._err.close()


class ManiSkillExpert:
    """``ExpertFn`` for in-process ``ManiSkillEnv`` envs: plans each episode once (at its first
    step), then follows the plan closed loop in ``pd_joint_delta_pos``."""

    def __init__(self) -> None:
        self.task = ""
        self._planner: PlannerProcess | None = None
        self._plans: dict[int, Plan] = {}
        self.planned = self.solved = 0

    def __call__(self, env: Any, ids: list[int], obs: Any) -> np.ndarray:
        if env.opts.control_mode != CONTROL_MODE:
            raise SystemExit(f"sft: the ManiSkill motion-planning expert replays plans in {CONTROL_MODE!r}; "
                             f"set env.options.control_mode={CONTROL_MODE} (the config has {env.opts.control_mode!r})")
        out = np.zeros((len(ids), env.spec.action_dim), np.float32)
        for k, i in enumerate(ids):
            seed, t = env.episode(i)
            plan = self._plans.get(i)
            if t == 0 or plan is None or plan.seed != seed:
                plan = self._plans[i] = self._plan(env, i, seed)
            out[k] = self._action(env, i, plan, t)
        return out

    def _plan(self, env: Any, i: int, seed: int) -> Plan:
        if self._planner is None:  # the task and robot of the envs it drives
            self.task = env.opts.task
            self._planner = PlannerProcess(env.opts.task, env.opts.robot_uids)
        plan = self._planner.plan(seed)
        state0 = env.sim_state(i)
        if state0.shape != plan.state0.shape or not np.allclose(state0, plan.state0, atol=1e-4):
            raise RuntimeError(f"maniskill expert: seed {seed} starts differently in the planner's twin env "
                               f"and in the adapter's (max diff {np.max(np.abs(state0 - plan.state0)) if state0.shape == plan.state0.shape else 'shape'})")
        self.planned += 1
        self.solved += int(plan.solved)
        return plan

    def _action(self, env: Any, i: int, plan: Plan, t: int) -> np.ndarray:
        if not plan.solved or len(plan.targets) == 0:
            a = np.zeros(env.spec.action_dim, np.float32)  # stay put: the episode fails and is dropped
            a[-1] = 1.0
            return a
        target = plan.targets[min(t, len(plan.targets) - 1)]
        qpos = env.robot_qpos(i)[:7]
        arm = np.clip((target[:7] - qpos) / env.joint_delta_limit(), -1.0, 1.0)
        return np.concatenate([arm, target[7:]]).astype(np.float32)

    def close(self) -> None:
        if self._planner is not None:
            self._planner.close()
            self._planner = None
        log.info("maniskill_expert_done", task=self.task, planned=self.planned, solved=self.solved)


# ---------------------------------------------------------------------------------------------
# The planner process (runs under NumPy 1): `python -m workers.envs.maniskill_expert TASK [ROBOT]`
# Reads {"seed": s} lines on stdin, answers one JSON line per seed on stdout.
# ---------------------------------------------------------------------------------------------


def _serve(task: str, robot_uids: str | None) -> None:
    reply = os.fdopen(os.dup(1), "w")  # the protocol's stdout; the solutions' prints go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if int(np.__version__.split(".")[0]) >= 2:
        reply.write(json.dumps({"error": f"planner process has NumPy {np.__version__}; mplib needs < 2"}) + "\n")
        reply.flush()
        return
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401 - registers the tasks
    from mani_skill.examples.motionplanning.panda.run import MP_SOLUTIONS

    if task not in MP_SOLUTIONS:
        reply.write(json.dumps({"error": f"mani_skill ships no motion-planning solution for {task!r} "
                                         f"(it has {sorted(MP_SOLUTIONS)})"}) + "\n")
        reply.flush()
        return
    kwargs: dict[str, Any] = dict(obs_mode="state", control_mode="pd_joint_pos", sim_backend="physx_cpu",
                                  render_backend="none", max_episode_steps=100_000)
    if robot_uids:
        kwargs["robot_uids"] = robot_uids
    twin = _Recorder(gym.make(task, **kwargs))
    solve = MP_SOLUTIONS[task]
    for line in sys.stdin:
        seed = int(json.loads(line)["seed"])
        try:
            res = solve(twin, seed=seed, debug=False, vis=False)
            solved = res != -1 and bool(np.asarray(res[-1]["success"]).reshape(-1)[0])
        except Exception as exc:  # noqa: BLE001 - mplib raises on unplannable starts: that episode is unsolved
            print(f"planner: seed {seed}: {exc!r}", file=sys.stderr)
            solved = False
        reply.write(json.dumps({"seed": seed, "solved": solved, "state0": twin.state0,
                                "targets": [a.tolist() for a in twin.actions]}) + "\n")
        reply.flush()


class _Recorder:
    """Records the first sim state after each reset and every action a solution sends."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.unwrapped = env.unwrapped
        self.actions: list[np.ndarray] = []
        self.state0: list[float] = []

    def reset(self, **kw: Any) -> Any:
        out = self.env.reset(**kw)
        self.actions = []
        self.state0 = self.unwrapped.get_state().detach().cpu().numpy().reshape(-1).astype(float).tolist()
        return out

    def step(self, action: Any) -> Any:
        self.actions.append(np.asarray(action, np.float32).reshape(-1))
        return self.env.step(action)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
