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

from rlvla3.protocol import DTYPES, MAX_NAME_LEN, MAX_TENSOR_DIMS, _itemsize

FROZEN = 0
"""Region of tensors written once (frozen parameters and buffers)."""
SLOTS = (1, 2)
"""The two trainable regions; consecutive publications alternate between them."""
REGIONS = (FROZEN, *SLOTS)
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

    @staticmethod
    def plan(tensors: Iterable[tuple[str, str, tuple[int, ...], bool]]) -> "Layout":
        """``tensors``: (name, wire dtype, shape, trainable), in the order to lay them out."""
        specs = []
        ends = {True: 0, False: 0}
        for name, dtype, shape, trainable in tensors:
            nbytes = math.prod(shape) * _itemsize(dtype)
            off = ends[trainable]
            specs.append(TensorSpec(name, dtype, tuple(shape), trainable, off, nbytes))
            ends[trainable] = align(off + nbytes)
        return Layout(tuple(specs), frozen_bytes=ends[False], slot_bytes=ends[True])

    @property
    def trainable_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs if s.trainable)


@dataclass(frozen=True)
class Manifest:
    version: int
    entries: tuple[Entry, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "entries": [e.to_wire() for e in self.entries]}

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
        return Manifest(version, tuple(entries))


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
    if region not in REGIONS:
        raise ManifestError(f"{name}: region {region!r} unknown")
    if not all(_is_int(v) and v >= 0 for v in (offset, nbytes, checksum, since)) or checksum >= 2**64:
        raise ManifestError(f"{name}: offset, nbytes, checksum and since must be non-negative integers")
    if nbytes != math.prod(shape) * _itemsize(dtype):
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
