"""LoRA adapters written by ``peft`` (``PeftModel.save_pretrained``) folded into a release's weights.

``adapter_config.json`` + ``adapter_model.safetensors`` beside the base release: each adapted
module's ``lora_A`` / ``lora_B`` merge into its base weight (``W += B A * alpha / r``, or
``alpha / sqrt(r)`` with rsLoRA, in float32; convolutions through their flattened kernels), and
``base_layer`` tensors peft saved (e.g. a resized ``lm_head``) replace the base ones. The merged
weights are the adapted model's, so the policy acts as the adapted upstream model does; RL may
then add its own adapters (``model.lora``) on top. Names are the release's, so this runs before a
family converts them.
"""

from __future__ import annotations

import json
import math
import os

import torch

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


def merge_peft_lora(local_dir: str, sd: dict[str, torch.Tensor], family: str) -> int:
    """Fold the folder's peft LoRA adapters into ``sd`` (release names) in place; returns the number
    of merged modules (0 when the folder has no adapters)."""
    from safetensors.torch import load_file

    path = os.path.join(local_dir, CONFIG)
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA" or cfg.get("use_dora") or cfg.get("fan_in_fan_out") or cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"{family}: {path}: only plain LoRA adapters merge (peft_type LORA, no DoRA, fan_in_fan_out, "
                         "rank or alpha patterns)")
    if not os.path.isfile(os.path.join(local_dir, WEIGHTS)):
        raise FileNotFoundError(f"{family}: {local_dir!r} has {CONFIG} but no {WEIGHTS} (peft writes both side by side)")
    r = int(cfg["r"])
    scale = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    adapters = load_file(os.path.join(local_dir, WEIGHTS))
    bad = [k for k in adapters if not k.startswith(PREFIX) or not (".lora_A." in k or ".lora_B." in k or ".base_layer." in k)]
    modules = sorted({k[len(PREFIX):].split(".lora_A.")[0] for k in adapters if ".lora_A." in k})
    bad += [m + ".weight" for m in modules if m + ".weight" not in sd and f"{PREFIX}{m}.base_layer.weight" not in adapters]
    if bad:
        raise ValueError(f"{family}: {len(bad)} adapter tensors have no base tensor, first: {', '.join(bad[:10])}")
    for k, t in adapters.items():
        if ".base_layer." in k:
            sd[k[len(PREFIX):].replace(".base_layer.", ".")] = t
    for m in modules:
        w = sd[m + ".weight"]
        a, b = adapters[f"{PREFIX}{m}.lora_A.weight"].float(), adapters[f"{PREFIX}{m}.lora_B.weight"].float()
        delta = (b.flatten(1) @ a.flatten(1)).view(w.shape) * scale
        sd[m + ".weight"] = (w.float() + delta).to(w.dtype)
    return len(modules)
