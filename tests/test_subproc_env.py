"""SubprocEnv: slots step in child processes; a crashing or hanging env is rebuilt on its own.

The faulty adapters are registered here and imported by the child via ``plugins=[__name__]`` (``env.plugins``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

from rlvla3.harness.jobs import run_cli
from rlvla3.observation import Observation
from rlvla3.shm import POISON, ShmPool, observation_block
from workers.envs.base import EnvSpec, SimEnv, StepResult, register_env
from workers.envs.subproc import EnvCrashed, GuardedEnv, SubprocEnv

MOD = __name__
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class FaultyOptions:
    crash_at: int = 0
    """Raise on this step of the child's life (0: never)."""
    hang_at: int = 0
    """Block forever on this step (0: never)."""
    segv_at: int = 0
    """Kill the child with SIGSEGV on this step (0: never)."""
    fail_build: bool = False
    """Raise while building the env."""
    first_child_only: bool = True
    """Faults fire only in the env built with seed 0; a rebuilt child is reseeded and behaves."""


@register_env("test_faulty", options=FaultyOptions)
class FaultyEnv(SimEnv):
    """A tiny state-only env: state = [step count, seed]; succeeds at step 3."""

    def __init__(self, num_envs: int, seed: int = 0, options: FaultyOptions | None = None) -> None:
        self.opts = options or FaultyOptions()
        if self.opts.fail_build:
            raise RuntimeError("build failed on purpose")
        self.num_envs = num_envs
        self.spec = EnvSpec(cameras={"cam": (4, 4)}, state_dim=2, action_dim=1, max_episode_steps=5)
        self.t = np.zeros(num_envs, np.int64)
        self.s = np.zeros(num_envs, np.int64)
        self.calls = 0
        self.armed = seed == 0 or not self.opts.first_child_only
        self.rng = np.random.default_rng(seed)

    def observe(self, ids: list[int], into: Observation, rows: Sequence[int]) -> None:
        rows = list(rows)
        into.images["cam"][rows] = 0
        into.state[rows] = np.stack([self.t[ids], self.s[ids]], 1)
        for r in rows:
            into.instruction[r] = "count"

    def _reset(self, ids: list[int], seeds: Sequence[int | None] | None) -> None:
        for k, i in enumerate(ids):
            seed = None if seeds is None else seeds[k]
            self.t[i] = 0
            self.s[i] = seed if seed is not None else int(self.rng.integers(1000, 2000))

    def _step(self, ids: list[int], actions: np.ndarray) -> StepResult:
        self.calls += 1
        if not self.armed:
            pass
        elif self.calls == self.opts.crash_at:
            raise ValueError("crash on purpose")
        elif self.calls == self.opts.hang_at:
            threading.Event().wait()
        elif self.calls == self.opts.segv_at:
            os.kill(os.getpid(), signal.SIGSEGV)
        ids = list(ids)
        self.t[ids] += 1
        n = len(ids)
        t = self.t[ids]
        return StepResult(np.ones(n, np.float32), t == 3, t >= 5, t == 3, {})


def _step_n(env: SubprocEnv, n: int) -> list[StepResult]:
    ids = list(range(env.num_envs))
    return [env.step(ids, np.zeros((len(ids), 1), np.float32)) for _ in range(n)]


def test_steps_and_reset_in_child() -> None:
    env = SubprocEnv("test_faulty", num_envs=2, plugins=[MOD])
    try:
        assert env.spec.state_dim == 2 and env.pid != os.getpid()
        obs = env.reset([0, 1], [7, 8])
        assert obs.state[:, 1].tolist() == [7, 8]
        res = _step_n(env, 3)[-1]
        assert res.success.all() and res.terminated.all() and env.restarts == 0
        assert res.obs.state[:, 0].tolist() == [3, 3]
        # Into a shared-memory block (a simulator slot's): the child writes the named rows in
        # place and nothing else; the parent copies nothing.
        pool = ShmPool(f"subproc{os.getpid()}", 1 << 16)
        block = observation_block(pool, env.spec.cameras, env.spec.state_dim, 2)
        assert env.reset([1], [9], into=block) is block
        res = env.step([1], np.zeros((1, 1), np.float32), into=block)
        assert res.obs is block and block.state[1].tolist() == [1, 9] and block.instruction == ["", "count"]
        assert (block.state[0] == POISON).all(), "a row that was not named was written"
        pool.close()
    finally:
        env.close()
    assert env.pid is None


@pytest.mark.parametrize("fault", ["crash_at", "segv_at"])
def test_crash_restarts_child_and_truncates(fault: str) -> None:
    env = SubprocEnv("test_faulty", num_envs=2, options={fault: 2}, plugins=[MOD])
    try:
        env.reset([0, 1], [1, 2])
        pid = env.pid
        _step_n(env, 1)
        res = _step_n(env, 1)[0]
        assert env.restarts == 1 and env.pid != pid
        assert res.truncated.all() and not res.success.any()
        assert sorted(res.info["restarted"]) == [0, 1] and res.info["restarts"] == 1
        assert res.obs.state[:, 0].tolist() == [0, 0]  # fresh reset obs
        ok = _step_n(env, 1)[0]  # the rebuilt env goes on
        assert not ok.truncated.any() and "restarted" not in ok.info
    finally:
        env.close()


def test_partial_step_reports_other_envs_when_next_stepped() -> None:
    env = SubprocEnv("test_faulty", num_envs=3, options={"crash_at": 1}, plugins=[MOD])
    try:
        env.reset([0, 1, 2])
        res = env.step([0], np.zeros((1, 1), np.float32))
        assert res.info["restarted"] == [0]
        env.reset([2])  # a fresh episode supersedes the lost one
        res = env.step([1, 2], np.zeros((2, 1), np.float32))
        assert res.truncated.tolist() == [True, False]
        assert res.info["restarted"] == [1]
        assert res.obs.state[:, 0].tolist() == [0, 1]
    finally:
        env.close()


def test_hanging_slot_is_restarted_while_other_slot_keeps_stepping() -> None:
    good = SubprocEnv("test_faulty", num_envs=1, plugins=[MOD])
    bad = SubprocEnv("test_faulty", num_envs=1, options={"hang_at": 1}, step_timeout_s=2.0, plugins=[MOD])
    try:
        good.reset([0])
        bad.reset([0])
        out: dict[str, StepResult] = {}
        bad.step_async([0], np.zeros((1, 1), np.float32))
        waiter = threading.Thread(target=lambda: out.setdefault("bad", bad.step_wait()))
        waiter.start()
        good_steps = 0
        deadline = time.monotonic() + 60
        while waiter.is_alive() and time.monotonic() < deadline:
            r = good.step([0], np.zeros((1, 1), np.float32))
            assert "restarted" not in r.info
            good_steps += 1
            if r.terminated.any() or r.truncated.any():
                good.reset([0])
        waiter.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not waiter.is_alive(), "hung slot never came back"
        assert good_steps > 10, "the healthy slot did not keep stepping"
        res = out["bad"]
        assert res.truncated.all() and res.info["restarted"] == [0] and bad.restarts == 1
        assert "no answer" in res.info["error"]
        assert not _step_n(bad, 1)[0].truncated.any()
    finally:
        good.close()
        bad.close()


def test_build_failure_raises_with_child_traceback() -> None:
    with pytest.raises(EnvCrashed, match="build failed on purpose"):
        SubprocEnv("test_faulty", num_envs=1, options={"fail_build": True}, plugins=[MOD])


def test_child_exits_when_parent_dies(tmp_path) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    parent = ctx.Process(target=_make_env_and_report_pid, args=(q,))
    parent.start()
    child_pid = q.get(timeout=120)
    parent.kill()
    parent.join(10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(child_pid):
        time.sleep(0.05)  # polling a pid with a deadline, not synchronising on sleep
    assert not _alive(child_pid), "child outlived its parent"


def _make_env_and_report_pid(q) -> None:  # runs in a spawned "parent"
    env = SubprocEnv("test_faulty", num_envs=1, plugins=[MOD])
    q.put(env.pid)
    threading.Event().wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_guarded_env_rebuilds_in_process() -> None:
    env = GuardedEnv("test_faulty", num_envs=2, options={"crash_at": 2})
    env.reset([0, 1])
    env.step([0, 1], np.zeros((2, 1), np.float32))
    res = env.step([0, 1], np.zeros((2, 1), np.float32))
    assert res.truncated.all() and res.info["restarted"] == [0, 1] and env.restarts == 1
    env.close()


SHARED_TRACKER = r"""
import os, sys
from pathlib import Path
import numpy as np
from rlvla3.shm import ShmPool, observation_block
from workers.envs.subproc import SubprocEnv

env = SubprocEnv("test_faulty", num_envs=2, plugins=["tests.test_subproc_env"])
pool = ShmPool(f"tracker{os.getpid()}", 1 << 16)
block = observation_block(pool, env.spec.cameras, env.spec.state_dim, 2)
env.reset([0, 1], [1, 2], into=block)
res = env.step([0, 1], np.zeros((2, 1), np.float32), into=block)
assert block.state[:, 0].tolist() == [1, 1], block.state
env.close()  # the child attached both pools, and has exited
assert Path("/dev/shm", pool.name).exists(), "the child's exit unlinked its parent's segment"
pool.close()
print("done", pool.name)
"""


def test_a_spawned_child_attaching_its_parents_memory_leaves_the_shared_tracker_alone() -> None:
    """The env child shares its parent's resource_tracker (spawn passes it on). Attaching must not
    touch it: unregistering there dropped the parent's own registration, and the parent's unlink
    then made the tracker print a KeyError traceback for each segment."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", SHARED_TRACKER], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = proc.stdout.split()[-1]
    assert not Path("/dev/shm", name).exists()
    assert "Traceback" not in proc.stderr and "KeyError" not in proc.stderr, proc.stderr[-3000:]


PLUGIN_JOB = """
run: {name: plugin, mode: async, total_env_steps: 300, progress_every_s: 1.0}
env: {name: test_faulty, plugins: [tests.test_subproc_env], num_envs: 4, slots: 2, fragment_len: 8}
model: {family: mlp, chunk_size: 1, options: {hidden: 16}}
algo: {name: ppo, batch_steps: 64, epochs: 1, minibatch_size: 32}
workers: {simulators: 1, generators: 1, trainers: 1}
"""


def _plugin_job(tmp_path: Path, plugins: bool = True) -> str:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(PLUGIN_JOB if plugins else PLUGIN_JOB.replace("plugins: [tests.test_subproc_env], ", ""))
    return str(cfg)


@pytest.mark.parametrize("parallel", ["process", "thread"])
def test_a_run_steps_an_adapter_that_env_plugins_registers(tmp_path, parallel: str) -> None:
    """``env.plugins`` is imported wherever the env is built or its spec read: the launcher's
    check, the simulator (and each slot's child), the trainer and the generator."""
    r = run_cli("run", _plugin_job(tmp_path), "--run-dir", str(tmp_path / "run"), "--set", f"env.parallel={parallel}",
                cwd=ROOT, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["env_steps"] >= 300 and summary["policy_version"] >= 1 and summary["successes"] > 0, summary


def test_a_run_whose_env_no_plugin_registers_is_refused_before_it_starts(tmp_path) -> None:
    cfg = _plugin_job(tmp_path, plugins=False)
    r = run_cli("run", cfg, "--run-dir", str(tmp_path / "run"), cwd=ROOT, timeout=60)
    assert r.returncode != 0 and "unknown env 'test_faulty'" in r.stderr and "env.plugins" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # nothing started
    r = run_cli("run", cfg, "--set", "env.plugins=[tests.no_such_plugin]", cwd=ROOT, timeout=60)
    assert r.returncode != 0 and "No module named 'tests.no_such_plugin'" in r.stderr, r.stderr[-2000:]
    (tmp_path / "broken_plugin.py").write_text("raise RuntimeError('broken on purpose')\n")
    r = run_cli("run", cfg, "--set", "env.plugins=[broken_plugin]", cwd=tmp_path, timeout=60)  # found in the job's directory
    assert r.returncode != 0 and "importing 'broken_plugin' failed: RuntimeError('broken on purpose')" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
