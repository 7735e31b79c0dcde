"""Publish -> every reader swapped: weight versions through the shared-memory store, against a
plain memcpy of the same bytes measured in the same run (docs/architecture.md, "Weights off the broker").

    python bench/fabric/weights.py --quick      # --sizes tiny,medium --readers 1,2 --versions 4 ...

This process plays trainer rank 0: a :class:`WeightPublisher` over a transformer-shaped bf16
model (``medium``: Qwen2-0.5B's shapes, the embedding frozen; built on the meta device, never as
an fp32 copy) whose every trainable tensor changes per version, announced through a real broker
(its RSS: ``broker_rss_mb``, before the first ``broker_rss_mb_start``). 1 or 2 readers, each a
:class:`WeightReceiver` beside a loop of bf16 "forward passes" that swaps between two passes.

Per version: ``publish_to_swap_ms`` from ``publish()`` to the last reader's swap (median over
versions 1..; version 0 also carries the frozen tensors: ``first_version_ms``). ``copies`` = 2
(model -> store -> the reader's staging; the swap re-points parameters). ``memcpy_ms``:
``np.copyto`` of as many bytes, one thread, right after each swap; ``hash_ms``: xxh3-64 over them;
``ratio`` = publish_to_swap / (memcpy x copies). ``max_serving_gap_ms``: the longest time between
two forward passes of a reader after its first swap (``max_swap_ms`` the swap itself,
``max_serving_gap_idle_ms`` with no version under way: the host's own noise). ``--sizes 3gb``: a
3.0 GB bf16 version (about 16 GB of RAM with 1 reader).

Last line of stdout: the largest size's and most readers' run plus ``runs`` (every size x readers).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import xxhash
import zmq

from rlvla3 import protocol as P
from rlvla3.config import load
from rlvla3.harness.bench import BenchRun, emit_to, note, parse_bench_args, start_child, stop_child
from rlvla3.harness.jobs import rss_mb, start_job
from rlvla3.harness.peer import Peer
from rlvla3.shm import host_id, segments_of_run
from rlvla3.weights.publisher import WeightPublisher
from rlvla3.weights.receiver import WeightReceiver

SIZES = {
    # name: (hidden, ffn, layers, vocab, kv)
    "tiny": (64, 256, 2, 1000, 16),
    "medium": (896, 4864, 24, 151936, 128),  # Qwen2-0.5B's shapes: 494M parameters
    "3gb": (2048, 8192, 25, 32000, 256),  # 1.5B trainable parameters: 3.0 GB of bf16 per version
}
COPIES = 2
PASSES = {"copies": COPIES, "hash_reads": 2, "finite_check_reads": 1,
          "path": "parameters -> store (copy, xxh3 of each 1 MiB chunk while in cache) -> reader's staging tensors "
                  "(copy, xxh3 likewise), an inf/NaN sum over what landed, then the swap re-points parameters (no copy)"}
"""What the path does to each byte besides the two full copies ``ratio`` counts."""
MEMCPY_CAP = 1 << 30
"""The memcpy baseline's buffers hold at most this many bytes (times scaled to the version's)."""
BATCH_MS = 5.0
"""A reader's forward pass lasts at least this long (matmuls, then a sleep for the rest)."""


# -- the model: transformer-shaped, bf16, built on meta ------------------------------------------


class Layer(torch.nn.Module):
    def __init__(self, h: int, ffn: int, kv: int) -> None:
        super().__init__()
        self.q = torch.nn.Linear(h, h)
        self.k = torch.nn.Linear(h, kv)
        self.v = torch.nn.Linear(h, kv)
        self.o = torch.nn.Linear(h, h, bias=False)
        self.gate = torch.nn.Linear(h, ffn, bias=False)
        self.up = torch.nn.Linear(h, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, h, bias=False)
        self.norm1 = torch.nn.RMSNorm(h)
        self.norm2 = torch.nn.RMSNorm(h)


class TransformerShaped(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int, layers: int, vocab: int, kv: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(Layer(hidden, ffn, kv) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(hidden)
        self.register_buffer("rope_inv_freq", torch.ones(hidden // 28 or 1))


def build_model(size: str, init: bool, dtype: str = "bfloat16") -> torch.nn.Module:
    """On the meta device, then materialised in bf16 (no fp32 copy ever exists). ``init``:
    fill with small random values (the publisher); otherwise zeros (a reader, whose version 0
    arrives through the store; zeroing touches its pages as a real build would)."""
    with torch.device("meta"):
        m = TransformerShaped(*SIZES[size]).to(getattr(torch, dtype))
    m = m.to_empty(device="cpu")
    m.embed.weight.requires_grad_(False)  # a frozen tower: sent once
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in [*m.parameters(), *m.buffers()]:
            t.uniform_(-0.02, 0.02, generator=g) if init else t.zero_()
    return m


def params_m(m: torch.nn.Module) -> float:
    return sum(p.numel() for p in m.parameters()) / 1e6


# -- children ----------------------------------------------------------------------------------


def reader(args: argparse.Namespace) -> None:
    """A serving loop with a WeightReceiver; reports swaps and serving figures over PUSH. ``args``:
    the settings :meth:`Bench.run` hands it (``--child JSON``)."""
    torch.set_num_threads(1)
    sys.setswitchinterval(0.0005)  # as the workers do
    model = build_model(args.size, init=False, dtype=args.dtype).eval()
    rx = WeightReceiver(model, args.host or host_id(), copy_threads=args.copy_threads)
    ppid = os.getppid()
    ctx = zmq.Context()
    sub, report = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(args.pub)
    report.setsockopt(zmq.LINGER, 5000)
    report.connect(args.report)
    print(args.name, flush=True)  # start_child waits for one line
    tell = lambda event, **kw: report.send_json({"event": event, "name": args.name, **kw})  # noqa: E731
    pool = ThreadPoolExecutor(1)
    job = None
    hidden = SIZES[args.size][0]
    x = torch.randn(16, hidden, dtype=getattr(torch, args.dtype))
    work = [layer.q.weight for layer in model.layers[:4]]
    forward_ms: list[float] = []
    gaps: list[float] = []
    idle_gaps: list[float] = []  # no fetch under way and no swap: the machine's own scheduling noise
    busy = False
    swaps: list[float] = []  # after the first: the first also lets the seeded build go
    last_end = None
    swapped_once = False
    offered: dict[int, int] = {}
    ready_sent = time.monotonic() + 0.3  # PUB/SUB: give the subscription time to reach the PUB
    while True:
        t0 = time.monotonic_ns()
        if last_end is not None and swapped_once:
            gaps.append((t0 - last_end) / 1e6)
            if not busy:
                idle_gaps.append(gaps[-1])
        with torch.inference_mode():  # one "forward pass": matmuls, then the rest of BATCH_MS
            h = x
            for w in work:
                h = h @ w.T
        rest = BATCH_MS / 1000 - (time.monotonic_ns() - t0) / 1e9
        if rest > 0:
            time.sleep(rest)  # (a real forward pass also leaves the GIL to the weights thread)
        t1 = last_end = time.monotonic_ns()
        busy = job is not None or rx.wanted is not None
        if swapped_once:
            forward_ms.append((t1 - t0) / 1e6)
        if not swapped_once and time.monotonic() - ready_sent > 0.2:
            tell("ready")
            ready_sent = time.monotonic()
        if select.select([sys.stdin], [], [], 0)[0] or os.getppid() != ppid:
            break  # the end of stdin: the bench is done with this reader
        while sub.poll(0, zmq.POLLIN):
            frames = sub.recv_multipart(copy=False)
            if rx.offer(P.decode(frames[1:]).header):
                offered[rx.wanted.version] = time.monotonic_ns()
                busy = True
        now = time.monotonic()
        if job is not None and job[1].done():
            ann, fut = job
            job = None
            rx.fetched(ann, None if fut.exception() else fut.result(), fut.exception(), now)
        s0 = time.monotonic_ns()
        staged = rx.swap()  # between two forward passes
        if staged is not None:
            busy = True
            s1 = time.monotonic_ns()
            if swapped_once:
                swaps.append((s1 - s0) / 1e6)
            swapped_once = True
            pool.submit(rx.release)  # the old version's storage is freed off the serving thread
            tell("swapped", version=staged.version, t_ns=s1, swap_ms=(s1 - s0) / 1e6, offer_ns=offered.get(staged.version, s1),
                 fetch_ms=staged.fetch_ms, nbytes=staged.nbytes, source=staged.source)
        if job is None:
            ann = rx.next_fetch(now)
            if ann is not None:
                job = (ann, pool.submit(rx.fetch, ann))
    pool.shutdown(wait=True)
    tell("stats", forward_ms=statistics.median(forward_ms) if forward_ms else None,
         forward_ms_max=max(forward_ms, default=None), max_gap_ms=max(gaps, default=None),
         max_idle_gap_ms=max(idle_gaps, default=None), idle_gaps=len(idle_gaps),
         gap_p99_ms=float(np.percentile(gaps, 99)) if gaps else None,
         max_swap_ms=max(swaps, default=None), rejected=rx.rejected, rss_mb=rss_mb(os.getpid()))
    rx.close()
    for s in (sub, report):
        s.close()
    ctx.term()


# -- the benchmark -----------------------------------------------------------------------------


class Baseline:
    """A plain memcpy (np.copyto, one thread) and an xxh3-64 of the bytes one version moves,
    timed right after each version's swap so that both see the same load. Buffers are capped at
    ``MEMCPY_CAP`` bytes (two more copies of a 3 GB version would not fit beside it on a small
    host); the times are scaled to the version's bytes (linear far above the caches)."""

    def __init__(self, nbytes: int) -> None:
        self.scale = nbytes / min(nbytes, MEMCPY_CAP)
        self.src = np.ones(min(nbytes, MEMCPY_CAP), dtype=np.uint8)
        self.dst = np.zeros(min(nbytes, MEMCPY_CAP), dtype=np.uint8)  # both touched: no page faults in the timing
        np.copyto(self.dst, self.src)

    def measure(self) -> tuple[float, float]:
        t = time.perf_counter()
        np.copyto(self.dst, self.src)
        t1 = time.perf_counter()
        xxhash.xxh3_64_intdigest(self.src)
        return (t1 - t) * 1000 * self.scale, (time.perf_counter() - t1) * 1000 * self.scale


class Bench:
    def __init__(self, run: BenchRun, copy_threads: int, delta: str | None = None, dtype: str = "bfloat16") -> None:
        self.delta, self.dtype = delta, dtype
        self.ctx = zmq.Context()
        run.callback(self.ctx.term)
        cfg = load("synthetic.yaml", ["broker.liveness=600"])  # the bench trainer is busy publishing at times
        self.job = start_job(cfg, run.dir, workers=False)
        run.callback(self.job.stop)
        self.trainer = Peer(self.ctx, self.job.endpoint, "trainer", "bench")
        run.callback(self.trainer.close)
        self.broker = self.trainer.sock
        self.pub_ep = self.trainer.expect(P.READY, 30.0)["pub"]
        self.broker_rss_start = rss_mb(self.job.broker_proc.pid)
        self.pull = self.ctx.socket(zmq.PULL)
        run.callback(self.pull.close, 0)
        self.pull.bind("tcp://127.0.0.1:*")
        self.events: list[dict[str, Any]] = []
        self.broker_rss: list[float] = []
        self.next_version = 0  # one broker for every run: versions keep increasing
        self.copy_threads = copy_threads

    def announce(self, fields: dict[str, Any]) -> None:
        """WEIGHTS to the broker, then STATUS: its reply comes after any ERROR for the WEIGHTS."""
        self.broker.send_multipart(P.encode(P.WEIGHTS, fields))
        self.broker.send_multipart(P.encode(P.STATUS, {}))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not self.broker.poll(1000, zmq.POLLIN):
                continue
            msg = P.decode(self.broker.recv_multipart())
            if msg.type == P.ERROR:
                raise RuntimeError(f"the broker refused WEIGHTS: {msg['reason']}")
            if msg.type == P.STATUS:
                if msg["figures"]["policy_version"] < fields["version"]:  # STATUS figures are cached for 0.25 s
                    time.sleep(0.05)
                    self.broker.send_multipart(P.encode(P.STATUS, {}))
                    continue
                if msg["figures"]["policy_version"] != fields["version"]:
                    raise RuntimeError(f"the broker holds version {msg['figures']['policy_version']}, not {fields['version']}")
                self.broker_rss.append(rss_mb(self.job.broker_proc.pid))
                return
        raise RuntimeError("the broker did not answer STATUS")

    def drain(self, until: Any, timeout: float, what: str) -> None:
        """Reader events until ``until()``, heartbeating the broker (it expires a silent trainer)."""
        deadline = time.monotonic() + timeout
        while not until():
            while self.broker.poll(0, zmq.POLLIN):  # what the broker sends us is dropped
                if (msg := P.decode(self.broker.recv_multipart())).type == P.ERROR:
                    raise RuntimeError(f"the broker sent ERROR: {msg['reason']}")
            self.trainer.keepalive(drain=False)
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            if self.pull.poll(100, zmq.POLLIN):
                while self.pull.poll(0, zmq.POLLIN):
                    self.events.append(json.loads(self.pull.recv()))

    def run(self, size: str, model: torch.nn.Module, n_readers: int, versions: int) -> dict[str, Any]:
        self.events = []
        rid = "wb" + os.urandom(4).hex()
        names = [f"{size}-{n_readers}-{i}" for i in range(n_readers)]
        settings = {"size": size, "pub": self.pub_ep, "report": self.pull.getsockopt_string(zmq.LAST_ENDPOINT),
                    "copy_threads": self.copy_threads, "dtype": self.dtype, "host": "another-host" if self.delta else ""}
        procs = [start_child([__file__, "--child", json.dumps({**settings, "name": n})], timeout_s=120, talk=True)[0]
                 for n in names]
        pub = WeightPublisher(model, rid, stream_bind="tcp://127.0.0.1:0" if self.delta else "", copy_threads=self.copy_threads,
                              delta=self.delta or "none")
        base = Baseline(pub.layout.trainable_bytes)
        memcpy_mb = round(base.src.nbytes / 1e6, 1)
        memcpy_ms: list[float] = []
        hash_ms: list[float] = []
        swapped = lambda v: [e for e in self.events if e["event"] == "swapped" and e["version"] == v]  # noqa: E731
        try:
            self.drain(lambda: {e["name"] for e in self.events if e["event"] == "ready"} >= set(names), 120, "readers ready")
            per_version = []
            publish_ms = []
            announce_ms = []
            first = self.next_version
            for v in range(first, first + versions + 1):
                if v > first:
                    with torch.no_grad():  # an "update": every trainable tensor changes
                        for p in model.parameters():
                            if p.requires_grad:
                                p.view(-1)[0] += 1
                t0 = time.monotonic_ns()
                fields = pub.publish(v)
                t1 = time.monotonic_ns()
                publish_ms.append((t1 - t0) / 1e6)
                self.announce(fields)
                if v == first:
                    ann_bytes = len(P.encode(P.WEIGHTS, fields)[0])
                self.drain(lambda: len(swapped(v)) >= n_readers, 120, f"version {v} swapped by every reader")
                per_version.append((max(e["t_ns"] for e in swapped(v)) - t0) / 1e6)
                if v > first:
                    cp, hs = base.measure()
                    memcpy_ms.append(cp)
                    hash_ms.append(hs)
                announce_ms.append((max(e["offer_ns"] for e in swapped(v)) - t1) / 1e6)
            self.next_version = first + versions + 1
            for p in procs:
                p.stdin.close()
            self.drain(lambda: len([e for e in self.events if e["event"] == "stats"]) >= n_readers, 60, "reader stats")
        finally:
            for p in procs:
                stop_child(p, 30.0)
            pub.close()
        stats = [e for e in self.events if e["event"] == "stats"]
        steady = per_version[1:] or per_version
        nbytes = swapped(first + versions)[0]["nbytes"]
        p2s, memcpy = statistics.median(steady), statistics.median(memcpy_ms)
        return {
            "size": size, "readers": n_readers, "delta": self.delta, "dtype": self.dtype,
            "trainable_mb": round(pub.layout.trainable_bytes / 1e6, 2), "copy_threads": self.copy_threads, "params_m": round(params_m(model), 2),
            "bytes_mb": round(nbytes / 1e6, 2), "first_version_mb": round(swapped(first)[0]["nbytes"] / 1e6, 2),
            "publish_to_swap_ms": round(p2s, 2), "publish_to_swap_ms_all": [round(x, 2) for x in per_version],
            "first_version_ms": round(per_version[0], 2), "publish_write_ms": round(statistics.median(publish_ms[1:] or publish_ms), 2),
            "announce_ms": round(statistics.median(announce_ms[1:] or announce_ms), 2),
            "reader_fetch_ms": round(statistics.median(e["fetch_ms"] for e in self.events if e["event"] == "swapped" and e["version"] > first), 2),
            "memcpy_ms": round(memcpy, 2), "memcpy_ms_all": [round(x, 2) for x in memcpy_ms], "copies": COPIES,
            "ratio": round(p2s / (memcpy * COPIES), 3),
            "ratio_per_version": [round(a / (b * COPIES), 3) for a, b in zip(steady, memcpy_ms)],
            "memcpy_measured_mb": memcpy_mb, "memcpy_best_ms": round(min(memcpy_ms), 2), "memcpy_gb_per_s": round(nbytes / 1e9 / (min(memcpy_ms) / 1000), 3),
            "ratio_vs_best_memcpy": round(p2s / (min(memcpy_ms) * COPIES), 3),
            "passes": PASSES,
            "hash_ms": round(statistics.median(hash_ms), 2), "gb_per_s_to_every_reader": round(nbytes / 1e9 / (p2s / 1000), 3),
            "max_serving_gap_ms": round(max(s["max_gap_ms"] or 0 for s in stats), 3),
            "max_serving_gap_idle_ms": round(max(s["max_idle_gap_ms"] or 0 for s in stats), 3),
            "serving_gap_p99_ms": round(max(s["gap_p99_ms"] or 0 for s in stats), 3),
            "max_swap_ms": round(max(s["max_swap_ms"] or 0 for s in stats), 3),
            "forward_ms": round(statistics.median(s["forward_ms"] or 0 for s in stats), 3),
            "forward_ms_max": round(max(s["forward_ms_max"] or 0 for s in stats), 3),
            "broker_rss_mb": round(max(self.broker_rss), 1), "broker_rss_mb_start": round(self.broker_rss_start, 1),
            "announcement_bytes": ann_bytes,
            "reader_rss_mb": round(max(s["rss_mb"] for s in stats), 1),
            "rejected": sum(s["rejected"] for s in stats), "shm_left": segments_of_run(rid),
            "source": sorted({e["source"] for e in self.events if e["event"] == "swapped"}),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # a reader: its settings as JSON (Bench.run)
    ap.add_argument("--sizes", default="tiny,medium")
    ap.add_argument("--readers", default="1,2")
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--copy-threads", type=int, default=2, help="weights.copy_threads, both sides")
    ap.add_argument("--delta", choices=["none", "bf16"], help="readers on 'another host' read the stream; weights.delta")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the model's parameters")
    args = parse_bench_args(ap, "the last of --sizes only, 1 reader, 2 versions (about a minute)",
                            smoke_help="tiny, 1 reader, 2 versions (seconds)")
    if args.child:
        return reader(argparse.Namespace(**json.loads(args.child)))
    sizes = ["tiny"] if args.smoke else args.sizes.split(",")[-1:] if args.quick else args.sizes.split(",")
    readers = [1] if (args.smoke or args.quick) else [int(r) for r in args.readers.split(",")]
    versions = 2 if (args.quick or args.smoke) else args.versions
    torch.set_num_threads(1)
    runs = []
    with BenchRun("weights") as run:
        bench = Bench(run, args.copy_threads, args.delta, args.dtype)
        for size in sizes:
            t = time.perf_counter()
            model = build_model(size, init=True, dtype=args.dtype)
            note(f"{size}: {params_m(model):.1f}M parameters built in {time.perf_counter() - t:.1f} s")
            for n in readers:
                r = bench.run(size, model, n, versions)
                note(json.dumps(r))
                runs.append(r)
            del model
        run.ok = True
    head = dict(runs[-1])
    result = {**head, "runs": runs, "host_cpus": os.cpu_count(),
              "note": "broker_rss_mb: RSS of the real broker process (rlvla3 broker) that relays every "
                      "announcement; shared, noisy machine"}
    emit_to(args.out, "weights.json", result)


if __name__ == "__main__":
    main()
