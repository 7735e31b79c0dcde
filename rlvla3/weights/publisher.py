"""Trainer rank 0's side of weight publication: write a version into the store, return the
announcement to send as WEIGHTS.

The first publication (normally version 0, right after the trainer has built or loaded its
policy) writes every tensor: the frozen ones (parameters without ``requires_grad``, and
buffers) go to the store's frozen region once and for all; later publications write only the
trainable parameters, into the slot the previous publication did not use. Each tensor is
hashed (xxh3) chunk by chunk as it lands. The same store feeds same-host generators (they map
it) and other hosts (the stream server reads it), so rank 0 holds one copy of the model in the
store whatever the number of generators.

``delta="bf16"``: from the second publication on, each trainable tensor is also published as
``bf16(new - ref)`` in a delta region, where ``ref`` is the previous version as readers hold
it (the other slot). The slot then receives ``ref + delta`` (in the tensor's dtype, the
expression readers evaluate), not ``new``: rank 0's reference and every reader's rebuilt copy
stay bit-identical, and the rounding of one delta is carried into the next one instead of
accumulating. The trainer's own parameters are untouched.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import numpy as np
import structlog
import torch

from rlvla3.tensors import as_numpy, dtype_name
from rlvla3.shm import host_id, sweep_leftovers
from rlvla3.weights.announce import Announcement
from rlvla3.weights.manifest import DELTA_SLOTS, FROZEN, SLOTS, Entry, Layout, Manifest, checksum, copy_many
from rlvla3.weights.store import WeightStore
from rlvla3.weights.stream import StreamServer

log = structlog.get_logger()


def module_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, trainable) for every parameter (tied ones once) and buffer. A buffer the
    module lists in ``live_buffers`` (statistics the trainer updates) travels with every version,
    as a trainable parameter does."""
    live = set(getattr(module, "live_buffers", ()))
    for name, p in module.named_parameters():
        yield name, p, p.requires_grad
    for name, b in module.named_buffers():
        yield name, b, name in live


class WeightPublisher:
    """Publishes a module's versions through a shared-memory store (and a stream for other hosts).

    ``shm``: announce the store to same-host generators; ``stream_bind``: serve other hosts (or
    every generator when ``shm`` is off) from this endpoint; empty disables the stream;
    ``copy_threads``: threads that copy and hash tensors into the store; ``tensors``: the
    module's tensors gathered whole, when it is sharded (see :meth:`publish`)."""

    def __init__(self, module: torch.nn.Module, run_id: str, *, shm: bool = True,
                 stream_bind: str = "tcp://127.0.0.1:0", advertise_host: str = "", host: str | None = None,
                 copy_threads: int = 2, tensors: list[tuple[str, torch.Tensor, bool]] | None = None,
                 cuda_ipc: bool = False, delta: str = "none") -> None:
        if not shm and not stream_bind:
            raise ValueError("weights: with shm off, a stream endpoint is needed (weights.stream_bind)")
        if delta not in ("none", "bf16"):
            raise ValueError(f"weights.delta must be none or bf16, not {delta!r}")
        self.delta = delta == "bf16"
        self.module = module
        sweep_leftovers()  # stores (and pools) of processes that died without unlinking
        self.layout = Layout.plan([(n, dtype_name(t), tuple(t.shape), tr)
                                   for n, t, tr in (module_tensors(module) if tensors is None else tensors)], delta=self.delta)
        self.delta_offsets = self.layout.delta_offsets()
        self.store = WeightStore(run_id, self.layout.frozen_bytes, self.layout.slot_bytes, self.layout.delta_bytes)
        self.stream = StreamServer(self.store, stream_bind, advertise_host) if stream_bind else None
        self.shm = shm
        self.host = host or host_id()
        self.pool = ThreadPoolExecutor(copy_threads, thread_name_prefix="weights-copy") if copy_threads > 1 else None
        device = next((t.device for _, t, _ in module_tensors(module)), torch.device("cpu"))
        self.ipc = None
        if cuda_ipc and device.type == "cuda" and not self.delta:  # CUDA only: rlvla3.weights.cuda_ipc
            from rlvla3.weights.cuda_ipc import DeviceSlots

            self.ipc = DeviceSlots(self.layout.slot_bytes, device)
        self.version = -1
        self._count = 0
        self._frozen: list[Entry] = []
        self.last_write_ms = 0.0
        log.info("weight_store_created", seg=self.store.name, mb=round(self.store.size / 1e6, 1),
                 trainable_mb=round(self.layout.trainable_bytes / 1e6, 1), stream=self.stream and self.stream.endpoint)

    def publish(self, version: int, tensors: list[tuple[str, torch.Tensor, bool]] | None = None,
                policy_version: int | None = None) -> dict[str, Any]:
        """Write ``version`` into the store and return the WEIGHTS fields announcing it.
        Call it where no optimizer step runs at the same time (the copy reads the parameters).
        ``tensors``: the module's tensors gathered whole (an FSDP-sharded trainer,
        ``distributed.gather_tensors``), every one the first time, the trainable ones after.
        ``policy_version``: the policy version they act as, when not ``version`` (in flight)."""
        if version <= self.version:
            raise ValueError(f"version {version} is not newer than the last published ({self.version})")
        t0 = time.perf_counter()
        current = {n: (t, tr) for n, t, tr in (module_tensors(self.module) if tensors is None else tensors)}
        if self._count == 0:
            self._frozen = self._write(FROZEN, version, current, trainable=False)
        slot = SLOTS[self._count % 2]
        deltas: tuple[Entry, ...] = ()
        if self.delta and self._count > 0:
            entries, deltas = self._write_delta(self._count % 2, version, current)
        else:
            entries = self._write(slot, version, current, trainable=True)
        self._count += 1
        self.last_write_ms = (time.perf_counter() - t0) * 1000
        store = {"host": self.host, "seg": self.store.name, "size": self.store.size} if self.shm else None
        ipc = self.ipc.fields(slot, self.store.region_offset(slot)) if self.ipc is not None and self.shm else None
        manifest = Manifest(version, tuple(self._frozen + entries), self.version if deltas else None, deltas)
        ann = Announcement(version, manifest, store,
                           self.stream.endpoint if self.stream else None, time.time_ns(), ipc,
                           None if policy_version == version else policy_version)
        self.version = version
        log.info("weights_written", version=version, policy_version=policy_version, slot=slot, tensors=len(entries),
                 ms=round(self.last_write_ms, 2))
        return ann.fields()

    def _write(self, region: int, version: int, current: dict[str, tuple[torch.Tensor, bool]], trainable: bool) -> list[Entry]:
        base = self.store.region_offset(region)
        todo = []
        for spec in self.layout.specs:
            if spec.trainable != trainable:
                continue
            t, tr = current.get(spec.name, (None, None))
            if t is None or tr != spec.trainable or tuple(t.shape) != spec.shape or dtype_name(t) != spec.dtype:
                raise ValueError(f"weights: {spec.name} changed since the store was laid out "
                                 f"(now {None if t is None else (tuple(t.shape), dtype_name(t), tr)}); "
                                 "a model's tensors and their requires_grad must stay fixed")
            todo.append((spec, self.store.view(base + spec.rel_offset, spec.nbytes), t.detach()))
        self.store.write_begin(region)
        if trainable and self.ipc is not None:  # the device copy, inside the slot's seqlock window
            self.ipc.write(region, [(spec.rel_offset, t) for spec, _, t in todo])
        on_host = [(dst, as_numpy(t).reshape(-1).view(np.uint8)) for _, dst, t in todo if t.device.type == "cpu"]
        sums = iter(copy_many(on_host, self.pool))
        out = [Entry(spec.name, spec.dtype, spec.shape, region, base + spec.rel_offset, spec.nbytes,
                     next(sums) if t.device.type == "cpu" else _from_device(dst, t), version, spec.trainable)
               for spec, dst, t in todo]
        self.store.write_end(region, version)
        return out

    def _write_delta(self, k: int, version: int, current: dict[str, tuple[torch.Tensor, bool]]) -> tuple[list[Entry], tuple[Entry, ...]]:
        """Write each trainable tensor's bf16 delta against the other slot (the previous
        version as readers hold it) into delta region ``k``, and ``ref + delta`` into slot ``k``."""
        slot, ref_slot, region = SLOTS[k], SLOTS[1 - k], DELTA_SLOTS[k]
        base, ref_base, dbase = (self.store.region_offset(r) for r in (slot, ref_slot, region))
        self.store.write_begin(region)
        self.store.write_begin(slot)
        entries, deltas = [], []
        for spec in self.layout.specs:
            if not spec.trainable:
                continue
            t, tr = current.get(spec.name, (None, None))
            if t is None or not tr or tuple(t.shape) != spec.shape or dtype_name(t) != spec.dtype:
                raise ValueError(f"weights: {spec.name} changed since the store was laid out; "
                                 "a model's tensors and their requires_grad must stay fixed")
            dtype = getattr(torch, spec.dtype)
            ref = _tensor(self.store.view(ref_base + spec.rel_offset, spec.nbytes), dtype, spec.shape)
            dst = _tensor(self.store.view(base + spec.rel_offset, spec.nbytes), dtype, spec.shape)
            doff = dbase + self.delta_offsets[spec.name]
            d = _tensor(self.store.view(doff, spec.nbytes // dtype.itemsize * 2), torch.bfloat16, spec.shape)
            wide = torch.promote_types(dtype, torch.float32)
            d.copy_(t.detach().to("cpu", wide) - ref.to(wide))
            rebuild(ref, d, out=dst)
            entries.append(Entry(spec.name, spec.dtype, spec.shape, slot, base + spec.rel_offset, spec.nbytes,
                                 checksum(dst.reshape(-1).view(torch.uint8).numpy()), version, True))
            deltas.append(Entry(spec.name, "bfloat16", spec.shape, region, doff, d.numel() * 2, 0, version, True))
        self.store.write_end(slot, version)
        self.store.write_end(region, version)
        return entries, tuple(deltas)

    def close(self) -> None:
        """Stop the stream and unlink the store (readers keep what they copied)."""
        if self.stream is not None:
            self.stream.close()
        if self.pool is not None:
            self.pool.shutdown()
        self.store.close()


def rebuild(ref: torch.Tensor, delta: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``ref + delta`` in ``ref``'s dtype: the one expression rank 0 and readers evaluate, so
    both hold the same bits (an elementwise IEEE add is exactly rounded on every device)."""
    return torch.add(ref, delta.to(ref.dtype), out=out)


def _tensor(buf: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A torch view of a flat uint8 store range."""
    return torch.from_numpy(buf).view(dtype).view(shape)


def _from_device(dst: np.ndarray, t: torch.Tensor) -> int:
    """A device tensor: one device-to-host copy straight into the store, then hash what landed."""
    if dst.nbytes:
        torch.from_numpy(dst).view(t.dtype).view(t.shape).copy_(t)
    return checksum(dst)
