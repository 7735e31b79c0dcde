"""How many requests per second one broker routes: fake simulator slots and an echo generator,
the offered rate ramped until the broker saturates (docs/scaling.md).

    python bench/broker/capacity.py --quick     # --sims 2 --slots 256 --envs 1 --max-batch 32 --curve ...

A real broker (on ipc://), the echo generator (``rlvla3/harness/echo.py``) and ``--sims``
simulator processes of ``--slots`` slots. A request is one OBS whose observation (a 16x16 image
and a state) lies in the simulator's shared memory, counted when its ACT comes back; ``--envs N``:
N envs per OBS (``env_obs_per_broker_core``). What is due goes as one BUNDLE and ACTs come in
BUNDLEs, as with a simulator worker (``--no-bundles``: one message per request). Open-loop:
request ``i`` is due at ``t0 + i/rate``; latency counts from then (HdrHistogram, us).

The ramp: steps of ``--duration`` s, the offered rate growing by ``--factor`` from
``--start-rate`` until saturation (achieved < 85% of offered, or 90% of a core used) or
``--steps``; ``max_rps`` is the best achieved rate; one step at 80% of it gives
``p99_us_at_80pct``. The load generators share the cores with the broker, so
``rps_per_broker_core`` divides the rate by the broker process's own CPU over the same window
(``broker_threads_cpu_pct`` splits it). Target: >= 20,000 requests/s per broker core.
``reference_obs_decode_us`` (one OBS decode's CPU time here, before and after) is the yardstick
between runs under different loads. ``errors``: an overloaded step leaves requests outstanding
that the broker may refuse as ``over_limit``.

Writes ``broker_capacity.png`` and ``.json`` under ``--out``; ``--profile`` runs the broker under
cProfile (its thread's CPU clock): ``broker_capacity.prof.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

import msgpack
import zmq
from hdrh.histogram import HdrHistogram

from rlvla3 import bundle, names
from rlvla3 import protocol as P
from rlvla3.config import load
from rlvla3.harness.bench import (
    BenchRun, cpu_seconds, emit_to, load_avg, merged, new_hist, note, parse_bench_args, read_line, record_us, save_figure,
    shm_slots, start_child, subplots, summary, thread_cpu_seconds, wait_readable,
)
from rlvla3.harness.echo import ECHO
from rlvla3.harness.jobs import Job, generator_serving, start_job
from rlvla3.harness.peer import Peer
from rlvla3.lifetime import follow_launcher
from rlvla3.observation import IMAGES, STATE
from rlvla3.shm import host_id

IMAGE = 16
STATE_DIM = 4
REQ_ID_MARK = 2**53
"""A req_id msgpack writes as a uint64 (``0xcf`` and 8 bytes): the place each request's id goes."""
_MARK_BYTES = b"\xcf" + REQ_ID_MARK.to_bytes(8, "big")
SATURATED_RATE = 0.85
"""A step whose achieved rate is under this share of the offered one has saturated."""
SATURATED_CPU = 90.0
"""A step where the broker's process used this much of one core (%) has saturated."""


class FakeSimulator:
    """One simulator peer: ``slots`` slots, each with its observation in this process's shared
    memory (written once: the broker reads only the reference)."""

    def __init__(self, endpoint: str, slots: int, envs: int, keys: str | None, bundles: bool) -> None:
        self.ctx = zmq.Context()
        self.peer = Peer(self.ctx, endpoint, "simulator", f"capacity-{os.getpid()}", keys, slots=slots,
                         num_envs=slots * envs, bundles=bundles)
        self.sock, self.slots, self.bundles = self.peer.sock, slots, bundles
        welcome = self.peer.expect(P.READY, 30.0)
        self.pool, blocks, refs = shm_slots(str(welcome.get("run_id", "bench")), slots, envs, {"top": (IMAGE, IMAGE)}, STATE_DIM)
        # Per slot, encoded once with a fixed-width req_id patched per request (``request``): the
        # broker serves each (slot, req_id) once, and the load generator spends its CPU on
        # sending, not encoding. Two versions, as a simulator worker sends them: the first OBS of a
        # slot carries its block's descriptors, the later ones name the block.
        self.frames: list[tuple[list[Any], list[Any]]] = []
        for slot, block in enumerate(blocks):
            block.images["top"][...], block.state[...] = 7, 0.5
            fields = {"slot": slot, "req_id": REQ_ID_MARK, "n": envs, "instruction": ["reach the goal"] * envs,
                      "episode_step": [1] * envs, "env_steps": envs, "block": slot}
            full, named = P.encode(P.OBS, fields, refs[slot]), P.encode(P.OBS, fields)
            self.frames.append(([bytearray(full[0]), *full[1:]], [bytearray(named[0]), *named[1:]]))
        blocks.clear()  # views of the pool, which ``close`` closes
        # Where each header's req_id bytes are: per header, since a slot number from 128 on takes
        # one more byte than those before it.
        self.at = [tuple(frames[0].index(_MARK_BYTES) + 1 for frames in versions) for versions in self.frames]
        for slot in range(slots):  # every patched header is one the broker accepts as this slot's
            for version in (0, 1):
                msg = P.decode(self._patched(slot, version, slot + 1))
                if (msg["slot"], msg["req_id"], msg["block"]) != (slot, slot + 1, slot):
                    raise RuntimeError(f"slot {slot}'s pre-encoded OBS reads as slot {msg['slot']}, req_id {msg['req_id']}")
        self.defined: set[int] = set()  # slots whose block's descriptors the broker has
        self.next_req = 0

    def _patched(self, slot: int, version: int, req_id: int) -> list[Any]:
        frames, at = self.frames[slot][version], self.at[slot][version]
        frames[0][at:at + 8] = req_id.to_bytes(8, "big")
        return frames

    def request(self, slot: int) -> tuple[list[Any], int]:
        """The slot's OBS frames with a new req_id, and that id."""
        self.next_req += 1
        frames = self._patched(slot, int(slot in self.defined), self.next_req)
        self.defined.add(slot)
        return frames, self.next_req

    def phase(self, start_at: float, rate: float, duration_s: float) -> dict[str, Any]:
        """Requests due at ``start_at + i/rate`` (wall clock) for ``duration_s``; ACTs counted in
        that window. Then what is still out is drained (not counted) and the rest dropped."""
        hist = new_hist()
        period_ns = 1e9 / rate
        total = int(rate * duration_s)
        free = list(range(self.slots - 1, -1, -1))
        backlog: deque[int] = deque()
        inflight: dict[int, tuple[int, int]] = {}  # slot -> (due_ns, req_id)
        while time.time() < start_at - 0.001:
            self.peer.keepalive()
            time.sleep(min(0.05, max(0.0, start_at - time.time() - 0.001)))  # the step starts at a shared wall time
        t0 = time.perf_counter_ns() + int((start_at - time.time()) * 1e9)
        end = t0 + int(duration_s * 1e9)
        drain_until = end + 2_000_000_000
        sent = done = i = 0
        errors: dict[str, int] = {}  # ERROR codes, and "act" for an ACT that carried an error
        now = time.perf_counter_ns()
        while now < drain_until and (now < end or inflight):
            while i < total and t0 + int(i * period_ns) <= now:
                backlog.append(t0 + int(i * period_ns))
                i += 1
            turn = []  # what is due now goes as one BUNDLE, as a simulator's finished slots do
            while backlog and free and now < end:
                due = backlog.popleft()
                slot = free.pop()
                frames, req_id = self.request(slot)
                turn.append(frames)
                inflight[slot] = (due, req_id)
                sent += 1
            for _, frames in (bundle.bundle(turn) if self.bundles else ((1, f) for f in turn)):
                self.sock.send_multipart(frames)
            until = t0 + int(i * period_ns) if i < total and now < end else drain_until
            if wait_readable(self.sock, max(0.0, (until - now) / 1e9)):
                while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    frames = self.sock.recv_multipart()
                    t = time.perf_counter_ns()
                    for header in headers(frames):
                        if header.get("type") != P.ACT:
                            if header.get("type") == P.ERROR:
                                errors[header.get("code")] = errors.get(header.get("code"), 0) + 1
                            continue
                        entry = inflight.get(header.get("slot"))
                        if entry is None or entry[1] != header.get("req_id"):
                            continue
                        del inflight[header["slot"]]
                        free.append(header["slot"])
                        if header.get("error"):
                            errors["act"] = errors.get("act", 0) + 1
                        if t <= end:
                            done += 1
                            record_us(hist, t - entry[0])
            now = time.perf_counter_ns()
            self.peer.keepalive(drain=False)
        return {"sent": sent, "done": done, "errors": errors, "unanswered": len(inflight), "hist": hist.encode().decode()}

    def close(self) -> None:
        self.peer.close()
        self.pool.close()
        self.ctx.term()


def headers(frames: list[bytes]) -> list[dict[str, Any]]:
    """The headers of a message, or of each part of a BUNDLE. The broker is trusted here: count,
    don't validate (``bundle.decode_all`` is what workers run)."""
    header = msgpack.unpackb(frames[0])
    if header.get("type") != P.BUNDLE:
        return [header]
    return [msgpack.unpackb(part[0]) for part in bundle.parts(header["parts"], frames[1:])]


def simulator_child(args: argparse.Namespace) -> None:
    """``--child``: one FakeSimulator; a stdin line ``START_AT RATE DURATION`` runs a phase and
    answers one JSON line; end of stdin ends the process."""
    follow_launcher()
    sim = FakeSimulator(args.endpoint, args.slots, args.envs, args.keys, not args.no_bundles)
    print("ready", flush=True)
    try:
        while True:
            sim.peer.keepalive()
            # One line at a time: the next comes only after this one's answer, so none waits in
            # stdin's buffer where select cannot see it.
            if not select.select([sys.stdin], [], [], 0.2)[0]:
                continue
            line = sys.stdin.readline()
            if not line:
                return
            start_at, rate, duration = (float(x) for x in line.split())
            print(json.dumps(sim.phase(start_at, rate, duration)), flush=True)
    finally:
        sim.close()


def profiled_broker(config: str, run_dir: str, prof_out: str) -> None:
    """``--profiled-broker``: the real ``Broker`` in this process under cProfile, timed by this
    thread's CPU clock (a busy machine's waits for a core then count for nothing); the 40
    functions with the most own time go to ``prof_out`` when it stops (SIGTERM)."""
    import cProfile
    import io
    import pstats

    from brokers.broker import Broker
    from rlvla3.lifetime import on_stop_signals
    from rlvla3.logging import configure

    follow_launcher()
    configure(role="broker", pid=os.getpid(), level="warning")
    broker = Broker(load(config), bind=f"ipc://{run_dir}/broker", pub=f"ipc://{run_dir}/pub")
    on_stop_signals(broker.stop)
    print(broker.bound, flush=True)
    prof = cProfile.Profile(time.thread_time)
    prof.runcall(broker.run)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    Path(prof_out).write_text(text.getvalue())


def run_step(sims: list[Any], procs: dict[str, list[int]], rate: float, duration_s: float) -> dict[str, Any]:
    """Offer ``rate`` requests/s in all for ``duration_s``; the figures of that window."""
    start_at = time.time() + 0.3
    for s in sims:
        s.stdin.write(f"{start_at} {rate / len(sims)} {duration_s}\n".encode())
        s.stdin.flush()
    time.sleep(max(0.0, start_at - time.time()))
    cpu0 = {k: sum(cpu_seconds(p) for p in ps) for k, ps in procs.items()}
    threads0 = thread_cpu_seconds(procs["broker"][0])
    time.sleep(duration_s)
    cpu1 = {k: sum(cpu_seconds(p) for p in ps) for k, ps in procs.items()}
    threads1 = thread_cpu_seconds(procs["broker"][0])
    lines = [read_line(s, duration_s + 30.0) for s in sims]
    if None in lines:
        raise TimeoutError(f"a simulator gave no figures within {duration_s + 30.0} s")
    answers = [json.loads(line) for line in lines]
    hist = merged(HdrHistogram.decode(a["hist"]) for a in answers)
    done = sum(a["done"] for a in answers)
    achieved = done / duration_s
    cpu = {k: round(100.0 * (cpu1[k] - cpu0[k]) / duration_s, 1) for k in procs}
    lat = summary(hist)
    return {
        "offered_rps": round(rate, 1), "achieved_rps": round(achieved, 1), "done": done,
        "errors": sum(sum(a["errors"].values()) for a in answers), "error_codes": merged_counts(a["errors"] for a in answers),
        "unanswered": sum(a["unanswered"] for a in answers),
        "broker_cpu_pct": cpu["broker"], "generator_cpu_pct": cpu["generator"], "simulators_cpu_pct": cpu["simulators"],
        "rps_per_broker_core": round(achieved / (cpu["broker"] / 100.0), 1) if cpu["broker"] > 0 else None,
        "broker_cpu_us_per_request": round(1e4 * cpu["broker"] / achieved, 1) if achieved else None,
        # the broker's CPU by thread (% of one core): its Python loop, and libzmq's I/O thread
        "broker_threads_cpu_pct": {k: round(100.0 * (threads1[k] - threads0[k]) / duration_s, 1) for k in threads1},
        "p50_us": lat.get("p50"), "p99_us": lat.get("p99"),
    }


def merged_counts(counts: Any) -> dict[str, int]:
    """Error counts of several steps or simulators, summed per code."""
    return dict(sum((Counter(c) for c in counts), Counter()))


def reference_us(frames: list[Any], reps: int = 2000) -> float:
    """CPU us of one ``protocol.decode`` of an OBS in this process, now: a yardstick for the
    machine's state (a loaded shared machine inflates CPU time too), reported beside the rates."""
    t0 = time.process_time()
    for _ in range(reps):
        P.decode(frames)
    return round((time.process_time() - t0) / reps * 1e6, 2)


def plot(ramp: list[dict[str, Any]], path: Path, title: str) -> Path:
    fig, ax = subplots(figsize=(7, 4.2))
    xs = [r["offered_rps"] for r in ramp]
    ax.plot(xs, [r["achieved_rps"] for r in ramp], "o-", label="achieved requests/s")
    ax.plot(xs, xs, ":", color="grey", label="offered")
    ax.set(xlabel="offered requests/s", ylabel="requests/s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(xs, [r["broker_cpu_pct"] for r in ramp], "s--", color="#c63", label="broker CPU %")
    ax2.set_ylabel("broker CPU (% of one core)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    return save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sims", type=int, default=2, help="simulator processes")
    ap.add_argument("--slots", type=int, default=256, help="slots per simulator (at most broker.max_peer_requests)")
    ap.add_argument("--envs", type=int, default=1, help="envs per request (per slot): each OBS carries this many")
    ap.add_argument("--max-batch", type=int, default=32)  # envs, as the broker counts them
    ap.add_argument("--max-wait-ms", type=float, default=2.0)
    ap.add_argument("--credits", type=int, default=2, help="the echo generator's credits")
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per ramp step")
    ap.add_argument("--start-rate", type=float, default=1000.0, help="offered requests/s of the first step")
    ap.add_argument("--factor", type=float, default=1.5, help="offered rate growth per step")
    ap.add_argument("--steps", type=int, default=10, help="ramp steps at most")
    ap.add_argument("--curve", action="store_true", help="CURVE on: the broker gets a key folder, every peer a key")
    ap.add_argument("--no-bundles", action="store_true",
                    help="simulators neither send nor take BUNDLEs: one message per request each way")
    ap.add_argument("--profile", action="store_true",
                    help="run the broker under cProfile (its thread's CPU time): broker_capacity.prof.txt")
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--keys", help=argparse.SUPPRESS)
    ap.add_argument("--profiled-broker", nargs=3, metavar=("CONFIG", "RUN_DIR", "OUT"), help=argparse.SUPPRESS)
    args = parse_bench_args(ap, "short ramp (about a minute with start-up)", simulator_child)
    if args is None:
        return
    if args.profiled_broker:
        profiled_broker(*args.profiled_broker)
        return
    if args.quick:  # to 25,600 offered requests/s: past what this 2-core machine's simulators can send
        args.duration, args.steps = 2.0, 9
    if args.smoke:
        # 160 slots: past 128, where a slot's number takes one more byte in its pre-encoded header
        args.duration, args.steps, args.start_rate, args.sims, args.slots = 0.5, 2, 200.0, 1, 160
    out = Path(args.out)

    t_start = time.monotonic()
    with BenchRun("capacity", args.curve) as run:
        run_dir, keys = run.dir, run.keys
        cfg = load("synthetic.yaml", [
            "env.name=synthetic", f"env.options.image_size={IMAGE}", "workers.simulators=0", "workers.generators=1",
            "workers.trainers=0", "run.mode=async", f"batching.max_batch={args.max_batch}",
            f"batching.max_wait_ms={args.max_wait_ms}", f"batching.credits={args.credits}",
            *([f"broker.keys_dir={keys}"] if keys else []),
        ])
        if args.profile:  # the broker is this script's child, under cProfile
            (run_dir / "config.yaml").write_text(cfg.to_yaml())
            job = Job(cfg, run_dir, run_dir / "config.yaml")
            prof_path = (out / "broker_capacity.prof.txt").resolve()
            job.broker_proc, job.endpoint = start_child([__file__, "--profiled-broker", str(run_dir / "config.yaml"),
                                                         str(run_dir), str(prof_path)])
        else:
            job = start_job(cfg, run_dir, False, f"ipc://{run_dir}/broker", f"ipc://{run_dir}/pub")
        run.callback(job.stop)
        key_args = ["--keys", keys] if keys else []
        gen, _ = run.child([*ECHO, "generator", job.endpoint, "--credits", str(args.credits), *key_args])
        job.wait(generator_serving, 60.0, "the echo generator")
        sims = [run.child([__file__, "--child", "--endpoint", job.endpoint, "--slots", str(args.slots), "--envs", str(args.envs),
                           *key_args, *(["--no-bundles"] if args.no_bundles else [])], talk=True)[0] for _ in range(args.sims)]
        procs = {"broker": [job.broker_proc.pid], "generator": [gen.pid],
                 "simulators": [s.pid for s in sims]}
        note(f"up in {time.monotonic() - t_start:.1f} s: {args.sims} simulators x {args.slots} slots x {args.envs} envs, "
             f"max_batch {args.max_batch}, max_wait {args.max_wait_ms} ms, CURVE {'on' if keys else 'off'}")

        ref_frames = P.encode(P.OBS, {"slot": 0, "req_id": 1, "n": 1, "instruction": ["reach the goal"],
                                      "episode_step": [1], "env_steps": 1},
                              {names.tensor_name(IMAGES, "top"): P.ShmRef(P.SHM_PREFIX + "ref_1_1", 0, 768, "uint8",
                                                                          (1, IMAGE, IMAGE, 3), host_id()),
                               STATE: P.ShmRef(P.SHM_PREFIX + "ref_1_1", 1024, 16, "float32", (1, STATE_DIM), host_id())})
        ref_before = reference_us(ref_frames)
        run_step(sims, procs, args.start_rate / 2, min(1.0, args.duration))  # warm-up
        ramp: list[dict[str, Any]] = []
        rate = args.start_rate
        for _ in range(args.steps):
            step = run_step(sims, procs, rate, args.duration)
            ramp.append(step)
            note(f"offered {step['offered_rps']:.0f}/s: achieved {step['achieved_rps']:.0f}/s, broker CPU "
                 f"{step['broker_cpu_pct']}%, {step['rps_per_broker_core']} req/s per broker core, p99 {step['p99_us']} us")
            if step["achieved_rps"] < SATURATED_RATE * rate or step["broker_cpu_pct"] >= SATURATED_CPU:
                break
            rate *= args.factor
        best = max(ramp, key=lambda r: r["achieved_rps"])
        at80 = run_step(sims, procs, 0.8 * best["achieved_rps"], args.duration)
        note(f"80% of max ({at80['offered_rps']:.0f}/s): achieved {at80['achieved_rps']:.0f}/s, p99 {at80['p99_us']} us")
        status = job.status()
        result = {
            "max_rps": best["achieved_rps"],
            "rps_per_broker_core": best["rps_per_broker_core"],
            "broker_cpu_pct": best["broker_cpu_pct"],
            "broker_cpu_us_per_request": best["broker_cpu_us_per_request"],
            "broker_threads_cpu_pct": best["broker_threads_cpu_pct"],
            "p99_us_at_80pct": at80["p99_us"], "p50_us_at_80pct": at80["p50_us"],
            "target_rps_per_broker_core": 20_000,
            "envs_per_request": args.envs, "bundles": not args.no_bundles,
            "env_obs_per_broker_core": round(best["rps_per_broker_core"] * args.envs, 1) if best["rps_per_broker_core"] else None,
            "saturated": best is not ramp[-1] or ramp[-1]["achieved_rps"] < SATURATED_RATE * ramp[-1]["offered_rps"]
                         or ramp[-1]["broker_cpu_pct"] >= SATURATED_CPU,
            # Who ran out first: the broker (a core's worth of CPU) or the rest of the machine.
            "saturated_by": "broker" if max(r["broker_cpu_pct"] for r in ramp) >= SATURATED_CPU else "machine",
            "curve": bool(keys), "transport": "ipc", "sims": args.sims, "slots": args.slots,
            "max_batch": args.max_batch, "max_wait_ms": args.max_wait_ms, "duration_s": args.duration,
            "errors": sum(r["errors"] for r in [*ramp, at80]),
            "error_codes": merged_counts(r["error_codes"] for r in [*ramp, at80]),
            "broker_batch_size": status.get("batch_size"),
            "ramp": ramp, "at_80pct": at80,
            "reference_obs_decode_us": [ref_before, reference_us(ref_frames)],
            "cpus": os.cpu_count(), "load_avg": load_avg(),
            "wall_s": round(time.monotonic() - t_start, 1),
        }
        result["png"] = str(plot(ramp, out / "broker_capacity.png",
                                 f"one broker, echo generator, {args.sims} x {args.slots} slots x {args.envs} envs, max_batch "
                                 f"{args.max_batch}, CURVE {'on' if keys else 'off'}"))
        run.ok = True
    if args.profile:  # written when the broker stopped
        prof = out / "broker_capacity.prof.txt"
        note(f"broker profile (own CPU time): {prof}" if prof.is_file() else "no broker profile written")
    emit_to(out, "broker_capacity.json", result)


if __name__ == "__main__":
    main()
