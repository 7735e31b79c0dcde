"""Starting processes: the broker and workers as real OS processes (``LocalJob``), stopping them
in order, and asking a broker for STATUS or a new batching rule.

``rlvla3 run`` (``rlvla3/app/run.py``) is nothing more than what a user would do by hand on
several machines - ``rlvla3 broker`` and ``rlvla3 worker --role ...`` - started on this one,
plus a progress display that asks the broker for STATUS.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import structlog
import zmq

from rlvla3 import auth
from rlvla3 import protocol as P
from rlvla3.config import JobConfig
from rlvla3.lifetime import STOP_TIMEOUT_S, launcher_env, stop_timeout_s

log = structlog.get_logger()


def python_cmd(*args: str) -> list[str]:
    """``python -m rlvla3 ...``: ``rlvla3/__main__.py`` follows the launcher before anything else."""
    return [sys.executable, "-m", "rlvla3", *args]


def spawn(args: list[str], log_path: Path | None = None, env: dict[str, str] | None = None,
          wrap: list[str] = ()) -> subprocess.Popen:
    """Start one rlvla3 process that ends with this one (``rlvla3/lifetime.py``); its stderr (the
    structlog stream) goes to ``log_path``. Main thread only. The child gets its own session, so
    a terminal's Ctrl-C or hang-up reaches only this launcher, which then stops its children in
    order (:func:`stop_processes`). ``wrap`` prefixes the command with one that execs it (e.g.
    ``nsenter ... --``, ``rlvla3/harness/netns.py``), so the pid is still the rlvla3 process's."""
    out = open(log_path, "ab") if log_path else None
    proc = subprocess.Popen(
        [*wrap, *python_cmd(*args)], stdout=out or subprocess.DEVNULL, stderr=subprocess.STDOUT if out else None,
        env={**os.environ, **(env or {}), **launcher_env()}, start_new_session=True,
    )
    if out:
        out.close()
    return proc


def stop_processes(procs: list[subprocess.Popen], timeout_s: float | None = None) -> None:
    """SIGTERM every process and wait for them (``timeout_s``, by default
    ``lifetime.STOP_TIMEOUT_S``: long enough for a trainer to finish its update and checkpoint;
    much shorter once our own launcher is gone), then SIGKILL what is left."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    t0 = time.monotonic()
    bound = STOP_TIMEOUT_S if timeout_s is None else timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() - t0 < min(bound, stop_timeout_s()):
        time.sleep(0.05)  # polling exit codes with a deadline that shrinks if we are orphaned
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(5)


def request_status(broker: str, timeout_s: float = 5.0, ctx: zmq.Context | None = None,
                   keys_dir: str | None = None, key_name: str = "client") -> dict[str, Any]:
    """Ask a broker for its live figures (one STATUS round trip), as CURVE client ``key_name``
    when a key folder is given. An unreadable reply is logged and skipped, not raised."""
    own = ctx is None
    ctx = ctx or zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        auth.configure_client(sock, keys_dir, key_name)
        sock.connect(broker)
        sock.send_multipart(P.encode(P.STATUS, {}))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sock.poll(int(max(1, (deadline - time.monotonic()) * 1000))):
                try:
                    msg = P.decode(sock.recv_multipart())
                except P.ProtocolError as err:
                    log.warning("bad_status_reply", code=err.code, reason=err.reason)
                    continue
                if msg.type == P.STATUS:
                    return dict(msg["figures"])
        raise TimeoutError(f"no STATUS reply from {broker} within {timeout_s} s"
                           + (" (with CURVE keys: is this client's key in the broker's allowlist?)" if keys_dir else ""))
    finally:
        sock.close()
        if own:
            ctx.term()


def request_tune(broker: str, timeout_s: float = 5.0, **fields: Any) -> dict[str, Any]:
    """Set the broker's batching rule live (``max_batch``, ``max_wait_ms``, ``adaptive``): join
    as a ``client`` (TUNE is taken only from one), send TUNE, leave. Returns the rule in force."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 200)  # the DISCONNECT goes out before the socket closes
    sock.connect(broker)
    try:
        deadline = time.monotonic() + timeout_s
        sock.send_multipart(P.encode(P.READY, {"role": "client", "host": socket.gethostname(), "pid": os.getpid(),
                                               "name": "tune"}))
        sent = False
        while time.monotonic() < deadline:
            if not sock.poll(int(max(1, (deadline - time.monotonic()) * 1000))):
                continue
            msg = P.decode(sock.recv_multipart())
            if msg.type == P.READY and not sent:
                sock.send_multipart(P.encode(P.TUNE, fields))
                sent = True
            elif msg.type == P.TUNE:
                sock.send_multipart(P.encode(P.DISCONNECT, {"reason": "tuned"}))
                return dict(msg["batching"])
            elif msg.type == P.ERROR:
                raise RuntimeError(f"TUNE refused: {msg['code']}: {msg['reason']}")
        raise TimeoutError(f"no TUNE reply from {broker} within {timeout_s} s")
    finally:
        sock.close()
        ctx.term()


class JobInterrupted(RuntimeError):
    """A stop was requested (a signal) while the job was still starting."""


def wait_for_file(path: Path, timeout_s: float, procs: list[subprocess.Popen],
                  cancelled: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cancelled():
            raise JobInterrupted(f"stopped while waiting for {path.name}")
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:
                pass
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"process exited early with code {dead[0].returncode}; see the logs in {path.parent}")
        time.sleep(0.05)  # polling a file with a deadline
    raise TimeoutError(f"{path} did not appear within {timeout_s} s")


class LocalJob:
    """Broker plus workers on this machine, from one config file."""

    def __init__(self, cfg: JobConfig, run_dir: Path, config_path: Path, log_json: bool = False,
                 resume: str | Path | None = None) -> None:
        self.cfg = cfg
        self.resume = str(resume) if resume else None  # trainers load this run folder's latest checkpoint
        self.run_dir = run_dir
        self.config_path = config_path
        self.log_json = log_json
        self.broker_proc: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self.endpoint = ""
        self.keys_dir = cfg.broker.keys_dir or None  # CURVE: workers use their role's key, polls "client"
        self.stop_requested = False
        """Set from a signal handler (``request_stop``); start-up waits give up when it is set."""

    def request_stop(self) -> None:
        self.stop_requested = True

    def _log_flags(self) -> list[str]:
        return ["--log-json"] if self.log_json else []

    def start_broker(self, bind: str | None = None, pub: str | None = None) -> str:
        info = self.run_dir / "broker.json"
        if info.exists():
            info.unlink()
        args = [*self._log_flags(), "broker", "--config", str(self.config_path), "--info-file", str(info)]
        if bind:
            args += ["--bind", bind]
        if pub:
            args += ["--pub", pub]
        self.broker_proc = spawn(args, self.run_dir / "broker.log")
        data = wait_for_file(info, 30.0, [self.broker_proc], lambda: self.stop_requested)
        self.endpoint = data["bind"]
        return self.endpoint

    def start_worker(self, role: str, name: str, extra: list[str] | None = None) -> subprocess.Popen:
        args = [*self._log_flags(), "worker", "--role", role, "--broker", self.endpoint, "--name", name,
                "--run-dir", str(self.run_dir), *(["--keys", self.keys_dir] if self.keys_dir else []), *(extra or [])]
        p = spawn(args, self.run_dir / f"{name}.log")
        self.workers.append(p)
        return p

    def start_all(self) -> None:
        from rlvla3.scale_config import validate_placement

        w, pl = self.cfg.workers, self.cfg.placement
        gpus = validate_placement(pl, w.generators, w.trainers)  # validated at load; here: the mapping
        on = {role: (lambda i, d=devs: ["--gpus", str(d[i])] if d else []) for role, devs in gpus.items()}
        log.info("placement_chosen", mode=pl.mode, offload=pl.offload, generator_gpus=gpus["generator"],
                 trainer_gpus=gpus["trainer"])
        for i in range(w.trainers):
            self.start_worker("trainer", f"trainer{i}", on["trainer"](i) + (["--resume", self.resume] if self.resume else []))
        if self.resume:
            # Generators must serve the resumed weights from their first batch; otherwise the first
            # episodes would carry version numbers that belong to a different (fresh) policy.
            self.wait_status(lambda f: f.get("policy_version", -1) >= 0, 180.0, "the resumed trainer's WEIGHTS")
        for i in range(w.generators):
            self.start_worker("generator", f"generator{i}", on["generator"](i))
        for i in range(w.simulators):
            self.start_worker("simulator", f"simulator{i}", ["--index", str(i)])

    def status(self) -> dict[str, Any]:
        return request_status(self.endpoint, keys_dir=self.keys_dir)

    def wait_status(self, pred: Any, timeout_s: float, what: str) -> dict[str, Any]:
        """Poll STATUS until ``pred(figures)`` holds (deadline; a dead process fails at once)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.stop_requested:
                raise JobInterrupted(f"stopped while waiting for {what}")
            dead = [p for p in [self.broker_proc, *self.workers] if p is not None and p.poll() is not None]
            if dead:
                raise RuntimeError(f"a process exited with code {dead[0].returncode} while waiting for {what}; logs in {self.run_dir}")
            try:
                fig = request_status(self.endpoint, timeout_s=2.0, keys_dir=self.keys_dir)
            except TimeoutError:
                continue
            if pred(fig):
                return fig
            time.sleep(0.1)  # polling STATUS with a deadline
        raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")

    def stop(self) -> None:
        """Workers first (SIGTERM, bounded wait: the trainer checkpoints), the broker last."""
        stop_processes(self.workers)
        if self.broker_proc is not None:
            stop_processes([self.broker_proc])
