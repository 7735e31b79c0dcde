"""OpenVLA-OFT release folders, as ``OpenVLAForActionPrediction.save_pretrained`` writes them and
the OFT authors, SimpleVLA-RL and RLinf publish them.

* ``config.json``: prismatic's ``OpenVLAConfig`` (``vision_backbone_id: dinosiglip-vit-so-224px``,
  ``llm_backbone_id``, ``arch_specifier``, ``timm_model_ids``, ``image_sizes``, ``text_config`` (the
  Llama, vocab padded by ``pad_to_multiple_of``), ``n_action_bins``, ``norm_stats``).
* ``model.safetensors`` or shards + ``model.safetensors.index.json``: ``vision_backbone.*`` (timm),
  ``projector.fc1..3``, ``language_model.*`` - converted by :mod:`workers.release.prismatic_names`.
* ``*proprio_projector*checkpoint*.pt`` (``fc1``, ``fc2``) and ``*action_head*checkpoint*.pt``
  (``L1RegressionActionHead``: ``model.*``), DDP's ``module.`` prefix stripped, read with
  ``torch.load(weights_only=True)``: a pickle holding anything but tensors is refused.
* ``dataset_statistics.json`` (the same ``norm_stats``), ``preprocessor_config.json``, the tokenizer.

The architecture comes from the tensors' shapes and ``text_config``; the chunk length from the
platform the statistics name (OFT's constants: LIBERO 8, ALOHA 25, Bridge 5).

RLinf's exports hold its whole model: ``value_head.mlp.*`` (not read: its critic's shape is not
ours) and, from its ``official`` variant, ``proprio_projector.*`` (used when no ``.pt`` is there).
A folder of peft adapters without weights loads onto its base (:mod:`workers.release.sources`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import structlog
import torch

from workers.release import prismatic_names as names
from workers.release.common import (NORM, RL_HEADS, RLVLA3_FILE, TOKENIZER_FILE, export_state, load_tokenizer, options_for, read_rlvla3_files,
                                    read_safetensors, strict_load, write_rlvla3_files)
from workers.release.peft_lora import merge_peft_lora
from workers.release.sources import Sources, resolve

log = structlog.get_logger(__name__)

FAMILY = "openvla_oft"
STATS = "dataset_statistics.json"
PREPROCESSOR = "preprocessor_config.json"
PROPRIO = "proprio_projector--0_checkpoint.pt"
ACTION_HEAD = "action_head--0_checkpoint.pt"
CHUNK_BY_PLATFORM = {"libero": 8, "aloha": 25, "bridge": 5}
"""OFT's ``prismatic/vla/constants.py``: the action chunk each platform was trained with."""
LLAMA_DEFAULTS = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, rms_norm_eps=1e-6,
                      rope_theta=10000.0, max_position_embeddings=2048, hidden_act="silu", attention_bias=False)
"""transformers 4.40's ``LlamaConfig`` defaults: a release's ``text_config`` holds only what differs
from them (openvla-7b's: model_type, pad_token_id, torch_dtype, vocab_size), so they are part of the layout."""
_RELEASE_CONFIG = {
    "model_type": "openvla", "architectures": ["OpenVLAForActionPrediction"], "vision_backbone_id": "dinosiglip-vit-so-224px",
    "llm_backbone_id": "llama2-7b-pure", "arch_specifier": "no-align+fused-gelu-mlp", "use_fused_vision_backbone": True,
    "image_resize_strategy": "resize-naive", "timm_model_ids": ["vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224"],
    "timm_override_act_layers": [None, None], "llm_max_length": 2048, "pad_token_id": 32000, "output_projector_states": False,
}


def read_pt(path: str) -> dict[str, torch.Tensor]:
    """A component state dict: tensors only (``weights_only``), DDP prefix stripped."""
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # the unpickler names the global it refused
        why = next((ln.strip() for ln in str(exc).splitlines() if "global" in ln.lower()), str(exc).splitlines()[0])
        raise ValueError(f"{FAMILY}: {path} holds more than tensors; torch.load(weights_only=True) refused it: {why}") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"{FAMILY}: {path} is not a state dict of tensors")
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}


def _component(src: Sources, pattern: str) -> str | None:
    hits = src.glob(f"*{pattern}*checkpoint*.pt")
    if len(hits) > 1:
        raise ValueError(f"{FAMILY}: {os.path.dirname(hits[0])} has {len(hits)} {pattern} checkpoints, expected one: {hits}")
    return hits[0] if hits else None


def _norm_stats(src: Sources, config: dict[str, Any], key: str | None) -> tuple[str, dict[str, Any]]:
    """(dataset, statistics): ``dataset_statistics.json`` when present (OFT's ``_load_dataset_stats``
    puts it over the config's), else config.json's ``norm_stats``."""
    stats = config.get("norm_stats")
    local_dir = src.dir_of(STATS)
    if os.path.isfile(os.path.join(local_dir, STATS)):
        with open(os.path.join(local_dir, STATS)) as f:
            stats = json.load(f)
    if not stats:
        raise FileNotFoundError(f"{FAMILY}: {local_dir!r} has no statistics: the release keeps them in config.json's "
                                f"'norm_stats' and in {STATS} beside it")
    if key is None and len(stats) > 1:
        raise ValueError(f"{FAMILY}: the release has statistics for {sorted(stats)}; pick one with model.options.unnorm_key")
    key = key or next(iter(stats))
    if key not in stats:
        raise ValueError(f"{FAMILY}: unnorm_key {key!r} not in the release's statistics {sorted(stats)}")
    return key, stats[key]


def _affine(entry: dict[str, Any], inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """BOUNDS_Q99 as OFT applies it (``2 (x - q01) / (q99 - q01 + 1e-8) - 1``); dims with ``mask:
    false`` pass through."""
    lo, hi = (torch.as_tensor(np.asarray(entry[k], dtype=np.float64)) for k in ("q01", "q99"))
    half = (hi - lo + 1e-8) / 2
    mask = torch.as_tensor(np.asarray(entry.get("mask", [True] * len(lo)), dtype=bool))
    shift, scale = torch.where(mask, lo + half, 0.0), torch.where(mask, half, 1.0)
    return shift.float(), scale.float()


def infer_arch(config: dict[str, Any], sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The policy's architecture from a release's tensors (towers) and ``text_config`` (Llama)."""
    def tower(prefix: str) -> dict[str, Any]:
        pos, patch = sd[prefix + "pos_embed"], sd[prefix + "patch_embed.proj.weight"]
        side = int(round(pos.shape[1] ** 0.5))
        return dict(hidden_size=pos.shape[-1], intermediate_size=sd[prefix + "blocks.0.mlp.fc1.weight"].shape[0],
                    num_hidden_layers=names.blocks(sd, prefix), image_size=side * patch.shape[-1], patch_size=patch.shape[-1])

    for key in (names.DINO + "pos_embed", names.SIGLIP + "pos_embed", "language_model.model.embed_tokens.weight"):
        if key not in sd:
            raise ValueError(f"{FAMILY}: the weights have no {key}: not a fused DINOv2+SigLIP prismatic release")
    text = config.get("text_config") or {}
    llm = {k: text.get(k, v) if text.get(k) is not None else v for k, v in LLAMA_DEFAULTS.items()}
    llm["vocab_size"], llm["hidden_size"] = sd["language_model.model.embed_tokens.weight"].shape
    llm["num_key_value_heads"] = text.get("num_key_value_heads") or llm["num_attention_heads"]
    return {"dino": tower(names.DINO), "siglip": tower(names.SIGLIP), "llm": llm, "vocab_pad": int(config.get("pad_to_multiple_of", 64))}


def _preprocess(local_dir: str) -> dict[str, Any] | None:
    path = os.path.join(local_dir, PREPROCESSOR)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        pre = json.load(f)
    strategy = pre.get("image_resize_strategy", "resize-naive")
    interp = set(pre.get("interpolations") or ["bicubic"])
    if strategy != "resize-naive" or interp != {"bicubic"}:
        raise ValueError(f"{FAMILY}: {path}: only resize-naive bicubic preprocessing is supported, not {strategy} {sorted(interp)}")
    return {"means": [tuple(m) for m in pre["means"]], "stds": [tuple(s) for s in pre["stds"]]}


def _rlinf_extras(release: dict[str, torch.Tensor], has_proprio_pt: bool) -> dict[str, torch.Tensor]:
    """RLinf's exports save its whole ``OpenVLAOFTForRLActionPrediction`` state dict
    (``convert_pt_to_hf``), so beside the prismatic tensors a folder may hold ``value_head.mlp.*``
    and (its ``official`` variant) ``proprio_projector.fc1/fc2.*``. Removes both from ``release``;
    returns the projector's tensors in the ``.pt`` file's names when no ``.pt`` file is there
    (RLinf loads the ``.pt`` over them). The value head is not read (see :func:`load`)."""
    value = {k: tuple(release.pop(k).shape) for k in [k for k in release if k.startswith("value_head.")]}
    if value:
        log.info("release_value_head_not_loaded", family=FAMILY, tensors=value,
                 why="RLinf's critic (hidden-512-128-n MLP) does not fit rlvla3's value_head; a fresh one is used")
    proprio = {k[len("proprio_projector."):]: release.pop(k) for k in [k for k in release if k.startswith("proprio_projector.")]}
    return {} if has_proprio_pt else proprio


def load(local_dir: str, spec: Any, overrides: dict[str, Any], base: str = "") -> Any:
    """A prismatic OpenVLA-OFT folder -> ``OpenVLAOFTPolicy`` (weights, side files, statistics);
    ``base`` (``model.base``) is the release a folder of adapters without weights was trained on."""
    from workers.policies.openvla_oft import OpenVLAOFTPolicy

    src = resolve(local_dir, base, FAMILY)
    with open(os.path.join(src.dir_of("config.json"), "config.json")) as f:
        config = json.load(f)
    own_opts, heads = read_rlvla3_files(src.dir_of(RLVLA3_FILE), FAMILY)
    release = read_safetensors(src.weights, FAMILY)
    merged = merge_peft_lora(src.adapter, release, FAMILY) if src.adapter else 0
    proprio, head = _component(src, "proprio_projector"), _component(src, "action_head")
    proprio_sd = _rlinf_extras(release, proprio is not None)
    arch = infer_arch(config, release)
    sd, unmapped = names.to_ours(release)
    if unmapped:
        raise ValueError(f"{FAMILY}: {local_dir!r} read as a prismatic OpenVLA release: {len(unmapped)} tensors have no "
                         f"counterpart, first: {', '.join(unmapped[:10])}")
    derived: dict[str, Any] = {"n_bins": int(config.get("n_action_bins", 256)), "max_text_len": int(config.get("llm_max_length", 2048))}
    if proprio:
        proprio_sd = read_pt(proprio)
    derived["proprio"] = bool(proprio_sd)
    sd.update({f"proprio_proj.{'0' if k.startswith('fc1.') else '2'}.{k.split('.', 1)[1]}" if k.startswith(("fc1.", "fc2.")) else k: v
               for k, v in proprio_sd.items()})
    if head:
        derived["action_head"] = "l1"
        sd.update({("l1_head." + k[len("model."):]) if k.startswith("model.") else k: v for k, v in read_pt(head).items()})
    key, stats = _norm_stats(src, config, {**own_opts, **overrides}.get("unnorm_key"))
    platform = next((p for p in CHUNK_BY_PLATFORM if p in key.lower()), None)
    if platform:
        derived["chunk_size"] = CHUNK_BY_PLATFORM[platform]
    opts = options_for(OpenVLAOFTPolicy.OPTIONS, derived, own_opts, overrides, {"unnorm_key": key})
    if opts.action_head != "l1" and head:
        log.info("release_l1_head_unused", family=FAMILY, file=os.path.basename(head), action_head=opts.action_head)
        sd = {k: v for k, v in sd.items() if not k.startswith("l1_head.")}
    if not src.has(TOKENIZER_FILE):
        raise FileNotFoundError(f"{FAMILY}: {local_dir!r} has no {TOKENIZER_FILE}; the release keeps it beside config.json "
                                "(with tokenizer_config.json and special_tokens_map.json)")
    policy = OpenVLAOFTPolicy(opts, spec, tokenizer=load_tokenizer(src.dir_of(TOKENIZER_FILE), FAMILY), arch=arch,
                              preprocess=_preprocess(src.dir_of(PREPROCESSOR)))
    sd.update(heads)
    strict_load(policy, {k: v.to(policy.device) for k, v in sd.items()}, f"{FAMILY} (prismatic OpenVLA release at {local_dir})",
                RL_HEADS + (NORM,) + names.OURS_ONLY)
    action = _affine(stats["action"], True)
    state = _affine(stats["proprio"], False) if "proprio" in stats else None
    policy.norm.set(state=state, action=action)
    log.info("release_loaded", family=FAMILY, dataset=key, chunk=opts.chunk_size, action_head=opts.action_head, proprio=opts.proprio,
             lora_merged=merged, base=src.weights if src.weights != local_dir else None)
    return policy


def save(policy: Any, out_dir: str) -> None:
    """The release folder: prismatic config and weights, side ``.pt`` files, statistics, tokenizer,
    preprocessor settings, and rlvla3's options and RL heads."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    sd = export_state(policy, skip=RL_HEADS + (NORM, "proprio_proj.", "l1_head.") + names.OURS_ONLY)
    save_file({k: v.contiguous() for k, v in names.to_release(sd).items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    full = policy.state_dict()
    if policy.proprio_proj is not None:
        torch.save({k.replace("proprio_proj.0.", "fc1.").replace("proprio_proj.2.", "fc2."): v.detach().cpu().clone()
                    for k, v in full.items() if k.startswith("proprio_proj.")}, os.path.join(out_dir, PROPRIO))
    if policy.l1_head is not None:
        torch.save({"model." + k[len("l1_head."):]: v.detach().cpu().clone() for k, v in full.items() if k.startswith("l1_head.")},
                   os.path.join(out_dir, ACTION_HEAD))
    (s_shift, s_scale), (a_shift, a_scale) = policy.norm.affines()
    # q99 - q01 + 1e-8 = 2 scale and q01 + scale = shift (in float64): the statistics read back bit for bit.
    bounds = lambda shift, scale: {"q01": (shift.double() - scale.double()).tolist(),  # noqa: E731
                                   "q99": (shift.double() + scale.double() - 1e-8).tolist()}
    stats = {policy.opts.unnorm_key or "rlvla3": {"action": dict(bounds(a_shift, a_scale), mask=[True] * a_shift.numel()),
                                                  "proprio": bounds(s_shift, s_scale)}}
    arch = policy.arch
    text = dict(arch["llm"], model_type="llama", pad_token_id=_RELEASE_CONFIG["pad_token_id"], tie_word_embeddings=False)
    config = dict(_RELEASE_CONFIG, text_config=text, image_sizes=[arch["dino"]["image_size"], arch["siglip"]["image_size"]],
                  pad_to_multiple_of=arch["vocab_pad"], n_action_bins=policy.opts.n_bins, norm_stats=stats)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, STATS), "w") as f:
        json.dump(stats, f, indent=2)
    with open(os.path.join(out_dir, PREPROCESSOR), "w") as f:
        json.dump({"image_resize_strategy": "resize-naive", "interpolations": ["bicubic", "bicubic"],
                   "input_sizes": [[3, arch["dino"]["image_size"], arch["dino"]["image_size"]]] * 2,
                   "means": [list(m) for m in policy.preprocess["means"]], "stds": [list(s) for s in policy.preprocess["stds"]],
                   "use_fused_vision_backbone": True, "image_processor_type": "PrismaticImageProcessor"}, f, indent=2)
    policy.tokenizer.save_pretrained(out_dir)
    write_rlvla3_files(policy, out_dir)
