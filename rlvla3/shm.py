"""Shared-memory tensors: one owner creates and unlinks, everyone else attaches by name.

The owner of a segment is the process that writes it (a simulator worker writes its
observations and trajectories). It allocates blocks from a :class:`ShmPool` and sends only a
descriptor (segment, offset, nbytes, dtype, shape, host); a reader on the same host maps the
segment once (:class:`ShmAttachments`) and reads a numpy view without a copy. A block is freed
by its owner only when the reader has said it is done (ACT for an observation slot, TRAJ_ACK
for a trajectory): never because of a timeout.

Segment names are ``rlvla3_<run>_<pid>_<k>``, so a sweep at start can unlink what a dead
process left behind. Only owners register with multiprocessing's resource_tracker; attachers
map by name without it (:class:`AttachedSegment`).
"""

from __future__ import annotations

import _posixshmem  # what SharedMemory itself opens segments with on POSIX
import math
import mmap
import os
import re
import socket
import threading
import weakref
from bisect import insort
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from rlvla3.lifetime import add_exit_cleanup
from rlvla3.observation import Observation
from rlvla3.tensors import SHM_PREFIX, InlineTensor, ShmRef, as_numpy, dtype_name, inline_array, itemsize, np_dtype

log = structlog.get_logger()

ALIGN = 64
POISON = np.float32(-42.42)
"""Unwritten pool memory reads as this (Sample Factory's marker), so stale reads show up."""
SHM_DIR = Path("/dev/shm")
_NAME_RE = re.compile(rf"^{SHM_PREFIX}([A-Za-z0-9]+)_(\d+)_(w?\d+)$")
"""Pools are ``rlvla3_<run>_<pid>_<k>``, weight stores (rlvla3/weights/store.py) ``..._w<k>``."""


def host_id() -> str:
    """Identifies the shared-memory domain: same id, same /dev/shm. Override: RLVLA3_HOST_ID."""
    override = os.environ.get("RLVLA3_HOST_ID")
    if override:
        return override
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "noboot"
    try:
        dev = os.stat(SHM_DIR).st_dev
    except OSError:
        dev = 0
    return f"{socket.gethostname()}:{boot[:8]}:{dev}"


def shm_free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def check_free_space(nbytes: int) -> None:
    """Fail clearly when /dev/shm cannot hold a pool (Docker's default is 64 MB)."""
    free = shm_free_bytes()
    if free < nbytes:
        raise RuntimeError(
            f"/dev/shm has {free / 2**20:.1f} MiB free, a pool of {nbytes / 2**20:.1f} MiB is needed; "
            "give the container more (docker run --shm-size=8g) or lower env.num_envs / image size"
        )


def sweep_leftovers(prefix: str = SHM_PREFIX) -> list[str]:
    """Unlink segments whose creating process is gone. Returns the names removed."""
    removed = []
    if not SHM_DIR.is_dir():
        return removed
    for path in SHM_DIR.iterdir():
        m = _NAME_RE.match(path.name)
        if not m or not path.name.startswith(prefix):
            continue
        pid = int(m.group(2))
        if _pid_alive(pid):
            continue
        try:
            path.unlink()
            removed.append(path.name)
        except OSError:
            pass
    if removed:
        log.info("shm_swept", count=len(removed))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def segments_of_run(run_id: str) -> list[str]:
    """Names of this run's segments still in /dev/shm (tests check this is empty at the end)."""
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(f"{SHM_PREFIX}{run_id}_"))


def unmap(shm: shared_memory.SharedMemory | AttachedSegment) -> None:
    """Close this process's mapping of ``shm``; a numpy view still alive keeps its pages mapped
    until it goes (the segment's name can be unlinked meanwhile)."""
    try:
        shm.close()
    except BufferError:
        pass


class OwnedSegment:
    """A segment this process created: its owner unmaps and unlinks it, once."""

    shm: shared_memory.SharedMemory
    _closed: bool

    def _drop_views(self) -> None:
        """Forget this object's own views of the segment, so that unmapping can proceed."""

    def close(self) -> None:
        """Unmap and unlink (only the owner calls this)."""
        if self._closed:
            return
        self._closed = True
        self._drop_views()
        unmap(self.shm)
        self.unlink()

    def unlink(self) -> None:
        """Remove the segment's name (the memory goes when the last mapping does). Safe while
        other threads still write through their views, unlike ``close``."""
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass


class ShmPool(OwnedSegment):
    """One owned segment with a first-fit block allocator. Not thread-safe across writers
    unless used through its lock (the simulator's slot threads share one pool)."""

    _counter = 0

    def __init__(self, run_id: str, nbytes: int, host: str | None = None) -> None:
        if not re.fullmatch(r"[A-Za-z0-9]+", run_id):
            raise ValueError(f"run id {run_id!r} must be alphanumeric")
        nbytes = _round_up(max(int(nbytes), ALIGN))
        check_free_space(nbytes)
        ShmPool._counter += 1
        self.name = f"{SHM_PREFIX}{run_id}_{os.getpid()}_{ShmPool._counter}"
        self.shm = shared_memory.SharedMemory(name=self.name, create=True, size=nbytes)
        self.size = nbytes
        self.host = host or host_id()
        self.buf = np.ndarray((nbytes,), dtype=np.uint8, buffer=self.shm.buf)
        self.buf.view(np.float32)[:] = POISON
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted by offset
        self._used: dict[int, int] = {}
        self.lock = threading.Lock()
        self._closed = False
        _OWNED.add(self)

    # -- allocation --------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free block of at least ``nbytes``, or None when the pool is full."""
        need = _round_up(max(int(nbytes), 1))
        with self.lock:
            for i, (off, size) in enumerate(self._free):
                if size >= need:
                    if size == need:
                        self._free.pop(i)
                    else:
                        self._free[i] = (off + need, size - need)
                    self._used[off] = need
                    return off
        return None

    def free(self, offset: int) -> None:
        with self.lock:
            size = self._used.pop(offset, None)
            if size is None:
                return
            self.buf[offset : offset + size].view(np.float32)[:] = POISON
            insort(self._free, (offset, size))
            merged: list[tuple[int, int]] = []
            for off, sz in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + sz)
                else:
                    merged.append((off, sz))
            self._free = merged

    # -- tensors -----------------------------------------------------------------------------

    def view(self, offset: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        count = math.prod(shape)
        return np.ndarray(shape, dtype=np_dtype(dtype), buffer=self.shm.buf, offset=offset) if count else np.empty(shape, np_dtype(dtype))

    def ref(self, offset: int, dtype: str, shape: tuple[int, ...]) -> ShmRef:
        nbytes = math.prod(shape) * itemsize(dtype)
        return ShmRef(seg=self.name, offset=offset, nbytes=nbytes, dtype=dtype, shape=tuple(shape), host=self.host)

    def put(self, arr: Any) -> ShmRef | None:
        """Copy an array into a new block; None when the pool is full (caller sends inline)."""
        dt = dtype_name(arr)
        a = as_numpy(arr)
        off = self.alloc(a.nbytes)
        if off is None:
            return None
        self.view(off, dt, a.shape)[...] = a.view(np_dtype(dt)) if dt == "bfloat16" else a
        return self.ref(off, dt, a.shape)

    def put_many(self, tensors: dict[str, Any]) -> tuple[dict[str, ShmRef], list[int]] | None:
        """Place several arrays; all or nothing. Returns the refs and the offsets to free later."""
        refs: dict[str, ShmRef] = {}
        offsets: list[int] = []
        for name, arr in tensors.items():
            r = self.put(arr)
            if r is None:
                for off in offsets:
                    self.free(off)
                return None
            refs[name] = r
            offsets.append(r.offset)
        return refs, offsets

    def _drop_views(self) -> None:
        self.buf = None  # type: ignore[assignment]

    def unlink(self) -> None:
        _OWNED.discard(self)
        super().unlink()


_OWNED: "weakref.WeakSet[ShmPool]" = weakref.WeakSet()


def observation_block(pool: ShmPool, cameras: dict[str, tuple[int, int]], state_dim: int, n: int) -> Observation:
    """A blank observation of ``n`` envs whose arrays are views of new blocks of ``pool``: where
    envs write their observations in place (:func:`locate` gives the blocks' descriptors)."""
    blank = Observation.zeros(cameras, state_dim, n).to_tensors()
    views: dict[str, np.ndarray] = {}
    for name, arr in blank.items():
        off = pool.alloc(arr.nbytes)
        if off is None:
            raise RuntimeError(f"shared-memory pool {pool.name} is too small for an observation block of {n} env(s)")
        views[name] = pool.view(off, dtype_name(arr), arr.shape)
    return Observation.from_tensors(views, [""] * n)


def block_refs(block: Observation) -> dict[str, ShmRef | None]:
    """The descriptors of an :func:`observation_block`'s arrays, by tensor name: what an OBS
    names instead of carrying the bytes."""
    return {name: locate(a) for name, a in block.to_tensors().items()}


def locate(arr: np.ndarray) -> ShmRef | None:
    """The descriptor of a C-contiguous array that lies in a pool this process owns (so another
    process can write or read it in place), or None for private memory."""
    if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous or not arr.nbytes:
        return None
    addr = arr.__array_interface__["data"][0]
    for pool in list(_OWNED):
        if pool.buf is None:
            continue
        base = pool.buf.__array_interface__["data"][0]
        if base <= addr and addr + arr.nbytes <= base + pool.size:
            return pool.ref(addr - base, dtype_name(arr), arr.shape)
    return None


def unlink_owned() -> None:
    """Unlink every segment this process still owns: run before a forced exit, which cannot
    wait for the threads that use the pools."""
    for pool in list(_OWNED):
        pool.unlink()


add_exit_cleanup(unlink_owned)


class AttachedSegment:
    """A segment another process owns, mapped here by name, read-write, and never unlinked here.

    Not through ``SharedMemory(create=False)``: before Python 3.13 that registers every attacher
    with the resource_tracker, which unlinks the owner's segment when the attacher exits, and
    unregistering afterwards is wrong where the tracker is shared. A spawned child shares its
    parent's tracker, so its unregister dropped the parent's own registration: the parent's
    unlink then made the tracker print a KeyError, and a parent killed outright left its segment
    to the start-up sweep. Raises FileNotFoundError when the name is gone."""

    def __init__(self, name: str) -> None:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self.size = os.fstat(fd).st_size
            self.mmap = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.name = name
        self.buf = memoryview(self.mmap)

    def close(self) -> None:
        """Unmap; raises BufferError while a view of ``buf`` is alive (as SharedMemory does)."""
        self.buf.release()
        self.mmap.close()


class ShmAttachments:
    """Segments this process reads, attached once by name and never unlinked here."""

    def __init__(self) -> None:
        self._segs: dict[str, AttachedSegment] = {}

    def _attach(self, name: str) -> AttachedSegment:
        seg = self._segs.get(name)
        if seg is None:
            try:
                seg = AttachedSegment(name)
            except FileNotFoundError:
                raise KeyError(f"shared-memory segment {name} is gone (its writer exited?)") from None
            self._segs[name] = seg
        return seg

    def array(self, ref: ShmRef) -> np.ndarray:
        """A numpy view of the referenced bytes (valid until the owner frees the block)."""
        seg = self._attach(ref.seg)
        if ref.offset + ref.nbytes > seg.size:
            raise ValueError(f"{ref.seg}: block {ref.offset}+{ref.nbytes} beyond segment size {seg.size}")
        return np.ndarray(ref.shape, dtype=np_dtype(ref.dtype), buffer=seg.buf, offset=ref.offset)

    def materialize(self, value: InlineTensor | ShmRef, copy: bool = False) -> np.ndarray:
        """The numpy array behind a received tensor, from a frame or shared memory."""
        arr = inline_array(value) if isinstance(value, InlineTensor) else self.array(value)
        return arr.copy() if copy else arr

    def close(self) -> None:
        for seg in self._segs.values():
            unmap(seg)
        self._segs.clear()


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def to_inline(att: ShmAttachments, ref: ShmRef) -> InlineTensor:
    """Read a shared-memory tensor into bytes that can travel to another host."""
    arr = att.array(ref)
    return InlineTensor(dtype=ref.dtype, shape=ref.shape, buffer=arr.tobytes())
