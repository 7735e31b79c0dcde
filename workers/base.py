"""What every worker shares: connect, READY, heartbeats, reconnect with back-off, and a way to
run blocking work (env steps, forward passes, updates) off the socket thread.

The socket thread never blocks on compute: heartbeats keep flowing while a generator runs a
long forward pass or a trainer runs an update. Blocking work goes to a :class:`JobRunner`
thread; when it finishes, the runner wakes the loop through an inproc socket and the result is
handled on the loop's thread (sockets are not thread-safe).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import uuid
from typing import Any, Callable

import structlog
import zmq

from rlvla3 import auth, bundle
from rlvla3 import protocol as P
from rlvla3.config import ConfigError, JobConfig, apply_overrides, from_dict
from rlvla3.lifetime import drain_wakeup, on_stop_signals, stop_wakeup_fd
from rlvla3.shm import ShmAttachments, host_id

log = structlog.get_logger()


class JobRunner:
    """One thread that runs submitted callables in order and wakes the owner's poll loop."""

    def __init__(self, ctx: zmq.Context, wake_addr: str, name: str) -> None:
        self.name = name
        self._jobs: queue.Queue = queue.Queue()
        self.results: queue.Queue = queue.Queue()
        self._ctx = ctx
        self._wake_addr = wake_addr
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], tag: Any = None) -> None:
        self._jobs.put((fn, tag))

    def stop(self) -> None:
        self._jobs.put(None)

    def report(self, tag: Any, result: Any) -> None:
        """From inside a running job (this runner's thread): hand the loop a result before the job
        ends, e.g. weights the trainer published between two epochs."""
        self.results.put((tag, result, None))
        self._wake.send(b"", zmq.DONTWAIT)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _loop(self) -> None:
        wake = self._wake = self._ctx.socket(zmq.PUSH)  # this thread's only (``report`` runs here too)
        wake.setsockopt(zmq.LINGER, 0)
        wake.connect(self._wake_addr)
        try:
            while True:
                item = self._jobs.get()
                if item is None:
                    return
                fn, tag = item
                try:
                    result, error = fn(), None
                except BaseException as exc:  # reported to the loop, which decides
                    result, error = None, exc
                self.results.put((tag, result, error))
                wake.send(b"", zmq.DONTWAIT)
        finally:
            wake.close()


def broker_wait_s(role: str, overrides: tuple[str, ...]) -> float:
    """``workers.broker_wait_s`` as this worker's own ``--set`` gives it: the job's config arrives
    only once a broker answers, so this one setting is read before it."""
    mine = [o for o in overrides if o.split("=", 1)[0].strip() == "workers.broker_wait_s"]
    try:
        return from_dict(apply_overrides({}, mine)).workers.broker_wait_s
    except ConfigError as exc:
        raise SystemExit(f"{role}: {exc}") from None


class WorkerBase:
    """Connect / READY / heartbeat / reconnect, and a poll loop subclasses plug into."""

    role: str = ""

    def __init__(self, broker: str, name: str | None = None, overrides: tuple[str, ...] = (), device: str | None = None,
                 keys_dir: str | None = None, key_name: str | None = None) -> None:
        self.broker_url = broker
        self.keys_dir = keys_dir  # CURVE key folder (rlvla3/auth.py); None: plain sockets
        self.key_name = key_name or self.role
        self.name = name or f"{self.role}-{os.getpid()}"
        self.overrides = tuple(overrides)
        self.device = device
        self.host = host_id()
        self.ctx = zmq.Context()
        self.sock: zmq.Socket | None = None
        self.poller = zmq.Poller()
        self.wake_addr = f"inproc://wake-{uuid.uuid4().hex[:8]}"
        self.wake = self.ctx.socket(zmq.PULL)
        self.wake.bind(self.wake_addr)
        self.poller.register(self.wake, zmq.POLLIN)
        self.runners: list[JobRunner] = []
        self.attach = ShmAttachments()
        self.cfg: JobConfig | None = None
        """The job's config as this worker runs it: the broker's, with this worker's own ``--set``."""
        self.job: JobConfig | None = None
        """The broker's job config alone: what the broker checks this worker's messages against."""
        self.welcome: dict[str, Any] = {}
        self.hb_s = P.HEARTBEAT_INTERVAL_S
        self.liveness = P.HEARTBEAT_LIVENESS
        self._stop = False
        self._signal_fd: int | None = None
        self._last_recv = 0.0
        self._last_send = 0.0
        self._backoff = P.RECONNECT_MIN_S
        self._connects = 0
        self._held: list[tuple[str, list[Any]]] | None = None  # sends held for one BUNDLE (``_drain_runners``)
        self.broker_wait_s = broker_wait_s(self.role, self.overrides)

    # -- what subclasses provide --------------------------------------------------------------

    def ready_fields(self) -> dict[str, Any]:
        """Extra READY fields (slots, credits, ...)."""
        return {}

    def setup(self) -> None:
        """Build envs / models once the config has arrived. Runs off the socket thread (so
        heartbeats continue during a long model load): it must not touch sockets."""

    def start(self) -> None:
        """On the socket thread, after ``setup``: open extra sockets, send first requests."""

    def on_message(self, msg: P.Message) -> None:
        """A message from the broker (not HEARTBEAT/DISCONNECT/ERROR)."""

    def on_job_done(self, tag: Any, result: Any, error: BaseException | None) -> None:
        """A JobRunner finished something."""

    def on_reconnected(self) -> None:
        """Re-send whatever the broker lost (pending requests)."""

    def tick(self, now: float) -> None:
        """Called every loop iteration."""

    def extra_sockets(self) -> list[zmq.Socket]:
        return []

    def on_socket(self, sock: zmq.Socket) -> None:
        """An extra socket is readable."""

    def teardown(self) -> None:
        """Release envs, models, shared memory."""

    def heartbeat_fields(self) -> dict[str, Any]:
        return {}

    # -- connection ---------------------------------------------------------------------------

    def _open(self) -> None:
        if self.sock is not None:
            self.poller.unregister(self.sock)
            self.sock.close(linger=0)
        self._connects += 1
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"{self.role[:3]}-{os.getpid()}-{self._connects}-{uuid.uuid4().hex[:6]}".encode())
        self.sock.setsockopt(zmq.LINGER, P.LINGER_MS)
        self.sock.setsockopt(zmq.SNDHWM, P.SOCKET_HWM)
        self.sock.setsockopt(zmq.RCVHWM, P.SOCKET_HWM)
        self.sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
        auth.configure_client(self.sock, self.keys_dir, self.key_name)
        self.sock.connect(self.broker_url)
        self.poller.register(self.sock, zmq.POLLIN)

    def connect(self, timeout_s: float | None = None) -> None:
        """READY until the broker answers with the job config (back-off 1 s doubling to 32 s). A
        worker started before its broker (a scheduler starts them in any order) waits
        ``workers.broker_wait_s`` by default, then exits with one error line; a stop signal ends
        the wait at once."""
        timeout_s = self.broker_wait_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        backoff = P.RECONNECT_MIN_S
        while not self._stop:
            self._open()
            # Sent at once, even inside a turn whose sends are held: its answer is awaited here.
            self._send_frames(P.READY, P.encode(P.READY, {"role": self.role, "host": self.host, "pid": os.getpid(),
                                                          "name": self.name, "bundles": True, **self.ready_fields()}))
            waiting = zmq.Poller()
            waiting.register(self.sock, zmq.POLLIN)
            if self._signal_fd is not None:
                waiting.register(self._signal_fd, zmq.POLLIN)
            wait_until = min(time.monotonic() + backoff, max(deadline, time.monotonic() + P.RECONNECT_MIN_S))
            while time.monotonic() < wait_until and not self._stop:
                events = dict(waiting.poll(int(max(1, (wait_until - time.monotonic()) * 1000))))
                if self._signal_fd in events:
                    drain_wakeup()  # a stop signal: the flag is set
                if self.sock not in events:
                    continue
                for msg in self._recv():
                    if msg.type == P.READY:
                        self._welcome(msg)
                        return
                    if msg.type == P.ERROR and msg.get("ref_type") == P.READY:
                        raise SystemExit(f"{self.role}: the broker refused to let us join: {msg['reason']}")
            if self._stop:
                return
            if time.monotonic() >= deadline:
                raise SystemExit(f"{self.role} {self.name}: no broker answered at {self.broker_url} within "
                                 f"{timeout_s:.0f} s (workers.broker_wait_s); is it running, and are the address "
                                 "and keys right?")
            log.info("broker_unreachable_retrying", broker=self.broker_url, backoff_s=backoff)
            backoff = min(backoff * 2, P.RECONNECT_MAX_S)

    def _welcome(self, msg: P.Message) -> None:
        before = self.welcome
        self.welcome = dict(msg.header)
        if before and (before.get("host"), before.get("pid")) != (msg.get("host"), msg.get("pid")):
            # another broker process on the same address: it knows nothing of this worker's past
            log.warning("broker_restarted", broker=self.broker_url, old_pid=before.get("pid"), new_pid=msg.get("pid"))
        try:
            self.job = from_dict(dict(msg["config"]))
        except (ConfigError, KeyError, TypeError, ValueError) as exc:  # another rlvla3 version, say
            raise SystemExit(f"{self.role}: the broker's job config does not load here: {exc}") from None
        try:
            self.cfg = from_dict(apply_overrides(dict(msg["config"]), list(self.overrides))) if self.overrides else self.job
        except ConfigError as exc:
            raise SystemExit(f"{self.role}: bad config override: {exc}") from None
        self.hb_s = float(msg.get("heartbeat_s", P.HEARTBEAT_INTERVAL_S))
        self.liveness = int(msg.get("liveness", P.HEARTBEAT_LIVENESS))
        self._last_recv = time.monotonic()
        self._backoff = P.RECONNECT_MIN_S
        structlog.contextvars.bind_contextvars(worker_id=msg.get("worker_id"))
        log.info("worker_ready", role=self.role, name=self.name, broker=self.broker_url, run_id=msg.get("run_id"))

    def _recv(self) -> list[P.Message]:
        """The messages of one received message (a BUNDLE's parts); bad ones are logged and dropped."""
        frames = self.sock.recv_multipart(copy=False)
        self._last_recv = time.monotonic()
        out = []
        for msg in bundle.decode_each(frames):
            if type(msg) is P.ProtocolError:
                log.warning("bad_message_from_broker", code=msg.code, reason=msg.reason)
            else:
                out.append(msg)
        return out

    def send(self, msg_type: str, fields: dict[str, Any] | None = None, tensors: dict[str, Any] | None = None) -> None:
        """Send now without blocking, or, while sends are held, at the end of the turn."""
        frames = P.encode(msg_type, fields, tensors)
        if self._held is not None:
            self._held.append((msg_type, frames))
            return
        self._send_frames(msg_type, frames)

    def _send_frames(self, msg_type: str, frames: list[Any]) -> None:
        try:
            self.sock.send_multipart(frames, zmq.DONTWAIT, copy=False)
        except zmq.Again:
            log.warning("send_queue_full", type=msg_type)
            return
        self._last_send = time.monotonic()

    def _send_held(self) -> None:
        """What this turn sent, as few messages as possible (``rlvla3.bundle``)."""
        held, self._held = self._held or [], None
        at = 0
        for n, frames in bundle.bundle([frames for _, frames in held]):
            self._send_frames(held[at][0] if n == 1 else P.BUNDLE, frames)
            at += n

    def _reconnect(self) -> None:
        log.warning("broker_silent_reconnecting", backoff_s=self._backoff)
        time.sleep(self._backoff)  # back-off between attempts, not synchronisation
        self._backoff = min(self._backoff * 2, P.RECONNECT_MAX_S)
        self.connect(timeout_s=float("inf"))
        self.on_reconnected()

    # -- the loop -----------------------------------------------------------------------------

    def new_runner(self, name: str) -> JobRunner:
        r = JobRunner(self.ctx, self.wake_addr, name)
        self.runners.append(r)
        return r

    def stop(self) -> None:
        self._stop = True

    def run(self) -> None:
        """Connect, set up, then serve until DISCONNECT, SIGTERM or ``stop()``."""
        self._install_signals()
        # Work hops between the socket thread and JobRunner threads on every batch and chunk;
        # Python's default 5 ms switch interval would add milliseconds to each hop.
        sys.setswitchinterval(0.0005)
        try:
            self.connect()
            if self._stop:
                return
            self._setup_runner = self.new_runner("setup")
            self._setup_runner.submit(self.setup, "__setup__")
            self._started = False
            self._early: list[P.Message] = []
            while not self._stop:
                events = dict(self.poller.poll(int(self.hb_s * 1000 / 2)))
                if self.sock in events:
                    for _ in range(256):
                        if self._stop or not self.sock.poll(0, zmq.POLLIN):
                            break
                        for msg in self._recv():
                            if not self._started and msg.type not in (P.HEARTBEAT, P.DISCONNECT, P.ERROR):
                                self._early.append(msg)  # routed once set-up is done
                                continue
                            self._route(msg)
                            if self._stop:
                                break
                if self._signal_fd is not None and self._signal_fd in events:
                    drain_wakeup()  # a stop signal: the flag is set, the loop ends
                if self.wake in events:
                    while True:
                        try:
                            self.wake.recv(zmq.DONTWAIT)
                        except zmq.Again:
                            break
                    self._drain_runners()
                for s in self.extra_sockets():
                    if s in events:
                        self.on_socket(s)
                now = time.monotonic()
                if now - self._last_send >= self.hb_s:
                    self.send(P.HEARTBEAT, self.heartbeat_fields())
                if now - self._last_recv > self.hb_s * self.liveness:
                    # A last call before the verdict: a worker that was paused or starved (SIGSTOP,
                    # a loaded host) between turns may hold the broker's messages unread, and
                    # reopening the socket would drop them.
                    if not self.sock.poll(int(self.hb_s * 1000), zmq.POLLIN):
                        self._reconnect()
                    continue
                if self._started:
                    self.tick(now)
        finally:
            if self.sock is not None and self.cfg is not None:
                try:
                    self.send(P.DISCONNECT, {})
                except zmq.ZMQError:
                    pass
            for r in self.runners:
                r.stop()
            try:
                self.teardown()
            finally:
                self.attach.close()
                if self.sock is not None:
                    self.sock.close(linger=P.LINGER_MS)
                self.wake.close(linger=0)
                for s in self.extra_sockets():
                    s.close(linger=0)
                self.ctx.term()
                log.info("worker_stopped", role=self.role, name=self.name)

    def _drain_runners(self) -> None:
        """Finished jobs, handled in order; what they send goes out at the end as one BUNDLE
        (several slots' OBS that finished together: one message through each socket)."""
        self._held = []
        try:
            self._handle_finished_jobs()
        finally:
            self._send_held()

    def _handle_finished_jobs(self) -> None:
        for r in self.runners:
            while True:
                try:
                    tag, result, error = r.results.get_nowait()
                except queue.Empty:
                    break
                if tag == "__setup__":
                    if error is not None:
                        log.error("setup_failed", role=self.role, error=repr(error)[:1000])
                        raise error
                    self.start()
                    for s in self.extra_sockets():
                        self.poller.register(s, zmq.POLLIN)
                    self._started = True
                    self.send(P.HEARTBEAT, self.heartbeat_fields())
                    for msg in self._early:
                        self._route(msg)
                    self._early = []
                    continue
                self.on_job_done(tag, result, error)

    def _route(self, msg: P.Message) -> None:
        if msg.type == P.HEARTBEAT:
            return
        if msg.type == P.DISCONNECT:
            log.info("broker_said_disconnect", reason=msg.get("reason"))
            self._stop = True
            return
        if msg.type == P.ERROR:
            log.warning("broker_error", code=msg["code"], reason=msg["reason"], ref_type=msg.get("ref_type"))
            if msg["code"] == P.E_STATE and "READY" in msg["reason"]:
                self.connect(timeout_s=float("inf"))  # the broker restarted and forgot us
                self.on_reconnected()
            return
        if msg.type == P.READY:
            return
        self.on_message(msg)

    def _install_signals(self) -> None:
        """SIGTERM/SIGINT/SIGHUP stop the loop (a flag); a launched worker whose launcher died is
        forced out after a short grace if teardown hangs (``rlvla3/lifetime.py``)."""
        if threading.current_thread() is not threading.main_thread():
            return
        on_stop_signals(self.stop)
        self._signal_fd = stop_wakeup_fd()  # a stop wakes the poll at once, not after its timeout
        self.poller.register(self._signal_fd, zmq.POLLIN)
