"""GR00T N1.5's release folder: weights by prefix rules, and ``experiment_cfg/metadata.json``.

UNVERIFIED against upstream code (no offline copy of Isaac-GR00T could be run here; the layout
was read from public source excerpts): see docs/checkpoints.md for which release tensors have
no counterpart in our composed model.

``config.json``, ``model.safetensors`` or ``model-*.safetensors`` + index, and
``experiment_cfg/metadata.json`` = ``{embodiment_tag: {"statistics": {"state"|"action":
{key: {min, max, mean, std, q01, q99}}}}}``; state and action use MIN_MAX (keys joined in order).
"""

from __future__ import annotations

import json
import os
from typing import Any

import structlog

from workers.release.common import NORM, RL_HEADS, first_entry, load_renamed, read_safetensors, save_renamed
from workers.release.normalize import affine_from_stats, concat_stats

log = structlog.get_logger(__name__)

FAMILY = "gr00t_n15"
MODEL_TYPE = "gr00t_n1_5"
"""``config.json``'s ``model_type`` in the release; rlvla3's options ride along under ``options``."""
META = os.path.join("experiment_cfg", "metadata.json")

# GR00T release names -> ours (Eagle's LM and vision tower in HF layout assumed).
RELEASE_RULES = [
    ("backbone.eagle_model.vision_model.vision_model.", "vision."),
    ("backbone.eagle_model.vision_model.", "vision."),
    ("backbone.eagle_model.language_model.model.", "llm."),
    ("backbone.eagle_model.mlp1.", "projector."),
    ("action_head.", "head."),
]
FRESH = RL_HEADS
"""What RL adds and the release lacks: the critic and Flow-Noise's std head."""


def read_stats(local_dir: str) -> tuple[Any, Any]:
    """(state, action) affine pairs from ``metadata.json``; None for a side it does not hold."""
    first = first_entry(local_dir, META)
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
    log.info("release_stats_read", family=FAMILY, embodiment=tag)
    return out[0], out[1]


def write_stats(policy: Any, out_dir: str) -> None:
    """The policy's statistics as ``metadata.json`` (bounds = shift -/+ scale, exact for identity maps)."""
    (s_shift, s_scale), (a_shift, a_scale) = policy.norm.affines()
    lohi = lambda shift, scale: {"min": (shift - scale).tolist(), "max": (shift + scale).tolist(),  # noqa: E731
                                 "mean": shift.tolist(), "std": scale.tolist()}
    os.makedirs(os.path.join(out_dir, "experiment_cfg"), exist_ok=True)
    meta = {"rlvla3": {"statistics": {"state": {"state": lohi(s_shift, s_scale)}, "action": {"action": lohi(a_shift, a_scale)}},
                       "embodiment_tag": "rlvla3"}}
    with open(os.path.join(out_dir, META), "w") as f:
        json.dump(meta, f, indent=2)


def load(local_dir: str, spec: Any, overrides: dict[str, Any]) -> Any:
    """A GR00T N1.5 folder -> ``Gr00tPolicy`` (weights, statistics)."""
    from workers.policies.gr00t import Gr00tPolicy

    sd = read_safetensors(local_dir, FAMILY)
    policy = load_renamed(local_dir, Gr00tPolicy, spec, overrides, sd, RELEASE_RULES, FRESH)
    state, action = read_stats(local_dir)
    policy.norm.set(state=state, action=action)
    return policy


def save(policy: Any, out_dir: str) -> None:
    """The release folder: weights under release names, statistics, tokenizer, rlvla3 options."""
    save_renamed(policy, out_dir, MODEL_TYPE, RELEASE_RULES, skip=(NORM,))
    write_stats(policy, out_dir)
