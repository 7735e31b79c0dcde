"""The tensor codec: how a tensor travels in a message, as bytes in a frame or as a reference
into shared memory, and how a descriptor is checked before anything reads it.

Each tensor descriptor is an array, by position (a map's keys cost the broker a third of an
OBS's decode, and every request carries two descriptors):

    [name: str, dtype: str, shape: [int, ...], "inline"]
        -> its bytes are the next unused frame, sent zero-copy;
    [name: str, dtype: str, shape: [int, ...], "shm", seg: str, offset: int, nbytes: int, host: str]
        -> its bytes live in the named shared-memory segment on ``host``.

``rlvla3.protocol`` puts the descriptors in a message's header; ``rlvla3.shm`` and
``rlvla3.weights`` use the same dtypes, sizes and views.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from rlvla3.protocol_errors import E_MALFORMED, E_TENSOR, ProtocolError

DTYPES = (
    "bool", "uint8", "int8", "int16", "uint16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64",
)
"""bfloat16 travels as raw 2-byte words (numpy has no bf16); torch views it back."""

MAX_TENSOR_DIMS = 8
MAX_NAME_LEN = 256
MAX_SHM_OFFSET = 2**40
"""No shared-memory segment is larger than 1 TiB: offsets and sizes beyond it are hostile."""

SHM_PREFIX = "rlvla3_"
"""Every shared-memory segment of rlvla3 is named with it."""

ZERO_COPY_MIN_BYTES = 64 * 1024
"""Below this, pyzmq's zero-copy send costs more than it saves; copy instead."""


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
        return math.prod(self.shape) * itemsize(self.dtype)


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


ITEMSIZE = {d: 2 if d == "bfloat16" else np.dtype(d).itemsize for d in DTYPES}
"""Bytes per item of each wire dtype."""
itemsize = ITEMSIZE.__getitem__


def np_dtype(dtype: str) -> np.dtype:
    """The numpy dtype a wire dtype's bytes are read as (bfloat16: raw uint16 words)."""
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
    arr = np.frombuffer(t.buffer, dtype=np_dtype(t.dtype), count=math.prod(t.shape))
    return arr.reshape(t.shape)


def describe(tensors: dict[str, Any]) -> tuple[list[list[Any]], list[Any]]:
    """A message's tensor descriptors and the frames that carry the inline ones.

    Values are numpy arrays / torch tensors (sent inline), ShmRef (sent as a descriptor), or
    already-received InlineTensor (forwarded without a copy).
    """
    descs: list[list[Any]] = []
    frames: list[Any] = []
    for name, value in tensors.items():
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
    return descs, frames


def bytes_of(frame: Any) -> bytes | memoryview:
    """A received frame's bytes without a copy."""
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return frame
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if buf is not None:
        return buf
    raise ProtocolError(E_MALFORMED, f"frame of type {type(frame).__name__}")


def decode_tensors(descs: Any, frames: Sequence[Any]) -> dict[str, InlineTensor | ShmRef]:
    """A header's tensor descriptors and the frames after it -> name -> InlineTensor | ShmRef,
    every descriptor checked (name, dtype, shape, segment, sizes) and every frame described."""
    if type(descs) is not list:
        raise ProtocolError(E_TENSOR, "tensors is not a list")
    out: dict[str, InlineTensor | ShmRef] = {}
    next_frame = 0
    for d in descs:
        if type(d) is not list or len(d) not in (4, 8):
            raise ProtocolError(E_TENSOR, "tensor descriptor is not [name, dtype, shape, where, ...]")
        name, dtype, shape, where = d[0], d[1], d[2], d[3]
        if type(name) is not str or not name or len(name) > MAX_NAME_LEN or name in out:
            raise ProtocolError(E_TENSOR, f"tensor name {str(name)[:64]!r}: missing, too long or twice")
        size = ITEMSIZE.get(dtype) if type(dtype) is str else None
        if size is None:
            raise ProtocolError(E_TENSOR, f"tensor {name!r}: dtype {dtype!r} not allowed")
        if type(shape) is not list or len(shape) > MAX_TENSOR_DIMS:
            raise ProtocolError(E_TENSOR, f"tensor {name!r}: bad shape {shape!r}")
        nbytes = size
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
            buf = bytes_of(frames[next_frame])
            next_frame += 1
            if len(buf) != nbytes:
                raise ProtocolError(E_TENSOR, f"tensor {name!r}: frame has {len(buf)} bytes, shape needs {nbytes}")
            out[name] = InlineTensor(dtype=dtype, shape=tuple(shape), buffer=buf)
        else:
            raise ProtocolError(E_TENSOR, f"tensor {name!r}: where={str(where)[:32]!r} with {len(d)} items")
    if next_frame != len(frames):
        raise ProtocolError(E_TENSOR, f"{len(frames) - next_frame} frame(s) not described by the header")
    return out
