"""Trainer memory: activation recomputation, and moving trainer state off the device and back
(colocated placement, where generators need the memory between updates)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def enable_gradient_checkpointing(policy: nn.Module) -> int:
    """Turn on transformers' non-reentrant gradient checkpointing in every transformers tower of
    ``policy`` (layers recompute their activations in backward); returns how many towers.

    Towers nested in an outer transformers model are covered by the outer one. Custom heads
    (GR00T's DiT, the value heads) keep their activations: they are a small part of the memory.
    A policy whose action expert reads a KV cache that its VLM writes (pi0, pi0.5) names the
    towers that are safe in ``checkpoint_towers()``: a checkpointed language model writes no cache,
    and a checkpointed expert would append its keys to the cache again when it recomputes.
    """
    from transformers import PreTrainedModel

    named = getattr(policy, "checkpoint_towers", None)
    towers = list(named()) if named else [
        m for m in policy.modules() if isinstance(m, PreTrainedModel) and m.supports_gradient_checkpointing]
    outer = [m for m in towers if not any(m is not o and any(m is s for s in o.modules()) for o in towers)]
    for m in outer:  # transformers >= 5.x names it activation_checkpointing_enable; 5.0 has the old name
        enable = getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    if not outer:
        raise ValueError(f"train.gradient_checkpointing: {type(policy).__name__} has no transformers tower")
    return len(outer)


class TrainerOffload:
    """Colocated placement: the trainer's state leaves the device while generators work on it,
    and comes back for the update (``placement.offload``).

    ``offload()`` copies the optimizer state (and the parameters, with ``params``) into host
    memory (pinned on CUDA) and drops the gradients (every update zeroes them first);
    ``onload()`` copies them back. Copies, not moves, even on CPU: the path is the same where
    everything fits (``offload: always``), and the tensors that come back are bit-identical.
    ``moved_bytes`` / ``offloads`` / ``on_device`` are the bookkeeping tests and logs read.
    """

    def __init__(self, policy: nn.Module, optimizers: list, device: torch.device, params: bool) -> None:
        self.policy, self.device, self.params = policy, torch.device(device), params
        self.optimizers = list({id(o): o for o in optimizers}.values())  # the critic's may be the same
        self.on_device = True
        self.offloads = 0
        self.moved_bytes = 0

    def _tensors(self) -> list[tuple[Any, Any]]:
        """(holder, key) of every tensor that moves: optimizer state entries, then parameters."""
        out: list[tuple[Any, Any]] = []
        for opt in self.optimizers:
            for st in opt.state.values():
                out += [(st, k) for k, v in st.items() if isinstance(v, torch.Tensor)]
        if self.params:
            out += [(p, "data") for p in self.policy.parameters()]
        return out

    @torch.no_grad()
    def offload(self) -> int:
        """Trainer state off the device; returns the bytes moved."""
        if not self.on_device:
            return 0
        pin = self.device.type == "cuda"
        moved = 0
        for holder, key in self._tensors():
            t = holder.data if key == "data" else holder[key]
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin).copy_(t, non_blocking=pin)
            moved += t.numel() * t.element_size()
            if key == "data":
                holder.data = host
            else:
                holder[key] = host
        for p in self.policy.parameters():
            p.grad = None
        if pin:
            torch.cuda.synchronize(self.device)
        self.on_device, self.offloads, self.moved_bytes = False, self.offloads + 1, moved
        return moved

    @torch.no_grad()
    def onload(self) -> int:
        """Trainer state back on the device for the update; returns the bytes moved."""
        if self.on_device:
            return 0
        moved = 0
        for holder, key in self._tensors():
            t = holder.data if key == "data" else holder[key]
            dev = torch.empty(t.shape, dtype=t.dtype, device=self.device).copy_(t)
            moved += t.numel() * t.element_size()
            if key == "data":
                holder.data = dev
            else:
                holder[key] = dev
        self.on_device = True
        return moved


def make_offload(placement_mode: str, offload: str, policy: nn.Module, optimizers: list,
                 device: torch.device) -> TrainerOffload | None:
    """The trainer's offload for its placement, or None when its state stays on the device:
    ``always`` offloads (parameters too), ``auto`` offloads optimizer state and gradients when a
    colocated CUDA device has less than half its memory free, ``never`` and CPU ``auto`` do not."""
    if placement_mode == "disaggregated" or offload == "never":
        return None
    if offload == "always":
        return TrainerOffload(policy, optimizers, device, params=True)
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if free < total / 2:
            return TrainerOffload(policy, optimizers, device, params=False)
    return None
