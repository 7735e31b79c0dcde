"""Throw >= 100,000 hostile messages at a live job and check that it shrugs them off.

    python bench/faults/fuzz.py --quick    # 5,000 messages; --curve: a broker with CURVE keys

A synthetic job (real processes on tcp://127.0.0.1) runs while a few clients send as fast as the
broker takes them: frames that are not msgpack, not a map or of a wrong version; a real message
type with one field (every field of SCHEMA in turn) made hostile (``HOSTILE``); BUNDLEs of those,
and bundles whose part counts lie; valid but hostile messages (unknown batch ids, re-READY as
another role, extreme counters, SNAPSHOT, DISCONNECT and join again). The clients join as roles
that cannot feed the job's workers (a generator with no credits, a simulator whose OBS are all
malformed, a ``client``) plus a stranger that never joins; each ends with a STATUS whose reply
proves the broker read everything (``all_read``).

The JSON: ``sent``, ``errors`` (answered with ERROR, the broker's count), ``broker_alive``,
``job_advanced`` (env steps and policy version grew while fuzzing), ``rss_growth_mb`` (the
broker's) and ``peer_turn_us`` (the broker loop's time per turn on one peer's messages, from
STATUS). Targets: alive, advancing, RSS growth <= 64 MB, ``peer_turn_us`` p99 <= 1,000 us.
"""

from __future__ import annotations

import argparse
import random
import threading
import time

import msgpack
import zmq

from rlvla3 import auth, bundle
from rlvla3 import protocol as P
from rlvla3.app.launch import request_status
from rlvla3.config import load
from rlvla3.harness.bench import BenchRun, emit_to, note, parse_bench_args
from rlvla3.harness.jobs import SMALL_JOB, rss_mb, start_job

VALID = {  # one valid header per message type a peer may send to the broker
    P.READY: {"role": "client", "host": "fuzzhost", "pid": 1},
    P.HEARTBEAT: {}, P.DISCONNECT: {}, P.SNAPSHOT: {},
    P.OBS: {"slot": 0, "req_id": 1, "n": 1, "instruction": ["x"], "episode_step": [0]},
    P.RESULT: {"batch_id": 1, "version": 0},
    P.TRAJ: {"traj_id": 1, "slot": 0, "steps": 8},
    P.TRAJ_ACK: {"traj_ids": [1]},
    P.WEIGHTS: {"version": 0},
    P.TRAIN: {"phase": "end", "version": 0},
    P.BUNDLE: {"parts": []},
}
HOSTILE = [[1], {"a": [1]}, True, float("inf"), float("-inf"), float("nan"), 2**64 - 1, -(2**40), "x" * 5000, None]
FIELDS = [(t, name) for t in VALID for name in {**P.SCHEMA[t][0], **P.SCHEMA[t][1]}]


def confused(rng: random.Random) -> list[bytes]:
    """A real message type with one field replaced by a hostile value (never a valid message)."""
    while True:
        t, name = rng.choice(FIELDS)
        frames = [msgpack.packb({"v": 1, "type": t, **VALID[t], name: rng.choice(HOSTILE)})]
        try:
            P.decode(frames)
        except P.ProtocolError:
            return frames


def garbage(rng: random.Random) -> list[bytes]:
    kind = rng.randrange(4)
    if kind == 0:
        return [rng.randbytes(rng.randrange(1, 64))]
    if kind == 1:
        return [msgpack.packb([1, 2, {"type": "OBS"}])]
    if kind == 2:
        return [msgpack.packb({"v": 2, "type": "READY"})]
    return [msgpack.packb({"v": 1, "type": rng.choice([["OBS"], {"t": 1}, 7, None, "NOPE"])})]


def bundled(rng: random.Random) -> list[bytes]:
    """A BUNDLE of 2-8 bad messages, or (one time in four) one whose ``parts`` lie about its frames."""
    parts = [confused(rng) if rng.random() < 0.5 else garbage(rng) for _ in range(rng.randint(2, 8))]
    if rng.random() < 0.25:
        counts = [rng.randint(1, 3) for _ in parts]
        return [msgpack.packb({"v": 1, "type": P.BUNDLE, "parts": counts}), *(f for m in parts for f in m)]
    (_, frames), = bundle.bundle(parts)
    return frames


def hostile_valid(rng: random.Random, role: str) -> list:
    """Well-formed messages no honest worker sends (none of them feeds work to the job)."""
    kind = rng.randrange(6)
    if kind == 0:
        return P.encode(P.RESULT, {"batch_id": rng.randrange(2**53), "version": 2**53, "queue_us": [2**53] * 8})
    if kind == 1:
        return P.encode(P.HEARTBEAT, {"credits": 0, "version": 2**53, "info": {"env_steps": 2**53, "dist": {"x": [1] * 50}}})
    if kind == 2:
        return P.encode(P.TRAJ_ACK, {"traj_ids": [rng.randrange(2**53) for _ in range(50)], "dropped_stale": 2**32})
    if kind == 3:
        return P.encode(P.SNAPSHOT if role == "generator" else P.TRAIN, {} if role == "generator" else
                        {"phase": "starved", "version": 2**53})
    if kind == 4:
        return P.encode(P.READY, {"role": role, "host": "fuzzhost", "pid": 2**31, "name": "x" * 256, "credits": 0,
                                  "slots": 0, "info": {"version": 2**53}})
    return P.encode(P.DISCONNECT, {"reason": "x" * 4000})


class Fuzzer(threading.Thread):
    """One client: joins as ``role`` (or never, for the stranger) and sends ``count`` messages."""

    def __init__(self, ctx: zmq.Context, endpoint: str, role: str | None, count: int, seed: int,
                 keys_dir: str | None = None) -> None:
        super().__init__(daemon=True, name=f"fuzz-{role}")
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        auth.configure_client(self.sock, keys_dir, role or "client")  # with CURVE: an allowlisted key of its role
        self.sock.connect(endpoint)
        self.role, self.count, self.rng = role, count, random.Random(seed)
        self.sent = self.errors = self.replies = 0
        self.confirmed = False
        self.failure = ""

    def _drain(self) -> bool:
        """Read every waiting reply; True if one was a STATUS."""
        status = False
        while self.sock.poll(0):
            msg = P.decode(self.sock.recv_multipart())
            self.replies += 1
            self.errors += msg.type == P.ERROR
            status |= msg.type == P.STATUS
        return status

    def _confirm(self) -> bool:
        """A STATUS after everything: its reply proves the broker has read all our messages
        (one peer's messages are read in order). Re-asked every 10 s: a reply can be dropped
        while our receive queue is full."""
        for _ in range(12):
            self._send(P.encode(P.STATUS, {}))
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if self.sock.poll(200) and self._drain():
                    return True
        return False

    def _send(self, frames: list) -> None:
        """Send when the broker takes more (its queue for us is bounded: back-pressure is fair
        play), reading its replies meanwhile; a broker that takes nothing for 120 s fails us."""
        deadline = time.monotonic() + 120
        while not self.sock.poll(100, zmq.POLLOUT):
            self._drain()
            if time.monotonic() > deadline:
                raise TimeoutError("the broker took no message for 120 s")
        self.sock.send_multipart(frames, zmq.DONTWAIT)

    def run(self) -> None:
        try:
            if self.role is not None:
                self._send(P.encode(P.READY, {**VALID[P.READY], "role": self.role, "credits": 0, "slots": 0}))
            for i in range(self.count):
                pick = self.rng.random()
                if pick < 0.40:
                    frames = confused(self.rng)
                elif pick < 0.55:
                    frames = garbage(self.rng)
                elif pick < 0.65:
                    frames = bundled(self.rng)
                elif self.role is not None:
                    frames = hostile_valid(self.rng, self.role)
                else:
                    frames = confused(self.rng)
                self._send(frames)
                self.sent += 1
                if i % 64 == 0:
                    self._drain()
            self.confirmed = self._confirm()
            while self.sock.poll(500):
                self._drain()
        except Exception as exc:  # reported in the JSON: a fuzzer that stops early is a finding
            self.failure = f"{type(exc).__name__}: {exc}"
        finally:
            self.sock.close()


def keyless_answered(ctx: zmq.Context, endpoint: str) -> bool:
    """Whether a peer without a key gets any answer (READY, then STATUS) within 3 s."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        for frames in (P.encode(P.READY, {**VALID[P.READY], "role": "client"}), P.encode(P.STATUS, {})):
            sock.send_multipart(frames, zmq.DONTWAIT)
        return bool(sock.poll(3000))
    finally:
        sock.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=100_000, help="Messages in all, split over the clients.")
    ap.add_argument("--clients", type=int, default=4, help="Fuzzing clients (simulator, generator, client, stranger...).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--curve", action="store_true",
                    help="The broker runs with CURVE keys (rlvla3 keys): the clients hold allowlisted keys of their "
                         "roles (the stranger the client key, never joining), and a peer without a key must get nothing.")
    args = parse_bench_args(ap, "5,000 messages: a short run", smoke_help="1,000 messages: checks the script runs")
    total = 1_000 if args.smoke else 5_000 if args.quick else args.messages

    with BenchRun("fuzz", args.curve) as run:
        root, keys = run.dir, run.keys
        job = start_job(load("synthetic.yaml", [*SMALL_JOB, *([f"broker.keys_dir={keys}"] if keys else [])]), root)
        run.callback(job.stop)
        endpoint = job.endpoint
        before = job.wait_status(lambda f: f["env_steps"] > 0 and f["policy_version"] >= 1, 300.0, "the job to train once")
        rss0 = rss_mb(job.broker_proc.pid)
        note(f"job running (env_steps={before['env_steps']}, version={before['policy_version']}); fuzzing with {total} messages")
        ctx = zmq.Context()
        roles = ["simulator", "generator", "client", None]
        fuzzers = [Fuzzer(ctx, endpoint, roles[i % len(roles)], total // args.clients + (i < total % args.clients),
                          args.seed + i, keys) for i in range(args.clients)]
        t0 = time.monotonic()
        for f in fuzzers:
            f.start()
        rss_peak = rss0
        while any(f.is_alive() for f in fuzzers):
            rss_peak = max(rss_peak, rss_mb(job.broker_proc.pid)) if job.broker_proc.poll() is None else rss_peak
            time.sleep(0.2)  # sampling RSS while the clients send
        seconds = time.monotonic() - t0
        alive = job.broker_proc.poll() is None
        after = {}
        if alive:  # the job must go on advancing after the storm, not only survive it
            try:
                after = job.wait_status(lambda f: f["env_steps"] > before["env_steps"] and
                                        f["policy_version"] > before["policy_version"], 120.0, "the job to advance")
            except (TimeoutError, RuntimeError) as exc:
                note(f"job did not advance: {exc}")
                after = request_status(endpoint, keys_dir=keys)
        rss1 = rss_mb(job.broker_proc.pid) if alive else 0.0
        keyless = keyless_answered(ctx, endpoint) if keys else None
        ctx.term()
        result = {
            "sent": sum(f.sent for f in fuzzers),
            "errors": (after.get("errors", 0) - before.get("errors", 0)) if after else None,
            "broker_alive": alive,
            "job_advanced": bool(after) and after["env_steps"] > before["env_steps"] and after["policy_version"] > before["policy_version"],
            "rss_growth_mb": round(rss1 - rss0, 1),
            "rss_peak_growth_mb": round(rss_peak - rss0, 1),
            "all_read": all(f.confirmed for f in fuzzers),
            "error_replies_received": sum(f.errors for f in fuzzers),
            "replies": sum(f.replies for f in fuzzers),
            "messages_per_s": round(sum(f.sent for f in fuzzers) / max(seconds, 1e-9)),
            "env_steps": [before["env_steps"], after.get("env_steps")],
            "policy_version": [before["policy_version"], after.get("policy_version")],
            "workers_alive": all(p.poll() is None for p in job.workers),
            "client_failures": [f.failure for f in fuzzers if f.failure],
            "broker_log_mb": round((root / "broker.log").stat().st_size / 2**20, 2),  # rejections are rate-limited
            # The loop's time per turn for one peer's messages (bundles included), over the job's
            # life up to ``after``, fuzzing included (brokers/broker.py PEER_TURN_S); target p99 <= 1 ms.
            "peer_turn_us": {k: after.get("peer_turn_us", {}).get(k) for k in ("count", "p50", "p99", "max")},
            "peer_turns_cut": after.get("peer_turns_cut"),
            "peer_rate": after.get("peer_rate"),
            "curve": bool(keys),
            "keyless_answered": keyless,  # with CURVE: a peer without an allowlisted key gets nothing back
            "targets": {"broker_alive": True, "job_advanced": True, "rss_growth_mb_max": 64, "peer_turn_us_p99_max": 1000},
        }
        run.ok = result["broker_alive"] and result["job_advanced"] and result["workers_alive"]
    emit_to(args.out, "fuzz.json", result)


if __name__ == "__main__":
    main()
