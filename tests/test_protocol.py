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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
        ([msgpack.packb({"v": 1, "type": "HEARTBEAT", "tensors": [{"name": "x", "dtype": "float32", "shape": [2], "where": "inline"}]})], P.E_TENSOR),
        ([msgpack.packb({"v": 1, "type": "HEARTBEAT", "tensors": [{"name": "x", "dtype": "float32", "shape": [2], "where": "inline"}]}), b"abc"], P.E_TENSOR),
        ([msgpack.packb({"v": 1, "type": "HEARTBEAT", "tensors": [{"name": "x", "dtype": "object", "shape": [1], "where": "inline"}]}), b"a"], P.E_TENSOR),
        ([msgpack.packb({"v": 1, "type": "HEARTBEAT", "tensors": [{"name": "x", "dtype": "uint8", "shape": [-1], "where": "inline"}]}), b"a"], P.E_TENSOR),
        ([msgpack.packb({"v": 1, "type": "HEARTBEAT", "tensors": [{"name": "x", "dtype": "uint8", "shape": [4], "where": "shm", "seg": "/etc/passwd", "offset": 0, "nbytes": 4, "host": "h"}]})], P.E_TENSOR),
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
    sock.send_multipart(frames)
    assert sock.poll(5000), f"no reply to {frames!r}"
    msg = P.decode(sock.recv_multipart())
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


def test_replayed_corpus(broker_sock):
    job, sock = broker_sock
    cases = sorted(CORPUS.glob("*.json"))
    assert cases, "the corpus is empty"
    for case in cases:
        frames = [bytes.fromhex(h) for h in json.loads(case.read_text())["frames"]]
        reply = _expect_error(sock, frames)
        assert reply.type == P.ERROR, case.name
    _still_serves(sock)
    assert job.fig()["errors"] >= len(cases)


def test_message_before_ready_and_wrong_role(broker_sock):
    job, sock = broker_sock
    obs = P.encode(P.OBS, {"slot": 0, "req_id": 1, "n": 1, "instruction": ["x"], "episode_step": [0]})
    r = _expect_error(sock, obs)
    assert r.type == P.ERROR and r["code"] == P.E_STATE
    hello = _expect_error(sock, P.encode(P.READY, {"role": "generator", "host": "elsewhere", "pid": 1}))
    assert hello.type == P.READY and "config" in hello.header
    r = _expect_error(sock, obs)  # a generator may not send OBS
    assert r.type == P.ERROR and r["code"] == P.E_ROLE
