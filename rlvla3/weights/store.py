"""The same-host weight store: one shared-memory segment, owned by trainer rank 0, that holds
the frozen tensors once and the trainable ones in two slots used in turn (double buffering).

    [ header 4 KiB | frozen region | slot 1 | slot 2 | delta 1 | delta 2 ]

The delta regions (``weights.delta: bf16``; empty otherwise) hold each version's bf16
difference from the previous one, beside the rebuilt tensors in the slot.

Each region has a seqlock stamp in the header: ``seq`` (odd while a writer is inside) and
``version``. The writer makes ``seq`` odd, writes the bytes, writes ``version``, then makes
``seq`` even again: a version's stamp is written after its bytes. A reader notes ``seq`` (it
must be even, and the region must hold the version it wants), copies, then checks ``seq`` is
unchanged; a read that overlapped a write is torn and discarded. With two slots a writer
publishing version v+1 never touches the slot that holds v, so readers of v are only torn when
two newer versions are published during one read. The manifest's checksums are the last word
(they also catch what an out-of-order CPU might let through on weaker memory models).

Naming and ownership follow :mod:`rlvla3.shm`: ``rlvla3_<run>_<pid>_w<k>``, the owner creates
and unlinks, attachers do not register with the resource_tracker, and /dev/shm's free space
is checked before creating.
"""

from __future__ import annotations

import os
import re
from multiprocessing import shared_memory

import numpy as np

from rlvla3.tensors import SHM_PREFIX
from rlvla3.shm import POISON, AttachedSegment, OwnedSegment, check_free_space, unmap
from rlvla3.weights.manifest import REGIONS

HEADER_BYTES = 4096
MAGIC = np.frombuffer(b"RLVLA3W2", dtype=np.uint64)[0]
PAGE = 4096
MADV_POPULATE_READ = 22
# header words (uint64): [magic, region offsets x5 (words 1-5), region sizes x5 (words 8-12), stamps from word 16]
_SIZES = 8
_STAMPS = 16


class TornRead(RuntimeError):
    """A read overlapped a write, or the region no longer holds the wanted version."""


def _page(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


class _Segment:
    """Header accessors shared by the owner and the attachers."""

    shm: shared_memory.SharedMemory | AttachedSegment
    words: np.ndarray

    def region_offset(self, region: int) -> int:
        return int(self.words[1 + region])

    def region_size(self, region: int) -> int:
        return int(self.words[_SIZES + region])

    @property
    def size(self) -> int:
        return self.shm.size

    def stamp(self, region: int) -> tuple[int, int]:
        """(seq, version) of a region; version -1 until first written."""
        seq = int(self.words[_STAMPS + 2 * region])
        return seq, int(self.words[_STAMPS + 2 * region + 1].view(np.int64))

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        if offset < HEADER_BYTES or offset + nbytes > self.shm.size:
            raise ValueError(f"{self.shm.name}: bytes {offset}+{nbytes} outside the store's data")
        return np.ndarray((nbytes,), dtype=np.uint8, buffer=self.shm.buf, offset=offset)

    # -- reader side of the seqlock -------------------------------------------------------

    def read_begin(self, region: int, version: int) -> int:
        seq, held = self.stamp(region)
        if seq % 2:
            raise TornRead(f"region {region} is being written")
        if held != version:
            raise TornRead(f"region {region} holds version {held}, not {version}")
        return seq

    def read_end(self, region: int, seq: int) -> None:
        if self.stamp(region)[0] != seq:
            raise TornRead(f"region {region} was rewritten during the read")


class WeightStore(_Segment, OwnedSegment):
    """The owner's segment (trainer rank 0): creates, writes, unlinks."""

    _counter = 0

    def __init__(self, run_id: str, frozen_bytes: int, slot_bytes: int, delta_bytes: int = 0) -> None:
        if not re.fullmatch(r"[A-Za-z0-9]+", run_id):
            raise ValueError(f"run id {run_id!r} must be alphanumeric")
        offsets = [HEADER_BYTES]
        sizes = [_page(frozen_bytes), _page(slot_bytes), _page(slot_bytes), _page(delta_bytes), _page(delta_bytes)]
        for s in sizes[:-1]:
            offsets.append(offsets[-1] + s)
        total = offsets[-1] + sizes[-1]
        check_free_space(total)
        WeightStore._counter += 1
        self.name = f"{SHM_PREFIX}{run_id}_{os.getpid()}_w{WeightStore._counter}"
        self.shm = shared_memory.SharedMemory(name=self.name, create=True, size=total)
        self.words = np.ndarray((HEADER_BYTES // 8,), dtype=np.uint64, buffer=self.shm.buf)
        self.words[:] = 0
        # Unwritten weights read as Sample Factory's poison (and the pages are faulted in now,
        # not during the first publication).
        np.ndarray((total - HEADER_BYTES) // 4, dtype=np.float32, buffer=self.shm.buf, offset=HEADER_BYTES)[:] = POISON
        for r in REGIONS:
            self.words[1 + r] = offsets[r]
            self.words[_SIZES + r] = sizes[r]
            self.words[_STAMPS + 2 * r + 1] = np.int64(-1).view(np.uint64)
        self.words[0] = MAGIC  # last: an attacher that sees the magic sees a complete header
        self._closed = False

    def write_begin(self, region: int) -> None:
        seq, _ = self.stamp(region)
        self.words[_STAMPS + 2 * region] = seq + 1 if seq % 2 == 0 else seq

    def write_end(self, region: int, version: int) -> None:
        seq, _ = self.stamp(region)
        self.words[_STAMPS + 2 * region + 1] = np.int64(version).view(np.uint64)
        self.words[_STAMPS + 2 * region] = seq + 1 if seq % 2 else seq

    def _drop_views(self) -> None:
        self.words = None  # type: ignore[assignment]


class StoreReader(_Segment):
    """A generator's attachment to a store on its host (never unlinks it)."""

    def __init__(self, name: str) -> None:
        if not name.startswith(SHM_PREFIX) or "/" in name:
            raise ValueError(f"bad weight store name {name!r}")
        try:
            self.shm = AttachedSegment(name)
        except FileNotFoundError:
            raise TornRead(f"weight store {name} is gone (its trainer exited?)") from None
        self.name = name
        if self.shm.size < HEADER_BYTES:
            self.close()
            raise ValueError(f"{name} is too small to be a weight store")
        self.words = np.ndarray((HEADER_BYTES // 8,), dtype=np.uint64, buffer=self.shm.buf)
        if self.words[0] != MAGIC:
            self.close()
            raise ValueError(f"{name} is not a weight store (bad magic)")
        try:  # map every page now, not during the first reads (Linux >= 5.14; harmless elsewhere)
            self.shm.mmap.madvise(MADV_POPULATE_READ)
        except (AttributeError, OSError, ValueError):
            pass

    def close(self) -> None:
        self.words = None  # type: ignore[assignment]
        unmap(self.shm)
