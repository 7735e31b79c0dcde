"""LeRobot's pi0 / pi0.5 layout (``lerobot/pi0``, ``lerobot/pi05_base``), read and written.

Verified against the LeRobot 0.4.4 wheel's source (``policies/pi0|pi05/modeling_*.py``,
``configuration_*.py``, ``processor_*.py``, ``processor/pipeline.py``,
``processor/normalize_processor.py``):

* ``config.json`` - the draccus-serialised ``PI0Config`` / ``PI05Config`` (``type: pi0|pi05``);
  the architecture is named by ``paligemma_variant`` / ``action_expert_variant``, which fix head
  counts; layer counts and widths are read off the tensors (so tiny test releases load too).
* ``model.safetensors`` - ``PI0Policy.state_dict()``: ``model.`` + ``PI0Pytorch`` names
  (``paligemma_with_expert.paligemma`` is transformers' PaliGemmaForConditionalGeneration,
  ``gemma_expert`` a GemmaForCausalLM without token table; LeRobot also accepts them unprefixed).
* ``policy_preprocessor.json`` / ``policy_postprocessor.json`` with the normaliser steps' stats in
  ``policy_{pre,post}processor_step_N_{normalizer,unnormalizer}_processor.safetensors``
  (flat ``"<feature>.<stat>"`` keys, e.g. ``observation.state.mean``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from workers.release.common import (
    NORM,
    RL_HEADS,
    export_state,
    inverted,
    load_tokenizer,
    options_for,
    read_rlvla3_files,
    read_safetensors,
    rename,
    strict_load,
    write_rlvla3_files,
)
from workers.release.normalize import affine_from_stats, mean_std_stats

STATE_KEY, ACTION_KEY = "observation.state", "action"
TOKENIZER_NAME = "google/paligemma-3b-pt-224"
PRE, POST = "policy_preprocessor", "policy_postprocessor"

# openpi's Gemma variants (LeRobot get_gemma_config): heads are fixed by the variant.
GEMMA_VARIANTS = {
    "gemma_300m": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=18, num_attention_heads=8,
                       num_key_value_heads=1, head_dim=256),
    "gemma_2b": dict(hidden_size=2048, intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8,
                     num_key_value_heads=1, head_dim=256),
}
SIGLIP_HEADS = 16  # PaliGemma's SigLIP So400m tower, which LeRobot does not override
PALIGEMMA_VOCAB = 257152

_VLM = "paligemma_with_expert.paligemma."
_EXPERT = "paligemma_with_expert.gemma_expert."


def _paligemma_rules(vlm: str) -> list[tuple[str, str]]:
    """LeRobot's PaliGemma names -> ours under ``vlm`` (the same tower in both families)."""
    return [
        (_VLM + "model.vision_tower.vision_model.", vlm + "vision_tower."),
        (_VLM + "model.", vlm),
        (_VLM + "lm_head.", vlm + "language_model.embed_tokens."),  # tied to the token table
    ]


# LeRobot names (without the policy's ``model.`` prefix) -> ours. One table per family.
PI0_RULES = _paligemma_rules("pi0.model.vlm.") + [
    (_EXPERT + "model.", "pi0.model.dit."),
    (_EXPERT + "lm_head.", "pi0.model.dit.embed_tokens."),
    ("state_proj.", "pi0.embed_action_time.state_proj."),
    ("action_in_proj.", "pi0.embed_action_time.action_in_proj."),
    ("action_time_mlp_in.", "pi0.embed_action_time.action_time_mlp_in."),
    ("action_time_mlp_out.", "pi0.embed_action_time.action_time_mlp_out."),
    ("time_mlp_in.", "pi0.embed_action_time.action_time_mlp_in."),  # openpi's pi0 name (LeRobot renames it)
    ("time_mlp_out.", "pi0.embed_action_time.action_time_mlp_out."),
    ("action_out_proj.", "pi0.action_out_proj."),
]
PI05_RULES = _paligemma_rules("vlm.") + [
    (_EXPERT + "model.", "expert."),
    ("action_in_proj.", "action_in_proj."),
    ("action_out_proj.", "action_out_proj."),
    ("time_mlp_in.", "time_mlp_in."),
    ("time_mlp_out.", "time_mlp_out."),
]
RULES = {"pi0": PI0_RULES, "pi05": PI05_RULES}
UNMAPPED = {"pi05": (_EXPERT + "lm_head.",)}
"""Release tensors with no counterpart here: pi0.5's expert output table, which LeRobot never
reads (our expert reads embeddings only and keeps an 8-row stub token table, not exported)."""
_VLM_HEAD, _VLM_TABLE = _VLM + "lm_head.weight", _VLM + "model.language_model.embed_tokens.weight"


def _unread(sd: dict[str, torch.Tensor], family: str) -> tuple[str, ...]:
    """Release tensors LeRobot never reads: the family's ``UNMAPPED`` and, where the folder also
    holds PaliGemma's token table (LeRobot >= 0.5 writes both, untied), PaliGemma's ``lm_head``;
    without the table the head is the table (LeRobot copies it there)."""
    return UNMAPPED.get(family, ()) + ((_VLM_HEAD,) if _VLM_HEAD in sd and _VLM_TABLE in sd else ())


def _check_shapes(policy: Any, sd: dict[str, torch.Tensor], names: dict[str, str], family: str, local_dir: str) -> None:
    """Every release tensor's shape against ours, the mismatches named in the release's spelling."""
    own = policy.state_dict()
    bad = [f"{k} {tuple(sd[k].shape)} vs {tuple(own[n].shape)}" for k, n in names.items() if n in own and own[n].shape != sd[k].shape]
    if bad:
        raise ValueError(f"{family}: {local_dir!r} read as LeRobot's {family} layout (lerobot/{'pi0' if family == 'pi0' else 'pi05_base'}): "
                         f"{len(bad)} tensor(s) do not match the model built from its config.json: {'; '.join(bad[:10])}")


OURS_NOT_EXPORTED = {"pi05": ("expert.embed_tokens.",)}


def _not_in_release(family: str) -> tuple[str, ...]:
    """Our parameters a LeRobot folder does not hold: the RL heads, the normalisation buffers and
    the family's own (``OURS_NOT_EXPORTED``); a save skips them and a load starts them fresh."""
    return RL_HEADS + (NORM,) + OURS_NOT_EXPORTED.get(family, ())


def is_lerobot_pi(local_dir: str) -> bool:
    try:
        with open(os.path.join(local_dir, "config.json")) as f:
            return json.load(f).get("type") in RULES
    except (OSError, ValueError):
        return False


def _strip_policy_prefix(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len("model."):] if k.startswith("model.") else k: v for k, v in sd.items()}


# ---------------------------------------------------------------------------------------------
# Architecture from config + tensors
# ---------------------------------------------------------------------------------------------


def _layers(sd: dict[str, torch.Tensor], prefix: str) -> int:
    idx = {int(k[len(prefix):].split(".")[0]) for k in sd if k.startswith(prefix)}
    return max(idx) + 1 if idx else 0


def _gemma(sd: dict[str, torch.Tensor], prefix: str, variant: str) -> dict[str, Any]:
    """A Gemma config: heads from the variant, every size from the tensors."""
    if variant not in GEMMA_VARIANTS:
        raise ValueError(f"unknown Gemma variant {variant!r}; LeRobot knows {sorted(GEMMA_VARIANTS)}")
    g = dict(GEMMA_VARIANTS[variant])
    lay = prefix + "layers.0."
    kv = g["num_key_value_heads"]
    g.update(
        hidden_size=sd[lay + "input_layernorm.weight" if lay + "input_layernorm.weight" in sd else lay + "self_attn.q_proj.weight"].shape[-1],
        intermediate_size=sd[lay + "mlp.gate_proj.weight"].shape[0],
        num_hidden_layers=_layers(sd, prefix + "layers."),
        head_dim=sd[lay + "self_attn.k_proj.weight"].shape[0] // kv,
    )
    g["num_attention_heads"] = sd[lay + "self_attn.q_proj.weight"].shape[0] // g["head_dim"]
    return g


def infer_arch(config: dict[str, Any], sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Our size-preset dict (see ``workers.policies.pi0.SIZES``) for a LeRobot release."""
    vis = _VLM + "model.vision_tower.vision_model."
    patch = sd[vis + "embeddings.patch_embedding.weight"]
    n_pos = sd[vis + "embeddings.position_embedding.weight"].shape[0]
    p = patch.shape[-1]
    vocab = sd[_VLM + "lm_head.weight"].shape[0] if _VLM + "lm_head.weight" in sd else sd[_VLM + "model.language_model.embed_tokens.weight"].shape[0]
    text = _gemma(sd, _VLM + "model.language_model.", config.get("paligemma_variant", "gemma_2b"))
    expert = _gemma(sd, _EXPERT + "model.", config.get("action_expert_variant", "gemma_300m"))
    if _EXPERT + "lm_head.weight" in sd:
        expert["vocab_size"] = sd[_EXPERT + "lm_head.weight"].shape[0]
    for key in ("head_dim", "num_key_value_heads"):  # one attention over both streams' keys and values
        if text[key] != expert[key]:
            raise ValueError(f"the VLM ({_VLM}model.language_model.layers.*.self_attn) and the action expert "
                             f"({_EXPERT}model.layers.*.self_attn) attend jointly, so their {key} must be equal: "
                             f"{text[key]} vs {expert[key]} (k_proj.weight {tuple(sd[_VLM + 'model.language_model.layers.0.self_attn.k_proj.weight'].shape)} "
                             f"vs {tuple(sd[_EXPERT + 'model.layers.0.self_attn.k_proj.weight'].shape)})")
    return {
        "image_size": int(round(n_pos ** 0.5)) * p,
        "patch_size": p,
        "vision": dict(hidden_size=patch.shape[0], intermediate_size=sd[vis + "encoder.layers.0.mlp.fc1.weight"].shape[0],
                       num_hidden_layers=_layers(sd, vis + "encoder.layers."), num_attention_heads=SIGLIP_HEADS),
        "text": dict(text, vocab_size=vocab),
        "expert": expert,
        "image_token_id": PALIGEMMA_VOCAB if vocab == PALIGEMMA_VOCAB else vocab - 1,
        "pad_dims": True,
        "max_state_dim": int(config.get("max_state_dim", 32)),
        "max_action_dim": int(config.get("max_action_dim", 32)),
    }


def arch_variants(arch: dict[str, Any]) -> tuple[str, str]:
    """LeRobot variant names for our VLM and expert; an error when its fixed heads cannot say ours."""
    for part in ("text", "expert"):
        g = arch[part]
        if (g["num_attention_heads"], g["num_key_value_heads"]) != (8, 1):
            raise ValueError(f"LeRobot's config cannot describe {part} heads {g['num_attention_heads']}/{g['num_key_value_heads']}: "
                             "its Gemma variants fix 8 heads and 1 KV head (use size 3b or tiny_release)")
    if arch["vision"]["num_attention_heads"] != SIGLIP_HEADS:
        raise ValueError(f"LeRobot's config fixes SigLIP at {SIGLIP_HEADS} heads; this model has {arch['vision']['num_attention_heads']}")
    text = "gemma_300m" if arch["text"]["hidden_size"] == 1024 else "gemma_2b"
    expert = "gemma_2b" if arch["expert"]["hidden_size"] == 2048 else "gemma_300m"
    return text, expert


# ---------------------------------------------------------------------------------------------
# Normalisation statistics (processor files)
# ---------------------------------------------------------------------------------------------


def _step(local_dir: str, pipeline: str, registry: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    from safetensors.torch import load_file

    path = os.path.join(local_dir, f"{pipeline}.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        steps = json.load(f).get("steps", [])
    for s in steps:
        if s.get("registry_name") == registry:
            state = load_file(os.path.join(local_dir, s["state_file"])) if s.get("state_file") else {}
            return s.get("config", {}), state
    return None


def _affine(step: tuple[dict[str, Any], dict[str, torch.Tensor]] | None, key: str, inverse: bool):
    if step is None:
        return None
    cfg, state = step
    feature = cfg.get("features", {}).get(key)
    prefix = key + "."
    stats = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if feature is None or not stats:
        return None
    mode = cfg.get("norm_map", {}).get(feature["type"], "IDENTITY")
    dim = next(iter(stats.values())).numel()
    return affine_from_stats(mode, stats, dim, float(cfg.get("eps", 1e-8)), inverse)


def read_stats(local_dir: str) -> tuple[Any, Any]:
    """(state affine, action affine) from the processor files; None where a side has none."""
    return (_affine(_step(local_dir, PRE, "normalizer_processor"), STATE_KEY, inverse=False),
            _affine(_step(local_dir, POST, "unnormalizer_processor"), ACTION_KEY, inverse=True))


def _features(policy: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = policy.spec
    inputs = {f"observation.images.{c}": {"type": "VISUAL", "shape": [3, *spec.cameras[c]]} for c in policy.cameras}
    inputs[STATE_KEY] = {"type": "STATE", "shape": [spec.state_dim]}
    return inputs, {ACTION_KEY: {"type": "ACTION", "shape": [spec.action_dim]}}


NORM_MAP = {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}


def write_processors(policy: Any, out_dir: str, new_line_step: str | None, max_length: int) -> None:
    """The two processor pipelines as LeRobot saves them, stats as MEAN_STD with ``eps = 0`` (exact)."""
    from safetensors.torch import save_file

    (s_aff, a_aff) = policy.norm.affines()
    inputs, outputs = _features(policy)
    norm_cfg = lambda feats: {"eps": 0.0, "features": feats, "norm_map": NORM_MAP}  # noqa: E731
    pre_state = {f"{STATE_KEY}.{k}": v for k, v in mean_std_stats(s_aff).items()}
    pre_state.update({f"{ACTION_KEY}.{k}": v for k, v in mean_std_stats(a_aff).items()})
    post_state = {f"{ACTION_KEY}.{k}": v for k, v in mean_std_stats(a_aff).items()}
    tok = {"registry_name": "tokenizer_processor", "config": {"max_length": max_length, "task_key": "task",
           "padding_side": "right", "padding": "max_length", "truncation": True, "tokenizer_name": TOKENIZER_NAME}}
    pre = [{"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
           {"registry_name": "to_batch_processor", "config": {}}]
    norm_step = {"registry_name": "normalizer_processor", "config": norm_cfg({**inputs, **outputs})}
    if new_line_step:  # pi0: newline, tokenizer, device, then normaliser
        pre += [{"registry_name": new_line_step, "config": {}}, tok, {"registry_name": "device_processor", "config": {"device": "cpu"}}, norm_step]
    else:  # pi0.5: normaliser first (the state is discretised after it)
        pre += [norm_step, {"registry_name": "pi05_prepare_state_tokenizer_processor_step", "config": {}}, tok,
                {"registry_name": "device_processor", "config": {"device": "cpu"}}]
    post = [{"registry_name": "unnormalizer_processor", "config": norm_cfg(outputs)},
            {"registry_name": "device_processor", "config": {"device": "cpu"}}]
    for name, steps, registry, state in ((PRE, pre, "normalizer_processor", pre_state), (POST, post, "unnormalizer_processor", post_state)):
        i = next(j for j, s in enumerate(steps) if s["registry_name"] == registry)
        steps[i]["state_file"] = f"{name}_step_{i}_{registry}.safetensors"
        save_file(state, os.path.join(out_dir, steps[i]["state_file"]))
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump({"name": name, "steps": steps}, f, indent=2)


# ---------------------------------------------------------------------------------------------
# Load / save
# ---------------------------------------------------------------------------------------------


def load(local_dir: str, family: str, spec: Any, overrides: dict[str, Any]) -> Any:
    """A LeRobot pi0 / pi0.5 folder -> our policy (weights, normalisation, RL heads if exported)."""
    with open(os.path.join(local_dir, "config.json")) as f:
        config = json.load(f)
    if config.get("type") != family:
        raise ValueError(f"{family}: {local_dir}/config.json is a LeRobot {config.get('type')!r} config")
    if config.get("use_relative_actions"):
        raise ValueError(f"{family}: {local_dir}/config.json sets use_relative_actions (actions relative to the state), "
                         "which rlvla3 does not apply; its actions would be wrong")
    sd = _strip_policy_prefix(read_safetensors(local_dir, family))
    arch = infer_arch(config, sd)
    saved_opts, heads = read_rlvla3_files(local_dir, family)
    release = {"chunk_size": int(config.get("chunk_size", 50)), "num_steps": int(config.get("num_inference_steps", 10))}
    if "tokenizer_max_length" in config:
        release["max_text_len"] = int(config["tokenizer_max_length"])
    tokenizer = load_tokenizer(local_dir, family, TOKENIZER_NAME)
    if family == "pi0":
        from workers.policies.pi0 import Pi0Options, Pi0Policy, build_pi0_config

        opts = options_for(Pi0Options, release, saved_opts, overrides)
        policy = Pi0Policy(opts, spec, pi0_config=build_pi0_config(arch, spec, opts.chunk_size, opts.num_steps), tokenizer=tokenizer)
    else:
        from workers.policies.pi05 import Pi05Options, Pi05Policy

        opts = options_for(Pi05Options, release, saved_opts, overrides)
        policy = Pi05Policy(opts, spec, tokenizer=tokenizer, arch=arch)
    skip = _unread(sd, family)
    names = rename([k for k in sd if not k.startswith(skip)], RULES[family])
    _check_shapes(policy, sd, names, family, local_dir)
    mapped = {names[k]: sd[k].to(policy.device) for k in names}
    mapped.update(heads)
    strict_load(policy, mapped, family, _not_in_release(family))
    state, action = read_stats(local_dir)
    policy.norm.set(state=state, action=action)
    return policy


def save(policy: Any, out_dir: str) -> None:
    """Write ``policy`` as LeRobot saves its policy, plus tokenizer and rlvla3 side files."""
    from safetensors.torch import save_file

    family = policy.family
    arch = policy.arch
    paligemma, expert = arch_variants(arch)
    os.makedirs(out_dir, exist_ok=True)
    ours = export_state(policy, skip=_not_in_release(family))
    back = inverted([r for r in RULES[family] if not r[0].startswith("time_mlp") or family == "pi05"])
    names = rename(ours, back)
    released = {"model." + names[k]: v for k, v in ours.items()}
    if family == "pi05":  # LeRobot's strict load wants the expert's output table, which it never reads: zeros
        table = ours["vlm.language_model.embed_tokens.weight"]
        released["model." + _EXPERT + "lm_head.weight"] = table.new_zeros(table.shape[0], arch["expert"]["hidden_size"])
    save_file(released, os.path.join(out_dir, "model.safetensors"))
    inputs, outputs = _features(policy)
    config = {
        "type": family, "n_obs_steps": 1, "input_features": inputs, "output_features": outputs, "device": "cpu",
        "use_amp": False, "push_to_hub": False, "repo_id": None, "private": None, "tags": None, "license": None,
        "pretrained_path": None, "paligemma_variant": paligemma, "action_expert_variant": expert, "dtype": "float32",
        "chunk_size": policy.chunk_size, "n_action_steps": policy.chunk_size,
        "max_state_dim": arch["max_state_dim"], "max_action_dim": arch["max_action_dim"],
        "num_inference_steps": policy.opts.num_steps, "image_resolution": [arch["image_size"], arch["image_size"]],
        "empty_cameras": 0, "normalization_mapping": NORM_MAP, "tokenizer_max_length": policy.opts.max_text_len,
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_processors(policy, out_dir, "pi0_new_line_processor" if family == "pi0" else None, policy.opts.max_text_len)
    policy.tokenizer.save_pretrained(out_dir)
    write_rlvla3_files(policy, out_dir)
