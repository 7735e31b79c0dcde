"""Low-rank adapters (LoRA) in plain torch: no dependency, and the base weights keep their names.

Each targeted ``nn.Linear`` gets two child layers, ``lora_A`` (in -> r) and ``lora_B`` (r -> out,
zero-initialised, so a fresh adapter changes nothing), and a forward hook that adds
``B(A(x)) * alpha / r`` to its output. Keeping the Linear in place (no wrapper module) leaves
every base parameter's name as the release layouts and checkpoints know it; the adapters appear
next to it as ``<layer>.lora_A.weight`` / ``<layer>.lora_B.weight``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rlvla3.scale_config import LoraConfig


def _lora_delta(layer: nn.Linear, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    x = inputs[0]
    return output + layer.lora_B(layer.lora_A(x.to(layer.lora_A.weight.dtype))).to(output.dtype) * layer.lora_scale


def add_lora(policy: nn.Module, cfg: LoraConfig, seed: int = 0) -> int:
    """Add adapters to ``policy``'s target layers and freeze all but them and ``cfg.train_also``;
    returns the number of adapted layers. Adapters are created on each layer's device and dtype,
    seeded, so every process that builds the policy gets the same version-0 adapters."""
    targets = set(cfg.targets)
    # Frozen layers are ones the policy never runs (OpenVLA's last tower blocks): no adapter there.
    layers = [(n, m) for n, m in policy.named_modules()
              if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in targets and m.weight.requires_grad]
    if not layers:
        raise ValueError(f"model.lora: no nn.Linear named {sorted(targets)} in {type(policy).__name__}")
    keep = tuple(cfg.train_also)
    for name, p in policy.named_parameters():
        if not name.startswith(keep):
            p.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _, layer in layers:
            w = layer.weight
            layer.lora_A = nn.Linear(layer.in_features, cfg.rank, bias=False, device=w.device, dtype=w.dtype)
            layer.lora_B = nn.Linear(cfg.rank, layer.out_features, bias=False, device=w.device, dtype=w.dtype)
            nn.init.kaiming_uniform_(layer.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(layer.lora_B.weight)
            layer.lora_scale = cfg.alpha / cfg.rank
            layer.lora_hook = layer.register_forward_hook(_lora_delta)
    return len(layers)


@torch.no_grad()
def merge_lora(policy: nn.Module) -> int:
    """Fold every adapter into its base weight (``W += B @ A * alpha / r``, summed in fp32) and
    remove it, so the policy holds the base names only, as the release layouts expect; returns
    the number of merged layers. Exports call it; the policy's outputs change only by rounding."""
    merged = 0
    for layer in policy.modules():
        if not (isinstance(layer, nn.Linear) and hasattr(layer, "lora_hook")):
            continue
        delta = layer.lora_B.weight.float() @ layer.lora_A.weight.float() * layer.lora_scale
        layer.weight.copy_((layer.weight.float() + delta).to(layer.weight.dtype))
        layer.lora_hook.remove()
        del layer.lora_A, layer.lora_B, layer.lora_scale, layer.lora_hook
        merged += 1
    return merged

