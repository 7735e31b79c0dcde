"""Helpers only tests need, beside the shared harness (``rlvla3/harness/``): a job per test in
a fresh run folder, commands run two at a time, hand-played generators that misbehave, videos."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from rlvla3.harness import jobs
from rlvla3.harness.peer import Peer

CI_CUT_S = 4.0
"""The partition tests' cut: twice the broker's liveness window (``rlvla3.harness.faults.LIVENESS``:
2 s), long enough to be a real partition, with room to detect it before the heal on a loaded machine."""


def last_json(stdout: str) -> Any:
    """The JSON object on the last line of a command's stdout (``rlvla3 run``'s summary, a bench's result)."""
    return json.loads(stdout.strip().splitlines()[-1])


def start_job(cfg: Any, tmp_path: Path, started: list[jobs.Job], workers: bool = True) -> jobs.Job:
    """``rlvla3.harness.jobs.start_job`` in a fresh run folder under ``tmp_path``, appended to
    ``started`` for the fixture to stop."""
    job = jobs.start_job(cfg, tmp_path / f"job{len(started)}", workers)
    started.append(job)
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


def join_as_generator(ctx: Any, endpoint: str, name: str, host: str = "elsewhere", pid: int = 1) -> Any:
    """A DEALER that joins ``endpoint`` as a generator with one credit: the test plays the
    generator by hand (``next_batch``, then RESULT or nothing). ``host``/``pid`` the host's own
    to read shared memory (the broker hands same-host peers descriptors)."""
    return Peer(ctx, endpoint, "generator", name, host=host, pid=pid, credits=1).sock


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


def child_env() -> dict[str, str]:
    """The environment of a test's child process: this repository first on PYTHONPATH, and whatever
    was there kept (the GPU machine's carried packages live in a site named there)."""
    root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
