"""Open-loop request latency through the broker (simulator -> broker -> generator -> back),
beside two floors measured in the same run: a raw pyzmq DEALER<->ROUTER echo, and a raw relay
of the same topology (simulator -> relay -> echo -> relay -> simulator, pyzmq and no logic).

    python bench/broker/latency.py --quick     # --rate 150 --curve

A real broker (16x16 images, ``max_batch`` 1, ``max_wait_ms`` 0) with the echo generator
(``rlvla3/harness/echo.py``: no forward pass, so the figure is the broker's own cost). This
process is a simulator whose slots' observations lie in shared memory. Request ``i`` is due at
``t0 + i/rate`` and goes out on a free slot (waiting for one is part of its latency); latency
counts from when it was *due* (wrk2's cure for coordinated omission). All three run the same
client code and frames, in alternating rounds so that a noisy neighbour hits all alike.
Targets: broker p50 <= 1.5x the relay's, p99 <= 2x.

``parts`` (us): ``send_lag`` (due -> sent), ``queue_wait`` (ACT.queue_us), ``forward``
(ACT.forward_us), the broker's ``generate`` and ``batch_form`` (STATUS), and what remains: the
hops and the Python on them. Writes ``latency.png`` and ``latency.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import numpy as np
import zmq

from rlvla3 import protocol as P
from rlvla3.config import load
from rlvla3.harness.bench import (
    BenchRun, emit_to, merged, new_hist, note, parse_bench_args, percentile_plot, record_us, shm_slots, summary, wait_readable,
)
from rlvla3.harness.echo import ECHO
from rlvla3.harness.jobs import Job, generator_serving, start_job
from rlvla3.harness.peer import Peer, zmq_socket

IMAGE = 16
STATE_DIM = 4


class Client:
    """Builds OBS frames the way the simulator worker does (a shared-memory block per slot)."""

    def __init__(self, slots: int, n: int, run_id: str, seed: int = 0) -> None:
        self.slots = slots
        self.n = n
        rng = np.random.default_rng(seed)
        self.images = rng.integers(0, 256, (slots, n, IMAGE, IMAGE, 3), dtype=np.uint8)
        self.state = rng.standard_normal((slots, n, STATE_DIM)).astype(np.float32)
        self.pool, self.blocks, self.refs = shm_slots(run_id, slots, n, {"top": (IMAGE, IMAGE)}, STATE_DIM)

    def obs_frames(self, slot: int, req_id: int) -> list[Any]:
        np.copyto(self.blocks[slot].images["top"], self.images[slot])
        np.copyto(self.blocks[slot].state, self.state[slot])
        fields = {"slot": slot, "req_id": req_id, "n": self.n, "instruction": ["reach the goal"] * self.n,
                  "episode_step": [1] * self.n, "env_steps": 0}
        return P.encode(P.OBS, fields, self.refs[slot])

    def close(self) -> None:
        self.blocks.clear()
        self.pool.close()


class PhaseResult:
    def __init__(self) -> None:
        self.latency = new_hist()  # due -> reply
        self.service = new_hist()  # sent -> reply
        self.send_lag = new_hist()  # due -> sent
        self.queue_wait = new_hist()  # ACT.queue_us
        self.forward = new_hist()  # ACT.forward_us
        self.hops_and_python = new_hist()  # sent -> reply, minus queue_wait and forward
        self.sent = self.done = self.errors = 0
        self.elapsed_s = 0.0


def open_loop(sock: zmq.Socket, client: Client, rate: float, duration_s: float, res: PhaseResult,
              expect: str | None, tick: Callable[[], None], req0: int, spin_s: float = 0.0) -> int:
    """Issue ``rate * duration_s`` requests, each due at ``t0 + i/rate``; wait for all replies.

    ``expect`` is the reply type that completes a request (ACT from the broker); None accepts any
    message carrying the request's slot and req_id (the echo). Returns the next req_id.
    """
    total = max(1, int(round(rate * duration_s)))
    period_ns = 1e9 / rate
    free = list(range(client.slots - 1, -1, -1))
    backlog: deque[int] = deque()
    inflight: dict[int, tuple[int, int, int]] = {}  # slot -> (due_ns, sent_ns, req_id)
    req_id = req0
    i = 0
    now = time.perf_counter_ns()
    t0 = now + 2_000_000
    drain_deadline = t0 + int(duration_s * 1e9) + 10_000_000_000
    next_tick = now
    while res.done < total and now < drain_deadline:
        # -- requests that are due go out on free slots (the rest wait for one) --------------
        while i < total and t0 + int(i * period_ns) <= now:
            backlog.append(t0 + int(i * period_ns))
            i += 1
        while backlog and free:
            due = backlog.popleft()
            slot = free.pop()
            req_id += 1
            frames = client.obs_frames(slot, req_id)
            sent = time.perf_counter_ns()
            sock.send_multipart(frames, copy=False)
            inflight[slot] = (due, sent, req_id)
            record_us(res.send_lag, sent - due)
            res.sent += 1
        # -- wait for a reply, or until the next request is due ------------------------------
        now = time.perf_counter_ns()
        until = t0 + int(i * period_ns) if i < total else drain_deadline
        if now >= next_tick:
            tick()
            next_tick = now + 250_000_000
            until = min(until, next_tick)
        if wait_readable(sock, max(0.0, (min(until, next_tick) - now) / 1e9), spin_s if i < total else 0.0):
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                frames = sock.recv_multipart(copy=False)
                t = time.perf_counter_ns()
                try:
                    msg = P.decode(frames)
                except P.ProtocolError:
                    res.errors += 1
                    continue
                if expect is not None and msg.type != expect:
                    if msg.type == P.ERROR:
                        res.errors += 1
                        note(f"ERROR from broker: {msg['code']}: {msg['reason']}")
                    continue
                slot, rid = msg.get("slot"), msg.get("req_id")
                entry = inflight.get(slot)
                if entry is None or entry[2] != rid:
                    continue
                due, sent, _ = inflight.pop(slot)
                record_us(res.latency, t - due)
                record_us(res.service, t - sent)
                if expect is not None:
                    if msg.get("error"):
                        res.errors += 1
                    q, f = int(msg.get("queue_us", 0)), int(msg.get("forward_us", 0))
                    res.queue_wait.record_value(max(1, q))
                    res.forward.record_value(max(1, f))
                    res.hops_and_python.record_value(max(1, (t - sent) // 1000 - q - f))
                free.append(slot)
                res.done += 1
        now = time.perf_counter_ns()
    res.elapsed_s += (now - t0) / 1e9
    if res.done < total:
        note(f"warning: {total - res.done} of {total} requests unanswered at the deadline")
    return req_id


def start_broker(args: argparse.Namespace, run_dir: Path, keys: str | None) -> Job:
    """The broker, configured for one generator: the echo peer."""
    overrides = [
        "env.name=synthetic", f"env.options.image_size={IMAGE}", "env.num_envs=1", "env.slots=1",
        "model.family=mlp", "model.options.hidden=64", "model.chunk_size=1", "model.options.use_images=false",
        f"batching.max_batch={args.max_batch}", f"batching.max_wait_ms={args.max_wait_ms}",
        f"batching.credits={args.credits}", "workers.simulators=0", "workers.generators=1",
        "workers.trainers=0", "run.mode=async", "workers.device=cpu", "workers.torch_threads=1",
        *([f"broker.keys_dir={keys}"] if keys else []),
    ]
    return start_job(load("synthetic.yaml", overrides), run_dir, workers=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=150.0, help="target requests per second")
    ap.add_argument("--duration", type=float, default=2.0, help="seconds per phase and round")
    ap.add_argument("--rounds", type=int, default=8, help="raw/relay/broker rounds, alternating")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--n", type=int, default=1, help="envs per request")
    ap.add_argument("--curve", action="store_true", help="CURVE on: the broker gets a key folder, every peer a key")
    ap.add_argument("--max-batch", type=int, default=1)
    ap.add_argument("--max-wait-ms", type=float, default=0.0)
    ap.add_argument("--credits", type=int, default=2)
    ap.add_argument("--spin-us", type=float, default=200.0,
                    help="spin (instead of sleeping) this long before each due time: timer wake-ups on a VM are late")
    args = parse_bench_args(ap, "short run (under 60 s with start-up)")
    if args.quick:  # many short rounds: on a shared machine the noise then falls on all three alike
        args.rate, args.duration, args.rounds = min(args.rate, 100.0), 1.0, 6
    if args.smoke:
        args.rate, args.duration, args.rounds = min(args.rate, 100.0), 0.5, 1
    out = Path(args.out)

    t_start = time.monotonic()
    with BenchRun("latency", args.curve) as run:
        # -- start-up: broker + generator, echo server, relay + its echo; join as a simulator --
        keys, ctx = run.keys, zmq.Context()
        run.callback(ctx.term)
        job = start_broker(args, run.dir, keys)
        run.callback(job.stop)
        run.child([*ECHO, "generator", job.endpoint, "--credits", str(args.credits), *(["--keys", keys] if keys else [])])
        echo_ep, relay_ep = run.child([*ECHO, "echo"])[1], run.child([*ECHO, "relay"])[1]
        run.child([*ECHO, "relay-echo", relay_ep])
        sim = Peer(ctx, job.endpoint, "simulator", "bench-latency", keys, slots=args.slots, num_envs=args.slots * args.n)
        run.callback(sim.close)
        welcome, bsock = sim.expect(P.READY, 20.0).header, sim.sock
        esock, rsock = zmq_socket(ctx, zmq.DEALER), zmq_socket(ctx, zmq.DEALER)
        for sk, ep in ((esock, echo_ep), (rsock, relay_ep)):
            sk.connect(ep)
            run.callback(sk.close, 0)
        client = Client(args.slots, args.n, str(welcome.get("run_id", "bench")))
        run.callback(client.close)

        def drain_broker() -> None:
            sim.keepalive(every_s=0.0)  # the broker expires a silent worker after 3 x 1 s

        job.wait(lambda f: drain_broker() or generator_serving(f), 60, "the generator to serve")
        note(f"fabric up in {time.monotonic() - t_start:.1f} s; echo generator, shm, "
             f"curve={bool(keys)}, rate={args.rate}/s, {args.rounds} x {args.duration} s per phase")

        # -- warm-up, then alternating rounds: raw echo, raw relay, broker ----------------------
        spin = args.spin_us / 1e6
        phases = {"raw": (esock, None, drain_broker), "relay": (rsock, None, drain_broker),
                  "broker": (bsock, P.ACT, lambda: None)}
        req = 0
        warm = min(1.0, args.duration)
        for sock, expect, tick in phases.values():
            req = open_loop(sock, client, args.rate, warm, PhaseResult(), expect, tick, req, spin)
        status0 = job.status()
        rounds: dict[str, list[PhaseResult]] = {name: [] for name in phases}
        for r in range(args.rounds):
            for name, (sock, expect, tick) in phases.items():
                res = PhaseResult()
                req = open_loop(sock, client, args.rate, args.duration, res, expect, tick, req, spin)
                rounds[name].append(res)
            note(f"round {r}: p50 " + ", ".join(f"{k} {v[-1].latency.get_value_at_percentile(50)} us"
                                                for k, v in rounds.items()))
        status = job.status()

        # -- figures ---------------------------------------------------------------------------
        def mg(name: str, attr: str):
            return merged(getattr(x, attr) for x in rounds[name])

        def rate(name: str) -> float:
            elapsed = sum(x.elapsed_s for x in rounds[name])
            return round(sum(x.done for x in rounds[name]) / elapsed, 1) if elapsed else 0.0

        def ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
            return round(a[key] / b[key], 2) if a.get(key) and b.get(key) else None

        lat, raw_lat, relay_lat = mg("broker", "latency"), mg("raw", "latency"), mg("relay", "latency")
        s, rs, ls = summary(lat), summary(raw_lat), summary(relay_lat)
        parts = {
            **{f"{part}_us": summary(mg("broker", part))
               for part in ("send_lag", "service", "queue_wait", "forward", "hops_and_python")},
            **{f"broker_{key}": status.get(key) for key in ("queue_wait_us", "generate_us", "batch_form_us", "batch_size")},
            **{f"{floor}_{part}_us": summary(mg(floor, part)) for floor in ("raw", "relay") for part in ("send_lag", "service")},
        }
        result = {
            **{f"{prefix}{p}_us": summ.get(p) for prefix, summ in (("", s), ("raw_", rs), ("relay_", ls))
               for p in ("p50", "p90", "p99", "p999")},
            "max_us": s.get("max"),
            "ratio_p50": ratio(s, rs, "p50"), "ratio_p99": ratio(s, rs, "p99"),
            "p50_over_relay": ratio(s, ls, "p50"), "p99_over_relay": ratio(s, ls, "p99"),
            "p50_over_relay_by_round": [round(b.latency.get_value_at_percentile(50) / max(1, r.latency.get_value_at_percentile(50)), 2)
                                        for b, r in zip(rounds["broker"], rounds["relay"])],
            "target_p50_over_relay": 1.5, "target_p99_over_relay": 2.0,
            "generator": "echo", "curve": bool(keys),
            "target_rate": args.rate,
            "achieved_rate": rate("broker"), "raw_achieved_rate": rate("raw"), "relay_achieved_rate": rate("relay"),
            "requests": sum(x.done for x in rounds["broker"]), "raw_requests": sum(x.done for x in rounds["raw"]),
            "relay_requests": sum(x.done for x in rounds["relay"]),
            "errors": sum(x.errors for x in rounds["broker"]),
            "rounds": args.rounds, "duration_s": args.duration, "slots": args.slots, "n": args.n,
            "transport": "shm", "spin_us": args.spin_us, "max_batch": args.max_batch, "max_wait_ms": args.max_wait_ms,
            "requests_seen_by_broker": status.get("requests", 0) - status0.get("requests", 0),
            "parts": parts,
            "wall_s": round(time.monotonic() - t_start, 1),
        }
        result["png"] = str(percentile_plot(
            {f"broker, echo generator (p50 {s.get('p50')} us)": lat,
             f"raw pyzmq relay (p50 {ls.get('p50')} us)": relay_lat,
             f"raw pyzmq echo (p50 {rs.get('p50')} us)": raw_lat},
            out / "latency.png",
            f"open-loop {args.rate:.0f} req/s, shm, max_batch {args.max_batch}, "
            f"max_wait {args.max_wait_ms} ms, CURVE {'on' if keys else 'off'} (latency from due time)",
        ))
        run.ok = True
    emit_to(out, "latency.json", result)


if __name__ == "__main__":
    main()
