"""What a weight version holds: one entry per tensor (name, dtype, shape, where its bytes lie,
their xxh3 checksum, the version that wrote them, trainable or not).

The manifest travels in the WEIGHTS announcement (never the bytes). Entries are compact lists
so that a 3B model's ~1000 tensors stay a few tens of KB of msgpack:

    [name, dtype, shape, region, offset, nbytes, xxh3_64, since, trainable]

``region`` names the part of the weight store that holds the bytes (:data:`FROZEN`, or one of
the two trainable slots); ``offset`` is absolute in the store (the stream serves the same
offsets); ``since`` is the version whose publication wrote those bytes. Frozen tensors and
buffers are written once, with the first version; a reader that already holds a version copies
only entries with ``since`` newer than it (the trainable parameters).

With ``weights.delta: bf16`` a version after the first also carries ``delta``: the version
``base`` it was taken against, and per trainable tensor ``[name, region, offset, nbytes]``
where its bf16 difference lies (a :data:`DELTA_SLOTS` region). The entries' checksums are those
of the rebuilt tensors (``base + delta``, which rank 0 also writes whole into the slot), so a
reader verifies what it rebuilt, and a reader that does not hold ``base`` reads them whole.

Checksums are xxh3-64 (tens of GB/s, not a cryptographic hash): the announcement comes over
the broker's authenticated channel, and its checksums vouch for bytes read from elsewhere.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import xxhash

from rlvla3.tensors import DTYPES, MAX_NAME_LEN, MAX_TENSOR_DIMS, itemsize

FROZEN = 0
"""Region of tensors written once (frozen parameters and buffers)."""
SLOTS = (1, 2)
"""The two trainable regions; consecutive publications alternate between them."""
DELTA_SLOTS = (3, 4)
"""The two regions of bf16 deltas (``weights.delta: bf16``), one beside each slot."""
REGIONS = (FROZEN, *SLOTS, *DELTA_SLOTS)
ALIGN = 256
"""Every tensor starts on this boundary (cache lines, and aligned device copies)."""
MAX_ENTRIES = 100_000
HASH_CHUNK = 2**20
"""Copies are hashed chunk by chunk right after each chunk lands, while it is still in cache."""


class ManifestError(ValueError):
    """An announcement whose manifest cannot be trusted or does not fit this model."""


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    region: int
    offset: int
    nbytes: int
    checksum: int
    since: int
    trainable: bool

    def to_wire(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.region, self.offset, self.nbytes,
                self.checksum, self.since, self.trainable]


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's place in the store layout, before any bytes are written."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    trainable: bool
    rel_offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """Where each tensor lies inside its region, and how big each region is."""

    specs: tuple[TensorSpec, ...]
    frozen_bytes: int
    slot_bytes: int
    delta_bytes: int = 0
    """Bytes of one delta region: every trainable tensor in bf16 (0 without deltas)."""

    @staticmethod
    def plan(tensors: Iterable[tuple[str, str, tuple[int, ...], bool]], delta: bool = False) -> "Layout":
        """``tensors``: (name, wire dtype, shape, trainable), in the order to lay them out;
        ``delta``: also lay out a bf16 delta region (trainable tensors, same order)."""
        specs = []
        ends = {True: 0, False: 0}
        delta_end = 0
        for name, dtype, shape, trainable in tensors:
            nbytes = math.prod(shape) * itemsize(dtype)
            off = ends[trainable]
            specs.append(TensorSpec(name, dtype, tuple(shape), trainable, off, nbytes))
            ends[trainable] = align(off + nbytes)
            if trainable and delta:
                if not dtype.startswith("float") and dtype != "bfloat16":
                    raise ValueError(f"weights.delta: trainable tensor {name} is {dtype}, not floating point")
                delta_end = align(delta_end + math.prod(shape) * 2)
        return Layout(tuple(specs), frozen_bytes=ends[False], slot_bytes=ends[True], delta_bytes=delta_end)

    def delta_offsets(self) -> dict[str, int]:
        """Each trainable tensor's offset inside a delta region."""
        out, end = {}, 0
        for s in self.specs:
            if s.trainable:
                out[s.name] = end
                end = align(end + math.prod(s.shape) * 2)
        return out

    @property
    def trainable_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs if s.trainable)


@dataclass(frozen=True)
class Manifest:
    version: int
    entries: tuple[Entry, ...]
    delta_base: int | None = None
    """The version the deltas were taken against (None: no deltas, read whole)."""
    deltas: tuple[Entry, ...] = ()
    """Where each trainable tensor's bf16 delta lies (dtype bfloat16, checksum unused: the
    entry's checksum covers the rebuilt tensor)."""

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version, "entries": [e.to_wire() for e in self.entries]}
        if self.delta_base is not None:
            out["delta"] = {"base": self.delta_base,
                            "entries": [[d.name, d.region, d.offset, d.nbytes] for d in self.deltas]}
        return out

    def changed_since(self, held: int) -> list[Entry]:
        """Entries a reader holding version ``held`` must copy (all of them when ``held`` < 0)."""
        return [e for e in self.entries if held < 0 or e.since > held]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @staticmethod
    def from_wire(data: Any, store_size: int | None = None) -> "Manifest":
        """Validate a received manifest; raises ManifestError naming what is wrong."""
        if not isinstance(data, dict):
            raise ManifestError("manifest is not a map")
        version, raw = data.get("version"), data.get("entries")
        if not _is_int(version) or version < 0:
            raise ManifestError(f"manifest version {version!r} is not a non-negative integer")
        if not isinstance(raw, list) or len(raw) > MAX_ENTRIES:
            raise ManifestError("manifest entries missing or too many")
        entries, seen = [], set()
        for item in raw:
            e = _entry(item, version, store_size)
            if e.name in seen:
                raise ManifestError(f"tensor {e.name!r} appears twice")
            seen.add(e.name)
            entries.append(e)
        if data.get("delta") is None:
            return Manifest(version, tuple(entries))
        base, deltas = _deltas(data["delta"], version, {e.name: e for e in entries}, store_size)
        return Manifest(version, tuple(entries), base, deltas)


def _deltas(data: Any, version: int, entries: dict[str, Entry], store_size: int | None) -> tuple[int, tuple[Entry, ...]]:
    if not isinstance(data, dict) or not _is_int(data.get("base")) or not 0 <= data["base"] < version:
        raise ManifestError("manifest delta must be {base: an older version, entries: [...]}")
    raw = data.get("entries")
    if not isinstance(raw, list) or len(raw) > len(entries):
        raise ManifestError("manifest delta entries missing or too many")
    out, seen = [], set()
    for item in raw:
        if not isinstance(item, list) or len(item) != 4:
            raise ManifestError("manifest delta entry is not a 4-item list")
        name, region, offset, nbytes = item
        e = entries.get(name) if isinstance(name, str) else None
        if e is None or not e.trainable or e.since != version or name in seen:
            raise ManifestError(f"delta {name!r} names no trainable tensor of version {version} (or twice)")
        seen.add(name)
        if region not in DELTA_SLOTS or not _is_int(offset) or offset < 0 or nbytes != math.prod(e.shape) * 2:
            raise ManifestError(f"delta {name}: region {region!r}, offset {offset!r} or nbytes {nbytes!r} is wrong")
        if store_size is not None and offset + nbytes > store_size:
            raise ManifestError(f"delta {name}: bytes {offset}+{nbytes} lie beyond the store ({store_size})")
        out.append(Entry(name, "bfloat16", e.shape, region, offset, nbytes, 0, version, True))
    return data["base"], tuple(out)


def _entry(item: Any, version: int, store_size: int | None) -> Entry:
    if not isinstance(item, list) or len(item) != 9:
        raise ManifestError("manifest entry is not a 9-item list")
    name, dtype, shape, region, offset, nbytes, checksum, since, trainable = item
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN:
        raise ManifestError("tensor name missing or too long")
    if dtype not in DTYPES:
        raise ManifestError(f"{name}: dtype {dtype!r} not allowed")
    if not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS or not all(_is_int(s) and 0 <= s < 2**40 for s in shape):
        raise ManifestError(f"{name}: bad shape {shape!r}")
    if region not in (FROZEN, *SLOTS):
        raise ManifestError(f"{name}: region {region!r} unknown")
    if not all(_is_int(v) and v >= 0 for v in (offset, nbytes, checksum, since)) or checksum >= 2**64:
        raise ManifestError(f"{name}: offset, nbytes, checksum and since must be non-negative integers")
    if nbytes != math.prod(shape) * itemsize(dtype):
        raise ManifestError(f"{name}: nbytes {nbytes} does not match shape {shape} x {dtype}")
    if since > version or (region in SLOTS and since != version) or not isinstance(trainable, bool):
        raise ManifestError(f"{name}: since={since} does not fit version {version} in region {region}")
    if store_size is not None and offset + nbytes > store_size:
        raise ManifestError(f"{name}: bytes {offset}+{nbytes} lie beyond the store ({store_size})")
    return Entry(name, dtype, tuple(shape), region, offset, nbytes, checksum, since, trainable)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def checksum(buf: Any) -> int:
    """xxh3-64 of a contiguous buffer (numpy array, memoryview, bytes)."""
    return xxhash.xxh3_64_intdigest(buf)


def copy_and_hash(dst: np.ndarray, src: np.ndarray) -> int:
    """Copy ``src`` into ``dst`` (both flat uint8 of one size) and return the xxh3-64 of what
    landed in ``dst``, hashing each chunk right after copying it (it is still in cache)."""
    n = dst.nbytes
    if n <= HASH_CHUNK:
        np.copyto(dst, src)
        return xxhash.xxh3_64_intdigest(dst)
    h = xxhash.xxh3_64()
    for a in range(0, n, HASH_CHUNK):
        b = min(a + HASH_CHUNK, n)
        np.copyto(dst[a:b], src[a:b])
        h.update(dst[a:b])
    return h.intdigest()


def copy_many(pairs: list[tuple[np.ndarray, np.ndarray]], pool: ThreadPoolExecutor | None) -> list[int]:
    """:func:`copy_and_hash` over (dst, src) pairs, spread over ``pool``'s threads (numpy's copy
    and xxhash leave the GIL, so a few threads reach more of the memory bandwidth)."""
    if pool is None:
        return [copy_and_hash(d, s) for d, s in pairs]
    return list(pool.map(lambda p: copy_and_hash(*p), pairs))
