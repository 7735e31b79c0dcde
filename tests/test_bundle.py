"""BUNDLE: several messages to one peer as one. The codec keeps order and limits, a bad part
fails alone, and a live broker answers a bundle's parts one by one and sends what it has for a
peer that reads bundles as one message (a peer that never said ``bundles`` gets them singly)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq

from rlvla3 import bundle
from rlvla3 import protocol as P
from rlvla3.status_client import wait_until


def _obs(slot: int, req_id: int = 1) -> list:
    return P.encode(P.OBS, {"slot": slot, "req_id": req_id, "n": 1, "instruction": ["x"], "episode_step": [0]},
                    {"state": np.full((1, 3), slot, np.float32)})


def _bundle_of(messages: list[list]) -> list:
    (n, frames), = bundle.bundle(messages)
    assert n == len(messages)
    return frames


def test_a_bundle_decodes_to_its_parts_in_order_and_a_bad_part_fails_alone():
    garbage = [b"\x92\x01"]  # msgpack, not a map
    frames = _bundle_of([_obs(0), garbage, _obs(1), P.encode(P.HEARTBEAT)])
    out = list(bundle.decode_each(frames))
    assert [m.type if isinstance(m, P.Message) else m.code for m in out] == [P.OBS, P.E_MALFORMED, P.OBS, P.HEARTBEAT]
    assert out[2]["slot"] == 1 and out[2].tensors["state"].shape == (1, 3)
    assert [type(m) for m in bundle.decode_each(_obs(3))] == [P.Message]  # a message alone is itself


@pytest.mark.parametrize("parts, frames, code", [
    ([1, 1], 1, P.E_FIELD),  # frames the parts do not account for
    ([2], 3, P.E_FIELD),
    ([0], 0, P.E_FIELD),  # a part of no frames
    ([1] * (P.MAX_BUNDLE_PARTS + 1), P.MAX_BUNDLE_PARTS + 1, P.E_FIELD),
    ([True], 1, P.E_FIELD),
])
def test_a_malformed_bundle_is_one_error(parts, frames, code):
    header = msgpack.packb({"v": 1, "type": P.BUNDLE, "parts": parts})
    out = list(bundle.decode_each([header, *[P.encode(P.HEARTBEAT)[0]] * frames]))
    assert len(out) == 1 and isinstance(out[0], P.ProtocolError) and out[0].code == code


def test_a_bundle_inside_a_bundle_is_refused():
    inner = _bundle_of([P.encode(P.HEARTBEAT), P.encode(P.HEARTBEAT)])
    out = list(bundle.decode_each(_bundle_of([inner, P.encode(P.HEARTBEAT)])))
    assert isinstance(out[0], P.ProtocolError) and "inside" in out[0].reason
    assert isinstance(out[1], P.Message) and out[1].type == P.HEARTBEAT


def test_bundle_splits_at_its_limits_and_keeps_order():
    many = [P.encode(P.HEARTBEAT, {"served": i}) for i in range(P.MAX_BUNDLE_PARTS + 3)]
    runs = bundle.bundle(many)
    assert [n for n, _ in runs] == [P.MAX_BUNDLE_PARTS, 3]
    served = [m["served"] for _, frames in runs for m in bundle.decode_each(frames)]
    assert served == list(range(len(many)))
    big = np.zeros(P.MAX_BUNDLE_BYTES // 4 // 2 + 1, np.float32)  # two of these pass the byte limit
    runs = bundle.bundle([P.encode(P.TRAJ_ACK, {"traj_ids": [1]}, {"x": big}), P.encode(P.TRAJ_ACK, {"traj_ids": [2]}, {"x": big})])
    assert [n for n, _ in runs] == [1, 1]


class Peer:
    """A raw DEALER that joined the broker, keeping each message it received as frames (to see
    how it travelled)."""

    def __init__(self, zctx, endpoint: str, role: str, bundles: bool, **fields) -> None:
        self.sock = zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.received: list[list[bytes]] = []
        self.send(P.encode(P.READY, {"role": role, "host": "bundlehost", "pid": 1, "name": f"b-{role}",
                                     "bundles": bundles, **fields}))
        assert self.next(lambda m: m.type != P.HEARTBEAT).type == P.READY

    def send(self, frames: list) -> None:
        self.sock.send_multipart(frames)

    def messages(self):
        """Every message the broker sends, a bundle's parts one by one."""
        while True:
            assert self.sock.poll(5000), "the broker sent nothing"
            frames = self.sock.recv_multipart()
            self.received.append(frames)
            for m in bundle.decode_each(frames):
                assert isinstance(m, P.Message), m
                yield m

    def next(self, pred) -> P.Message:
        return next(m for m in self.messages() if pred(m))

    def types_received(self) -> list[str]:
        return [msgpack.unpackb(f[0])["type"] for f in self.received]

    def close(self) -> None:
        self.sock.close()


def test_a_live_broker_serves_a_bundle_part_by_part_and_bundles_its_answers(job_factory, zctx):
    job = job_factory("batching.max_batch=2", "batching.max_wait_ms=50", start=False)
    sim = Peer(zctx, job.endpoint, "simulator", True, slots=4, num_envs=4)
    gen = Peer(zctx, job.endpoint, "generator", True, credits=1)
    sim.received = []
    # One part that is not msgpack, one whose slot the simulator does not have, two good requests.
    # The bad ones come first: refusing them is cheap, so both usually fall in the broker's first
    # turn for this peer (PEER_TURN_S of CPU), and their ERRORs leave together.
    sim.send(_bundle_of([[b"\xc1"], _obs(99), _obs(0), _obs(2)]))
    errors = []
    for m in sim.messages():
        errors += [m["code"]] if m.type == P.ERROR else []
        if len(errors) == 2:
            break
    assert sorted(errors) == sorted([P.E_MALFORMED, P.E_FIELD])
    errors_bundled = P.BUNDLE in sim.types_received()
    if not errors_bundled:  # a turn's answers leave together: singles mean a cut turn
        assert job.status()["peer_turns_cut"] >= 1, "the two ERRORs of one turn came singly"
    batch = gen.next(lambda m: m.type == P.BATCH)
    assert [r["slot"] for r in batch["requests"]] == [0, 2]
    tensors = {"actions": np.array([np.full((1, 7), r["slot"]) for r in batch["requests"]], np.float32)}
    gen.send(P.encode(P.RESULT, {"batch_id": batch["batch_id"], "version": 0}, tensors))
    sim.received = []
    acts = {}
    for m in sim.messages():
        if m.type == P.ACT:
            acts[m["slot"]] = float(P.inline_array(m.tensors["actions"]).max())
        if len(acts) == 2:
            break
    assert acts == {0: 0.0, 2: 2.0}
    assert [t for t in sim.types_received() if t != P.HEARTBEAT] == [P.BUNDLE], "the two ACTs were not one message"
    # STATUS figures are cached for a moment: wait for ones built after the ACTs left.
    out = 2 if errors_bundled else 1  # the ACTs' bundle, and the ERRORs' unless their turn was cut
    wait_until(lambda: job.status()["requests"] == 2 and job.status()["bundles"]["out"] >= out, 10,
               "the broker to count two requests and its bundles out")
    bundles = job.status()["bundles"]
    assert bundles["in"] == 1 and bundles["in_parts"] == 4
    assert bundles["out_parts"] >= 2 * out  # two ERRORs, two ACTs (a heartbeat may join one)
    for p in (sim, gen):
        p.close()


def test_a_peer_that_never_said_bundles_gets_every_message_alone(job_factory, zctx):
    job = job_factory("batching.max_batch=2", "batching.max_wait_ms=50", start=False)
    sim = Peer(zctx, job.endpoint, "simulator", False, slots=4, num_envs=4)
    gen = Peer(zctx, job.endpoint, "generator", False, credits=1)
    sim.send(_obs(0))
    sim.send(_obs(1))
    batch = gen.next(lambda m: m.type == P.BATCH)
    assert len(batch["requests"]) == 2
    tensors = {"actions": np.zeros((2, 1, 7), np.float32)}
    gen.send(P.encode(P.RESULT, {"batch_id": batch["batch_id"], "version": 0}, tensors))
    sim.received = []
    acts = []
    for m in sim.messages():
        acts += [m["slot"]] if m.type == P.ACT else []
        if len(acts) == 2:
            break
    assert sorted(acts) == [0, 1]
    assert P.BUNDLE not in sim.types_received()
    assert job.status()["bundles"] == {"in": 0, "in_parts": 0, "out": 0, "out_parts": 0}
    for p in (sim, gen):
        p.close()
