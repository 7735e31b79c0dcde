"""Weights off the broker: a publisher (this process) writes versions into its shared-memory store
and announces them; reader processes (tests/weights_peer.py) fetch, verify and swap them while
they keep serving. Torn and corrupt versions are rejected and fetched again, a late joiner gets
the newest version, the stream serves readers when shared memory is off, and no segment is left.

The broker's part is played by the broker's own rule (:class:`LatestWeights`) behind a real
PUB socket and a ROUTER that answers SNAPSHOT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack
import pytest
import torch
import zmq

from rlvla3 import protocol as P
from rlvla3.shm import host_id, segments_of_run
from rlvla3.status_client import wait_until
from rlvla3.weights.announce import LatestWeights, parse_announcement
from rlvla3.weights.manifest import Entry, ManifestError, Manifest
from rlvla3.weights.publisher import WeightPublisher
from rlvla3.weights.receiver import WeightReceiver
from rlvla3.weights.stream import plan_buckets
from tests.jobs import child_env
from tests.weights_peer import digest, tiny_model

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / "tests" / "weights_peer.py"


class Relay:
    """The broker's weight duties for a test: LatestWeights, PUB, SNAPSHOT answers; plus a PULL
    that collects what the readers report. Pumped from the test's thread while it waits."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self._bind(zmq.PUB)
        self.router = self._bind(zmq.ROUTER)
        self.pull = self._bind(zmq.PULL)
        self.rule = LatestWeights()
        self.latest: dict[str, Any] = {"version": -1}  # what SNAPSHOT answers, as the broker keeps it
        self.events: list[dict[str, Any]] = []
        self.procs: list[subprocess.Popen] = []  # the readers: one that exits early fails the wait
        self._last_pub = 0.0

    def _bind(self, kind: int) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.bind("tcp://127.0.0.1:*")
        return s

    def endpoint(self, s: zmq.Socket) -> str:
        return s.getsockopt_string(zmq.LAST_ENDPOINT)

    def announce(self, fields: dict[str, Any]) -> None:
        """What the broker does with a trainer's WEIGHTS: the rule, then PUB."""
        out = self.rule.offer(P.decode(P.encode(P.WEIGHTS, fields)))
        assert out is not None
        self.latest = out
        self.pub.send_multipart([b"W", *P.encode(P.WEIGHTS, out)])

    def pump(self) -> None:
        while self.router.poll(0, zmq.POLLIN):
            ident, *frames = self.router.recv_multipart()
            if P.decode(frames).type == P.SNAPSHOT:
                self.router.send_multipart([ident, *P.encode(P.WEIGHTS, self.latest)])
        while self.pull.poll(0, zmq.POLLIN):
            self.events.append(json.loads(self.pull.recv()))
        now = time.monotonic()
        if self.rule.version >= 0 and now - self._last_pub > 0.3:  # PUB drops for slow joiners
            self.pub.send_multipart([b"W", *P.encode(P.WEIGHTS, self.latest)])
            self._last_pub = now

    def wait(self, pred: Callable[[list[dict[str, Any]]], Any], what: str, timeout: float = 90.0) -> Any:
        def check() -> Any:
            self.pump()
            dead = [p for p in self.procs if p.poll() not in (None, 0)]
            assert not dead, f"a reader exited with {dead[0].returncode} while waiting for {what}"
            return pred(self.events)

        return wait_until(check, timeout, what, interval=0.02)

    def of(self, name: str, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["name"] == name and e["event"] == event]

    def swapped(self, name: str, version: int) -> dict[str, Any] | None:
        return next((e for e in self.of(name, "swapped") if e["version"] == version), None)

    def stop(self) -> None:
        self.pub.send_multipart([b"stop"])

    def close(self) -> None:
        for s in (self.pub, self.router, self.pull):
            s.close(linger=0)
        self.ctx.term()


@pytest.fixture
def relay():
    r = Relay()
    yield r
    for p in r.procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    r.close()


def spawn(relay: Relay, name: str, *extra: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, str(PEER), "--pub", relay.endpoint(relay.pub), "--snap", relay.endpoint(relay.router),
                          "--report", relay.endpoint(relay.pull), "--name", name, *extra], env=child_env())
    relay.procs.append(p)
    return p


def stop_readers(relay: Relay) -> None:
    relay.stop()
    for p in relay.procs:
        deadline = time.monotonic() + 60
        while p.poll() is None and time.monotonic() < deadline:
            relay.pump()
            relay.stop()
            time.sleep(0.05)
        assert p.returncode == 0, f"reader exited with {p.returncode}"


def bump(model: torch.nn.Module, by: float) -> None:
    """An 'update': every trainable parameter changes."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(by)


def publish_versions(relay: Relay, pub: WeightPublisher, model: torch.nn.Module, readers: list[str],
                     by: float) -> dict[int, str]:
    """Publish versions 0-3 (before version v, every trainable parameter moves by ``by`` x v) and
    wait after each until every reader has swapped it in; returns each version's digest."""
    expected = {}
    for v in range(4):
        if v:
            bump(model, by * v)
        expected[v] = digest(model)
        relay.announce(pub.publish(v))
        relay.wait(lambda ev: all(relay.swapped(n, v) for n in readers), f"{readers} on version {v}")
    return expected


def run_id() -> str:
    return "wt" + uuid.uuid4().hex[:8]


@contextmanager
def publishing(model: torch.nn.Module, **kw: Any) -> Iterator[WeightPublisher]:
    """A publisher of ``model`` under a fresh run id; once it is closed, no segment of the run is left."""
    rid = run_id()
    pub = WeightPublisher(model, rid, **kw)
    try:
        yield pub
    finally:
        pub.close()
    assert segments_of_run(rid) == []


# -- same host: readers swap while serving; late joiner; nothing left ----------------------------


def test_readers_swap_versions_while_serving_and_a_late_joiner_gets_the_newest(relay):
    model = tiny_model(1)
    with publishing(model) as pub:
        readers = ["r1", "r2"]
        for n in readers:
            spawn(relay, n)
        relay.wait(lambda ev: all(relay.of(n, "ready") for n in readers), "both readers ready")
        expected = publish_versions(relay, pub, model, readers, 0.5)
        total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        for n in readers:
            swaps = [relay.swapped(n, v) for v in range(4)]
            assert [s["digest"] for s in swaps] == [expected[v] for v in range(4)]
            assert all(s["source"] == "shm" for s in swaps)
            assert swaps[0]["nbytes"] == total and all(s["nbytes"] == trainable for s in swaps[1:])  # frozen once
            served = [s["batches"] for s in swaps]
            assert served == sorted(served) and served[-1] > served[0]  # serving went on between swaps
        # A late joiner: its snapshot is version 3, fetched whole (frozen part included).
        spawn(relay, "late")
        late = relay.wait(lambda ev: relay.swapped("late", 3), "the late joiner on version 3")
        assert late["digest"] == expected[3] and late["nbytes"] == total
        assert not [e for e in relay.events if e["event"] == "swapped" and e["name"] == "late" and e["version"] < 3]
        stop_readers(relay)


def test_torn_and_corrupt_versions_are_rejected_and_fetched_again(relay):
    model = tiny_model(2)
    with publishing(model) as pub:
        spawn(relay, "r")
        relay.wait(lambda ev: relay.of("r", "ready"), "reader ready")
        relay.announce(pub.publish(0))
        relay.wait(lambda ev: relay.swapped("r", 0), "version 0")

        # Corrupt: one flipped byte in a trainable tensor of version 1.
        bump(model, 1.0)
        ann = pub.publish(1)
        entry = next(e for e in parse_announcement(ann).manifest.entries if e.trainable and e.nbytes > 2**20)
        view = pub.store.view(entry.offset + 12345, 1)
        view[0] ^= 0xFF
        relay.announce(ann)
        relay.wait(lambda ev: [e for e in relay.of("r", "rejected") if e["version"] == 1], "version 1 rejected")
        assert "checksum" in relay.of("r", "rejected")[-1]["error"]
        assert relay.swapped("r", 1) is None  # still serving version 0
        view[0] ^= 0xFF  # repaired: the retry gets it
        got = relay.wait(lambda ev: relay.swapped("r", 1), "version 1 after the retry")
        assert got["digest"] == digest(model)

        # Torn: version 2's slot is being written (seqlock odd) while the reader reads.
        bump(model, 1.0)
        ann = pub.publish(2)
        region = next(e.region for e in parse_announcement(ann).manifest.entries if e.trainable)
        pub.store.write_begin(region)
        relay.announce(ann)
        relay.wait(lambda ev: [e for e in relay.of("r", "rejected") if e["version"] == 2], "version 2 rejected")
        assert "being written" in relay.of("r", "rejected")[-1]["error"]
        assert relay.swapped("r", 2) is None
        pub.store.write_end(region, 2)
        got = relay.wait(lambda ev: relay.swapped("r", 2), "version 2 after the write ended")
        assert got["digest"] == digest(model)
        stop_readers(relay)


# -- another host: the bucketed stream --------------------------------------------------------


def test_stream_serves_readers_when_shared_memory_is_off(relay):
    model = tiny_model(3)
    with publishing(model, shm=False, stream_bind="tcp://127.0.0.1:0") as pub:
        # 1 MiB buckets: the 5.8 MB tensor is split, the small ones share buckets.
        spawn(relay, "same", "--bucket-mb", "1")
        spawn(relay, "other", "--bucket-mb", "1", "--host", "another-host")
        relay.wait(lambda ev: relay.of("same", "ready") and relay.of("other", "ready"), "readers ready")
        for v in range(3):
            if v:
                bump(model, 0.25)
            relay.announce(pub.publish(v))
            got = relay.wait(lambda ev: relay.swapped("same", v) and relay.swapped("other", v), f"version {v} by stream")
            for n in ("same", "other"):
                s = relay.swapped(n, v)
                assert s["source"] == "stream" and s["digest"] == digest(model)
        assert got and pub.stream.buckets_sent > 6
        stop_readers(relay)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU (bench/gpu/check.sh runs this on one)")
def test_a_reader_on_the_same_gpu_takes_trainable_tensors_by_cuda_ipc(relay):
    """weights.cuda_ipc: after the first version, trainable tensors go device to device from rank
    0's slot buffer (source "ipc"); the first comes from the store (its frozen tensors are not in
    the device slot). The reader ends up with the publisher's bytes either way."""
    model = tiny_model(4).cuda()
    with publishing(model, cuda_ipc=True) as pub:
        assert pub.ipc is not None
        spawn(relay, "r", "--device", "cuda", "--cuda-ipc")
        relay.wait(lambda ev: relay.of("r", "ready"), "reader ready")
        expected = publish_versions(relay, pub, model, ["r"], 0.25)
        swaps = [relay.swapped("r", v) for v in range(4)]
        assert [s["digest"] for s in swaps] == [expected[v] for v in range(4)]
        assert swaps[0]["source"] == "shm" and [s["source"] for s in swaps[1:]] == ["ipc"] * 3
        assert not relay.of("r", "rejected")
        stop_readers(relay)


def test_bf16_deltas_rebuild_rank0s_reference_and_a_reader_that_cannot_use_them_reads_whole():
    """One publisher with ``delta="bf16"``, three in-process receivers over the real store and
    stream: ``far`` (another host) rebuilds from deltas, ``near`` (same host) reads the slot whole,
    ``late`` skips a version (wrong base) and reads whole; a corrupted delta is read whole."""
    model = tiny_model(3)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    with publishing(model, delta="bf16") as pub:
        rxs = {n: WeightReceiver(tiny_model(None), h, bucket_mb=1, copy_threads=1)
               for n, h in (("far", "another-host"), ("near", host_id()), ("late", "another-host"))}

        def step(name: str, fields: dict[str, Any]):
            rx = rxs[name]
            assert rx.offer(fields)
            ann = rx.next_fetch(time.monotonic())
            rx.fetched(ann, rx.fetch(ann), None, time.monotonic())
            return rx.swap()

        try:
            v0 = pub.publish(0)
            assert {step(n, v0).source for n in rxs} == {"stream", "shm"}
            for v in (1, 2, 3, 4):
                bump(model, 1e-3 * v)  # small steps: bf16 rounds them
                fields = pub.publish(v)
                ann = parse_announcement(fields)
                assert ann.manifest.delta_base == v - 1 and len(ann.manifest.deltas) == 7
                if v == 4:  # a corrupted delta: the rebuilt tensor fails its checksum, read whole
                    big = max(ann.manifest.deltas, key=lambda d: d.nbytes)
                    pub.store.view(big.offset, 4)[:] ^= 0xFF
                far, near = step("far", fields), step("near", fields)
                assert near.source == "shm" and far.source == "delta"
                assert digest(rxs["far"].module) == digest(rxs["near"].module)  # rank 0's rebuilt bits
                whole = big.nbytes * 2 if v == 4 else 0
                assert far.nbytes == sum(d.nbytes for d in ann.manifest.deltas) + whole
                if v < 4:
                    assert 0.5 * trainable < far.nbytes < 0.55 * trainable  # fp32 -> bf16, one bf16 tensor
                served = dict(rxs["far"].module.named_parameters())
                err = max((served[n].float() - p.float()).abs().max().item()
                          for n, p in model.named_parameters() if p.requires_grad)
                assert err < 2e-3  # one delta's rounding, not accumulated over versions
                if v in (1, 3):
                    continue
                late = step("late", fields)  # holds v-2 or v-3: not the base, reads whole
                assert late.source == "stream" and late.nbytes == trainable
                assert digest(rxs["late"].module) == digest(rxs["near"].module)
        finally:
            for rx in rxs.values():
                rx.close()


def test_a_killed_publishers_store_is_swept_by_the_next_one():
    rid = run_id()
    code = ("import sys, time; from rlvla3.weights.store import WeightStore; "
            f"s = WeightStore('{rid}', 4096, 4096); print(s.name, flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True,
                         env=child_env())
    name = p.stdout.readline().strip()
    assert segments_of_run(rid) == [name]
    os.killpg(p.pid, 9)  # its resource_tracker dies with it: nobody unlinks the store
    p.wait(10)
    p.stdout.close()
    assert segments_of_run(rid) == [name]  # left behind
    pub = WeightPublisher(tiny_model(4), run_id(), stream_bind="")  # sweeps at start
    pub.close()
    assert segments_of_run(rid) == []


def test_a_version_that_does_not_fit_is_dropped_and_the_weights_stay():
    other = torch.nn.Sequential(tiny_model(5), torch.nn.Linear(4, 4))  # other names
    model = tiny_model(None)
    before = digest(model)
    with publishing(other, stream_bind="") as pub:
        rx = WeightReceiver(model, host_id())
        try:
            assert rx.offer(pub.publish(0))
            ann = rx.next_fetch(time.monotonic())
            with pytest.raises(ManifestError, match="lacks|this model lacks") as err:
                rx.fetch(ann)
            rx.fetched(ann, None, err.value, time.monotonic())
            assert rx.next_fetch(time.monotonic() + 60) is None  # not retried
            assert rx.swap() is None and rx.version == -1 and digest(model) == before
        finally:
            rx.close()


# -- pure rules --------------------------------------------------------------------------------


def _ann(version: int, **kw: Any) -> dict[str, Any]:
    e = Entry("w", "float32", (2, 2), 1, 4096, 16, 7, version, True)
    return {"version": version, "manifest": Manifest(version, (e,)).to_wire(), "store": None,
            "stream": "tcp://127.0.0.1:1", "published_at": 0, **kw}


def test_broker_rule_keeps_the_newest_announcement_and_never_bytes():
    rule = LatestWeights()
    assert rule.version == -1
    assert rule.offer(P.decode(P.encode(P.WEIGHTS, _ann(1))))["version"] == 1
    assert rule.offer(P.decode(P.encode(P.WEIGHTS, _ann(1)))) is None  # not newer
    assert rule.offer(P.decode(P.encode(P.WEIGHTS, _ann(0)))) is None
    newest = rule.offer(P.decode(P.encode(P.WEIGHTS, _ann(3))))
    assert newest["version"] == 3 and "tensors" not in newest
    with pytest.raises(P.ProtocolError, match="never the broker"):  # today's inline WEIGHTS
        rule.offer(P.decode(P.encode(P.WEIGHTS, {"version": 4}, {"w": torch.zeros(2)})))
    with pytest.raises(P.ProtocolError):
        rule.offer(P.decode(P.encode(P.WEIGHTS, _ann(5, stream=None))))  # nowhere to fetch
    assert rule.version == 3
    assert len(msgpack.packb(newest)) < 300


def test_an_in_flight_publication_acts_as_an_older_policy_version_and_never_goes_back():
    rule = LatestWeights()
    assert parse_announcement(_ann(7)).acts_as == 7  # no policy_version: the publication's own number
    assert rule.offer(P.decode(P.encode(P.WEIGHTS, _ann(8, policy_version=2))))["policy_version"] == 2
    assert (rule.version, rule.policy_version) == (8, 2)
    assert rule.offer(P.decode(P.encode(P.WEIGHTS, _ann(9, policy_version=2)))) is not None  # newer weights, same version
    with pytest.raises(P.ProtocolError, match="older"):
        rule.offer(P.decode(P.encode(P.WEIGHTS, _ann(10, policy_version=1))))
    assert (rule.version, rule.policy_version) == (9, 2)


@pytest.mark.parametrize("bad", [
    {"policy_version": 2},  # acts as a version newer than its publication
    {"policy_version": -1},
    {"policy_version": "1"},
    {"manifest": None},
    {"manifest": {"version": 2, "entries": []}},  # for another version
    {"manifest": {"version": 1, "entries": [["w", "float32", [2, 2], 1, 4096, 15, 7, 1, True]]}},  # nbytes
    {"manifest": {"version": 1, "entries": [["w", "object", [2], 1, 4096, 8, 7, 1, True]]}},
    {"manifest": {"version": 1, "entries": [["w", "float32", [2], 1, 4096, 8, 7, 0, True]]}},  # slot, old since
    {"manifest": {"version": 1, "entries": [["w", "float32", [2], 9, 4096, 8, 7, 1, True]]}},  # region
    {"manifest": {"version": 1, "entries": [["w", "float32", [2], 1, 4096, 8, -1, 1, True]]}},
    {"manifest": {"version": 1, "entries": [["w", "float32", [2], 1, 4096, 8, 7, 1, True]] * 2}},  # twice
    {"manifest": {"version": 1, "entries": [["w", "float32", [2], 1, 4096, 8, 7, 1, True]], "delta": {"base": 1, "entries": []}}},  # base not older
    {"manifest": {"version": 1, "entries": [["w", "float32", [2], 1, 4096, 8, 7, 1, True]], "delta": {"base": 0, "entries": [["w", 1, 8192, 4]]}}},  # region
    {"manifest": {"version": 1, "entries": [["w", "float32", [2], 1, 4096, 8, 7, 1, True]], "delta": {"base": 0, "entries": [["w", 3, 8192, 8]]}}},  # not bf16
    {"manifest": {"version": 1, "entries": [["w", "float32", [2], 1, 4096, 8, 7, 1, True]], "delta": {"base": 0, "entries": [["x", 3, 8192, 4]]}}},  # unknown
    {"store": {"host": "h", "seg": "/etc/passwd", "size": 10}},
    {"store": {"host": "h", "seg": "rlvla3_x", "size": 100}},  # bytes beyond the store
    {"stream": 5},
    {"version": True},
    {"ipc": {"uuid": "GPU-0", "slot": 1}},  # a CUDA IPC handle without its bytes
    {"ipc": {"uuid": "GPU-0", "slot": 0, "base": 0, "device": 0, "handle": b"h", "size": 8, "offset": 0,
             "ref_handle": b"r", "ref_offset": 0}},  # the frozen region is never handed over by IPC
])
def test_hostile_announcements_are_refused_with_a_reason(bad):
    with pytest.raises(ManifestError):
        parse_announcement({**_ann(1), **bad})


def test_buckets_cover_every_byte_once():
    es = [Entry(f"t{i}", "uint8", (n,), r, off, n, 0, 1, True)
          for i, (r, off, n) in enumerate([(1, 4096, 1000), (1, 5120, 3 * 2**20 + 5), (1, 4096 + 4 * 2**20, 10), (2, 9000, 7)])]
    buckets = plan_buckets(es, 2**20)
    covered = sorted((r, o, o + n) for r, o, n in buckets)
    assert all(n <= 2**20 for _, _, n in buckets)
    for e in es:
        inside = sum(min(b, e.offset + e.nbytes) - max(a, e.offset) for r, a, b in covered
                     if r == e.region and a < e.offset + e.nbytes and b > e.offset)
        assert inside == e.nbytes
    assert len({(r, a) for r, a, _ in covered}) == len(covered)
