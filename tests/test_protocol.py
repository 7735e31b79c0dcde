"""The wire: round trips, validation, and a live broker that answers every bad message with
ERROR and keeps serving (hypothesis-generated frames plus a replayed corpus)."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rlvla3 import fields as F
from rlvla3 import protocol as P
from rlvla3.shm import ShmAttachments, ShmPool

CORPUS = Path(__file__).parent / "corpus" / "protocol"


def _frames_bytes(frames):
    return [bytes(f) if not isinstance(f, (bytes, bytearray)) else bytes(f) for f in frames]


def test_round_trip_inline_and_bf16():
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    big = np.random.default_rng(0).integers(0, 255, (4, 64, 64, 3), dtype=np.uint8)  # zero-copy path
    bf = torch.randn(3, 5).to(torch.bfloat16)
    frames = _frames_bytes(P.encode(P.OBS, {"slot": 0, "req_id": 1, "n": 2, "instruction": ["a", "b"],
                                            "episode_step": [0, 3]}, {"state": a, "img": big, "w": bf}))
    msg = P.decode(frames)
    assert msg.type == P.OBS and msg["episode_step"] == [0, 3]
    att = ShmAttachments()
    np.testing.assert_array_equal(att.materialize(msg.tensors["state"]), a)
    np.testing.assert_array_equal(att.materialize(msg.tensors["img"]), big)
    back = torch.from_numpy(att.materialize(msg.tensors["w"], copy=True).view(np.int16)).view(torch.bfloat16)
    assert torch.equal(back, bf)


def test_shm_descriptor_round_trip():
    pool = ShmPool("prototest", 1 << 16)
    try:
        ref = pool.put(np.full((3, 4), 7, np.int32))
        msg = P.decode(_frames_bytes(P.encode(P.WEIGHTS, {"version": 3}, {"x": ref})))
        arr = ShmAttachments().materialize(msg.tensors["x"], copy=True)
        assert arr.shape == (3, 4) and (arr == 7).all()
    finally:
        pool.close()


@pytest.mark.parametrize(
    "frames, code",
    [
        ([], P.E_MALFORMED),
        ([b"\xc1\xc1"], P.E_MALFORMED),
        ([msgpack.packb([1, 2])], P.E_MALFORMED),
        ([msgpack.packb({"v": 99, "type": "OBS"})], P.E_VERSION),
        ([msgpack.packb({"v": 1, "type": "NOPE"})], P.E_TYPE),
        ([msgpack.packb({"v": 1, "type": "OBS", "slot": 0})], P.E_FIELD),
        ([msgpack.packb({"v": 1, "type": "WEIGHTS", "version": True})], P.E_FIELD),
        ([msgpack.packb({"v": 1, "type": "HEARTBEAT", "tensors": [["x", "float32", [2], "inline"]]})], P.E_TENSOR),
        ([msgpack.packb({"v": 1, "type": "HEARTBEAT", "tensors": [["x", "float32", [2], "inline"]]}), b"abc"], P.E_TENSOR),
        ([msgpack.packb({"v": 1, "type": "HEARTBEAT", "tensors": [["x", "object", [1], "inline"]]}), b"a"], P.E_TENSOR),
        ([msgpack.packb({"v": 1, "type": "HEARTBEAT", "tensors": [["x", "uint8", [-1], "inline"]]}), b"a"], P.E_TENSOR),
        ([msgpack.packb({"v": 1, "type": "HEARTBEAT", "tensors": [["x", "uint8", [4], "shm", "/etc/passwd", 0, 4, "h"]]})], P.E_TENSOR),
        ([msgpack.packb({"v": 1, "type": "HEARTBEAT", "tensors": [["x", "uint8", [4], "shm", "rlvla3_a", 0, 4, 7]]})], P.E_TENSOR),
        ([msgpack.packb({"v": 1, "type": "HEARTBEAT", "tensors": [{"name": "x", "dtype": "uint8", "shape": [1], "where": "inline"}]}), b"a"], P.E_TENSOR),
        ([msgpack.packb({"v": 1, "type": "HEARTBEAT", "tensors": [["x", "uint8", [1]]]}), b"a"], P.E_TENSOR),
        ([msgpack.packb({"v": 1, "type": "HEARTBEAT", "tensors": [["x", "uint8", [1], "inline", 0, 0, 1, "h"]]}), b"a"], P.E_TENSOR),
        ([msgpack.packb({"v": 1, "type": "HEARTBEAT", "tensors": [["x", "uint8", [4], "shm"]]})], P.E_TENSOR),
        ([msgpack.packb({"v": 1, "type": "HEARTBEAT", "tensors": [[["x"], "uint8", [1], "inline"]]}), b"a"], P.E_TENSOR),
        ([msgpack.packb({"v": 1, "type": "HEARTBEAT", "tensors": [["x", ["uint8"], [1], "inline"]]}), b"a"], P.E_TENSOR),
        ([msgpack.packb({"v": 1, "type": "HEARTBEAT", "tensors": []}), b"extra"], P.E_TENSOR),
        ([msgpack.packb({"v": 1, "type": "HEARTBEAT"}), *([b""] * (P.MAX_FRAMES + 1))], P.E_OVERSIZE),
    ],
)
def test_decode_rejects(frames, code):
    with pytest.raises(P.ProtocolError) as exc:
        P.decode(frames)
    assert exc.value.code == code


# ---------------------------------------------------------------------------------------------
# Against a live broker
# ---------------------------------------------------------------------------------------------

_header_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_bad_headers = st.one_of(
    st.binary(max_size=64),  # not msgpack at all (or not a map)
    st.builds(lambda d: msgpack.packb(d), st.dictionaries(st.text(max_size=6), _header_values, max_size=5)),
    st.builds(  # the right version and a real type, with missing / mistyped fields or tensors
        lambda t, d: msgpack.packb({"v": 1, "type": t, **d}),
        st.sampled_from([P.OBS, P.TRAJ, P.RESULT, P.WEIGHTS, P.TRAJ_ACK, P.TRAIN]),
        st.dictionaries(st.sampled_from(["slot", "req_id", "n", "tensors", "batch_id", "version", "traj_ids"]),
                        _header_values, max_size=4),
    ),
)


def _expect_error(sock: zmq.Socket, frames: list[bytes]) -> dict:
    """The broker's reply to ``frames`` (its heartbeats to a joined peer are skipped)."""
    sock.send_multipart(frames)
    while True:
        assert sock.poll(5000), f"no reply to {frames!r}"
        msg = P.decode(sock.recv_multipart())
        if msg.type != P.HEARTBEAT:
            return msg


def _still_serves(sock: zmq.Socket) -> None:
    sock.send_multipart(P.encode(P.STATUS, {}))
    assert sock.poll(5000), "broker stopped answering STATUS"
    assert P.decode(sock.recv_multipart()).type == P.STATUS


@pytest.fixture
def broker_sock(job_factory, zctx):
    job = job_factory(start=False)
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(job.endpoint)
    yield job, sock
    sock.close()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=_bad_headers, extra=st.lists(st.binary(max_size=16), max_size=3))
def test_fuzzed_frames_get_error_and_broker_keeps_serving(broker_sock, header, extra):
    job, sock = broker_sock
    frames = [header, *extra]
    try:
        P.decode(frames)
        valid = True
    except P.ProtocolError:
        valid = False
    reply = _expect_error(sock, frames)
    if valid:  # a well-formed message from a peer that never sent READY is still refused
        assert reply.type in (P.ERROR, P.STATUS, P.READY)
    else:
        assert reply.type == P.ERROR and reply["code"]
    _still_serves(sock)


def _joined(zctx, endpoint: str, role: str) -> zmq.Socket:
    """A DEALER that has joined the broker as ``role`` (so its messages reach the handlers)."""
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    extra = {"slots": 2, "num_envs": 4} if role == "simulator" else {"credits": 1} if role == "generator" else {}
    reply = _expect_error(sock, P.encode(P.READY, {"role": role, "host": "fuzzhost", "pid": 1, "name": f"fuzz-{role}", **extra}))
    if reply.type != P.READY:
        sock.close()
        raise AssertionError(f"the broker refused READY as {role}: {reply.header}")
    return sock


def test_replayed_corpus(broker_sock, zctx):
    """Every input that once crashed or slipped past decode: refused by decode, answered with
    ERROR by a live broker (from a peer that joined as the role that may send it)."""
    job, sock = broker_sock
    cases = sorted(CORPUS.glob("*.json"))
    assert cases, "the corpus is empty"
    peers: dict[str, zmq.Socket] = {}
    try:
        for case in cases:
            data = json.loads(case.read_text())
            frames = [bytes.fromhex(h) for h in data["frames"]]
            with pytest.raises(P.ProtocolError):
                P.decode(frames)
            role = data.get("role")
            if role is not None and role not in peers:
                peers[role] = _joined(zctx, job.endpoint, role)
            peer = sock if role is None else peers[role]
            reply = _expect_error(peer, frames)
            assert reply.type == P.ERROR and reply["code"] != P.E_STATE, (case.name, reply.header)
        _still_serves(sock)
        assert job.status()["errors"] >= len(cases)
        assert job.broker_proc.poll() is None
    finally:
        for s in peers.values():
            s.close()


# ---------------------------------------------------------------------------------------------
# Type confusion: every field of every message type, with every kind of wrong value
# ---------------------------------------------------------------------------------------------

_VALID = {  # one valid header per message type (required fields only)
    P.READY: {"role": "simulator", "host": "h", "pid": 1},
    P.HEARTBEAT: {}, P.DISCONNECT: {}, P.SNAPSHOT: {}, P.STATUS: {},
    P.OBS: {"slot": 0, "req_id": 1, "n": 1, "instruction": ["x"], "episode_step": [0]},
    P.ACT: {"slot": 0, "req_id": 1, "version": 0},
    P.BATCH: {"batch_id": 1, "requests": []},
    P.RESULT: {"batch_id": 1, "version": 0},
    P.TRAJ: {"traj_id": 1, "slot": 0, "steps": 8},
    P.TRAJ_ACK: {"traj_ids": [1]},
    P.WEIGHTS: {"version": 0},
    P.TRAIN: {"phase": "end", "version": 0},
    P.ERROR: {"code": "x", "reason": "y"},
    P.TUNE: {},
    P.FETCH: {"version": 1, "region": 1, "offset": 0, "nbytes": 8},
    P.BUCKET: {"version": 1, "region": 1, "offset": 0},
    P.BUNDLE: {"parts": []},
}
# A hostile value and the spec kinds it could legitimately be (F.Free takes any finite data).
_HOSTILE = [
    ([1], ("List", "Free")), ({"a": 1}, ("Map", "Free")), (True, ("Bool", "Free")),
    (float("inf"), ()), (float("-inf"), ()), (float("nan"), ()), (2**64 - 1, ("Num", "Free")),
    (-(2**40), ("Num", "Free")), (1.5, ("Num", "Free")), ("x" * 5000, ("Free",)), (b"\x00", ("Free",)),
]
_FIELDS = [(t, name, spec) for t, (req, opt) in P.SCHEMA.items() for name, spec in {**req, **opt}.items()]


def test_every_field_is_in_the_fuzzed_schema():
    assert set(_VALID) == set(P.SCHEMA)
    for t, fields in _VALID.items():
        P.decode([msgpack.packb({"v": 1, "type": t, **fields})])  # the base of every case is valid


def _hostile_header(t: str, name: str, value):
    return msgpack.packb({"v": 1, "type": t, **_VALID[t], name: value})


@pytest.mark.parametrize("t, name, spec", _FIELDS, ids=[f"{t}.{n}" for t, n, _ in _FIELDS])
def test_type_confusion_every_field(t, name, spec):
    kind = type(spec).__name__
    for value, fits in _HOSTILE:
        if kind in fits or (value is None and getattr(spec, "nullable", False)):
            continue
        with pytest.raises(P.ProtocolError) as exc:
            P.decode([_hostile_header(t, name, value)])
        assert exc.value.code == P.E_FIELD, (t, name, value)


_any_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)


@settings(max_examples=400, deadline=None)
@given(case=st.sampled_from(_FIELDS), value=_any_value)
@example(case=(P.READY, "slots", None), value=float("inf"))
@example(case=(P.RESULT, "queue_us", None), value=[float("inf")])
def test_decode_raises_nothing_but_protocol_error(case, value):
    """Whatever a field holds (inf, NaN, 2^64, nested lists and maps), decode either accepts
    it or raises ProtocolError: no other exception can reach a receive loop."""
    t, name, _ = case
    header = msgpack.unpackb(_hostile_header(t, name, value))
    assert P._FAST[t](header) == _specs_accept(t, header), "the compiled check and the specs disagree"
    try:
        msg = P.decode([_hostile_header(t, name, value)])
    except P.ProtocolError:
        return
    assert msg.type == t


def _specs_accept(t: str, header: dict) -> bool:
    """Whether every field passes its spec, checked one by one (what ``fields.compile_check``
    compiles into one function)."""
    required, optional = P.SCHEMA[t]
    try:
        for name, value in header.items():
            if name not in ("v", "type", "tensors"):
                {**required, **optional}[name].check(value, name)
        return all(name in header for name in required)
    except F.FieldError:
        return False


_SENDER = {P.OBS: "simulator", P.TRAJ: "simulator", P.RESULT: "generator", P.SNAPSHOT: "generator",
           P.HEARTBEAT: "generator", P.TRAJ_ACK: "trainer", P.WEIGHTS: "trainer", P.TRAIN: "trainer", P.READY: None,
           P.BUNDLE: "simulator"}
_TO_BROKER = [(t, n, s) for t, n, s in _FIELDS if t in _SENDER]


@pytest.fixture
def joined(broker_sock, zctx):
    job, sock = broker_sock
    peers = {r: _joined(zctx, job.endpoint, r) for r in ("simulator", "generator", "trainer")}
    peers[None] = sock
    yield job, peers
    for r in ("simulator", "generator", "trainer"):
        peers[r].close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(_TO_BROKER), value=st.sampled_from([v for v, _ in _HOSTILE]))
def test_type_confusion_at_a_live_broker(joined, case, value):
    """The same confusion sent by a peer that joined as the sending role: ERROR, and the
    broker keeps serving."""
    job, peers = joined
    t, name, spec = case
    frames = [_hostile_header(t, name, value)]
    try:
        P.decode(frames)
        return  # this value fits this field (a list for a list field): not a confusion
    except P.ProtocolError:
        pass
    reply = _expect_error(peers[_SENDER[t]], frames)
    assert reply.type == P.ERROR and reply["code"] == P.E_FIELD, reply.header
    _still_serves(peers[None])
    assert job.broker_proc.poll() is None


# ---------------------------------------------------------------------------------------------
# Valid but hostile: well-formed messages in orders and with values no honest worker sends
# ---------------------------------------------------------------------------------------------

_ids = st.integers(0, 2**53)
_hostile_actions = st.one_of(
    st.tuples(st.just("simulator"), st.builds(lambda slot, rid, n, steps: (P.OBS, {
        "slot": slot, "req_id": rid, "n": n, "instruction": ["x"] * n, "episode_step": [steps] * n,
        "env_steps": steps % 2**32, "version": 2**53}, {"state": np.zeros((n, 3), np.float32)}),
        st.integers(0, 3), _ids, st.integers(1, 6), _ids)),
    st.tuples(st.just("simulator"), st.builds(lambda tid, steps, done: (P.TRAJ, {
        "traj_id": tid, "slot": 0, "steps": steps, "done": done, "episode_return": 1e300, "episode_success": done,
        "episode_returns": [1e300], "episode_successes": [done], "env": 0}, {}),
        _ids, st.integers(0, 2**32), st.booleans())),
    st.tuples(st.just("generator"), st.builds(lambda bid, v: (P.RESULT, {"batch_id": bid, "version": v,
                                                                          "queue_us": [2**53] * 3}, {}),
                                              st.integers(0, 50), st.integers(-1, 2**53))),
    st.tuples(st.just("generator"), st.builds(lambda bid: (P.RESULT, {"batch_id": bid, "version": 0, "error": "x" * 4000}, {}),
                                              st.integers(0, 50))),
    st.tuples(st.just("generator"), st.builds(lambda c: (P.HEARTBEAT, {"credits": c, "info": {"env_steps": 2**53}}, {}),
                                              st.integers(0, 2**16))),
    st.tuples(st.just("generator"), st.just((P.SNAPSHOT, {}, {}))),
    st.tuples(st.just("trainer"), st.builds(lambda ids, d: (P.TRAJ_ACK, {"traj_ids": ids, "dropped_stale": d, "discarded": d}, {}),
                                            st.lists(st.integers(0, 2**53), max_size=20), st.integers(0, 2**32))),
    st.tuples(st.just("trainer"), st.builds(lambda phase, v, s: (P.TRAIN, {"phase": phase, "version": v, "steps": s,
                                                                            "stats": {"staleness_counts": {"99999": 2**53}}}, {}),
                                            st.sampled_from(["begin", "end", "starved"]), _ids, st.integers(0, 2**32))),
    st.tuples(st.sampled_from(["simulator", "generator", "trainer"]), st.builds(
        lambda role, slots: (P.READY, {"role": role, "host": "fuzzhost", "pid": 2**31, "slots": slots, "num_envs": slots,
                                       "credits": slots}, {}),
        st.sampled_from(["simulator", "generator", "trainer", "client"]), st.integers(0, 2**16))),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=st.lists(_hostile_actions, min_size=1, max_size=25))
def test_valid_but_hostile_sequences(joined, actions):
    """Sequences of well-formed messages with extreme values, unknown ids and role changes,
    from peers that joined: the broker answers STATUS afterwards and is still running."""
    job, peers = joined
    for role, (t, fields, tensors) in actions:
        peers[role].send_multipart(P.encode(t, fields, tensors))
    _still_serves(peers[None])
    for sock in peers.values():  # drain replies (BATCH, ERROR, READY, WEIGHTS) for the next example
        while sock.poll(0):
            P.decode(sock.recv_multipart())
    assert job.broker_proc.poll() is None


def test_message_before_ready_and_wrong_role(broker_sock):
    job, sock = broker_sock
    obs = P.encode(P.OBS, {"slot": 0, "req_id": 1, "n": 1, "instruction": ["x"], "episode_step": [0]})
    r = _expect_error(sock, obs)
    assert r.type == P.ERROR and r["code"] == P.E_STATE
    hello = _expect_error(sock, P.encode(P.READY, {"role": "generator", "host": "elsewhere", "pid": 1}))
    assert hello.type == P.READY and "config" in hello.header
    r = _expect_error(sock, obs)  # a generator may not send OBS
    assert r.type == P.ERROR and r["code"] == P.E_ROLE


def test_obs_naming_an_unknown_shm_host_is_answered(joined):
    """A request whose shm lives on a host the broker cannot read is dropped and answered."""
    job, peers = joined
    ref = P.ShmRef(seg=P.SHM_PREFIX + "nosuch", offset=0, nbytes=12, dtype="float32", shape=(1, 3), host="nowhere")
    peers["simulator"].send_multipart(P.encode(P.OBS, {"slot": 0, "req_id": 1, "n": 1, "instruction": ["x"],
                                                       "episode_step": [0]}, {"state": ref}))
    from rlvla3.status_client import wait_until

    wait_until(lambda: job.broker_proc.poll() is not None or job.status()["queue_depth"] == 0, 10, "the request to leave the queue")
    _still_serves(peers[None])
    assert job.broker_proc.poll() is None


def test_rows_of_a_stacked_tensor_are_views_not_copies():
    stacked = np.arange(12, dtype=np.float32).reshape(6, 2)
    inline = P.decode(P.encode(P.RESULT, {"batch_id": 1, "version": 0}, {"a": stacked})).tensors["a"]
    part = P.row_slicer(inline)(2, 3)
    assert part.shape == (3, 2) and P.inline_array(part).tolist() == stacked[2:5].tolist()
    ref = P.ShmRef(P.SHM_PREFIX + "x", 4096, 48, "float32", (6, 2), "h")
    sliced = P.row_slicer(ref)(4, 2)
    assert (sliced.offset, sliced.nbytes, sliced.shape, sliced.seg) == (4096 + 32, 16, (2, 2), ref.seg)
    assert P.row_slicer(ref)(6, 0).nbytes == 0
