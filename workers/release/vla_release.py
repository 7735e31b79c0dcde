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


def _gr00t_stats(local_dir: str) -> tuple[Any, Any]:
    path = os.path.join(local_dir, GR00T_META)
    if not os.path.isfile(path):
        return None, None
    with open(path) as f:
        meta = json.load(f)
    tag, entry = next(iter(meta.items()))
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
    path = os.path.join(local_dir, OFT_STATS)
    if not os.path.isfile(path):
        return None, None
    with open(path) as f:
        stats = json.load(f)
    name, entry = next(iter(stats.items()))
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


def load(local_dir: str, family: str, spec: Any, overrides: dict[str, Any]) -> Any:
    from workers.model import policy_class
    from workers.policies.vla_common import load_mapped, options_from_config, read_local

    cls = policy_class(family)
    ck = read_local(local_dir, family)
    sd = dict(ck.state_dict)
    if family == "openvla_oft":
        from workers.release.common import rename

        proprio = _component(local_dir, "proprio_projector")
        if proprio:
            part = read_pt(proprio)
            names = rename(part, OFT_PROPRIO_RULES)
            sd.update({names[k]: v for k, v in part.items()})
        head = _component(local_dir, "action_head")
        if head:
            log.warning("release_keys_unmapped", family=family, file=os.path.basename(head), keys=sorted(read_pt(head)))
    opts = options_from_config(ck.config, cls.OPTIONS, family, overrides)
    policy = cls._build_loaded(ck, opts, spec, overrides)
    load_mapped(policy, sd, cls.RELEASE_RULES, tuple(cls.FRESH) + ("norm.",), family)
    state, action = (_gr00t_stats if family == "gr00t_n15" else _oft_stats)(local_dir)
    policy.norm.set(state=state, action=action)
    return policy


def save(policy: Any, out_dir: str) -> None:
    """The release folder: weights under release names, statistics, tokenizer, rlvla3 options."""
    from workers.policies.vla_common import save_local
    from workers.release.common import inverted, rename

    skip: tuple[str, ...] = ("norm.",)
    if policy.family == "openvla_oft":
        skip += ("proprio_proj.",)
    save_local(policy, out_dir, policy.family, policy.opts, policy.tokenizer, policy.RELEASE_RULES,
               policy._release_config(), skip=skip)
    if policy.family == "openvla_oft":
        part = {k[len("proprio_proj."):]: v for k, v in policy.state_dict().items() if k.startswith("proprio_proj.")}
        names = rename(["proprio_proj." + k for k in part], inverted(OFT_PROPRIO_RULES))
        torch.save({names["proprio_proj." + k]: v.detach().cpu().clone() for k, v in part.items()},
                   os.path.join(out_dir, OFT_PROPRIO))
    _write_stats(policy, out_dir)
