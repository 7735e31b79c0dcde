"""GR00T N1.5's release folder (``nvidia/GR00T-N1.5-3B``, RLinf's ``RLinf-Gr00t-SFT-*``).

Checked against LeRobot 0.4.4's ``GR00TN15`` run in its own environment: the class's own
``save_pretrained`` output loads here with every tensor mapped (docs/checkpoints.md).

Files: ``config.json`` (``model_type: gr00t_n1_5``, ``action_head_cfg``, ``backbone_cfg``),
``model.safetensors`` or ``model-*.safetensors`` + index, and ``experiment_cfg/metadata.json`` =
``{embodiment_tag: {"statistics": {"state"|"action": {key: {min, max, mean, std, q01, q99}}}}}``
(keys joined in order, MIN_MAX on both sides). Tensor names are the policy's own except the
vision tower, which transformers 4.x nests one ``vision_model.`` deeper. The LM head is tied to
the token table and not stored. N1.5 folders ship no tokenizer: ``model.tokenizer: DIR`` names
Eagle's (Qwen3's vocabulary with ``<IMG_CONTEXT>``); its ``chat_template.json`` is the prompt's
template (N1.5's when absent). The exporter writes the tokenizer and that template back.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import structlog

from workers.policies.eagle_prompt import read_chat_template, write_chat_template
from workers.release.common import (
    NORM,
    RL_HEADS,
    export_state,
    inverted,
    options_for,
    read_rlvla3_files,
    read_safetensors,
    rename,
    strict_load,
    write_rlvla3_files,
)
from workers.release.normalize import affine_from_stats, concat_stats

log = structlog.get_logger(__name__)

FAMILY = "gr00t_n15"
MODEL_TYPE = "gr00t_n1_5"
META = os.path.join("experiment_cfg", "metadata.json")
RELEASE_RULES = [("backbone.eagle_model.vision_model.vision_model.", "backbone.eagle_model.vision_model.")]
TIED = "backbone.eagle_model.language_model.lm_head.weight"
"""Tied to ``...language_model.model.embed_tokens.weight``; releases do not store it."""


def head_shape_of(config: dict[str, Any]) -> Any:
    """The action head's sizes from a release ``config.json``."""
    from workers.policies.gr00t_head import HeadShape

    ah = config["action_head_cfg"]
    dit, vl = ah["diffusion_model_cfg"], ah["vl_self_attention_cfg"]
    return HeadShape(
        backbone_dim=ah["backbone_embedding_dim"], embed_dim=ah["input_embedding_dim"], hidden=ah["hidden_size"],
        dit_heads=dit["num_attention_heads"], dit_layers=dit["num_layers"], vl_heads=vl["num_attention_heads"],
        vl_layers=vl["num_layers"], future_tokens=ah.get("num_target_vision_tokens", 32),
        max_state_dim=ah["max_state_dim"], action_dim=ah["action_dim"], embodiments=ah.get("max_num_embodiments", 32),
        max_seq_len=ah.get("max_seq_len", 1024), buckets=ah.get("num_timestep_buckets", 1000))


def release_config(policy: Any) -> dict[str, Any]:
    """``config.json`` as N1.5 writes it, for the policy's sizes (upstream loaders read it)."""
    s = policy.action_head.shape
    lm = policy.backbone.eagle_model.language_model.config
    head = {
        "action_dim": s.action_dim, "action_horizon": policy.chunk_size, "add_pos_embed": True,
        "backbone_embedding_dim": s.backbone_dim, "hidden_size": s.hidden, "input_embedding_dim": s.embed_dim,
        "max_action_dim": s.action_dim, "max_state_dim": s.max_state_dim, "max_num_embodiments": s.embodiments,
        "max_seq_len": s.max_seq_len, "model_dtype": "float32", "noise_beta_alpha": 1.5, "noise_beta_beta": 1.0,
        "noise_s": 0.999, "num_inference_timesteps": policy.opts.num_steps, "num_target_vision_tokens": s.future_tokens,
        "num_timestep_buckets": s.buckets, "tune_diffusion_model": True, "tune_projector": True, "use_vlln": True,
        "diffusion_model_cfg": {"attention_head_dim": s.embed_dim // s.dit_heads, "cross_attention_dim": s.backbone_dim,
                                "dropout": 0.2, "final_dropout": True, "interleave_self_attention": True,
                                "norm_type": "ada_norm", "num_attention_heads": s.dit_heads, "num_layers": s.dit_layers,
                                "output_dim": s.hidden, "positional_embeddings": None},
        "vl_self_attention_cfg": {"attention_head_dim": s.backbone_dim // s.vl_heads, "dropout": 0.2, "final_dropout": True,
                                  "num_attention_heads": s.vl_heads, "num_layers": s.vl_layers, "positional_embeddings": None},
    }
    backbone = {"eagle_path": "NVEagle/eagle_er-qwen3_1_7B-Siglip2_400M_stage1_5_128gpu_er_v7_1mlp_nops", "load_bf16": False,
                "project_to_dim": None, "reproject_vision": False, "select_layer": lm.num_hidden_layers,
                "tune_llm": policy.opts.tune_llm, "tune_visual": policy.opts.tune_visual, "use_flash_attention": True}
    return {"action_dim": s.action_dim, "action_head_cfg": head, "action_horizon": policy.chunk_size,
            "architectures": ["GR00T_N1_5"], "backbone_cfg": backbone, "hidden_size": s.backbone_dim,
            "model_dtype": "float32", "model_type": MODEL_TYPE}


def read_stats(local_dir: str, tag: str, spec: Any) -> tuple[Any, Any]:
    """(state, action) affine pairs for embodiment ``tag``; (None, None) without a metadata file."""
    path = os.path.join(local_dir, META)
    if not os.path.isfile(path):
        return None, None
    with open(path) as f:
        meta = json.load(f)
    if tag not in meta:
        raise ValueError(f"{FAMILY}: embodiment {tag!r} has no statistics in {path}; the folder's embodiments: "
                         f"{sorted(meta)} (set model.options.embodiment)")
    st = meta[tag].get("statistics", {})
    out = []
    for side, width, inverse in (("state", spec.state_dim, False), ("action", spec.action_dim, True)):
        parts = list(st.get(side, {}).values())
        if not parts:
            raise ValueError(f"{FAMILY}: {path} has no {side} statistics for embodiment {tag!r} (the env's {side} has {width} dims)")
        joined = concat_stats(parts, ("min", "max"))
        if joined["min"].size != width:
            raise ValueError(f"{FAMILY}: {path}'s {side} statistics for {tag!r} cover {joined['min'].size} dims; "
                             f"the env's {side} has {width}")
        out.append(affine_from_stats("MIN_MAX", joined, width, 1e-8, inverse))
    log.info("release_stats_read", family=FAMILY, embodiment=tag)
    return out[0], out[1]


def write_stats(policy: Any, out_dir: str) -> None:
    """The policy's statistics under its embodiment tag (bounds = shift -/+ scale, exact for identity maps)."""
    (s_shift, s_scale), (a_shift, a_scale) = policy.norm.affines()
    lohi = lambda shift, scale: {"min": (shift - scale).tolist(), "max": (shift + scale).tolist(),  # noqa: E731
                                 "mean": shift.tolist(), "std": scale.tolist()}
    os.makedirs(os.path.join(out_dir, "experiment_cfg"), exist_ok=True)
    tag = policy.opts.embodiment
    meta = {tag: {"statistics": {"state": {"state": lohi(s_shift, s_scale)}, "action": {"action": lohi(a_shift, a_scale)}},
                  "embodiment_tag": tag}}
    with open(os.path.join(out_dir, META), "w") as f:
        json.dump(meta, f, indent=2)


def load_tokenizer(local_dir: str, tokenizer_dir: str) -> tuple[Any, str | None]:
    """Eagle's tokenizer and processor chat template from ``model.tokenizer`` or the folder; N1.5
    releases ship neither."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    where = tokenizer_dir or local_dir
    names = ("tokenizer.json", "tokenizer_config.json") if tokenizer_dir else ("tokenizer.json",)
    if not any(os.path.isfile(os.path.join(where, n)) for n in names):
        raise FileNotFoundError(
            f"{FAMILY}: no tokenizer in {where!r} (GR00T N1.5 folders ship none): set model.tokenizer: DIR to a folder "
            f"holding Eagle 2.5's tokenizer (Qwen3's with <IMG_CONTEXT>)")
    if os.path.isfile(os.path.join(where, "tokenizer.json")):
        tok = PreTrainedTokenizerFast.from_pretrained(where)
    else:
        tok = AutoTokenizer.from_pretrained(where)  # vocab.json + merges.txt, as Eagle's folder holds them
    return tok, read_chat_template(where)


def load(local_dir: str, spec: Any, overrides: dict[str, Any], tokenizer_dir: str = "") -> Any:
    """A GR00T N1.5 folder -> ``Gr00tPolicy`` (weights, statistics of the chosen embodiment)."""
    from workers.policies.gr00t import SIZES, Gr00tOptions, Gr00tPolicy

    with open(os.path.join(local_dir, "config.json")) as f:
        config = json.load(f)
    if config.get("model_type") != MODEL_TYPE or "action_head_cfg" not in config:
        raise ValueError(f"{FAMILY}: {local_dir}/config.json is not a GR00T N1.5 config (model_type {MODEL_TYPE!r} with action_head_cfg)")
    saved, heads = read_rlvla3_files(local_dir, FAMILY)
    defaults = {"size": "3b", "chunk_size": config.get("action_horizon", 16),
                "num_steps": config["action_head_cfg"].get("num_inference_timesteps", 4)}
    opts = options_for(Gr00tOptions, defaults, saved, overrides)
    select = config.get("backbone_cfg", {}).get("select_layer")
    kept = SIZES[opts.size]["llm"]["num_hidden_layers"] if opts.size in SIZES else None
    if select is not None and kept is not None and select != kept:
        raise ValueError(f"{FAMILY}: the folder reads LM layer {select}; size {opts.size!r} keeps {kept} layers")
    tokenizer, template = load_tokenizer(local_dir, tokenizer_dir)
    policy = Gr00tPolicy(opts, spec, tokenizer=tokenizer, shape=head_shape_of(config), chat_template=template)
    sd = read_safetensors(local_dir, FAMILY)
    names = rename(sd, RELEASE_RULES)
    sd = {names[k]: v.to(policy.device) for k, v in sd.items()}
    sd.update({k: v.to(policy.device) for k, v in heads.items()})
    strict_load(policy, sd, FAMILY, RL_HEADS + (NORM, TIED))
    state, action = read_stats(local_dir, opts.embodiment, spec)
    policy.norm.set(state=state, action=action)
    return policy


def save(policy: Any, out_dir: str) -> None:
    """The release folder: config, weights under release names, metadata, tokenizer, rlvla3 side files."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    sd = export_state(policy, skip=RL_HEADS + (NORM, TIED))
    names = rename(sd, inverted(RELEASE_RULES))
    save_file({names[k]: v for k, v in sd.items()}, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(release_config(policy), f, indent=2)
    write_stats(policy, out_dir)
    policy.tokenizer.save_pretrained(out_dir)
    write_chat_template(out_dir, policy.prompt.template)
    write_rlvla3_files(policy, out_dir)
    log.info("release_saved", family=FAMILY, out=out_dir, tensors=len(sd), options=dataclasses.asdict(policy.opts)["size"])
