"""GR00T N1.5 and OpenVLA-OFT release folders: weights by prefix rules, plus each release's own
statistics file and, for OpenVLA-OFT, its separate ``.pt`` component files.

UNVERIFIED against upstream code (no offline copy of Isaac-GR00T or openvla-oft could be run
here; their layouts were read from public source excerpts): see docs/checkpoints.md for which
release tensors have no counterpart in our composed models.

* GR00T: ``config.json``, ``model.safetensors`` or ``model-*.safetensors`` + index, and
  ``experiment_cfg/metadata.json`` = ``{embodiment_tag: {"statistics": {"state"|"action":
  {key: {min, max, mean, std, q01, q99}}}}}``; state and action use MIN_MAX (keys joined in order).
* OpenVLA-OFT: the HF folder, ``dataset_statistics.json`` = ``{dataset: {"action"|"proprio":
  {q01, q99, mask, ...}}}`` (BOUNDS_Q99; masked action dims pass through), and
  ``*proprio_projector*checkpoint*.pt`` / ``*action_head*checkpoint*.pt`` read with
  ``torch.load(weights_only=True)`` only, DDP's ``module.`` prefix stripped.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import numpy as np
import structlog
import torch

from workers.release.normalize import affine_from_stats, concat_stats

log = structlog.get_logger(__name__)

GR00T_META = os.path.join("experiment_cfg", "metadata.json")
OFT_STATS = "dataset_statistics.json"
OFT_PROPRIO = "proprio_projector--0_checkpoint.pt"
# OpenVLA-OFT's ProprioProjector (fc1 -> GELU -> fc2) -> our proprio_proj Sequential.
OFT_PROPRIO_RULES = [("fc1.", "proprio_proj.0."), ("fc2.", "proprio_proj.2.")]
OFT_UNMAPPED_FILES = ("action_head",)
"""OFT's L1-regression action head (MLPResNet on the action tokens' states): our OFT decodes
action tokens through the LM head instead, so the file is read, listed, and not loaded."""


def read_pt(path: str) -> dict[str, torch.Tensor]:
    """A component state dict: tensors only (``weights_only``), DDP prefix stripped."""
    sd = torch.load(path, map_location="cpu", weights_only=True)
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}


def _component(local_dir: str, pattern: str) -> str | None:
    hits = sorted(p for p in glob.glob(os.path.join(local_dir, f"*{pattern}*")) if "checkpoint" in os.path.basename(p) and p.endswith(".pt"))
    if len(hits) > 1:
        raise ValueError(f"openvla_oft: {local_dir} has {len(hits)} {pattern} checkpoints, expected one: {hits}")
    return hits[0] if hits else None


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


def _first_entry(local_dir: str, name: str) -> tuple[str, Any] | None:
    """The first (key, value) of a release's JSON statistics file (both releases key their
    statistics by one embodiment or dataset); None when the release has no such file."""
    path = os.path.join(local_dir, name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return next(iter(json.load(f).items()))


def _gr00t_stats(local_dir: str) -> tuple[Any, Any]:
    first = _first_entry(local_dir, GR00T_META)
    if first is None:
        return None, None
    tag, entry = first
    st = entry["statistics"]
    out = []
    for side, inverse in (("state", False), ("action", True)):
        parts = list(st.get(side, {}).values())
        if not parts:
            out.append(None)
            continue
        joined = concat_stats(parts, ("min", "max"))
        out.append(affine_from_stats("MIN_MAX", joined, joined["min"].size, 1e-8, inverse))
    log.info("release_stats_read", family="gr00t_n15", embodiment=tag)
    return out[0], out[1]


def _oft_stats(local_dir: str) -> tuple[Any, Any]:
    first = _first_entry(local_dir, OFT_STATS)
    if first is None:
        return None, None
    name, entry = first
    state = affine_from_stats("QUANTILES", entry["proprio"], len(entry["proprio"]["q01"]), 1e-8, False) if "proprio" in entry else None
    shift, scale = affine_from_stats("QUANTILES", entry["action"], len(entry["action"]["q01"]), 1e-8, True)
    mask = torch.as_tensor(np.asarray(entry["action"].get("mask", [True] * shift.numel()), dtype=bool))
    action = (torch.where(mask, shift, torch.zeros_like(shift)), torch.where(mask, scale, torch.ones_like(scale)))
    log.info("release_stats_read", family="openvla_oft", dataset=name)
    return state, action


def _write_stats(policy: Any, out_dir: str) -> None:
    """Statistics in the release's own file (bounds = shift -/+ scale, exact for identity maps)."""
    (s_shift, s_scale), (a_shift, a_scale) = policy.norm.affines()
    lohi = lambda shift, scale, lo, hi: {lo: (shift - scale).tolist(), hi: (shift + scale).tolist(),  # noqa: E731
                                         "mean": shift.tolist(), "std": scale.tolist()}
    if policy.family == "gr00t_n15":
        os.makedirs(os.path.join(out_dir, "experiment_cfg"), exist_ok=True)
        meta = {"rlvla3": {"statistics": {"state": {"state": lohi(s_shift, s_scale, "min", "max")},
                                          "action": {"action": lohi(a_shift, a_scale, "min", "max")}},
                           "embodiment_tag": "rlvla3"}}
        with open(os.path.join(out_dir, GR00T_META), "w") as f:
            json.dump(meta, f, indent=2)
    else:
        action = dict(lohi(a_shift, a_scale, "q01", "q99"), mask=[True] * a_shift.numel())
        with open(os.path.join(out_dir, OFT_STATS), "w") as f:
            json.dump({"rlvla3": {"action": action, "proprio": lohi(s_shift, s_scale, "q01", "q99")}}, f, indent=2)


# ---------------------------------------------------------------------------------------------
# Load / save
# ---------------------------------------------------------------------------------------------


MODEL_TYPES = {"gr00t_n15": "gr00t_n1_5", "openvla_oft": "openvla"}
"""``config.json``'s ``model_type`` in each release; rlvla3's options ride along under ``options``."""


def load(local_dir: str, family: str, spec: Any, overrides: dict[str, Any]) -> Any:
    """A GR00T N1.5 / OpenVLA-OFT folder -> the family's policy (weights, statistics)."""
    from workers.model import policy_class
    from workers.release.common import load_tokenizer, options_for, read_safetensors, rename, strict_load

    cls = policy_class(family)
    with open(os.path.join(local_dir, "config.json")) as f:
        config = json.load(f)
    sd = read_safetensors(local_dir, family)
    if family == "openvla_oft":
        proprio = _component(local_dir, "proprio_projector")
        if proprio:
            part = read_pt(proprio)
            names = rename(part, OFT_PROPRIO_RULES)
            sd.update({names[k]: v for k, v in part.items()})
        head = _component(local_dir, "action_head")
        if head:
            log.warning("release_keys_unmapped", family=family, file=os.path.basename(head), keys=sorted(read_pt(head)))
    opts = options_for(cls.OPTIONS, config.get("options", {}), overrides)
    policy = cls(opts, spec, tokenizer=load_tokenizer(local_dir, family))
    names = rename(sd, cls.RELEASE_RULES)
    strict_load(policy, {names[k]: v.to(policy.device) for k, v in sd.items()}, family, tuple(cls.FRESH) + ("norm.",))
    state, action = (_gr00t_stats if family == "gr00t_n15" else _oft_stats)(local_dir)
    policy.norm.set(state=state, action=action)
    return policy


def save(policy: Any, out_dir: str) -> None:
    """The release folder: weights under release names, statistics, tokenizer, rlvla3 options."""
    import dataclasses

    from safetensors.torch import save_file

    from workers.release.common import export_state, inverted, rename

    family = policy.family
    os.makedirs(out_dir, exist_ok=True)
    sd = export_state(policy, skip=("norm.", "proprio_proj.") if family == "openvla_oft" else ("norm.",))
    names = rename(sd, inverted(policy.RELEASE_RULES))
    save_file({names[k]: v for k, v in sd.items()}, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"model_type": MODEL_TYPES[family], "options": dataclasses.asdict(policy.opts)}, f, indent=2)
    policy.tokenizer.save_pretrained(out_dir)
    if family == "openvla_oft":
        part = {k: v.detach().cpu().clone() for k, v in policy.state_dict().items() if k.startswith("proprio_proj.")}
        back = rename(part, inverted(OFT_PROPRIO_RULES))
        torch.save({back[k]: v for k, v in part.items()}, os.path.join(out_dir, OFT_PROPRIO))
    _write_stats(policy, out_dir)
