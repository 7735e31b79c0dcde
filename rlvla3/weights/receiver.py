"""A generator's side of weight publication: fetch an announced version next to the serving
weights, verify it, and swap it in between batches.

The generator's loop drives it without blocking:

    receiver.offer(header)            # on WEIGHTS (PUB or snapshot reply); newer versions only
    ann = receiver.next_fetch(now)    # when idle: the version to fetch now, if any
    staged = receiver.fetch(ann)      # on a worker thread: copy + checksum, raises on a bad read
    receiver.fetched(ann, staged, error, now)
    receiver.swap()                   # between batches: the staged version becomes the served one

``fetch`` copies each changed tensor into a staging tensor (pinned host memory when the model
is on CUDA, then a device copy made on a side stream), reading from the trainer's shared-memory
store on this host, or from rank 0's stream otherwise. It checks the store's seqlock and every
checksum; a torn or corrupt read raises and :meth:`fetched` schedules a retry with back-off
(1/20 s doubling to 2 s) unless a newer version was announced meanwhile. The served weights are
never touched until :meth:`swap`, which only re-points each parameter at its staged tensor
(``param.data = staged``); the old storage becomes the next fetch's staging. A version that
does not fit the model (unknown names, other shapes) or holds inf/NaN is dropped for good: the
generator keeps serving what it has.

A version announced with bf16 deltas (``weights.delta: bf16``) is fetched as deltas over the
stream when this receiver holds the delta's base version: each tensor is rebuilt as
``served + delta`` (:func:`rlvla3.weights.publisher.rebuild`) and checked against the
manifest's checksum of the rebuilt tensor. Tensors that fail, and every tensor of a version
whose base is not the held one, are read whole in the same fetch. Same-host readers always read
whole from the store (a memory copy costs less than reading half and adding).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import torch
import zmq

from rlvla3.weights.announce import Announcement, parse_announcement
from rlvla3.weights.cuda_ipc import DeviceSlotReader
from rlvla3.weights.manifest import Entry, ManifestError, checksum, copy_many
from rlvla3.weights.publisher import module_tensors, rebuild
from rlvla3.weights.store import StoreReader, TornRead
from rlvla3.weights.stream import stream_read

log = structlog.get_logger()

RETRY_MIN_S = 0.05
RETRY_MAX_S = 2.0


class CorruptVersion(RuntimeError):
    """A tensor's bytes do not match the manifest's checksum."""


@dataclass
class Staged:
    """A fetched, verified version waiting for the next gap between batches."""

    version: int
    tensors: dict[str, torch.Tensor]
    source: str
    nbytes: int
    fetch_ms: float
    published_at: int | None = None
    trainable: set[str] = field(default_factory=set)
    policy_version: int = -1
    """The policy version these weights act as (``Announcement.acts_as``): what a generator tags
    its results with."""


class WeightReceiver:
    def __init__(self, module: torch.nn.Module, host: str, *, shm: bool = True, bucket_mb: int = 128,
                 copy_threads: int = 2, cuda_ipc: bool = False) -> None:
        self.module = module
        self.host = host
        self.use_shm = shm
        self.bucket_bytes = int(bucket_mb) * 2**20
        self.targets = {n: t for n, t, _ in module_tensors(module)}
        self.device = next(iter(self.targets.values())).device if self.targets else torch.device("cpu")
        self.version = -1
        """The version this receiver last swapped in (-1: none yet)."""
        self.wanted: Announcement | None = None
        self.fetching: Announcement | None = None
        self.staged: Staged | None = None
        self.retry_at = 0.0
        self._backoff = RETRY_MIN_S
        self.rejected = 0
        self._spare: dict[str, torch.Tensor] = {}
        self._pinned: dict[str, torch.Tensor] = {}
        self._release: list[torch.Tensor] = []  # storage the last swap let go: freed on the weights thread
        self._stores: dict[str, StoreReader] = {}
        self._ctx: zmq.Context | None = None
        self.pool = ThreadPoolExecutor(copy_threads, thread_name_prefix="weights-copy") if copy_threads > 1 else None
        self.ipc = DeviceSlotReader(self.device) if cuda_ipc and self.device.type == "cuda" else None

    # -- the state machine (generator's thread) -------------------------------------------

    def newest(self) -> int:
        """The newest version held, staged, being fetched or wanted."""
        return max([self.version] + [a.version for a in (self.wanted, self.fetching, self.staged) if a is not None])

    def offer(self, header: dict[str, Any]) -> bool:
        """Take an announcement; True when it is newer than anything held or under way.
        A malformed one raises ManifestError."""
        ann = parse_announcement(header)
        if ann.version <= self.newest():
            return False
        self.wanted = ann
        self.retry_at = 0.0
        self._backoff = RETRY_MIN_S
        return True

    def next_fetch(self, now: float) -> Announcement | None:
        """The announcement to fetch now, or None (one fetch at a time, none while a staged
        version waits to be swapped, none before a retry's back-off has passed)."""
        if self.fetching is not None or self.staged is not None or self.wanted is None or now < self.retry_at:
            return None
        self.fetching, self.wanted = self.wanted, None
        return self.fetching

    def fetched(self, ann: Announcement, staged: Staged | None, error: BaseException | None, now: float) -> None:
        """Record a fetch's outcome: stage it, or schedule it again after a back-off."""
        self.fetching = None
        if error is None and staged is not None:
            self.staged = staged
            return
        self.rejected += 1
        retry = isinstance(error, (TornRead, CorruptVersion))
        log.warning("weights_rejected", version=ann.version, error=str(error)[:300], retry=retry and self.wanted is None)
        if retry and self.wanted is None:
            self.wanted = ann
            self.retry_at = now + self._backoff
            self._backoff = min(self._backoff * 2, RETRY_MAX_S)

    def swap(self) -> Staged | None:
        """Serve the staged version from now on (call between batches). Returns it, or None."""
        staged, self.staged = self.staged, None
        if staged is None:
            return None
        for name, new in staged.tensors.items():
            old = self.targets[name]
            held = old.data
            old.data = new
            if name in staged.trainable and held.shape == new.shape and held.dtype == new.dtype:
                self._spare[name] = held  # the next version lands here
            else:
                self._release.append(held)  # freeing a GB takes a while: not between two batches
        self.version = staged.version
        return staged

    # -- the fetch (worker thread) ---------------------------------------------------------

    def release(self) -> None:
        """Free the storage the last swap let go (on the weights thread, not the serving one)."""
        self._release.clear()

    def fetch(self, ann: Announcement) -> Staged:
        """Copy and verify what changed since the held version. Touches no served tensor."""
        t0 = time.perf_counter()
        self.release()
        entries = ann.manifest.changed_since(self.version)
        self._check_fits(ann, entries)
        store = ann.store
        same_host = self.use_shm and store is not None and store["host"] == self.host
        on_device: dict[str, torch.Tensor] = {}
        if same_host and self.ipc is not None and self.ipc.usable(ann.ipc):  # CUDA only (rlvla3.weights.cuda_ipc)
            on_device = self._read_ipc(ann, [e for e in entries if e.region == ann.ipc["slot"]])
        moved = 0
        if not same_host and ann.stream is not None and ann.manifest.delta_base is not None \
                and ann.manifest.delta_base == self.version:
            on_device, moved = self._fetch_delta(ann, entries)
        rest = [e for e in entries if e.name not in on_device]
        moved += sum(e.nbytes for e in rest)
        host = {e.name: self._host_buffer(e) for e in rest}
        flat = {n: _bytes_of(t) for n, t in host.items()}
        if not rest and on_device:
            source, sums = ("delta" if moved else "ipc"), {}
        elif same_host:
            source, sums = "shm", self._read_store(store["seg"], rest, flat)
        elif ann.stream is not None:
            if self._ctx is None:
                self._ctx = zmq.Context()
            source, sums = "stream", stream_read(self._ctx, ann.stream, rest, flat, self.bucket_bytes)
        else:
            raise ManifestError(f"version {ann.version}: its store is on another host and no stream is announced")
        bad = [e.name for e in rest if sums[e.name] != e.checksum]
        if bad:
            raise CorruptVersion(f"version {ann.version}: {len(bad)} tensor(s) fail their checksum, e.g. {bad[:3]}")
        nonfinite = [e.name for e in entries if not _finite(host[e.name] if e.name in host else on_device[e.name])]
        if nonfinite:  # a diverged trainer: keep serving the weights we have
            raise ManifestError(f"version {ann.version}: {len(nonfinite)} tensor(s) hold inf or NaN, e.g. {nonfinite[:3]}")
        tensors = {**self._to_device(host, rest), **on_device}
        if source == "stream" and len(rest) < len(entries):
            source = "delta"  # (some tensors read whole)
        return Staged(ann.version, tensors, source, moved, (time.perf_counter() - t0) * 1000,
                      ann.published_at, {e.name for e in entries if e.trainable}, ann.acts_as)

    def _fetch_delta(self, ann: Announcement, entries: list[Entry]) -> tuple[dict[str, torch.Tensor], int]:
        """Read the bf16 deltas of ``entries`` from the stream and rebuild them on the served
        tensors; returns the rebuilt tensors whose checksum matches, and the bytes read."""
        deltas = {d.name: d for d in ann.manifest.deltas}
        todo = [deltas[e.name] for e in entries if e.name in deltas]
        if not todo:
            return {}, 0
        if self._ctx is None:
            self._ctx = zmq.Context()
        bufs = {d.name: torch.empty(d.shape, dtype=torch.bfloat16) for d in todo}
        stream_read(self._ctx, ann.stream, todo, {n: _bytes_of(t) for n, t in bufs.items()}, self.bucket_bytes)
        want = {e.name: e.checksum for e in entries}
        out, refused = {}, []
        for name, d in bufs.items():
            served = self.targets[name].data
            dst = self._spare.pop(name, None)
            if dst is None or dst.dtype != served.dtype or dst.shape != served.shape or dst.device != served.device:
                dst = torch.empty_like(served)
            rebuild(served, d.to(served.device, non_blocking=False), out=dst)
            if checksum(_bytes_of(dst if dst.device.type == "cpu" else dst.cpu())) == want[name]:
                out[name] = dst
            else:
                self._spare[name] = dst
                refused.append(name)
        if refused:
            log.warning("weights_delta_refused", version=ann.version, base=ann.manifest.delta_base,
                        tensors=len(refused), example=refused[0])
        return out, sum(d.nbytes for d in todo)

    def _read_ipc(self, ann: Announcement, entries: list[Entry]) -> dict[str, torch.Tensor]:
        """CUDA only: copy the trainable entries device to device from rank 0's slot
        buffer (``rlvla3.weights.cuda_ipc``), inside the host slot's seqlock window."""
        reader = self._store(ann.store["seg"])
        slot = ann.ipc["slot"]
        seq = reader.read_begin(slot, ann.version)
        out = {}
        for e in entries:
            dst = self._spare.pop(e.name, None)
            target = self.targets[e.name]
            if dst is None or dst.dtype != target.dtype or dst.shape != target.shape or dst.device != target.device:
                dst = torch.empty_like(target)
            self.ipc.copy(ann.ipc, e.offset, dst)
            out[e.name] = dst
        torch.cuda.synchronize(self.device)
        reader.read_end(slot, seq)
        return out

    def _check_fits(self, ann: Announcement, entries: list[Entry]) -> None:
        names = {e.name for e in ann.manifest.entries}
        unknown = sorted(names - set(self.targets))
        if unknown:
            raise ManifestError(f"version {ann.version} has tensors this model lacks, e.g. {unknown[:3]}")
        missing = sorted(set(self.targets) - names)
        if missing:
            raise ManifestError(f"version {ann.version} lacks {len(missing)} of this model's tensors, e.g. {missing[:3]}")
        for e in entries:
            if tuple(self.targets[e.name].shape) != e.shape:
                raise ManifestError(f"{e.name}: shape {e.shape} in version {ann.version}, {tuple(self.targets[e.name].shape)} here")

    def _host_buffer(self, e: Entry) -> torch.Tensor:
        """Where an entry's bytes land on the host: the spare tensor of a CPU model (the old
        version's storage), or a reusable pinned buffer for a CUDA model."""
        dtype = getattr(torch, e.dtype)
        if self.device.type == "cpu":
            t = self._spare.get(e.name)
            if t is not None and t.dtype == dtype and tuple(t.shape) == e.shape:
                return self._spare.pop(e.name)
            return torch.empty(e.shape, dtype=dtype)
        t = self._pinned.get(e.name)
        if t is None or t.dtype != dtype or tuple(t.shape) != e.shape:
            t = torch.empty(e.shape, dtype=dtype, pin_memory=True)
            if e.trainable:
                self._pinned[e.name] = t
        return t

    def _store(self, seg: str) -> StoreReader:
        reader = self._stores.get(seg)
        if reader is None:
            for old in self._stores.values():  # a restarted trainer made a new store
                old.close()
            self._stores = {seg: (reader := StoreReader(seg))}
        return reader

    def _read_store(self, seg: str, entries: list[Entry], flat: dict[str, np.ndarray]) -> dict[str, int]:
        reader = self._store(seg)
        seqs = {}
        for e in entries:
            if e.region not in seqs:
                seqs[e.region] = reader.read_begin(e.region, e.since)
        sums = dict(zip((e.name for e in entries),
                        copy_many([(flat[e.name], reader.view(e.offset, e.nbytes)) for e in entries], self.pool)))
        for region, seq in seqs.items():
            reader.read_end(region, seq)
        return sums

    def _to_device(self, host: dict[str, torch.Tensor], entries: list[Entry]) -> dict[str, torch.Tensor]:
        """Staged tensors in the served tensors' device and dtype (CPU, same dtype: the host
        buffers themselves). CUDA: pinned -> device on a side stream, finished before return."""
        out: dict[str, torch.Tensor] = {}
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if stream is not None:  # the spares were served until the last swap: let those kernels end
            stream.wait_stream(torch.cuda.current_stream(self.device))
        for e in entries:
            target, src = self.targets[e.name], host[e.name]
            if target.device == src.device and target.dtype == src.dtype:
                out[e.name] = src
                continue
            dst = self._spare.pop(e.name, None)
            if dst is None or dst.dtype != target.dtype or dst.shape != target.shape or dst.device != target.device:
                dst = torch.empty_like(target)
            if stream is not None:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
            else:
                dst.copy_(src)
            out[e.name] = dst
        if stream is not None:
            stream.synchronize()
        return out

    def close(self) -> None:
        for r in self._stores.values():
            r.close()
        self._stores.clear()
        self._spare.clear()
        self._pinned.clear()
        self._release.clear()
        if self.ipc is not None:
            self.ipc.close()
        if self.pool is not None:
            self.pool.shutdown()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


def _finite(t: torch.Tensor) -> bool:
    """No inf or NaN in a floating tensor: one summing pass (either makes the sum non-finite).
    The sum keeps the tensor's dtype (torch accumulates bf16 in float32; a float32 result is 10x
    slower to ask for), except float16, whose range a sum of finite values can leave."""
    if not t.is_floating_point():
        return True
    return bool(torch.isfinite(t.sum(dtype=torch.float32) if t.dtype == torch.float16 else t.sum()))


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor."""
    return t.reshape(-1).view(torch.uint8).numpy()
