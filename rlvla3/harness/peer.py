"""A peer played by hand on the real protocol: a DEALER that joins a broker as a role and keeps
itself alive with heartbeats. Benches use it where the figure is the broker's own cost (the echo
generator, open-loop simulators, a trainer that only publishes); tests where the peer itself is
the subject (one that stalls, answers wrong or sits on another host). Everywhere else a job runs
the real workers (``workers/base.py``)."""

from __future__ import annotations

import os
import time
from typing import Any

import zmq

from rlvla3 import auth
from rlvla3 import protocol as P
from rlvla3.shm import host_id


def zmq_socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    """A socket set as the workers set theirs: no linger, the protocol's high-water marks."""
    sock = ctx.socket(kind)
    for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, P.SOCKET_HWM), (zmq.RCVHWM, P.SOCKET_HWM)):
        sock.setsockopt(opt, value)
    return sock


class Peer:
    """Joins ``endpoint`` as ``role`` at once (READY with ``fields``; host and pid are this
    process's unless given); with ``keys``, as that role's CURVE key."""

    def __init__(self, ctx: zmq.Context, endpoint: str, role: str, name: str, keys: str | None = None,
                 **fields: Any) -> None:
        self.sock = zmq_socket(ctx, zmq.DEALER)
        auth.configure_client(self.sock, keys, role)
        self.sock.connect(endpoint)
        self.send(P.READY, {"role": role, "host": host_id(), "pid": os.getpid(), "name": name, **fields})
        self.last_beat = time.monotonic()

    def send(self, msg_type: str, fields: dict[str, Any] | None = None, tensors: dict[str, Any] | None = None) -> None:
        self.sock.send_multipart(P.encode(msg_type, fields, tensors))

    def expect(self, msg_type: str, timeout_s: float = 30.0, **beat: Any) -> P.Message:
        """The next ``msg_type`` from the broker (others are dropped), heartbeating while it waits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.keepalive(drain=False, **beat)
            if self.sock.poll(100):
                msg = P.decode(self.sock.recv_multipart())
                if msg.type == msg_type:
                    return msg
        raise TimeoutError(f"no {msg_type} from the broker within {timeout_s} s")

    def keepalive(self, drain: bool = True, every_s: float = 0.5, **fields: Any) -> None:
        """A HEARTBEAT (with ``fields``) if ``every_s`` passed since the last one (the broker
        expires a silent peer); with ``drain``, what the broker sent meanwhile is dropped."""
        if time.monotonic() - self.last_beat >= every_s:
            self.sock.send_multipart(P.encode(P.HEARTBEAT, fields), zmq.DONTWAIT)
            self.last_beat = time.monotonic()
        while drain and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self.sock.recv_multipart()

    def close(self) -> None:
        """DISCONNECT (best effort), then the socket goes."""
        try:
            self.sock.send_multipart(P.encode(P.DISCONNECT), zmq.DONTWAIT)
        except zmq.ZMQError:
            pass
        self.sock.close(0)
