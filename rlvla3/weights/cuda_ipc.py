"""Same-GPU hand-over of trainable weights by CUDA IPC. Nothing here runs unless the trainer's
model is on a CUDA device and ``weights.cuda_ipc`` is on. Its test
(``tests/test_weights.py::test_a_reader_on_the_same_gpu_takes_trainable_tensors_by_cuda_ipc``)
skips without CUDA; it passed on an H200, and one π0 3B job there swapped 4 versions by it
(bench/gpu/README.md).

Where trainer rank 0 and a generator share one GPU (colocated placement), the trainable bytes
need not cross the host twice. Rank 0 keeps one device buffer per trainable slot of the weight
store (same offsets as the store's slot), copies the trainable parameters into it device to
device while it writes the host slot (inside the same seqlock window), and announces the
buffer's CUDA IPC handle. A generator on the same device (same uuid) opens that handle once,
copies its trainable entries device to device between the slot's ``read_begin`` and
``read_end`` (so a copy that overlapped the next write of that slot is torn and fetched again,
as from the store), and skips the host copy and the pinned -> device copy. The host store is
still written: frozen tensors, late joiners, other hosts and the checksums come from it.

The handle travels as plain fields (bytes and integers of
``torch.multiprocessing.reductions.reduce_tensor``'s CUDA arguments), never as a pickle; a
generator rebuilds the tensor from them with ``rebuild_cuda_tensor``. Bytes read by IPC are
not hashed (that would need them on the host): the seqlock guards them, the inf/NaN check still
runs on the device.
"""

from __future__ import annotations

from typing import Any

import torch

from rlvla3.weights.manifest import SLOTS


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _handle_fields(buf: torch.Tensor) -> dict[str, Any]:
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(buf)
    # (cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size_bytes,
    #  storage_offset_bytes, requires_grad, ref_counter_handle, ref_counter_offset,
    #  event_handle, event_sync_required)
    return {"device": int(args[6]), "handle": bytes(args[7]), "size": int(args[8]), "offset": int(args[9]),
            "ref_handle": bytes(args[11]), "ref_offset": int(args[12]),
            "event": bytes(args[13]) if args[13] is not None else None, "event_sync": bool(args[14])}


class DeviceSlots:
    """Rank 0's side: a device buffer per trainable slot, written beside the host slot."""

    def __init__(self, slot_bytes: int, device: torch.device) -> None:
        self.device = torch.device(device)
        self.uuid = device_uuid(self.device)
        self.bufs = {s: torch.empty(max(1, slot_bytes), dtype=torch.uint8, device=self.device) for s in SLOTS}
        self.handles = {s: _handle_fields(b) for s, b in self.bufs.items()}

    def write(self, slot: int, items: list[tuple[int, torch.Tensor]]) -> None:
        """Copy each (offset within the slot, tensor) into the slot's buffer; returns when done."""
        buf = self.bufs[slot]
        for rel, t in items:
            buf[rel:rel + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
        torch.cuda.current_stream(self.device).synchronize()

    def fields(self, slot: int, slot_offset: int) -> dict[str, Any]:
        """The announcement's ``ipc`` field: where the slot's bytes are on the device."""
        return {"uuid": self.uuid, "slot": slot, "base": slot_offset, **self.handles[slot]}


class DeviceSlotReader:
    """A generator's side: the trainer's slot buffers, opened once per handle."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.uuid = device_uuid(self.device) if self.device.type == "cuda" else ""
        # Keyed by handle and offset: the caching allocator may carve both slot buffers out of
        # one cudaMalloc block (small slots), and then they share the handle.
        self._open: dict[tuple[bytes, int], torch.Tensor] = {}

    def usable(self, ipc: dict[str, Any] | None) -> bool:
        return ipc is not None and self.device.type == "cuda" and ipc["uuid"] == self.uuid

    def buffer(self, ipc: dict[str, Any]) -> torch.Tensor:
        key = (ipc["handle"], ipc["offset"])
        buf = self._open.get(key)
        if buf is None:
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            n = ipc["size"]
            buf = rebuild_cuda_tensor(torch.Tensor, (n,), (1,), 0, torch.UntypedStorage, torch.uint8, ipc["device"],
                                      ipc["handle"], n, ipc["offset"], False, ipc["ref_handle"], ipc["ref_offset"],
                                      ipc.get("event"), ipc.get("event_sync", False))
            self._open[key] = buf
        return buf

    def copy(self, ipc: dict[str, Any], offset: int, dst: torch.Tensor) -> None:
        """Copy the entry at absolute store ``offset`` (in the announced slot) into ``dst``."""
        rel = offset - ipc["base"]
        nbytes = dst.numel() * dst.element_size()
        dst.copy_(self.buffer(ipc)[rel:rel + nbytes].view(dst.dtype).view(dst.shape))

    def close(self) -> None:
        self._open.clear()
