"""The broker process: one ROUTER for every worker, one PUB for weight versions, around a
``BrokerState`` that holds every rule (``brokers.state``).

The loop is Majordomo-thin: poll, decode, ``state.handle``, send; then ``state.tick`` for the
timers. Every send is non-blocking: one slow or dead peer never stalls the rest; a batch or
fragment that cannot be sent is handed back to the state (``state.unsent``).
"""

from __future__ import annotations

import os
import select
import time
import uuid
from typing import Any

import structlog
import zmq

from brokers.outgoing import Out
from brokers.state import BrokerState
from rlvla3 import auth, bundle
from rlvla3 import protocol as P
from rlvla3.config import JobConfig
from rlvla3.lifetime import drain_wakeup, stop_wakeup_fd
from rlvla3.shm import host_id

log = structlog.get_logger()

DRAIN = 256  # messages read per turn before the timers run again ...
DRAIN_S = 0.001  # ... or fewer, once a turn has read for this long: a flood never holds the timers back
# pyzmq's constants are enum flags: every `&` or `|` on them builds an enum member, a few us each
# in a loop that runs per message. Plain ints here.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_DONTWAIT, _MORE = int(zmq.DONTWAIT), int(zmq.DONTWAIT | zmq.SNDMORE)


class Broker:
    def __init__(self, cfg: JobConfig, bind: str | None = None, pub: str | None = None, run_id: str | None = None) -> None:
        self.ctx = zmq.Context.instance()
        # CURVE + a ZAP allowlist when the job has a key folder; ipc:// files are owner-only.
        keys = cfg.broker.keys_dir
        self.authenticator = auth.start_authenticator(self.ctx, keys) if keys else None
        self.router = self.ctx.socket(zmq.ROUTER)
        if keys:
            auth.configure_server(self.router, keys)
        for opt, value in ((zmq.ROUTER_MANDATORY, 1), (zmq.ROUTER_HANDOVER, 1), (zmq.LINGER, P.LINGER_MS),
                           (zmq.SNDHWM, P.SOCKET_HWM), (zmq.RCVHWM, P.SOCKET_HWM), (zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)):
            self.router.setsockopt(opt, value)
        auth.bind_private(self.router, bind or cfg.broker.bind)
        self.bound = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        # The compiled socket's send, without pyzmq's Python wrapper (it only adds routing_id and
        # group, for draft socket types): called for every part of every message sent.
        self._send_part = zmq.backend.Socket.send.__get__(self.router)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, P.LINGER_MS)
        self.pub.setsockopt(zmq.SNDHWM, 16)
        if keys:
            auth.configure_server(self.pub, keys)
        auth.bind_private(self.pub, pub or cfg.broker.pub)
        self.pub_bound = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.run_id = run_id or uuid.uuid4().hex[:10]
        self.state = BrokerState(cfg, time.monotonic(), self.run_id, host_id(), os.getpid(), self.pub_bound)
        self._stop = False
        log.info("broker_started", bind=self.bound, pub=self.pub_bound, run_id=self.run_id, mode=cfg.run.mode,
                 curve=bool(keys))

    def run(self, until: float | None = None) -> None:
        router, state, stats, recv = self.router, self.state, self.state.stats, self.router.recv
        fd = router.getsockopt(zmq.FD)
        signal_fd = stop_wakeup_fd()  # a stop signal wakes the wait at once (rlvla3/lifetime.py)
        fds = [fd] if signal_fd is None else [fd, signal_fd]
        while not self._stop and (until is None or time.monotonic() < until):
            # Sleep until a message or the next timer, to the microsecond: zmq_poll counts whole
            # milliseconds, and a deadline under 1 ms away became poll(0), a spin. ZMQ_FD is
            # edge-triggered: ask ZMQ_EVENTS first (which also re-arms it), then wait on the fd.
            wait = state.wait_s(time.monotonic())
            if wait > 0 and not router.getsockopt(_EVENTS) & _POLLIN:
                ready, _, _ = select.select(fds, [], [], wait)
                if signal_fd is not None and signal_fd in ready:
                    drain_wakeup()
            turn, turn_cpu = time.perf_counter(), time.thread_time()
            # Drain what is ready (ZMQ_EVENTS, not a zmq.Again raised per turn), replies sent as we go.
            # The identity comes as bytes; the header and tensors as frames, whose ``more`` says
            # whether a part follows (a getsockopt(RCVMORE) per part cost more than the rest).
            for _ in range(DRAIN):
                if not router.getsockopt(_EVENTS) & _POLLIN:
                    break
                try:
                    frames = [recv(_DONTWAIT), recv(_DONTWAIT, copy=False)]
                except zmq.Again:
                    break
                while frames[-1].more:  # the rest of a multipart message is there already
                    frames.append(recv(_DONTWAIT, copy=False))
                self._serve(frames)
                if time.perf_counter() - turn > DRAIN_S:
                    break
            t0 = time.perf_counter_ns()
            outs = state.tick(time.monotonic())
            if outs:
                self._send_all(outs)
                batches = sum(1 for o in outs if o.type == P.BATCH)
                if batches:  # forming and sending, per batch of this pass
                    stats.record("batch_form_us", [(time.perf_counter_ns() - t0) // 1000 // batches] * batches)
            stats.loop_turn(time.perf_counter() - turn, time.thread_time() - turn_cpu, time.monotonic())
        self.close()

    def _serve(self, frames: list[Any]) -> None:
        """Decode, handle and answer one message ``[identity, header, *tensors]``, or each part of
        a BUNDLE; the answers go out together. What a STATUS answer costs the loop (CPU, handling
        and sending; its few bytes' decode aside) goes to ``status_cpu_us``, measured for STATUS
        alone: reading the thread's CPU clock is a system call."""
        identity, state = frames[0], self.state
        now = time.monotonic()
        # With CURVE, the ZAP handler named the sender by its key file (rlvla3/auth.py).
        key = frames[1].get("User-Id") if self.authenticator is not None else None
        outs: list[Out] = []
        msgs = bundle.decode_all(frames[1:])
        if len(msgs) > 1:
            state.stats.bundles["in"] += 1
            state.stats.bundles["in_parts"] += len(msgs)
        for msg in msgs:
            if type(msg) is P.ProtocolError:
                outs += state.reject(identity, msg.code, msg.reason, None, now)
            elif msg.type != P.STATUS:
                outs += state.handle(identity, msg, now, key)
            else:
                t0 = time.thread_time_ns()
                self._send_all(state.handle(identity, msg, now, key))
                state.stats.status_cpu_us.record_value(max(1, (time.thread_time_ns() - t0) // 1000))
        if outs:
            self._send_all(outs)

    def _send_all(self, outs: list[Out]) -> None:
        """Send without blocking; what a peer that reads BUNDLEs gets in one call goes as one
        message. What cannot be sent goes back to the state (``state.unsent``)."""
        by_peer: dict[bytes, list[Out]] = {}
        for out in outs:
            if out.to is not None:
                by_peer.setdefault(out.to, []).append(out)
                continue
            try:
                self.pub.send_multipart([b"W", *out.encode()], zmq.DONTWAIT, copy=False)
            except zmq.Again:
                log.warning("weights_pub_full", version=out.fields.get("version"))
        workers = self.state.registry.workers
        for to, group in by_peer.items():
            peer = workers.get(to)
            if len(group) == 1 or peer is None or not peer.bundles:
                for out in group:
                    self._send_or_hand_back(to, [out], out.encode())
                continue
            at = 0
            for n, frames in bundle.bundle([out.encode() for out in group]):
                sent = self._send_or_hand_back(to, group[at:at + n], frames)
                at += n
                if sent and n > 1:
                    self.state.stats.bundles["out"] += 1
                    self.state.stats.bundles["out_parts"] += n

    def _send_or_hand_back(self, to: bytes, outs: list[Out], frames: list[Any]) -> bool:
        """Whether ``frames`` (``outs``, encoded) went; if not, ``outs`` go back to the state."""
        try:
            self._send(to, frames)
            return True
        except zmq.ZMQError as err:  # EHOSTUNREACH (peer gone) or EAGAIN (peer's queue full)
            log.warning("send_failed", peer=to.hex()[:16], type=outs[0].type, messages=len(outs), error=err.strerror)
            for out in outs:
                self.state.unsent(out)
            return False

    def _send(self, to: bytes, frames: list[Any]) -> None:
        """``[to, *frames]`` on the ROUTER without blocking. The first part decides: with
        ROUTER_MANDATORY an unroutable peer or a full queue raises there, before anything went."""
        send = self._send_part
        send(to, _MORE, copy=False)
        for frame in frames[:-1]:
            send(frame, _MORE, copy=False)
        send(frames[-1], _DONTWAIT, copy=False)

    def stop(self) -> None:
        self._stop = True

    def close(self) -> None:
        self._send_all(self.state.shutdown())
        self.state.bridge.close()
        self.router.close(linger=P.LINGER_MS)
        self.pub.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()
        figures = self.state.stats.snapshot(time.monotonic())
        log.info("broker_stopped", **{k: v for k, v in figures.items() if isinstance(v, int)})
