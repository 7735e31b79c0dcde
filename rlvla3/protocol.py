"""The rlvla3 wire protocol: every constant, limit and message type, then the message codec.

A message is a multipart ZeroMQ message ``[header, *tensor frames]`` (after the ROUTER's identity
frame, which the socket adds and strips). The header is a msgpack map:

    {"v": PROTOCOL_VERSION, "type": "OBS", ...fields..., "tensors": [desc, ...]}

and each tensor descriptor says where that tensor's bytes are: in the next frame, or in a
shared-memory segment (the tensor codec, ``rlvla3/tensors.py``).

Message types and who sends them (``->B`` = to the broker, ``B->`` = from the broker):

    READY       any ->B   join: role, host, pid, name; B-> reply: worker_id, config, run_id, ...
    HEARTBEAT   both      liveness; any traffic counts as a heartbeat
    DISCONNECT  both      orderly leave (worker) / shutdown order (broker)
    OBS         sim ->B   one slot's observation request (n envs); with ``block``, its shared-memory
                          tensors are sent once and named by that number after (``brokers.state``)
    ACT         B-> sim   actions, log-probs, values, replay for one OBS request
    BATCH       B-> gen   several OBS requests batched for one forward pass
    RESULT      gen ->B   the outputs of one BATCH, stacked: each tensor's rows are the served
                          requests' envs in batch order; the broker slices each request's (``row_slicer``)
    TRAJ        sim ->B, B-> trainer   a finished trajectory fragment; to a trainer with the
                          broker's ``gid`` and its simulator (``writer``), which with ``traj_id``
                          names it across broker restarts
    TRAJ_ACK    trainer ->B, B-> sim   trajectories taken (the sim may free their buffers), and
                          the fates of steps the trainer held
    WEIGHTS     trainer ->B, B-> gen (PUB, snapshot reply)   a version's announcement (manifest,
                where the bytes are: rlvla3/weights/), never the bytes
    SNAPSHOT    gen ->B   ask for the latest WEIGHTS (Clone pattern: subscribe first, then ask)
    FETCH       gen -> rank 0's weight stream (not the broker): one bucket of a version
    BUCKET      weight stream -> gen   that bucket's bytes (one inline uint8 tensor) or an error
Tensor names follow one scheme, in rlvla3/names.py.
    TRAIN       trainer ->B   phase of the trainer (begin/end of an update), for alternating modes
    STATUS      any ->B   live figures; B-> reply with them
    TUNE        client ->B   set the batching rule live; B-> reply with the rule in force
    ERROR       B-> any   the sender's message was bad: code + reason; the message is dropped
    BUNDLE      both      several messages to one peer as one: ``parts`` gives each one's frame
                count, its frames follow in order (``rlvla3/bundle.py``); sent only to a peer
                whose READY said ``bundles``

Nothing here unpickles; decoding validates before anything reads a field.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack

from rlvla3 import fields as F
from rlvla3.protocol_errors import (  # noqa: F401 - the wire's error vocabulary, read as P.E_*
    E_AUTH,
    E_FIELD,
    E_LIMIT,
    E_MALFORMED,
    E_OVERSIZE,
    E_ROLE,
    E_STATE,
    E_TENSOR,
    E_TYPE,
    E_VERSION,
    ProtocolError,
)
from rlvla3.tensors import (  # noqa: F401 - the tensor types and helpers every peer reads as P.*
    MAX_NAME_LEN,
    SHM_PREFIX,
    InlineTensor,
    ShmRef,
    as_numpy,
    bytes_of,
    decode_tensors,
    describe,
    dtype_name,
    inline_array,
    row_slicer,
)

# ---------------------------------------------------------------------------------------------
# Constants and limits
# ---------------------------------------------------------------------------------------------

PROTOCOL_VERSION = 1

READY = "READY"
HEARTBEAT = "HEARTBEAT"
DISCONNECT = "DISCONNECT"
OBS = "OBS"
ACT = "ACT"
BATCH = "BATCH"
RESULT = "RESULT"
TRAJ = "TRAJ"
TRAJ_ACK = "TRAJ_ACK"
WEIGHTS = "WEIGHTS"
SNAPSHOT = "SNAPSHOT"
TRAIN = "TRAIN"
STATUS = "STATUS"
TUNE = "TUNE"
ERROR = "ERROR"
FETCH = "FETCH"
BUCKET = "BUCKET"
BUNDLE = "BUNDLE"

ROLES = ("simulator", "generator", "trainer", "client")

HEARTBEAT_INTERVAL_S = 1.0
"""Send something at least this often (Paranoid Pirate)."""
HEARTBEAT_LIVENESS = 3
"""A peer silent for LIVENESS x INTERVAL is dead."""
RECONNECT_MIN_S = 1.0
RECONNECT_MAX_S = 32.0

MAX_HEADER_BYTES = 4 * 1024 * 1024
MAX_FRAMES = 8192
MAX_MESSAGE_BYTES = 2 * 1024**3 - 1
"""ZMQ_MAXMSGSIZE on every socket that receives from peers: one frame can never exceed it."""
SOCKET_HWM = 10_000
LINGER_MS = 500

MAX_BUNDLE_PARTS = 256
"""Messages in one BUNDLE: a receiver handles a bundle in one go, so this bounds how long it
holds the broker's loop from its timers (256 OBS, about 10 ms)."""
MAX_BUNDLE_BYTES = 64 * 1024**2
"""A bundle stops growing at this many bytes; a bigger message goes alone."""

# Every header field of every message type: name -> spec (rlvla3/fields.py). ``required`` must
# be present; the others are checked when present. Both directions of a type share one entry.
# Unknown extra fields are allowed but must be bounded, finite msgpack data.
_ID = F.Int(0, F.MAX_ID)
_VERSION = F.Int(-1, F.MAX_ID)
_SLOT = F.Int(0, F.MAX_COUNT)
_COUNT = F.Int(0, F.MAX_COUNT)
_STEPS = F.Int(0, F.MAX_STEPS)
_TEXT = F.Str(F.MAX_TEXT)
_NAME = F.Str(MAX_NAME_LEN)
_REASON = F.Str(F.MAX_TEXT)
_US = F.Int(0, F.MAX_ID)
_FREE = F.Free()  # an unknown extra field: bounded, finite data
_INFO = F.Map((("dist", F.Free()), ("env_steps", F.Int(0, F.MAX_ID)), ("version", _VERSION), ("served", F.Int(0, F.MAX_ID)),
               ("algo", F.Str(16))),
              closed=True, nullable=True)  # closed: the broker keeps it per worker, so no key may grow it
_REQUEST = F.Map((("req_id", _ID), ("slot", _SLOT), ("n", F.Int(1, F.MAX_COUNT)), ("instruction", F.List(_TEXT)),
                  ("episode_step", F.List(_ID)), ("deterministic", F.List(F.Bool()))),
                 required=("req_id", "slot", "n", "instruction", "episode_step"), closed=True)
_WRITER = F.Map((("host", _NAME), ("pid", F.Int(0, 2**31)), ("name", _NAME)), required=("host", "pid", "name"),
               closed=True)  # a fragment's simulator as the broker registered it
_TRAIN_STATS = F.Map((("staleness_counts", F.Map(finite=True)),), finite=False)

SCHEMA: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # type -> (required, optional)
    READY: (
        {"role": F.Str(32), "host": _NAME, "pid": F.Int(0, 2**31)},
        {"name": _NAME, "info": _INFO, "slots": _COUNT, "num_envs": _COUNT, "credits": _COUNT, "bundles": F.Bool(),
         # the broker's reply
         "worker_id": _ID, "run_id": _NAME, "config": F.Map(finite=False), "broker_host": _NAME, "pub": _NAME,
         "heartbeat_s": F.Num(1e-3, 3600.0), "liveness": F.Int(1, 1000), "version": _VERSION,
         "rank": _COUNT, "world_size": F.Int(1, F.MAX_COUNT), "trainer_version": _ID, "dist": F.Free()},
    ),
    HEARTBEAT: ({}, {"credits": _COUNT, "version": _VERSION, "served": _ID, "env_steps": _ID, "info": _INFO}),
    DISCONNECT: ({}, {"reason": _REASON}),
    OBS: (
        {"slot": _SLOT, "req_id": _ID, "n": F.Int(1, F.MAX_COUNT), "instruction": F.List(_TEXT),
         "episode_step": F.List(_ID)},
        {"version": _VERSION, "env_steps": _STEPS, "decision_steps": _STEPS, "env_restarts": _STEPS,
         "eval": F.Bool(), "deterministic": F.List(F.Bool()), "block": F.Int(0, 2 * F.MAX_COUNT)},  # two per slot
    ),
    ACT: ({"slot": _SLOT, "req_id": _ID, "version": _VERSION}, {"queue_us": _US, "forward_us": _US, "error": _REASON}),
    BATCH: ({"batch_id": _ID, "requests": F.List(_REQUEST)}, {"queue_us": F.List(_US), "min_version": _VERSION}),
    RESULT: ({"batch_id": _ID, "version": _VERSION}, {"error": _REASON, "forward_us": _US, "queue_us": F.List(_US),
                                                       "dropped": F.List(_COUNT)}),
    TRAJ: (
        {"traj_id": _ID, "slot": _SLOT, "steps": _STEPS},
        {"instruction": _TEXT, "env": _ID, "episode": _ID, "seed": F.Int(0, 2**63), "done": F.Bool(),
         "episode_return": F.Num(), "episode_success": F.Bool(), "episode_length": _STEPS,
         "episode_returns": F.List(F.Num()), "episode_successes": F.List(F.Bool()), "eval": F.Bool(),
         "eval_version": _VERSION, "eval_round": _COUNT, "gid": _ID, "writer": _WRITER},
    ),
    TRAJ_ACK: ({"traj_ids": F.List(_ID)}, {"dropped_stale": _STEPS, "stale_taken": _STEPS, "discarded": _STEPS,
                                           "trained": _STEPS, "unreadable": _STEPS, "duplicate": _STEPS}),
    WEIGHTS: ({"version": _VERSION}, {"published_at": F.Int(0, 2**63, nullable=True), "manifest": F.Free(),
                                      "store": F.Free(), "stream": F.Free(), "ipc": F.Free(), "policy_version": _VERSION}),  # checked deep by rlvla3.weights
    SNAPSHOT: ({}, {}),
    TRAIN: ({"phase": F.Str(16, ("begin", "end", "starved")), "version": _ID},
            {"steps": _STEPS, "ready_steps": _STEPS, "stats": _TRAIN_STATS}),
    STATUS: ({}, {"figures": F.Map(finite=False)}),
    TUNE: ({}, {"max_batch": F.Int(1, 1 << 16), "max_wait_ms": F.Num(0.0, 60_000.0), "adaptive": F.Bool(),
                "batching": F.Map(finite=False)}),  # the last: the broker's reply
    ERROR: ({"code": F.Str(64), "reason": _REASON}, {"ref_type": F.Str(32, nullable=True)}),
    FETCH: ({"version": _VERSION, "region": F.Int(0, 4), "offset": F.Int(0, 2**40), "nbytes": F.Int(1, 2**30)}, {}),
    BUCKET: ({"version": _VERSION, "region": F.Int(0, 4), "offset": F.Int(0, 2**40)},
             {"error": F.Str(64), "reason": _REASON}),
    BUNDLE: ({"parts": F.List(F.Int(1, MAX_FRAMES), MAX_BUNDLE_PARTS)}, {}),
}
BROKER_PRIVATE = ("attempts", "admitted")
"""Header fields the broker writes into a queued request; a peer may not send them."""
_FAST = {t: F.compile_check(req, opt, ("v", "type", "tensors")) for t, (req, opt) in SCHEMA.items()}


# ---------------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------------


@dataclass
class Message:
    """A decoded, validated message. ``tensors`` maps name -> InlineTensor | ShmRef."""

    type: str
    header: dict[str, Any]
    tensors: dict[str, InlineTensor | ShmRef] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.header[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.header.get(key, default)


_packers = threading.local()  # msgpack.packb builds a Packer per call: a third of a small header's cost


def pack_header(header: dict[str, Any]) -> bytes:
    """A header as msgpack, with this thread's Packer (it resets itself, also after a failure)."""
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(header)


def encode(msg_type: str, fields: dict[str, Any] | None = None, tensors: dict[str, Any] | None = None) -> list[Any]:
    """Frames for a message: msgpack header, then one frame per inline tensor.

    ``tensors`` values are numpy arrays / torch tensors (sent inline) or ShmRef (sent as a
    descriptor), or already-received InlineTensor (forwarded without a copy).
    """
    if msg_type not in SCHEMA:  # a dict: every type has its entry
        raise ProtocolError(E_TYPE, f"unknown message type {msg_type!r}")
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": msg_type, **(fields or {})}
    descs, frames = describe(tensors or {})
    header["tensors"] = descs
    return [pack_header(header), *frames]


def decode(frames: Sequence[Any]) -> Message:
    """Validate and decode frames (without the ROUTER identity). Raises ProtocolError."""
    if not frames:
        raise ProtocolError(E_MALFORMED, "empty message")
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(E_OVERSIZE, f"{len(frames)} frames > {MAX_FRAMES}")
    raw = bytes_of(frames[0])
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(E_OVERSIZE, f"header of {len(raw)} bytes > {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER_BYTES)
    except Exception as exc:  # msgpack raises many types; all mean the same to us
        raise ProtocolError(E_MALFORMED, f"header is not msgpack: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise ProtocolError(E_MALFORMED, "header is not a map")
    v = header.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:
        raise ProtocolError(E_VERSION, f"protocol version {v!r}, this peer speaks {PROTOCOL_VERSION}")
    msg_type = header.get("type")
    if type(msg_type) is not str or msg_type not in SCHEMA:
        raise ProtocolError(E_TYPE, f"unknown message type {str(msg_type)[:64]!r}")
    _check_fields(msg_type, header)
    if msg_type == BUNDLE:  # its frames are its parts' (``rlvla3.bundle``), not tensors
        if sum(header["parts"]) != len(frames) - 1:
            raise ProtocolError(E_FIELD, f"BUNDLE: parts of {sum(header['parts'])} frames, {len(frames) - 1} sent")
        return Message(type=BUNDLE, header=header)
    descs = header.get("tensors", [])
    if type(descs) is list and len(descs) > MAX_FRAMES:
        raise ProtocolError(E_OVERSIZE, f"{len(descs)} tensors > {MAX_FRAMES}")
    tensors = decode_tensors(descs, frames[1:])
    return Message(type=msg_type, header=header, tensors=tensors)


def _check_fields(msg_type: str, header: dict[str, Any]) -> None:
    """Every field against SCHEMA (type, range, finiteness), then the cross-field rules. A valid header
    passes one compiled check (``_FAST``); the specs run one by one to name a failure or accept free data."""
    required, optional = SCHEMA[msg_type]
    try:
        if not _FAST[msg_type](header):
            for name, spec in required.items():
                if name not in header:
                    raise F.FieldError(f"lacks field {name!r}")
                spec.check(header[name], name)
            for name, value in header.items():
                if name in required or name in ("v", "type", "tensors"):
                    continue
                if type(name) is not str:
                    raise F.FieldError(f"a field name of type {type(name).__name__}")
                if name in BROKER_PRIVATE:
                    raise F.FieldError(f"{name!r} is set by the broker, not sent")
                (optional.get(name) or _FREE).check(value, name)
        if msg_type == OBS:
            n = header["n"]
            for name in ("instruction", "episode_step", "deterministic"):
                if name in header and len(header[name]) != n:
                    raise F.FieldError(f"{name} has {len(header[name])} items, n={n}")
        elif msg_type == BATCH:
            for r in header["requests"]:
                if len(r["instruction"]) != r["n"] or len(r["episode_step"]) != r["n"] or len(r.get("deterministic", [0] * r["n"])) != r["n"]:
                    raise F.FieldError(f"request {r['req_id']}: lists disagree with n={r['n']}")
        elif msg_type == TRAIN and "stats" in header:
            for key, count in (header["stats"].get("staleness_counts") or {}).items():
                if not key.lstrip("-").isdigit() or len(key) > 16:
                    raise F.FieldError(f"stats.staleness_counts key {key[:32]!r} is not a staleness")
                F.checked_int(count, 0, F.MAX_ID, f"stats.staleness_counts[{key}]")
    except F.FieldError as err:
        raise ProtocolError(E_FIELD, f"{msg_type}: {err}") from None


def error_frames(code: str, reason: str, ref_type: str | None = None) -> list[Any]:
    """An ERROR message answering a bad one."""
    return encode(ERROR, {"code": code, "reason": reason[:1000], "ref_type": ref_type})
