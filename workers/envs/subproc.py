"""Run an env adapter in a child process: parallel CPU simulation and fault isolation.

A CPU simulator (MuJoCo, SAPIEN on CPU) holds the GIL and one core per step, so the simulator
worker runs one :class:`SubprocEnv` per slot and the slots step in parallel across cores. The
process boundary is also the fault boundary: a simulator that raises, segfaults or hangs past
``step_timeout_s`` is killed and rebuilt on its own; the episodes it held are reported truncated
with a fresh reset observation (``info["restarted"]``), a restart counter goes up, and the
caller goes on.

The child writes its observations straight into the caller's rows of shared memory (the
simulator's slot block, located with :func:`rlvla3.shm.block_refs`); only rewards, flags and
instructions cross the pipe. A caller without a shared-memory block gets a copy out of this
env's own block.

The child is a local ``spawn`` process talking over a pipe; nothing from the network crosses it.
It exits when its parent dies (a watchdog thread waits on the parent's sentinel) and is killed
on :meth:`SubprocEnv.close`, on garbage collection and at interpreter exit.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

import numpy as np
import structlog

from rlvla3.observation import Observation
from rlvla3.protocol import ShmRef
from rlvla3.shm import ShmAttachments, ShmPool, block_refs, observation_block
from workers.envs.base import EnvAdapter, EnvSpec, StepResult, make_env

log = structlog.get_logger()

_RESEED_STRIDE = 1_000_003  # a rebuilt child draws fresh episodes, not the ones that crashed


class EnvCrashed(RuntimeError):
    """The env in the child raised, died or hung; carries the child's traceback text."""


# ---------------------------------------------------------------------------------------------
# Child side
# ---------------------------------------------------------------------------------------------


def _watch_parent() -> None:
    parent = mp.parent_process()
    if parent is None:
        return
    wait([parent.sentinel])
    os._exit(0)  # parent gone: leave at once, no cleanup that could hang


def _child_main(conn: Connection, name: str, num_envs: int, seed: int, options: dict[str, Any] | None,
                plugins: Sequence[str]) -> None:
    threading.Thread(target=_watch_parent, daemon=True, name="parent-watchdog").start()
    try:
        env = make_env(name, num_envs=num_envs, seed=seed, options=options, plugins=plugins)
        conn.send(("ok", env.spec))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        conn.send(("err", traceback.format_exc()))
        return
    att = ShmAttachments()
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            break
        if cmd == "close":
            break
        try:
            *call, refs = args
            views = {name: att.array(ref) for name, ref in refs.items()}
            into = Observation.from_tensors(views, [""] * len(views["state"]))
            ids = call[0]
            res: StepResult | None = None
            if cmd == "reset":
                env.reset(ids, call[1], into)
            elif cmd == "step":
                res = env.step(ids, call[1], into)
                res.obs = None  # it is in the caller's block already
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", (res, [into.instruction[i] for i in ids])))
        except BaseException:  # noqa: BLE001
            conn.send(("err", traceback.format_exc()))
    try:
        env.close()
    finally:
        att.close()
        conn.close()


# ---------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------


class _Child:
    """One child process and its pipe; kill() is always safe."""

    def __init__(self, ctx: Any, name: str, num_envs: int, seed: int, options: dict[str, Any] | None,
                 plugins: Sequence[str]) -> None:
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=_child_main,
            args=(child_conn, name, num_envs, seed, options, tuple(plugins)),
            daemon=True,  # multiprocessing kills daemons at interpreter exit
            name=f"env-{name}",
        )
        self.proc.start()
        child_conn.close()

    def request(self, cmd: str, args: tuple) -> None:
        self.conn.send((cmd, args))

    def result(self, timeout: float | None) -> Any:
        """The child's answer, or EnvCrashed if it raised, died or took longer than ``timeout``."""
        ready = wait([self.conn, self.proc.sentinel], timeout)
        if not ready:
            raise EnvCrashed(f"no answer within {timeout:.1f}s (hung)")
        if self.conn in ready or self.conn.poll():
            try:
                status, payload = self.conn.recv()
            except (EOFError, OSError) as exc:
                raise EnvCrashed(f"child died (exit code {self.proc.exitcode}): {exc}") from None
            if status == "err":
                raise EnvCrashed(payload)
            return payload
        self.proc.join(0.1)
        raise EnvCrashed(f"child died (exit code {self.proc.exitcode})")

    def close(self, timeout: float = 5.0) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("close", ()))
            except (OSError, ValueError):
                pass
            self.proc.join(timeout)
        self.kill()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)
        self.conn.close()


def _kill_quietly(child: _Child) -> None:
    try:
        child.kill()
    except Exception:  # noqa: BLE001 - finalizer must not raise
        pass


class SubprocEnv(EnvAdapter):
    """A registered adapter, built and stepped in a child process that is rebuilt on faults.

    ``step_async``/``step_wait`` let one thread drive several slots' children at once.
    ``plugins`` (``env.plugins``) are imported in the child before building: adapters registered
    outside ``workers.envs``.
    """

    def __init__(
        self,
        name: str,
        num_envs: int,
        seed: int = 0,
        options: dict[str, Any] | None = None,
        *,
        step_timeout_s: float = 30.0,
        reset_timeout_s: float | None = None,
        start_timeout_s: float = 300.0,
        max_consecutive_restarts: int = 3,
        plugins: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.num_envs = num_envs
        self.seed = seed
        self.options = dict(options or {})
        self.step_timeout_s = float(step_timeout_s)
        self.reset_timeout_s = float(reset_timeout_s if reset_timeout_s is not None else max(60.0, 4 * step_timeout_s))
        self.start_timeout_s = float(start_timeout_s)
        self.max_consecutive_restarts = max_consecutive_restarts
        self.plugins = tuple(plugins)
        self.restarts = 0
        """How many times the child was rebuilt after a fault."""
        self._ctx = mp.get_context("spawn")
        self._child: _Child | None = None
        self._finalizer: weakref.finalize | None = None
        self._pending: tuple[tuple, float] | None = None
        # envs whose episode was lost in a restart but not yet reported: id -> fresh obs
        self._lost: dict[int, Observation] = {}
        self.spec: EnvSpec = self._start(seed)
        # Where the child writes when the caller's rows are not in shared memory, and restarts.
        n = self.blank().to_tensors()
        self._pool = ShmPool("env", sum(a.nbytes + 64 for a in n.values()) + 64)
        self._own = observation_block(self._pool, self.spec.cameras, self.spec.state_dim, num_envs)
        self._located: dict[int, tuple[Observation, dict[str, ShmRef]]] = {}  # id(block) -> (block, its descriptors)

    # -- lifecycle ---------------------------------------------------------------------------

    def _start(self, seed: int) -> EnvSpec:
        if self._finalizer is not None:
            self._finalizer.detach()  # the previous child is already dead
        child = _Child(self._ctx, self.name, self.num_envs, seed, self.options, self.plugins)
        self._child = child
        self._finalizer = weakref.finalize(self, _kill_quietly, child)
        try:
            return child.result(self.start_timeout_s)
        except EnvCrashed:
            child.kill()
            raise

    def _restart(self, reason: str) -> Observation:
        """Kill the child, build a new one and reset all its envs (into this env's own block,
        never the caller's); returns the fresh obs."""
        assert self._child is not None
        self._child.kill()
        for attempt in range(1, self.max_consecutive_restarts + 1):
            self.restarts += 1
            log.warning("env_restart", env=self.name, restarts=self.restarts, attempt=attempt,
                        reason=reason.strip().splitlines()[-1][:300] if reason.strip() else "")
            try:
                self._start(self.seed + _RESEED_STRIDE * self.restarts)
                ids = list(range(self.num_envs))
                self._child.request("reset", (ids, None, self._target(None)[1]))  # type: ignore[union-attr]
                _, instr = self._child.result(self.reset_timeout_s)  # type: ignore[union-attr]
                _set_instructions(self._own, ids, instr)
                return self._own
            except EnvCrashed as exc:
                reason = str(exc)
                if self._child is not None:
                    self._child.kill()
        raise EnvCrashed(f"{self.name}: {self.max_consecutive_restarts} restarts in a row failed; last: {reason}")

    def close(self) -> None:
        if self._child is not None:
            self._child.close()
            if self._finalizer is not None:
                self._finalizer.detach()
            self._child = None
        self._own = None  # type: ignore[assignment]
        self._pool.close()

    @property
    def pid(self) -> int | None:
        """The child's process id (for tests and diagnostics)."""
        return self._child.proc.pid if self._child is not None else None

    # -- reset -------------------------------------------------------------------------------

    def reset(self, ids: Sequence[int], seeds: Sequence[int | None] | None = None,
              into: Observation | None = None) -> Observation:
        ids = [int(i) for i in ids]
        for i in ids:
            self._lost.pop(i, None)  # a fresh episode supersedes a lost one
        assert self._child is not None, "env is closed"
        target, refs = self._target(into)
        for attempt in range(self.max_consecutive_restarts + 1):
            try:
                self._child.request("reset", (ids, seeds, refs))
                _, instr = self._child.result(self.reset_timeout_s)
                _set_instructions(target, ids, instr)
                return self._answer(target, ids, into)
            except (EnvCrashed, OSError) as exc:
                if attempt == self.max_consecutive_restarts:
                    raise
                fresh = self._restart(str(exc))
                self._mark_lost(fresh, exclude=ids)
        raise AssertionError("unreachable")

    # -- step --------------------------------------------------------------------------------

    def step_async(self, ids: Sequence[int], actions: np.ndarray, into: Observation | None = None) -> None:
        """Send a step to the child; collect it with :meth:`step_wait`."""
        assert self._child is not None, "env is closed"
        assert self._pending is None, "step_async called twice without step_wait"
        ids = [int(i) for i in ids]
        actions = np.asarray(actions, dtype=np.float32)
        live = [k for k, i in enumerate(ids) if i not in self._lost]
        target, refs = self._target(into)
        self._pending = ((ids, live, target, into), time.monotonic())
        if live:
            try:
                self._child.request("step", ([ids[k] for k in live], actions[live], refs))
            except OSError:
                pass  # a dead child is found and restarted in step_wait

    def step_wait(self) -> StepResult:
        assert self._pending is not None, "step_wait without step_async"
        (ids, live, target, into), t0 = self._pending
        self._pending = None
        n = len(ids)
        lost_now = [k for k in range(n) if k not in set(live)]
        res: StepResult | None = None
        error: str | None = None
        if live:
            assert self._child is not None
            remaining = max(0.0, self.step_timeout_s - (time.monotonic() - t0))
            try:
                res, instr = self._child.result(remaining)
                _set_instructions(target, [ids[k] for k in live], instr)
            except EnvCrashed as exc:
                error = str(exc)
                fresh = self._restart(error)
                self._mark_lost(fresh, exclude=())
                lost_now = list(range(n))
        if lost_now:
            res = self._merge(ids, live, res, lost_now, error, target)
        assert res is not None
        res.obs = self._answer(target, ids, into)
        return res

    def step(self, ids: Sequence[int], actions: np.ndarray, into: Observation | None = None) -> StepResult:
        self.step_async(ids, actions, into)
        return self.step_wait()

    # -- helpers -----------------------------------------------------------------------------

    def _target(self, into: Observation | None) -> tuple[Observation, dict[str, ShmRef]]:
        """Where the child writes, and its descriptors: the caller's rows when they are in
        shared memory, else this env's own block. A caller's block is located once."""
        for block in (into, self._own):
            if block is None:
                continue
            hit = self._located.get(id(block))
            if hit is None:
                refs = block_refs(block)
                if not all(refs.values()):
                    continue  # private memory: the child cannot write it
                if len(self._located) >= 8:
                    self._located.clear()
                hit = self._located[id(block)] = (block, refs)  # type: ignore[assignment]
            return hit
        raise AssertionError("this env's own block is in shared memory")

    def _answer(self, target: Observation, ids: list[int], into: Observation | None) -> Observation:
        """``into``, or a new batch of ``ids``, holding what the child wrote into ``target``."""
        if target is into:
            return into
        rows = target.select(ids)  # a copy out of our own block: callers without shared memory only
        if into is None:
            return rows
        into.assign(ids, rows)
        return into

    def _mark_lost(self, fresh: Observation, exclude: Sequence[int]) -> None:
        skip = set(exclude)
        for i in range(self.num_envs):
            if i not in skip:
                self._lost[i] = fresh.select([i])

    def _merge(self, ids: list[int], live: list[int], res: StepResult | None, lost: list[int],
               error: str | None, target: Observation) -> StepResult:
        """Report ``lost`` positions as truncated episodes, their fresh obs written into ``target``."""
        n = len(ids)
        lost_set = set(lost)
        live_pos = {k: j for j, k in enumerate(live)}
        reward = np.zeros(n, np.float32)
        terminated = np.zeros(n, bool)
        truncated = np.zeros(n, bool)
        success = np.zeros(n, bool)
        for k, i in enumerate(ids):
            if k in lost_set:
                target.assign([i], self._lost.pop(i))
                truncated[k] = True
            else:
                assert res is not None
                j = live_pos[k]
                reward[k], terminated[k] = res.reward[j], res.terminated[j]
                truncated[k], success[k] = res.truncated[j], res.success[j]
        info: dict[str, Any] = dict(res.info) if (res is not None and error is None) else {}
        info["restarted"] = [ids[k] for k in lost]
        info["restarts"] = self.restarts
        if error is not None:
            info["error"] = error.strip().splitlines()[-1][:500] if error.strip() else "crashed"
        return StepResult(reward, terminated, truncated, success, info)


def _set_instructions(target: Observation, ids: Sequence[int], instructions: Sequence[str]) -> None:
    for i, text in zip(ids, instructions):
        target.instruction[i] = text


class GuardedEnv(EnvAdapter):
    """In-process fault isolation for exceptions only (no hang or segfault protection).

    For simulators that must stay in the caller's process (a GPU-batched ManiSkill sharing one
    CUDA context): an exception rebuilds the adapter and reports every env truncated.
    """

    def __init__(self, name: str, num_envs: int, seed: int = 0, options: dict[str, Any] | None = None,
                 plugins: Sequence[str] = ()) -> None:
        self.name, self.num_envs, self.seed, self.options = name, num_envs, seed, dict(options or {})
        self.plugins = tuple(plugins)
        self.restarts = 0
        self._env = make_env(name, num_envs=num_envs, seed=seed, options=self.options, plugins=self.plugins)
        self.spec = self._env.spec

    def _rebuild(self, exc: BaseException) -> Observation:
        self.restarts += 1
        log.warning("env_restart", env=self.name, restarts=self.restarts, reason=repr(exc)[:300])
        try:
            self._env.close()
        except Exception:  # noqa: BLE001 - the old env is broken anyway
            pass
        self._env = make_env(self.name, num_envs=self.num_envs, seed=self.seed + _RESEED_STRIDE * self.restarts,
                             options=self.options, plugins=self.plugins)
        return self._env.reset(list(range(self.num_envs)), None)

    def reset(self, ids: Sequence[int], seeds: Sequence[int | None] | None = None,
              into: Observation | None = None) -> Observation:
        try:
            return self._env.reset(ids, seeds, into)
        except Exception as exc:  # noqa: BLE001
            self._rebuild(exc)
            return self._env.reset(ids, seeds, into)

    def step(self, ids: Sequence[int], actions: np.ndarray, into: Observation | None = None) -> StepResult:
        try:
            return self._env.step(ids, actions, into)
        except Exception as exc:  # noqa: BLE001
            fresh = self._rebuild(exc)
            ids = [int(i) for i in ids]
            n = len(ids)
            obs = fresh.select(ids)
            if into is not None:
                into.assign(ids, obs)
                obs = into
            return StepResult(
                np.zeros(n, np.float32), np.zeros(n, bool), np.ones(n, bool), np.zeros(n, bool),
                {"restarted": ids, "restarts": self.restarts, "error": repr(exc)[:500]}, obs,
            )

    def close(self) -> None:
        self._env.close()
