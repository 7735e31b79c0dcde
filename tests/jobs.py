"""Helpers for tests that run real jobs: a quick config, deadline polling, a job whose figures
tests can poll, and starting one in a fresh run dir."""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from rlvla3.app.launch import LocalJob
from rlvla3.observation import Observation

# Small and quick on a 2-core machine: few envs, short fragments, tiny updates.
FAST = (
    "env.num_envs=4", "env.slots=2", "env.fragment_len=8",
    "env.options.latency={kind: constant, mean_ms: 1.0}", "env.options.image_size=8",
    "algo.batch_steps=64", "algo.minibatch_size=32", "algo.epochs=1",
    "batching.max_batch=8", "batching.max_wait_ms=2", "model.options.hidden=32",
    "workers.simulators=1", "workers.generators=1", "workers.trainers=1",
)


def wait_until(fn: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``fn`` until it returns something truthy, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)  # polling with a deadline, not synchronising on a guess
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last={last!r}")


class TestJob(LocalJob):
    """A LocalJob whose figures tests can poll."""

    def fig(self) -> dict[str, Any]:
        return self.status()

    def wait(self, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            self.assert_alive()
            f = self.fig()
            return f if pred(f) else None

        return wait_until(check, timeout, what, interval=0.1)

    def assert_alive(self) -> None:
        for p in [self.broker_proc, *self.workers]:
            if p is not None and p.poll() is not None and p.returncode not in (0, -9, -15):
                logs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in self.run_dir.glob("*.log"))
                raise AssertionError(f"a process exited with {p.returncode}\n{logs}")

    def worker(self, fig: dict[str, Any], name: str) -> dict[str, Any] | None:
        return next((w for w in fig["per_worker"] if w["name"] == name), None)


def start_job(cfg: Any, tmp_path: Path, jobs: list[TestJob], start: bool = True) -> TestJob:
    """Write ``cfg`` into a fresh run dir under ``tmp_path``, start its broker (and its workers
    unless ``start`` is False) and append the job to ``jobs`` for the fixture to stop."""
    run_dir = tmp_path / f"job{len(jobs)}"
    run_dir.mkdir()
    cfg_path = run_dir / "config.yaml"
    cfg_path.write_text(cfg.to_yaml())
    job = TestJob(cfg, run_dir, cfg_path)
    jobs.append(job)
    job.start_broker("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    if start:
        job.start_all()
    return job


class ProcessPool:
    """Commands run in the background, ``at_once`` at a time in the order they were added, so a
    module's slow single-threaded subprocesses (model builds, exports) overlap one another and the
    tests that read them: on a 2-core CI machine the second core is otherwise idle. A test asks
    for its command's result; one not started yet starts then."""

    def __init__(self, at_once: int = 2) -> None:
        self.at_once = at_once
        self.pending: dict[str, tuple[list[str], dict[str, Any]]] = {}
        self.running: dict[str, tuple[subprocess.Popen, Any, Any]] = {}

    def add(self, key: str, argv: list[str], **popen: Any) -> None:
        """Queue ``argv`` under ``key`` (``popen``: ``cwd``, ``env``)."""
        self.pending[key] = (argv, popen)
        self._fill()

    def _start(self, key: str) -> None:
        argv, popen = self.pending.pop(key)
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # a full pipe would block it
        self.running[key] = (subprocess.Popen(argv, text=True, stdout=out, stderr=err, **popen), out, err)

    def _fill(self) -> None:
        while self.pending and len(self.running) < self.at_once:
            self._start(next(iter(self.pending)))

    def result(self, key: str, timeout: float = 600) -> tuple[int, str, str]:
        """The command's exit code, stdout and stderr, once it has ended."""
        if key not in self.running:
            self._start(key)
        proc, out, err = self.running.pop(key)
        try:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise
            out.seek(0)
            err.seek(0)
            return proc.returncode, out.read(), err.read()
        finally:
            out.close()
            err.close()
            self._fill()

    def close(self) -> None:
        self.pending.clear()
        for proc, out, err in self.running.values():
            proc.kill()
            proc.wait()
            out.close()
            err.close()
        self.running.clear()


def job_logs(job: TestJob) -> str:
    """The tail of every log in the job's run dir (for assertion messages)."""
    return "\n".join(f"--- {f.name}\n{f.read_text()[-2500:]}" for f in sorted(job.run_dir.glob("*.log")))


def robocasa_available() -> bool:
    """Whether robocasa can build envs here (its tests skip one way or the other)."""
    from workers.envs.robocasa import RoboCasaUnavailable, check_available

    try:
        check_available()
        return True
    except RoboCasaUnavailable:
        return False


def video_frames(path: Path) -> int:
    """Frames a written video decodes to (GIF through Pillow, MP4 through imageio's ffmpeg)."""
    if path.suffix == ".gif":
        from PIL import Image

        with Image.open(path) as im:
            return im.n_frames
    import imageio.v2 as iio

    with iio.get_reader(str(path), format="FFMPEG") as r:
        return sum(1 for _ in r)


def random_observation(spec: Any, n: int, rng: Any, instruction: str = "reach") -> Observation:
    """``n`` envs of random camera images and proprio state for an env spec (policy tests)."""
    return Observation({c: rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8) for c, (h, w) in spec.cameras.items()},
                       rng.uniform(-1, 1, (n, spec.state_dim)).astype(np.float32), [instruction] * n)


def join_as_generator(ctx: Any, endpoint: str, name: str, host: str = "elsewhere", pid: int = 1) -> Any:
    """A DEALER that joins ``endpoint`` as a generator with one credit: the test plays the
    generator by hand (``next_batch``, then RESULT or nothing). ``host``/``pid`` the host's own
    to read shared memory (the broker hands same-host peers descriptors)."""
    import zmq

    from rlvla3 import protocol as P

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart(P.encode(P.READY, {"role": "generator", "host": host, "pid": pid, "name": name, "credits": 1}))
    return sock


def next_batch(sock: Any, timeout_s: float = 60.0) -> Any:
    """The next BATCH on a hand-played generator's socket, heartbeating while it waits."""
    from rlvla3 import protocol as P

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(200):
            msg = P.decode(sock.recv_multipart())
            if msg.type == P.BATCH:
                return msg
        sock.send_multipart(P.encode(P.HEARTBEAT, {"credits": 1}))  # stay alive while waiting
    raise AssertionError(f"no BATCH within {timeout_s} s")
