"""Workers as schedulers start them: before their broker, and on nodes that may lack the devices
they are told to use.

- a worker started before its broker waits for it (``workers.broker_wait_s``) and joins once it
  listens;
- when the wait runs out, the worker leaves with one error line and exit code 1, no traceback;
- ``--gpus`` naming devices this machine does not show is refused before any worker starts,
  naming the devices it does show.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from rlvla3.lifetime import launcher_env

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rlvla3(*args: str, log: Path | None = None) -> subprocess.Popen:
    out = open(log, "wb") if log else subprocess.PIPE
    return subprocess.Popen([sys.executable, "-m", "rlvla3", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, **launcher_env()})


def test_a_worker_started_before_its_broker_joins_it(tmp_path: Path) -> None:
    url = f"tcp://127.0.0.1:{_free_port()}"
    worker = _rlvla3("worker", "--role", "generator", "--broker", url, "--set", "workers.broker_wait_s=120",
                     log=tmp_path / "generator.log")
    broker = None
    try:
        deadline = time.monotonic() + 60
        while b"broker_unreachable_retrying" not in (tmp_path / "generator.log").read_bytes():
            assert worker.poll() is None and time.monotonic() < deadline, (tmp_path / "generator.log").read_text()
            time.sleep(0.1)  # polling a log with a deadline
        broker = _rlvla3("broker", "--config", "configs/synthetic.yaml", "--bind", url, "--pub",
                         f"tcp://127.0.0.1:{_free_port()}", "--info-file", str(tmp_path / "broker.json"),
                         log=tmp_path / "broker.log")
        deadline = time.monotonic() + 90
        while b"worker_ready" not in (tmp_path / "generator.log").read_bytes():
            assert worker.poll() is None and time.monotonic() < deadline, (tmp_path / "generator.log").read_text()
            time.sleep(0.1)
        assert json.loads((tmp_path / "broker.json").read_text())["bind"]
    finally:
        for p in (worker, broker):
            if p is not None:
                p.terminate()
                p.wait(30)


def test_a_worker_gives_up_on_a_missing_broker_with_one_error_line() -> None:
    url = f"tcp://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "rlvla3", "--log-level", "warning", "worker", "--role", "simulator",
                           "--broker", url, "--set", "workers.broker_wait_s=2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert time.monotonic() - t0 < 60
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"simulator simulator0: no broker answered at {url} within 2 s (workers.broker_wait_s); "
                     "is it running, and are the address and keys right?"], proc.stderr


def test_gpus_this_machine_does_not_show_are_refused_before_anything_starts() -> None:
    proc = subprocess.run([sys.executable, "-m", "rlvla3", "worker", "--role", "generator", "--gpus", "62-63",
                           "--broker", f"tcp://127.0.0.1:{_free_port()}"],  # past every device, GPU machine or not
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(r"--gpus asks for devices \[62, 63\], but this machine shows (no CUDA device|CUDA devices \[0[\d, ]*\])",
                     proc.stderr), proc.stderr
    assert "worker_ready" not in proc.stderr and "broker_unreachable" not in proc.stderr  # no worker was started


def _generator(url: str, *sets: str) -> subprocess.Popen:
    """A generator that logs only warnings, its stderr kept for :func:`_one_error_line`."""
    args = [a for s in ("workers.broker_wait_s=60", *sets) for a in ("--set", s)]
    return subprocess.Popen([sys.executable, "-m", "rlvla3", "--log-level", "warning", "worker", "--role", "generator",
                             "--broker", url, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, **launcher_env()})


def _one_error_line(proc: subprocess.Popen, timeout: float) -> str:
    """The worker's exit code must be 1, its stderr free of tracebacks: the last line is its error."""
    _, err = proc.communicate(timeout=timeout)
    text = err.decode()
    assert proc.returncode == 1 and "Traceback" not in text, text
    return text.strip().splitlines()[-1]


def test_a_worker_override_naming_no_setting_is_refused_and_the_job_goes_on(tmp_path: Path) -> None:
    url = f"tcp://127.0.0.1:{_free_port()}"
    broker = _rlvla3("broker", "--config", "configs/synthetic.yaml", "--bind", url, "--pub",
                     f"tcp://127.0.0.1:{_free_port()}", log=tmp_path / "broker.log")
    try:
        line = _one_error_line(_generator(url, "algo.no_such_setting=3"), 120)
        assert line.startswith("generator: bad config override:") and "no_such_setting" in line, line
        assert broker.poll() is None, (tmp_path / "broker.log").read_text()
    finally:
        broker.terminate()
        broker.wait(30)


def test_a_job_config_this_worker_cannot_load_is_named_as_the_brokers(tmp_path: Path) -> None:
    """A broker of another rlvla3 version sends a section this one does not know: the worker says
    the broker's config is what failed, not an override it was never given."""
    import zmq

    from rlvla3 import protocol as P

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    worker = _generator(f"tcp://127.0.0.1:{port}")
    try:
        assert router.poll(90_000), "no READY from the worker"
        identity, *frames = router.recv_multipart()
        assert P.decode(frames).type == P.READY
        router.send_multipart([identity, *P.encode(P.READY, {
            "role": "broker", "host": "elsewhere", "pid": 1, "worker_id": 1, "run_id": "other-version",
            "config": {"telemetry": {"every_s": 5}}, "heartbeat_s": 1.0, "liveness": 3, "version": 0})])
        line = _one_error_line(worker, 120)
        assert line.startswith("generator: the broker's job config does not load here:") and "telemetry" in line, line
    finally:
        if worker.poll() is None:
            worker.kill()
        router.close(0)
        ctx.term()
