"""The broker process: one ROUTER for every worker, one PUB for weight versions, around a
``BrokerState`` that holds every rule (``brokers.state``).

The loop is Majordomo-thin: poll, decode, ``state.handle``, send; then ``state.tick`` for the
timers. Every send is non-blocking: one slow or dead peer never stalls the rest; a batch or
fragment that cannot be sent is handed back to the state (``state.unsent``).

Every peer is bounded: each message read (a BUNDLE's parts each) takes a token of the peer's
rate cap (``brokers.peer_rate``), and a peer's messages are handled for at most
``PEER_TURN_S`` per turn, the rest waiting, in order, for the next turn.
"""

from __future__ import annotations

import itertools
import os
import select
import time
import uuid
from collections import deque
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
PEER_TURN_S = 0.0003
"""The loop thread's CPU time a peer's messages get per loop turn (checked after each message, a
BUNDLE's parts included); the rest wait for the next turn, ahead of anything newer from that
peer. One peer's traffic then takes under 1 ms of a turn at p99 (``peer_turn_us`` in STATUS),
whatever it sends: a 256-part bundle is handled over many turns. CPU time, not wall time: a
crowded machine that preempts the broker must not split what a peer sent in one go (its
answers would no longer go out together)."""
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
        # Per peer, the messages read but not handled yet (``_work``): [CURVE key, messages, how many left].
        self._deferred: dict[bytes, deque[list[Any]]] = {}
        self._deferred_parts: dict[bytes, int] = {}
        log.info("broker_started", bind=self.bound, pub=self.pub_bound, run_id=self.run_id, mode=cfg.run.mode,
                 curve=bool(keys))

    def run(self, until: float | None = None) -> None:
        router, state, stats, recv = self.router, self.state, self.state.stats, self.router.recv
        fd = router.getsockopt(zmq.FD)
        signal_fd = stop_wakeup_fd()  # a stop signal wakes the wait at once (rlvla3/lifetime.py)
        fds = [fd] if signal_fd is None else [fd, signal_fd]
        deferred = self._deferred
        while not self._stop and (until is None or time.monotonic() < until):
            # Sleep until a message or the next timer, to the microsecond: zmq_poll counts whole
            # milliseconds, and a deadline under 1 ms away became poll(0), a spin. ZMQ_FD is
            # edge-triggered: ask ZMQ_EVENTS first (which also re-arms it), then wait on the fd.
            wait = 0.0 if deferred else state.wait_s(time.monotonic())
            if wait > 0 and not router.getsockopt(_EVENTS) & _POLLIN:
                ready, _, _ = select.select(fds, [], [], wait)
                if signal_fd is not None and signal_fd in ready:
                    drain_wakeup()
            turn, turn_cpu = time.perf_counter(), time.thread_time()
            spent: dict[bytes, float] = {}  # each peer's CPU time in this turn
            for peer in list(deferred):  # what waits from earlier turns goes first, in order
                self._work(peer, spent)
            # Drain what is ready (ZMQ_EVENTS, not a zmq.Again raised per turn), replies sent as we go.
            # The identity comes as bytes; the header and tensors as frames, whose ``more`` says
            # whether a part follows (a getsockopt(RCVMORE) per part cost more than the rest).
            reading = time.perf_counter()
            for _ in range(DRAIN):
                if not router.getsockopt(_EVENTS) & _POLLIN:
                    break
                try:
                    frames = [recv(_DONTWAIT), recv(_DONTWAIT, copy=False)]
                except zmq.Again:
                    break
                while frames[-1].more:  # the rest of a multipart message is there already
                    frames.append(recv(_DONTWAIT, copy=False))
                self._take(frames, spent)
                if time.perf_counter() - reading > DRAIN_S:
                    break
            t0 = time.perf_counter_ns()
            outs = state.tick(time.monotonic())
            if outs:
                self._send_all(outs)
                batches = sum(1 for o in outs if o.type == P.BATCH)
                if batches:  # forming and sending, per batch of this pass
                    stats.record("batch_form_us", [(time.perf_counter_ns() - t0) // 1000 // batches] * batches)
            if spent:
                stats.record("peer_turn_us", [int(s * 1e6) for s in spent.values()])
            stats.loop_turn(time.perf_counter() - turn, time.thread_time() - turn_cpu, time.monotonic())
        self.close()

    def _take(self, frames: list[Any], spent: dict[bytes, float]) -> None:
        """One message read ``[identity, header, *tensors]``: its messages (a BUNDLE's parts) are
        counted against the peer's rate cap (``brokers.peer_rate``), then handled now, or after
        what waits of this peer when its share of this turn is spent (``PEER_TURN_S``)."""
        identity, state = frames[0], self.state
        now = time.monotonic()
        rates = state.peer_rates
        if not rates.take(identity, 1, now):  # over its cap: not even decoded
            return
        n, msgs = bundle.opened(frames[1:])
        kept = 1 + (rates.take(identity, n - 1, now) if n > 1 else 0)
        if n > 1:
            state.stats.bundles["in"] += 1
            state.stats.bundles["in_parts"] += n
        if kept < n:
            msgs = itertools.islice(msgs, kept)
        # With CURVE, the ZAP handler named the sender by its key file (rlvla3/auth.py).
        key = frames[1].get("User-Id") if self.authenticator is not None else None
        waiting = self._deferred.get(identity)
        if waiting is None and spent.get(identity, 0.0) < PEER_TURN_S:
            self._deferred[identity] = deque([[key, msgs, kept]])
            self._deferred_parts[identity] = kept
            self._work(identity, spent)
            return
        held = self._deferred_parts.get(identity, 0)
        if held + kept > rates.burst:  # a peer that sends faster than it is served
            rates.drop(identity, kept, now)
            return
        if waiting is None:
            waiting = self._deferred[identity] = deque()
        waiting.append([key, msgs, kept])
        self._deferred_parts[identity] = held + kept

    def _work(self, peer: bytes, spent: dict[bytes, float]) -> None:
        """Handle ``peer``'s waiting messages in order until its share of this turn
        (``PEER_TURN_S``) is spent; the answers go out together. What is left waits for the next
        turn. What a STATUS answer costs the loop (CPU, handling and sending) goes to
        ``status_cpu_us``; the CPU time of all of them, to ``peer_turn_us``."""
        state, cpu = self.state, time.thread_time
        start = cpu()
        until = start + PEER_TURN_S - spent.get(peer, 0.0)
        waiting = self._deferred[peer]
        outs: list[Out] = []
        handled = 0
        while waiting:
            entry = waiting[0]
            key = entry[0]
            for msg in entry[1]:
                now = time.monotonic()
                if type(msg) is P.ProtocolError:
                    outs += state.reject(peer, msg.code, msg.reason, None, now)
                elif msg.type != P.STATUS:
                    outs += state.handle(peer, msg, now, key)
                else:
                    t0 = time.thread_time_ns()
                    self._send_all(state.handle(peer, msg, now, key))
                    state.stats.status_cpu_us.record_value(max(1, (time.thread_time_ns() - t0) // 1000))
                entry[2] -= 1
                handled += 1
                if entry[2] <= 0 or cpu() >= until:
                    break
            else:  # its messages ran out
                handled += entry[2]
                entry[2] = 0
            if entry[2] <= 0:
                waiting.popleft()
            if cpu() >= until:
                break
        if outs:
            self._send_all(outs)
        if waiting:
            self._deferred_parts[peer] -= handled
            state.stats.peer_turns_cut += 1
        else:
            del self._deferred[peer], self._deferred_parts[peer]
        spent[peer] = spent.get(peer, 0.0) + cpu() - start

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
