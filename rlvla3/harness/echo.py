"""Peers with no logic of their own, for measuring the broker against its floors (child processes
of ``bench/broker/latency.py`` and ``bench/broker/capacity.py``):

    python -m rlvla3.harness.echo generator ENDPOINT [--credits 4] [--keys DIR]
        a generator-role peer on the real protocol: for every BATCH a RESULT of zero actions;
    python -m rlvla3.harness.echo echo
        a ROUTER that returns every message to its sender: the floor with no hop in between;
    python -m rlvla3.harness.echo relay
        a ROUTER between simulators and one echo DEALER: the broker's topology in bare pyzmq;
    python -m rlvla3.harness.echo relay-echo ENDPOINT
        that echo: a DEALER that returns whatever it is sent.

Each prints one line once it is up (its endpoint, or "ready"), as ``start_child`` expects, and
ends with its launcher (``follow_launcher``)."""

from __future__ import annotations

import argparse
from typing import Any, Callable

import numpy as np
import zmq

from rlvla3 import protocol as P
from rlvla3.harness.peer import Peer, zmq_socket
from rlvla3.lifetime import follow_launcher

ECHO = ["-m", "rlvla3.harness.echo"]
"""``start_child``'s arguments that run this module."""
ACTION_SHAPE = (1, 7)
"""Per env: a chunk of one 7-dof action, what a small policy returns."""
HELLO = b"echo"
"""The relay-echo's first message: the relay learns its identity from it."""


def echo_result(batch: P.Message, zeros: dict[int, np.ndarray]) -> list[Any]:
    """The echo's RESULT to ``batch``: zero actions for its envs, stacked as a generator sends
    them (the broker slices each request's rows). ``zeros`` keeps one array per batch size."""
    n = sum(req["n"] for req in batch["requests"])
    if n not in zeros:
        zeros[n] = np.zeros((n, *ACTION_SHAPE), np.float32)
    return P.encode(P.RESULT, {"batch_id": batch["batch_id"], "version": 0, "forward_us": 0,
                               "queue_us": batch.get("queue_us", [])}, {"actions": zeros[n]})


def echo_generator(endpoint: str, credits: int, keys_dir: str | None) -> None:
    """Join ``endpoint`` as a generator and answer every BATCH with zero actions."""
    gen = Peer(zmq.Context(), endpoint, "generator", "echo-generator", keys_dir, credits=credits)
    zeros: dict[int, np.ndarray] = {}  # envs in a batch -> its zero actions
    announced = False
    while True:
        gen.keepalive(drain=False, credits=credits, version=0)
        if not gen.sock.poll(200):
            continue
        while gen.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            msg = P.decode(gen.sock.recv_multipart(copy=False))
            if msg.type == P.READY and not announced:
                announced = True
                print("ready", flush=True)
            elif msg.type == P.DISCONNECT:
                return
            elif msg.type == P.BATCH:
                gen.sock.send_multipart(echo_result(msg, zeros), copy=False)


def serve(sock: zmq.Socket, handle: Callable[[list[zmq.Frame]], None]) -> None:
    """Forever: every message that is ready is handled before the socket is polled again."""
    while True:
        if not sock.poll(200):
            continue
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            handle(sock.recv_multipart(copy=False))


def bound_router() -> zmq.Socket:
    """A ROUTER on a free loopback port, its endpoint printed."""
    sock = zmq_socket(zmq.Context(), zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:0")
    print(sock.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
    return sock


def echo_back() -> None:
    """Every message straight back to the peer that sent it (its identity frame first)."""
    sock = bound_router()
    serve(sock, lambda frames: sock.send_multipart(frames, copy=False))


def relay() -> None:
    """Simulator -> echo -> simulator through one ROUTER, routing by identity frames only."""
    sock = bound_router()
    echo: bytes | None = None
    while True:
        if not sock.poll(200):
            continue
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = sock.recv_multipart(copy=False)
            sender = frames[0].bytes
            if echo is None:
                if frames[1].bytes == HELLO:
                    echo = sender
                    sock.send_multipart([echo, HELLO])
                continue
            if sender == echo:  # [echo, sim, *msg] -> [sim, *msg]
                sock.send_multipart(frames[1:], copy=False)
            else:  # [sim, *msg] -> [echo, sim, *msg]
                sock.send_multipart([echo, *frames], copy=False)


def relay_echo(endpoint: str) -> None:
    """The relay's far end: every message goes back as it came (simulator identity first)."""
    sock = zmq_socket(zmq.Context(), zmq.DEALER)
    sock.connect(endpoint)
    sock.send(HELLO)
    if not sock.poll(30_000):
        raise TimeoutError(f"relay at {endpoint} did not answer within 30 s")
    sock.recv()  # the relay knows us now
    print("ready", flush=True)
    serve(sock, lambda frames: sock.send_multipart(frames, copy=False))


def main() -> None:
    follow_launcher()  # SIGTERM (default action: exit) when the benchmark dies
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("role", choices=("generator", "echo", "relay", "relay-echo"))
    ap.add_argument("endpoint", nargs="?")
    ap.add_argument("--credits", type=int, default=4)
    ap.add_argument("--keys", default=None, help="CURVE key folder (the generator joins as key 'generator')")
    args = ap.parse_args()
    if args.role == "generator":
        echo_generator(args.endpoint, args.credits, args.keys)
    elif args.role == "echo":
        echo_back()
    elif args.role == "relay":
        relay()
    else:
        relay_echo(args.endpoint)


if __name__ == "__main__":
    main()
