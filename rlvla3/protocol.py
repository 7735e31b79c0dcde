"""The rlvla3 wire protocol: every constant, limit and message type, then one codec.

A message is a multipart ZeroMQ message ``[header, *tensor frames]`` (after the ROUTER's identity
frame, which the socket adds and strips). The header is a msgpack map:

    {"v": PROTOCOL_VERSION, "type": "OBS", ...fields..., "tensors": [desc, ...]}

and each tensor descriptor is an array, by position (a map's keys cost the broker a third of
an OBS's decode, and every request carries two descriptors):

    [name: str, dtype: str, shape: [int, ...], "inline"]
        -> its bytes are the next unused frame, sent zero-copy;
    [name: str, dtype: str, shape: [int, ...], "shm", seg: str, offset: int, nbytes: int, host: str]
        -> its bytes live in the named shared-memory segment on ``host``.

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
    TRAJ        sim ->B, B-> trainer   a finished trajectory fragment
    TRAJ_ACK    trainer ->B, B-> sim   trajectories taken (the sim may free their buffers)
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

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import msgpack
import numpy as np

from rlvla3 import fields as F

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

MESSAGE_TYPES = (
    READY, HEARTBEAT, DISCONNECT, OBS, ACT, BATCH, RESULT, TRAJ, TRAJ_ACK,
    WEIGHTS, SNAPSHOT, TRAIN, STATUS, ERROR, FETCH, BUCKET, TUNE, BUNDLE,
)

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
MAX_TENSOR_DIMS = 8
MAX_NAME_LEN = 256
MAX_SHM_OFFSET = 2**40
"""No shared-memory segment is larger than 1 TiB: offsets and sizes beyond it are hostile."""
SOCKET_HWM = 10_000
LINGER_MS = 500

MAX_BUNDLE_PARTS = 256
"""Messages in one BUNDLE: a receiver handles a bundle in one go, so this bounds how long it
holds the broker's loop from its timers (256 OBS, about 10 ms)."""
MAX_BUNDLE_BYTES = 64 * 1024**2
"""A bundle stops growing at this many bytes; a bigger message goes alone."""

ZERO_COPY_MIN_BYTES = 64 * 1024
"""Below this, pyzmq's zero-copy send costs more than it saves; copy instead."""

DTYPES = (
    "bool", "uint8", "int8", "int16", "uint16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64",
)
"""bfloat16 travels as raw 2-byte words (numpy has no bf16); torch views it back."""

SHM_PREFIX = "rlvla3_"

# Error codes carried by ERROR messages.
E_MALFORMED = "malformed"
E_VERSION = "version"
E_TYPE = "unknown_type"
E_OVERSIZE = "oversize"
E_FIELD = "bad_field"
E_TENSOR = "bad_tensor"
E_STATE = "out_of_order"
E_ROLE = "wrong_role"
E_AUTH = "unauthorized"  # a key, segment or identity this peer may not use
E_LIMIT = "over_limit"  # a per-peer cap (broker.max_peer_*) or a request no batch can hold

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
    BATCH: ({"batch_id": _ID, "requests": F.List(_REQUEST)}, {"queue_us": F.List(_US)}),
    RESULT: ({"batch_id": _ID, "version": _VERSION}, {"error": _REASON, "forward_us": _US, "queue_us": F.List(_US),
                                                       "dropped": F.List(_COUNT)}),
    TRAJ: (
        {"traj_id": _ID, "slot": _SLOT, "steps": _STEPS},
        {"instruction": _TEXT, "env": _ID, "episode": _ID, "seed": F.Int(0, 2**63), "done": F.Bool(),
         "episode_return": F.Num(), "episode_success": F.Bool(), "episode_length": _STEPS,
         "episode_returns": F.List(F.Num()), "episode_successes": F.List(F.Bool()), "eval": F.Bool(),
         "eval_version": _VERSION, "gid": _ID},
    ),
    TRAJ_ACK: ({"traj_ids": F.List(_ID)}, {"dropped_stale": _STEPS, "discarded": _STEPS, "trained": _STEPS,
                                           "unreadable": _STEPS}),
    WEIGHTS: ({"version": _VERSION}, {"published_at": F.Int(0, 2**63, nullable=True), "manifest": F.Free(),
                                      "store": F.Free(), "stream": F.Free(), "ipc": F.Free()}),  # checked deep by rlvla3.weights
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


class ProtocolError(ValueError):
    """A message that must be answered with ERROR and dropped."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


# ---------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True, unsafe_hash=True)
class ShmRef:
    """Where a tensor's bytes live in a shared-memory segment (no bytes travel). Never changed;
    not ``frozen``: a frozen dataclass's init costs 1 us, per tensor of every OBS the broker reads."""

    seg: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    host: str

    def descriptor(self, name: str) -> list[Any]:
        return [name, self.dtype, self.shape, "shm", self.seg, self.offset, self.nbytes, self.host]


@dataclass(slots=True)
class InlineTensor:
    """A tensor whose bytes arrived as a frame (a zero-copy buffer of the received message)."""

    dtype: str
    shape: tuple[int, ...]
    buffer: Any  # bytes / memoryview / zmq.Frame buffer

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def row_slicer(t: InlineTensor | ShmRef) -> Callable[[int, int], InlineTensor | ShmRef]:
    """For a tensor stacked along its first axis, ``rows(start, count)``: those rows without a
    copy (a view of the frame, or a reference further into the segment). Made once per tensor,
    called once per request: what a RESULT's slicing costs per request is one small object."""
    row = t.nbytes // t.shape[0] if t.shape[0] else 0
    dtype, tail = t.dtype, tuple(t.shape[1:])
    if type(t) is ShmRef:
        seg, offset, host = t.seg, t.offset, t.host
        return lambda start, count: ShmRef(seg, offset + start * row, count * row, dtype, (count, *tail), host)
    buf = memoryview(t.buffer)
    return lambda start, count: InlineTensor(dtype, (count, *tail), buf[start * row:(start + count) * row])


_ITEMSIZE = {d: 2 if d == "bfloat16" else np.dtype(d).itemsize for d in DTYPES}
_itemsize = _ITEMSIZE.__getitem__  # bytes per item of a wire dtype


def _np_dtype(dtype: str) -> np.dtype:
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)


def dtype_name(arr: Any) -> str:
    """The wire name of a numpy array's or torch tensor's dtype."""
    d = getattr(arr, "dtype", None)
    s = str(d)
    if s.startswith("torch."):
        s = s[len("torch."):]
    if s not in DTYPES:
        raise ProtocolError(E_TENSOR, f"dtype {s} cannot travel; allowed: {DTYPES}")
    return s


def as_numpy(arr: Any) -> np.ndarray:
    """A contiguous numpy view of a numpy array or CPU torch tensor (bf16 as raw uint16)."""
    if isinstance(arr, np.ndarray):
        return np.ascontiguousarray(arr)
    import torch  # local: the codec must not need torch to decode

    if isinstance(arr, torch.Tensor):
        t = arr.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.uint16).numpy() if hasattr(torch, "uint16") else t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()
    return np.ascontiguousarray(np.asarray(arr))


def inline_array(t: InlineTensor) -> np.ndarray:
    """A read-only numpy view over an inline tensor's frame (no copy)."""
    arr = np.frombuffer(t.buffer, dtype=_np_dtype(t.dtype), count=math.prod(t.shape))
    return arr.reshape(t.shape)


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
    descs: list[list[Any]] = []
    frames: list[Any] = []
    for name, value in (tensors or {}).items():
        if type(value) is ShmRef:
            descs.append(value.descriptor(name))
            continue
        if type(value) is InlineTensor:
            descs.append([name, value.dtype, value.shape, "inline"])
            frames.append(value.buffer)
            continue
        dt = dtype_name(value)
        arr = as_numpy(value)
        descs.append([name, dt, arr.shape, "inline"])
        frames.append(arr.data if arr.nbytes >= ZERO_COPY_MIN_BYTES else arr.tobytes())
    header["tensors"] = descs
    return [pack_header(header), *frames]


def decode(frames: Sequence[Any]) -> Message:
    """Validate and decode frames (without the ROUTER identity). Raises ProtocolError."""
    if not frames:
        raise ProtocolError(E_MALFORMED, "empty message")
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(E_OVERSIZE, f"{len(frames)} frames > {MAX_FRAMES}")
    raw = _bytes_of(frames[0])
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
    tensors = _decode_tensors(header.get("tensors", []), frames[1:])
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


def _bytes_of(frame: Any) -> bytes | memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return frame
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if buf is not None:
        return buf
    raise ProtocolError(E_MALFORMED, f"frame of type {type(frame).__name__}")


def _decode_tensors(descs: Any, frames: Sequence[Any]) -> dict[str, InlineTensor | ShmRef]:
    if type(descs) is not list:
        raise ProtocolError(E_TENSOR, "tensors is not a list")
    if len(descs) > MAX_FRAMES:
        raise ProtocolError(E_OVERSIZE, f"{len(descs)} tensors > {MAX_FRAMES}")
    out: dict[str, InlineTensor | ShmRef] = {}
    next_frame = 0
    for d in descs:
        if type(d) is not list or len(d) not in (4, 8):
            raise ProtocolError(E_TENSOR, "tensor descriptor is not [name, dtype, shape, where, ...]")
        name, dtype, shape, where = d[0], d[1], d[2], d[3]
        if type(name) is not str or not name or len(name) > MAX_NAME_LEN or name in out:
            raise ProtocolError(E_TENSOR, f"tensor name {str(name)[:64]!r}: missing, too long or twice")
        itemsize = _ITEMSIZE.get(dtype) if type(dtype) is str else None
        if itemsize is None:
            raise ProtocolError(E_TENSOR, f"tensor {name!r}: dtype {dtype!r} not allowed")
        if type(shape) is not list or len(shape) > MAX_TENSOR_DIMS:
            raise ProtocolError(E_TENSOR, f"tensor {name!r}: bad shape {shape!r}")
        nbytes = itemsize
        for dim in shape:  # exact ints (not bools), each in [0, 2^31)
            if type(dim) is not int or not 0 <= dim < 2**31:
                raise ProtocolError(E_TENSOR, f"tensor {name!r}: bad shape {shape!r}")
            nbytes *= dim
        if nbytes > MAX_SHM_OFFSET:
            raise ProtocolError(E_TENSOR, f"tensor {name!r}: {nbytes} bytes is more than any segment")
        if where == "shm" and len(d) == 8:
            seg, offset, nb, host = d[4], d[5], d[6], d[7]
            if type(seg) is not str or not seg.startswith(SHM_PREFIX) or len(seg) > MAX_NAME_LEN or "/" in seg:
                raise ProtocolError(E_TENSOR, f"tensor {name!r}: bad segment name {seg!r}")
            if type(offset) is not int or not 0 <= offset <= MAX_SHM_OFFSET:
                raise ProtocolError(E_TENSOR, f"tensor {name!r}: bad offset {offset!r}")
            if type(nb) is not int or nb != nbytes:
                raise ProtocolError(E_TENSOR, f"tensor {name!r}: nbytes {nb!r} != shape's {nbytes}")
            if type(host) is not str or not host or len(host) > MAX_NAME_LEN:
                raise ProtocolError(E_TENSOR, f"tensor {name!r}: shm descriptor without host")
            out[name] = ShmRef(seg, offset, nbytes, dtype, tuple(shape), host)
        elif where == "inline" and len(d) == 4:
            if next_frame >= len(frames):
                raise ProtocolError(E_TENSOR, f"tensor {name!r}: no frame left for it")
            buf = _bytes_of(frames[next_frame])
            next_frame += 1
            if len(buf) != nbytes:
                raise ProtocolError(E_TENSOR, f"tensor {name!r}: frame has {len(buf)} bytes, shape needs {nbytes}")
            out[name] = InlineTensor(dtype=dtype, shape=tuple(shape), buffer=buf)
        else:
            raise ProtocolError(E_TENSOR, f"tensor {name!r}: where={str(where)[:32]!r} with {len(d)} items")
    if next_frame != len(frames):
        raise ProtocolError(E_TENSOR, f"{len(frames) - next_frame} frame(s) not described by the header")
    return out


def error_frames(code: str, reason: str, ref_type: str | None = None) -> list[Any]:
    """An ERROR message answering a bad one."""
    return encode(ERROR, {"code": code, "reason": reason[:1000], "ref_type": ref_type})
