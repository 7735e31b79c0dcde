"""Trainer memory: activation recomputation, and moving trainer state off the device and back
(colocated placement, where generators need the memory between updates)."""

from __future__ import annotations

from torch import nn


def enable_gradient_checkpointing(policy: nn.Module) -> int:
    """Turn on transformers' non-reentrant gradient checkpointing in every transformers tower of
    ``policy`` (layers recompute their activations in backward); returns how many towers.

    Towers nested in an outer transformers model are covered by the outer one. Custom heads
    (GR00T's DiT, the value heads) keep their activations: they are a small part of the memory.
    """
    from transformers import PreTrainedModel

    towers = [m for m in policy.modules() if isinstance(m, PreTrainedModel) and m.supports_gradient_checkpointing]
    outer = [m for m in towers if not any(m is not o and any(m is s for s in o.modules()) for o in towers)]
    for m in outer:  # transformers >= 5.x names it activation_checkpointing_enable; 5.0 has the old name
        enable = getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    if not outer:
        raise ValueError(f"train.gradient_checkpointing: {type(policy).__name__} has no transformers tower")
    return len(outer)
