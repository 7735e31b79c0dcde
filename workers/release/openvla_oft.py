"""OpenVLA-OFT's release folder: weights by prefix rules, ``dataset_statistics.json`` and the
separate ``.pt`` component files.

UNVERIFIED against upstream code (no offline copy of openvla-oft could be run here; the layout
was read from public source excerpts): see docs/checkpoints.md for which release tensors have
no counterpart in our composed model.

The HF folder, ``dataset_statistics.json`` = ``{dataset: {"action"|"proprio": {q01, q99, mask,
...}}}`` (BOUNDS_Q99; masked action dims pass through), and ``*proprio_projector*checkpoint*.pt``
/ ``*action_head*checkpoint*.pt`` read with ``torch.load(weights_only=True)`` only, DDP's
``module.`` prefix stripped.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import numpy as np
import structlog
import torch

from workers.release.common import NORM, first_entry, inverted, load_renamed, read_safetensors, rename, save_renamed
from workers.release.normalize import affine_from_stats

log = structlog.get_logger(__name__)

FAMILY = "openvla_oft"
MODEL_TYPE = "openvla"
"""``config.json``'s ``model_type`` in the release; rlvla3's options ride along under ``options``."""
STATS = "dataset_statistics.json"
PROPRIO = "proprio_projector--0_checkpoint.pt"

# OpenVLA release names (HF-format towers assumed) -> ours. The proprio projector ships in its
# own .pt file, renamed by PROPRIO_RULES.
RELEASE_RULES = [
    ("language_model.", "llm."),
    ("vision_backbone.fused_featurizer.", "siglip."),
    ("vision_backbone.featurizer.", "dinov2."),
    ("projector.fc1.", "projector.0."),
    ("projector.fc2.", "projector.2."),
    ("projector.fc3.", "projector.4."),
]
FRESH = ("value_head.", "action_queries")
"""What RL adds and the release lacks: the critic and the parallel-decoding placeholders."""
# OpenVLA-OFT's ProprioProjector (fc1 -> GELU -> fc2) -> our proprio_proj Sequential.
PROPRIO_RULES = [("fc1.", "proprio_proj.0."), ("fc2.", "proprio_proj.2.")]
UNMAPPED_FILES = ("action_head",)
"""OFT's L1-regression action head (MLPResNet on the action tokens' states): our OFT decodes
action tokens through the LM head instead, so the file is read, listed, and not loaded."""


def read_pt(path: str) -> dict[str, torch.Tensor]:
    """A component state dict: tensors only (``weights_only``), DDP prefix stripped."""
    sd = torch.load(path, map_location="cpu", weights_only=True)
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}


def _component(local_dir: str, pattern: str) -> str | None:
    hits = sorted(p for p in glob.glob(os.path.join(local_dir, f"*{pattern}*")) if "checkpoint" in os.path.basename(p) and p.endswith(".pt"))
    if len(hits) > 1:
        raise ValueError(f"{FAMILY}: {local_dir} has {len(hits)} {pattern} checkpoints, expected one: {hits}")
    return hits[0] if hits else None


def read_stats(local_dir: str) -> tuple[Any, Any]:
    """(state, action) affine pairs from ``dataset_statistics.json``; masked action dims stay identity."""
    first = first_entry(local_dir, STATS)
    if first is None:
        return None, None
    name, entry = first
    state = affine_from_stats("QUANTILES", entry["proprio"], len(entry["proprio"]["q01"]), 1e-8, False) if "proprio" in entry else None
    shift, scale = affine_from_stats("QUANTILES", entry["action"], len(entry["action"]["q01"]), 1e-8, True)
    mask = torch.as_tensor(np.asarray(entry["action"].get("mask", [True] * shift.numel()), dtype=bool))
    action = (torch.where(mask, shift, torch.zeros_like(shift)), torch.where(mask, scale, torch.ones_like(scale)))
    log.info("release_stats_read", family=FAMILY, dataset=name)
    return state, action


def write_stats(policy: Any, out_dir: str) -> None:
    """The policy's statistics as ``dataset_statistics.json`` (bounds = shift -/+ scale)."""
    (s_shift, s_scale), (a_shift, a_scale) = policy.norm.affines()
    lohi = lambda shift, scale: {"q01": (shift - scale).tolist(), "q99": (shift + scale).tolist(),  # noqa: E731
                                 "mean": shift.tolist(), "std": scale.tolist()}
    action = dict(lohi(a_shift, a_scale), mask=[True] * a_shift.numel())
    with open(os.path.join(out_dir, STATS), "w") as f:
        json.dump({"rlvla3": {"action": action, "proprio": lohi(s_shift, s_scale)}}, f, indent=2)


def load(local_dir: str, spec: Any, overrides: dict[str, Any]) -> Any:
    """An OpenVLA-OFT folder -> ``OpenVLAOFTPolicy`` (weights, proprio projector, statistics)."""
    from workers.policies.openvla_oft import OpenVLAOFTPolicy

    sd = read_safetensors(local_dir, FAMILY)
    proprio = _component(local_dir, "proprio_projector")
    if proprio:
        part = read_pt(proprio)
        names = rename(part, PROPRIO_RULES)
        sd.update({names[k]: v for k, v in part.items()})
    head = _component(local_dir, "action_head")
    if head:
        log.warning("release_keys_unmapped", family=FAMILY, file=os.path.basename(head), keys=sorted(read_pt(head)))
    policy = load_renamed(local_dir, OpenVLAOFTPolicy, spec, overrides, sd, RELEASE_RULES, FRESH)
    state, action = read_stats(local_dir)
    policy.norm.set(state=state, action=action)
    return policy


def save(policy: Any, out_dir: str) -> None:
    """The release folder: weights under release names, the proprio projector's ``.pt``,
    statistics, tokenizer, rlvla3 options."""
    save_renamed(policy, out_dir, MODEL_TYPE, RELEASE_RULES, skip=(NORM, "proprio_proj."))
    part = {k: v.detach().cpu().clone() for k, v in policy.state_dict().items() if k.startswith("proprio_proj.")}
    back = rename(part, inverted(PROPRIO_RULES))
    torch.save({back[k]: v for k, v in part.items()}, os.path.join(out_dir, PROPRIO))
    write_stats(policy, out_dir)
