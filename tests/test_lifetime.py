"""Process lifetime: a job dies with whatever started it, by any signal.

`rlvla3 run` killed with SIGKILL (even while its trainer is inside an update) and a bench script
killed while its job starts leave no process behind (resource_tracker included) and no
shared-memory segment of their run; Ctrl-C, SIGTERM and SIGHUP stop `rlvla3 run` cleanly within
15 s on a loaded machine, the trainer checkpointing first; a worker started by hand still outlives
its parent and its broker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlvla3.app.launch import request_status
from rlvla3.harness.jobs import per_worker
from rlvla3.lifetime import LAUNCHER_ENV, ORPHAN_GRACE_S, launcher_env
from rlvla3.shm import SHM_DIR, segments_of_run
from rlvla3.status_client import wait_until
from tests.machine_load import machine_alone, machine_folder, machine_load
from workers.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
GONE_WITHIN_S = 5.0
SMALL = ("env.num_envs=4", "env.slots=2", "env.fragment_len=8", "env.options.image_size=8",
         "env.options.latency={kind: constant, mean_ms: 1.0}",
         "workers.simulators=1", "workers.generators=1", "workers.trainers=1",
         "broker.liveness=30")  # a loaded 2-core machine can starve a process for seconds: not what these test
SLOW_UPDATES = ("algo.batch_steps=128", "algo.minibatch_size=8", "algo.epochs=400")
"""Updates of several seconds: a kill lands inside one."""


# ---------------------------------------------------------------------------------------------
# /proc helpers: a process is (pid, start time), so a reused pid is not mistaken for it
# ---------------------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of a live or zombie process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[1]), int(fields[19])


def _running(pid: int) -> bool:
    """Still running (a zombie has ended; only its parent has not reaped it)."""
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def _ends_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.05)  # polling /proc with a deadline
    return not _running(pid)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _threads(pid: int) -> list[str]:
    """Each thread's state and kernel wait channel (what a process that will not end is doing)."""
    out = []
    try:
        for t in Path(f"/proc/{pid}/task").iterdir():
            out.append(f"{(t / 'stat').read_text().rsplit(')', 1)[1].split()[0]}:{(t / 'wchan').read_text()}")
    except OSError:
        pass
    return out


def _tail(log: Path, lines: int = 6) -> list[str]:
    """The last lines of a worker's log (what it did before it would not end)."""
    try:
        return log.read_text().splitlines()[-lines:]
    except OSError:
        return []


def descendants(root: int) -> dict[tuple[int, int], str]:
    """Every process below ``root`` now: (pid, start time) -> command line."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[0] != "Z":
                children.setdefault(st[1], []).append((int(entry), st[2]))
    out: dict[tuple[int, int], str] = {}
    todo = [root]
    while todo:
        for key in children.get(todo.pop(), []):
            out[key] = _cmdline(key[0])
            todo.append(key[0])
    return out


def alive(procs: dict[tuple[int, int], str]) -> dict[tuple[int, int], str]:
    """Those of ``procs`` still running (a zombie has ended; only its parent has not reaped it)."""
    out = {}
    for (pid, start), cmd in procs.items():
        st = _stat(pid)
        if st is not None and st[0] != "Z" and st[2] == start:
            out[(pid, start)] = cmd
    return out


def assert_all_gone(procs: dict[tuple[int, int], str], run_id: str, logs: Path) -> None:
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline and (alive(procs) or segments_of_run(run_id)):
        time.sleep(0.05)  # polling /proc and /dev/shm with a deadline
    left, segs = alive(procs), segments_of_run(run_id)
    if left or segs:
        states = {pid: _threads(pid) for (pid, _) in left}
        for (pid, _), _cmd in left.items():  # do not leak them into the next test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for seg in segs:
            (SHM_DIR / seg).unlink(missing_ok=True)
        tails = "\n".join(f"--- {f.name}\n{f.read_text()[-1500:]}" for f in sorted(logs.rglob("*.log")))
        raise AssertionError(f"{GONE_WITHIN_S:.0f} s after the kill: still running {sorted(left.values())} "
                             f"(threads: state, wchan {states}), segments {segs}\n{tails}")


def start_run(run_dir: Path, *overrides: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "rlvla3", "run", "configs/synthetic.yaml", "--steps", "100000000",
            "--run-dir", str(run_dir)]
    for o in (*SMALL, *overrides):
        args += ["--set", o]
    # SIGHUP at its default, as under a terminal: a suite started under nohup ignores it, and
    # `rlvla3 run` keeps an ignored SIGHUP ignored (on purpose), which would void the SIGHUP cases.
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **launcher_env()},
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))


def broker_of(run_dir: Path, proc: subprocess.Popen, timeout: float = 120) -> dict:
    def info() -> dict | None:
        assert proc.poll() is None, f"rlvla3 run exited with {proc.returncode}: {proc.stderr.read()[-3000:]}"
        try:
            return json.loads((run_dir / "broker.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    return wait_until(info, timeout, "the broker's info file")


def inside_update(fig: dict, batch_steps: int) -> bool:
    """The trainer announced a batch (TRAIN begin) whose update has not ended: the broker counts
    that batch consumed (``admission.consumed``) before the trainer's version moves on."""
    adm = fig.get("admission") or {}
    return adm.get("consumed", 0) >= (adm.get("version", 0) + 1) * batch_steps


def kill_quietly(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()


# ---------------------------------------------------------------------------------------------
# SIGKILL of the launcher
# ---------------------------------------------------------------------------------------------


def test_sigkill_run_while_the_trainer_updates_leaves_nothing(tmp_path: Path):
    run_dir = tmp_path / "run"
    proc = start_run(run_dir, *SLOW_UPDATES)
    try:
        info = broker_of(run_dir, proc)
        run_id = info["run_id"]

        def mid_update() -> dict | None:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                fig = request_status(info["bind"], timeout_s=2.0)
            except TimeoutError:
                return None
            ok = fig["workers"]["trainer"] == 1 and inside_update(fig, 128) and segments_of_run(run_id)
            return fig if ok else None

        wait_until(mid_update, 240, "the trainer inside an update, the simulator's segments in /dev/shm", 0.5)
        procs = descendants(proc.pid)
        roles = " ".join(procs.values())
        for what in ("broker", "--role simulator", "--role generator", "--role trainer", "resource_tracker"):
            assert what in roles, f"{what} not among the job's processes: {sorted(procs.values())}"
        assert inside_update(request_status(info["bind"], timeout_s=5.0), 128), "the update ended before the kill"
        proc.kill()
        proc.wait(10)
        assert_all_gone(procs, run_id, run_dir)
        # The trainer was stuck in its update: it was forced out once its grace was over.
        assert "forced_exit" in (run_dir / "trainer0.log").read_text()
    finally:
        kill_quietly(proc)


def test_a_stuck_simulator_unlinks_its_shared_memory_before_it_is_forced_out(tmp_path: Path):
    run_dir = tmp_path / "run"
    proc = start_run(run_dir, "env.options.latency={kind: constant, mean_ms: 0.0}", "env.options.hang_on_step=1")
    try:
        info = broker_of(run_dir, proc)
        sim = wait_until(lambda: next((k for k, cmd in descendants(proc.pid).items() if "--role simulator" in cmd), None),
                         120, "the simulator process")

        def hung() -> bool:  # a slot thread asleep in its (hour-long) first step, pools allocated
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            tasks = Path(f"/proc/{sim[0]}/task")
            try:
                chans = [(t / "wchan").read_text() for t in tasks.iterdir()]
            except (FileNotFoundError, ProcessLookupError):
                return False
            return "hrtimer_nanosleep" in chans and bool(segments_of_run(info["run_id"]))

        wait_until(hung, 120, "a simulator slot stuck in a step", 0.2)
        procs = descendants(proc.pid)
        proc.kill()
        proc.wait(10)
        assert_all_gone(procs, info["run_id"], run_dir)
        log = (run_dir / "simulator0.log").read_text()
        assert "forced_exit" in log, log[-3000:]  # teardown waited on the stuck slot: forced out ...
        assert "leaked shared_memory" not in log, log[-3000:]  # ... having unlinked its pools itself
    finally:
        kill_quietly(proc)


def test_sigkill_bench_while_its_job_starts_leaves_nothing(tmp_path: Path):
    args = [sys.executable, "bench/jobs/ablation.py", "--quick", "--sims", "2", "--envs", "4", "--slots", "2",
            "--batch-steps", "64", "--train-cost", "0", "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path), **launcher_env()})
    try:
        def job_up() -> tuple[Path, str] | None:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            for info in tmp_path.glob("rlvla3-ablation-*/sync/broker.json"):
                try:
                    run_id = json.loads(info.read_text())["run_id"]
                except (json.JSONDecodeError, KeyError):
                    return None
                # both simulators own their pools: the job is still warming up
                pools = [s for s in segments_of_run(run_id) if not s.split("_")[3].startswith("w")]  # not the weight store
                if len({s.split("_")[2] for s in pools}) == 2:
                    return info.parent, run_id
            return None

        run_dir, run_id = wait_until(job_up, 180, "the bench job's simulators holding shared memory", 0.1)
        procs = descendants(proc.pid)
        roles = " ".join(procs.values())
        for what in ("broker", "--role simulator", "--role generator", "--role trainer", "resource_tracker"):
            assert what in roles, f"{what} not among the bench's processes: {sorted(procs.values())}"
        proc.kill()
        proc.wait(10)
        assert_all_gone(procs, run_id, run_dir)
    finally:
        kill_quietly(proc)


def launched_by_sh(code: str, log: Path) -> subprocess.Popen:
    """``python -c code`` in the background of a ``sh`` that is its launcher (the child follows
    it), output to ``log``; the shell prints the child's pid and waits."""
    return subprocess.Popen(["sh", "-c", f'{LAUNCHER_ENV}=$$ "{sys.executable}" -c "$0" >"{log}" 2>&1 & echo $!; wait', code],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if k != LAUNCHER_ENV})


STUCK_ORPHAN = """
import signal, sys, time
from rlvla3.lifetime import follow_launcher, on_stop_signals
follow_launcher()
on_stop_signals(lambda: None)  # stuck, as in a torch op: it never looks at the stop flag
def second_signal(frame, event, arg):
    # A second SIGTERM lands while the stop handler is inside a call its own calls made:
    # raise_signal runs the handler again right there, as a signal arriving then would.
    if event == "call":
        f, depth = frame.f_back, 1
        while f is not None and not (f.f_code.co_name == "handler" and f.f_code.co_filename.endswith("lifetime.py")):
            f, depth = f.f_back, depth + 1
        if f is not None and depth >= 2:
            signal.raise_signal(signal.SIGTERM)
sys.settrace(second_signal)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def test_a_second_stop_signal_inside_the_handler_does_not_keep_an_orphan_alive(tmp_path: Path):
    """`pkill -f` hit a bench script and its `rlvla3 run` together: the run's stop handler, already
    orphaned, got the second SIGTERM while it armed the forced exit under a lock, and waited on
    that lock for good, its workers long gone. Here the second signal is raised at every function
    the handler's own calls enter, and the stuck orphan must still be forced out in time."""
    log = tmp_path / "orphan.log"
    shell = launched_by_sh(STUCK_ORPHAN, log)
    pid = int(shell.stdout.readline())
    try:
        wait_until(lambda: log.is_file() and "ready" in log.read_text(), 60, "the child following its launcher")
        shell.kill()  # the launcher dies: the parent-death SIGTERM starts it all
        shell.wait(10)
        assert _ends_within(pid, ORPHAN_GRACE_S + GONE_WITHIN_S), \
            f"the orphan is still running (threads: state, wchan {_threads(pid)})"
        assert "forced_exit" in log.read_text(), log.read_text()[-2000:]
    finally:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
        kill_quietly(shell)


FORKED_COPY = """
import os, time
from rlvla3.lifetime import follow_launcher, on_stop_signals
follow_launcher()
on_stop_signals(lambda: None)  # stuck: only a forced exit ends it
pid = os.fork()
print("copy" if pid == 0 else f"parent {pid}", flush=True)
while True:
    time.sleep(0.05)
"""


def test_a_forked_copy_is_forced_out_on_its_own_and_leaves_its_parent_alone(tmp_path: Path):
    """A copy made by fork() (no exec) keeps the stop handler but not the forced-exit thread, and
    its parent is not its launcher, so it counts as orphaned: its SIGTERM must force out the copy,
    not write to the parent's pipe and end the parent."""
    log = tmp_path / "fork.log"
    shell = launched_by_sh(FORKED_COPY, log)
    parent = 0
    copy = 0
    try:
        def pids() -> tuple[int, int] | None:
            lines = log.read_text().split() if log.is_file() else []
            if "copy" not in lines or "parent" not in lines:
                return None
            p = int(lines[lines.index("parent") + 1])  # the forked copy's pid, printed by its parent
            return (_stat(p) or (0, 0))[1], p
        parent, copy = wait_until(pids, 60, "the process and its forked copy")
        os.kill(copy, signal.SIGTERM)
        assert _ends_within(copy, ORPHAN_GRACE_S + GONE_WITHIN_S), f"the forked copy is still running\n{log.read_text()}"
        assert "forced_exit" in log.read_text(), log.read_text()
        # a forced exit of the parent would come within its grace
        assert not _ends_within(parent, ORPHAN_GRACE_S + 1.0), f"the copy's SIGTERM ended its parent\n{log.read_text()}"
    finally:
        for pid in (copy, parent):
            if pid and _running(pid):
                os.kill(pid, signal.SIGKILL)
        kill_quietly(shell)


# ---------------------------------------------------------------------------------------------
# SIGTERM (preemption) and SIGHUP (a closed terminal)
# ---------------------------------------------------------------------------------------------


STOP_UNDER_LOAD_S = 15.0
"""Ctrl-C, SIGTERM and SIGHUP end the whole job, checkpoint written, within this, even with the
machine loaded (:func:`tests.machine_load.machine_load`)."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@pytest.fixture(scope="module")
def stopped_under_load(tmp_path_factory) -> dict[int, dict]:
    """One job per stop signal, started together and trained; then, under 4 busy processes per
    core and fsync'd 256 MB writes (as beside a package build, a plot or the interpreter's
    teardown each take tens of seconds: the stop must wait for neither), each job gets its signal
    at the same moment. Per signal: the job's run folder, the broker's info, the processes it had,
    how long it took to stop, its exit code and output, or why it did not stop. Started together,
    the jobs share one start-up and one load; stopping together, each stops under more load than
    one alone."""
    base = tmp_path_factory.mktemp("stops")
    jobs = {sig: {"run_dir": base / signal.Signals(sig).name} for sig in STOP_SIGNALS}
    try:
        for job in jobs.values():
            job["proc"] = start_run(job["run_dir"], "algo.batch_steps=64", "algo.minibatch_size=32", "algo.epochs=1")
        for job in jobs.values():
            job["info"] = broker_of(job["run_dir"], job["proc"])

        def trained(job: dict) -> bool:
            assert job["proc"].poll() is None, job["proc"].stderr.read()[-3000:]
            try:
                return request_status(job["info"]["bind"], timeout_s=2.0)["policy_version"] >= 1
            except TimeoutError:
                return False

        for job in jobs.values():
            wait_until(lambda: trained(job), 240, "a first policy version", 0.5)
        for job in jobs.values():
            job["procs"] = descendants(job["proc"].pid)
        # the load, with the machine to ourselves: it would starve a test beside it
        with machine_alone(machine_folder(tmp_path_factory)), machine_load(STOP_UNDER_LOAD_S + 10):
            time.sleep(2.0)  # the load takes hold before the stop
            t0 = time.monotonic()
            for sig, job in jobs.items():
                job["proc"].send_signal(sig)

            def stop(sig: int) -> None:
                job = jobs[sig]
                try:
                    job["out"], job["err"] = job["proc"].communicate(timeout=max(0.0, t0 + STOP_UNDER_LOAD_S - time.monotonic()))
                    job["took"] = time.monotonic() - t0
                    sys.stdout.write(f"{signal.Signals(sig).name}: the job stopped {job['took']:.1f} s after the signal, under load\n")
                except subprocess.TimeoutExpired:
                    job["stuck"] = (f"rlvla3 run still running {STOP_UNDER_LOAD_S:.0f} s after {signal.Signals(sig).name} "
                                    f"under load; threads: {_threads(job['proc'].pid)}; still alive: "
                                    f"{sorted(alive(job['procs']).values())}; trainer log tail: "
                                    f"{_tail(job['run_dir'] / 'trainer0.log')}")

            threads = [threading.Thread(target=stop, args=(sig,)) for sig in jobs]  # each job's pipes drained at once
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        for job in jobs.values():
            if "proc" in job:
                kill_quietly(job["proc"])
    return jobs


@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=[signal.Signals(s).name for s in STOP_SIGNALS])
def test_stop_signals_end_run_cleanly_with_a_checkpoint_under_load(stopped_under_load: dict[int, dict], sig: int):
    job = stopped_under_load[sig]
    if "stuck" in job:
        raise AssertionError(job["stuck"])
    run_dir, procs = job["run_dir"], job["procs"]
    assert job["proc"].returncode == 0, job["err"][-3000:]
    summary = json.loads(job["out"].strip().splitlines()[-1])
    assert summary["reason"] == "interrupted" and summary["shm_leftovers"] == 0, summary
    assert not alive(procs), sorted(alive(procs).values())
    assert not segments_of_run(job["info"]["run_id"])
    assert job["took"] < STOP_UNDER_LOAD_S
    # The trainer was told to stop (not killed) and checkpointed on its way out: --resume works.
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None, (run_dir / "trainer0.log").read_text()[-3000:]
    assert "checkpoint_saved" in (run_dir / "trainer0.log").read_text()


# ---------------------------------------------------------------------------------------------
# Started by hand: unchanged
# ---------------------------------------------------------------------------------------------


def test_hand_started_worker_outlives_its_parent_and_its_broker(job_factory, tmp_path: Path):
    job = job_factory("workers.simulators=0")
    env = {k: v for k, v in os.environ.items() if k != LAUNCHER_ENV}
    log = tmp_path / "byhand.log"
    # A shell starts the worker in the background and exits at once: the worker's parent is gone.
    shell = subprocess.run(
        ["sh", "-c", f'"{sys.executable}" -m rlvla3 worker --role simulator --broker {job.endpoint} '
                     f'--name byhand --num-envs 2 --slots 1 >"{log}" 2>&1 & echo $!'],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30, check=True)
    pid = int(shell.stdout.strip())
    try:
        job.wait(lambda f: (per_worker(f, "byhand").get("env_steps") or 0) > 0, 120,
                 "the hand-started simulator stepping after its parent exited")
        job.broker_proc.send_signal(signal.SIGKILL)
        job.broker_proc.wait(10)
        wait_until(lambda: "broker_silent_reconnecting" in log.read_text(), 60, "the worker noticing the broker gone")
        assert _running(pid), f"the hand-started worker died with its broker\n{log.read_text()[-2000:]}"
        job.start_broker(job.endpoint, None)  # the same address: the worker re-joins
        job.wait(lambda f: (per_worker(f, "byhand").get("env_steps") or 0) > 0, 120,
                 "the hand-started simulator re-joined the restarted broker")
    finally:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        wait_until(lambda: not _running(pid), 30, "the hand-started worker stopping")
    assert "worker_stopped" in log.read_text(), job.logs()
