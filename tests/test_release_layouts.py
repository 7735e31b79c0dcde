"""Released checkpoints in: each published layout, written here at tiny size with its published
key names, config fields and normalisation files, loads into the family's policy; every release
tensor lands, and the release's statistics normalise the state in and the actions out.

The LeRobot trees are built the way LeRobot 0.4.4 builds them (``PaliGemmaWithExpertModel``:
transformers' PaliGemmaForConditionalGeneration + a GemmaForCausalLM without token table, the
projections beside them). LeRobot pins transformers < 5, whose SigLIP tower sits under
``vision_tower.vision_model.`` (the name LeRobot's own code spells); transformers 5 dropped that
level, so the tree's vision keys are renamed to the pinned spelling here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_policies import SPEC, act, build, make_obs  # noqa: E402

from workers.release.layouts import load_release, save_release  # noqa: E402
from workers.release.lerobot_pi import GEMMA_VARIANTS  # noqa: E402

TINY_GEMMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1, head_dim=16)
TINY_EXPERT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1, head_dim=16)


def lerobot_tree(text: dict, expert: dict, vision: dict, image_size: int, patch: int, vocab: int, max_dim: int, pi05: bool):
    """``PI0Pytorch`` / ``PI05Pytorch``'s parameters, on the meta device when sizes are real."""
    from torch import nn
    from transformers import CONFIG_MAPPING, PaliGemmaForConditionalGeneration, GemmaForCausalLM

    vlm_cfg = CONFIG_MAPPING["paligemma"]()
    vlm_cfg.text_config.update(dict(text, vocab_size=vocab, hidden_activation="gelu_pytorch_tanh"))
    vlm_cfg.vision_config.update(dict(vision, image_size=image_size, patch_size=patch, projection_dim=text["hidden_size"]))
    vlm_cfg.projection_dim = text["hidden_size"]
    vlm_cfg.text_config.projection_dim = text["hidden_size"]
    root = nn.Module()
    root.paligemma = PaliGemmaForConditionalGeneration(vlm_cfg)
    root.gemma_expert = GemmaForCausalLM(CONFIG_MAPPING["gemma"](**expert, vocab_size=vocab))
    root.gemma_expert.model.embed_tokens = None
    sd = {f"paligemma_with_expert.{k}": v for k, v in root.state_dict().items()}
    sd = {k.replace("paligemma.model.vision_tower.", "paligemma.model.vision_tower.vision_model."): v for k, v in sd.items()}
    del sd["paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"]  # tied: the hub keeps lm_head only
    w, dev = expert["hidden_size"], next(iter(sd.values())).device
    lin = lambda i, o: {"weight": torch.randn(o, i, device=dev) * 0.02, "bias": torch.randn(o, device=dev) * 0.02}  # noqa: E731
    heads = {"action_in_proj": lin(max_dim, w), "action_out_proj": lin(w, max_dim)}
    if pi05:
        heads.update(time_mlp_in=lin(w, w), time_mlp_out=lin(w, w))
        e = "paligemma_with_expert.gemma_expert.model."
        for k in [k for k in sd if k.startswith(e) and ("layernorm" in k or k == e + "norm.weight")]:
            del sd[k]
            for p, t in lin(w, 3 * w).items():  # adaptive RMSNorm: weight -> dense (scale, shift, gate)
                sd[k.replace(".weight", f".dense.{p}")] = t
    else:
        heads.update(state_proj=lin(max_dim, w), action_time_mlp_in=lin(2 * w, w), action_time_mlp_out=lin(w, w))
    sd.update({f"{n}.{p}": t for n, d in heads.items() for p, t in d.items()})
    return {f"model.{k}": v for k, v in sd.items()}  # PI0Policy.state_dict(): the policy wraps its model as .model


STATE_MEAN, STATE_STD = np.linspace(-0.5, 0.5, SPEC.state_dim), np.linspace(0.5, 2.0, SPEC.state_dim)
ACT_MEAN, ACT_STD = np.linspace(0.1, 0.7, SPEC.action_dim), np.linspace(0.25, 1.5, SPEC.action_dim)


def write_lerobot_release(d: Path, family: str) -> dict[str, torch.Tensor]:
    """A tiny lerobot/pi0 or lerobot/pi05_base folder; returns the tensors written."""
    from safetensors.torch import save_file

    from workers.policies.vla_common import char_tokenizer

    torch.manual_seed(1)
    sd = lerobot_tree(TINY_GEMMA, TINY_EXPERT, dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=16),
                      32, 8, 128, 32, family == "pi05")
    sd = {k: v.contiguous() for k, v in sd.items()}
    d.mkdir()
    save_file(sd, d / "model.safetensors")
    cams = {f"observation.images.{c}": {"type": "VISUAL", "shape": [3, *hw]} for c, hw in SPEC.cameras.items()}
    feats_in = {**cams, "observation.state": {"type": "STATE", "shape": [SPEC.state_dim]}}
    feats_out = {"action": {"type": "ACTION", "shape": [SPEC.action_dim]}}
    norm_map = {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}
    config = {"type": family, "n_obs_steps": 1, "input_features": feats_in, "output_features": feats_out, "device": "cpu",
              "use_amp": False, "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m", "dtype": "float32",
              "chunk_size": 5, "n_action_steps": 5, "max_state_dim": 32, "max_action_dim": 32, "num_inference_steps": 3,
              "image_resolution": [32, 32], "empty_cameras": 0, "normalization_mapping": norm_map, "tokenizer_max_length": 48}
    (d / "config.json").write_text(json.dumps(config))
    stats = {"observation.state.mean": STATE_MEAN, "observation.state.std": STATE_STD, "action.mean": ACT_MEAN, "action.std": ACT_STD}
    stats = {k: torch.tensor(v, dtype=torch.float32) for k, v in stats.items()}
    norm = lambda feats: {"eps": 1e-8, "features": feats, "norm_map": norm_map}  # noqa: E731
    save_file(stats, d / "policy_preprocessor_step_5_normalizer_processor.safetensors")
    save_file({k: v for k, v in stats.items() if k.startswith("action.")}, d / "policy_postprocessor_step_0_unnormalizer_processor.safetensors")
    pre = [{"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
           {"registry_name": "to_batch_processor", "config": {}}, {"registry_name": "pi0_new_line_processor", "config": {}},
           {"registry_name": "tokenizer_processor", "config": {"tokenizer_name": "google/paligemma-3b-pt-224", "max_length": 48}},
           {"registry_name": "device_processor", "config": {"device": "cpu"}},
           {"registry_name": "normalizer_processor", "config": norm({**feats_in, **feats_out}),
            "state_file": "policy_preprocessor_step_5_normalizer_processor.safetensors"}]
    post = [{"registry_name": "unnormalizer_processor", "config": norm(feats_out),
             "state_file": "policy_postprocessor_step_0_unnormalizer_processor.safetensors"},
            {"registry_name": "device_processor", "config": {"device": "cpu"}}]
    (d / "policy_preprocessor.json").write_text(json.dumps({"name": "policy_preprocessor", "steps": pre}))
    (d / "policy_postprocessor.json").write_text(json.dumps({"name": "policy_postprocessor", "steps": post}))
    char_tokenizer().save_pretrained(str(d))  # LeRobot names PaliGemma's tokenizer; a local copy goes beside it
    return sd


def assert_normalised(policy, obs) -> None:
    """Actions with the release's statistics == identity-normalised policy on a normalised state, then un-normalised."""
    a = act(policy, obs, True).actions
    s_aff, a_aff = policy.norm.affines()
    policy.norm.set(state=(torch.zeros(SPEC.state_dim), torch.ones(SPEC.state_dim)), action=(torch.zeros(SPEC.action_dim), torch.ones(SPEC.action_dim)))
    raw = act(policy, dataclasses.replace(obs, state=((obs.state - STATE_MEAN) / (STATE_STD + 1e-8)).astype(np.float32)), True).actions
    policy.norm.set(state=s_aff, action=a_aff)
    torch.testing.assert_close(a, raw * torch.tensor(ACT_STD, dtype=torch.float32) + torch.tensor(ACT_MEAN, dtype=torch.float32), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a, raw)


@pytest.mark.parametrize("family", ["pi0", "pi05"])
def test_lerobot_release_loads_through_model_checkpoint(family, tmp_path):
    from rlvla3.config import from_dict
    from workers.model import build_policy

    sd = write_lerobot_release(tmp_path / "release", family)
    cfg = from_dict({"env": {"name": "synthetic"}, "model": {"family": family, "chunk_size": 5, "checkpoint": str(tmp_path / "release"),
                                                             "dtype": "float32", "options": {"num_steps": 3}}})
    policy = build_policy(cfg, spec=SPEC, device="cpu")
    ours = policy.state_dict()
    vis = "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.embeddings.patch_embedding.weight"
    lm = "model.paligemma_with_expert.paligemma.lm_head.weight"
    if family == "pi0":
        assert torch.equal(ours["pi0.model.vlm.vision_tower.embeddings.patch_embedding.weight"], sd[vis])
        assert torch.equal(ours["pi0.model.vlm.language_model.embed_tokens.weight"], sd[lm])
        assert torch.equal(ours["pi0.embed_action_time.state_proj.weight"], sd["model.state_proj.weight"])
        loaded = sum(v.numel() for k, v in ours.items() if not k.startswith(("value_head.", "sampler.", "norm.")))
    else:
        assert torch.equal(ours["vlm.vision_tower.embeddings.patch_embedding.weight"], sd[vis])
        assert torch.equal(ours["expert.layers.1.input_layernorm.dense.weight"],
                           sd["model.paligemma_with_expert.gemma_expert.model.layers.1.input_layernorm.dense.weight"])
        loaded = sum(v.numel() for k, v in ours.items() if not k.startswith(("value_head.", "sampler.", "norm.", "expert.embed_tokens.")))
        sd = {k: v for k, v in sd.items() if "gemma_expert.lm_head" not in k}  # the one unmapped release tensor
    assert loaded == sum(v.numel() for v in sd.values())  # every release tensor has exactly one home
    assert policy.chunk_size == 5 and policy.opts.num_steps == 3
    assert_normalised(policy, make_obs(2, seed=2))


def test_transformers_pi0_written_by_upstream_save_pretrained_loads(tmp_path):
    from transformers import PI0ForConditionalGeneration

    from workers.policies.pi0 import build_pi0_config
    from workers.policies.vla_common import char_tokenizer

    torch.manual_seed(3)
    upstream = PI0ForConditionalGeneration(build_pi0_config("tiny", SPEC, 4, 3)).eval()
    upstream.save_pretrained(str(tmp_path / "tf"))
    char_tokenizer().save_pretrained(str(tmp_path / "tf"))
    on_disk = json.loads((tmp_path / "tf" / "config.json").read_text())
    assert on_disk["model_type"] == "pi0"
    policy = load_release(str(tmp_path / "tf"), "pi0", SPEC, dict(device="cpu", dtype="float32"))
    for k, v in upstream.state_dict().items():
        assert torch.equal(policy.state_dict()[f"pi0.{k}"], v), k
    assert policy.chunk_size == 4 and policy.opts.num_steps == 3
    obs = make_obs(2, seed=7)
    with torch.no_grad():
        noise = torch.randn(2, 4, policy.model_action_dim)
        ref = upstream.sample_actions(noise=noise, num_steps=3, **policy.model_inputs(obs))
    # Same model, same Euler ODE: equal up to the last bit of the time grid (upstream steps by
    # 1 + k * (-1/K); bit-identical when K is a power of two, see the export test).
    torch.testing.assert_close(act(policy, obs, True, noise=noise).actions, ref[..., : SPEC.action_dim], rtol=0, atol=1e-6)


def test_release_missing_weights_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    write_lerobot_release(tmp_path / "r", "pi05")
    sd = load_file(tmp_path / "r" / "model.safetensors")
    del sd["model.time_mlp_in.weight"]
    save_file(sd, tmp_path / "r" / "model.safetensors")
    with pytest.raises(ValueError, match="missing parameters.*time_mlp_in.weight"):
        load_release(str(tmp_path / "r"), "pi05", SPEC, dict(device="cpu"))
    os.remove(tmp_path / "r" / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="paligemma-3b-pt-224"):
        load_release(str(tmp_path / "r"), "pi05", SPEC, dict(device="cpu"))


def _real_sizes() -> tuple[dict, dict, dict]:
    """As LeRobot builds the released pi0 / pi0.5: gemma_2b + gemma_300m, SigLIP So400m at 224."""
    vision = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16)
    return GEMMA_VARIANTS["gemma_2b"], GEMMA_VARIANTS["gemma_300m"], vision


def test_released_pi0_names_and_shapes_map_one_to_one():
    """lerobot/pi0 at its real size (meta device): every tensor maps to one of ours, same shape."""
    from transformers import PI0ForConditionalGeneration

    from workers.policies.pi0 import build_pi0_config
    from workers.release.common import rename
    from workers.release.lerobot_pi import PI0_RULES

    text, expert, vision = _real_sizes()
    with torch.device("meta"):
        rel = lerobot_tree(text, expert, vision, 224, 14, 257152, 32, pi05=False)
        ours = {f"pi0.{k}": v for k, v in PI0ForConditionalGeneration(build_pi0_config("3b", SPEC, 50, 10)).state_dict().items()}
    rel = {k[len("model."):]: v for k, v in rel.items()}
    names = rename(rel, PI0_RULES)
    assert set(names.values()) == set(ours) and len(set(names.values())) == len(names)
    assert [k for k in rel if rel[k].shape != ours[names[k]].shape] == []


class NotATensor:
    """Anything a pickle could carry besides tensors."""


def test_openvla_oft_folder_reads_pt_heads_weights_only_and_its_statistics(tmp_path):
    """OFT's folder: proprio projector as fc1/fc2 in a .pt (DDP prefix), dataset_statistics.json
    (q01/q99, masked gripper) applied over the config's; a .pt holding objects is refused."""
    policy = build("openvla_oft", "openvla_oft_tiny.yaml", {})
    d = tmp_path / "oft"
    save_release(policy, str(d))
    os.remove(d / "proprio_projector--0_checkpoint.pt")
    sd = policy.state_dict()
    torch.save({"module.fc1.weight": sd["proprio_proj.0.weight"] * 2, "module.fc1.bias": sd["proprio_proj.0.bias"],
                "module.fc2.weight": sd["proprio_proj.2.weight"], "module.fc2.bias": sd["proprio_proj.2.bias"]},
               d / "proprio_projector--150000_checkpoint.pt")
    q01, q99 = -np.linspace(0.5, 1.0, SPEC.action_dim), np.linspace(0.5, 1.5, SPEC.action_dim)
    mask = [True] * (SPEC.action_dim - 1) + [False]
    stats = {"libero_spatial_no_noops": {
        "action": {"q01": q01.tolist(), "q99": q99.tolist(), "mask": mask, "mean": [0.0] * SPEC.action_dim},
        "proprio": {"q01": [-2.0] * SPEC.state_dim, "q99": [2.0] * SPEC.state_dim}, "num_transitions": 10}}
    (d / "dataset_statistics.json").write_text(json.dumps(stats))
    loaded = load_release(str(d), "openvla_oft", SPEC, dict(device="cpu", dtype="float32"))
    assert torch.equal(loaded.state_dict()["proprio_proj.0.weight"], sd["proprio_proj.0.weight"] * 2)
    (s_shift, s_scale), (a_shift, a_scale) = loaded.norm.affines()
    assert torch.allclose(s_scale, torch.full((SPEC.state_dim,), 2.0)) and torch.allclose(s_shift, torch.zeros(SPEC.state_dim))
    want_scale = torch.tensor((q99 - q01 + 1e-8) / 2, dtype=torch.float32)
    assert torch.allclose(a_scale[:-1], want_scale[:-1]) and a_scale[-1] == 1 and a_shift[-1] == 0  # masked: passes through

    torch.save({"fc1.weight": torch.zeros(1), "payload": NotATensor()}, d / "proprio_projector--150000_checkpoint.pt")
    with pytest.raises(ValueError, match="holds more than tensors; torch.load.weights_only=True. refused"):
        load_release(str(d), "openvla_oft", SPEC, dict(device="cpu"))


def test_gr00t_folder_reads_sharded_weights_and_metadata_statistics(tmp_path):
    from safetensors.torch import load_file, save_file

    policy = build("gr00t_n15", "gr00t_n15_tiny.yaml", {})
    d = tmp_path / "gr00t"
    save_release(policy, str(d))
    sd = load_file(d / "model.safetensors")
    os.remove(d / "model.safetensors")
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2], "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, ks in shards.items():
        save_file({k: sd[k] for k in ks}, d / name)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: n for n, ks in shards.items() for k in ks}}))
    lo = lambda n, v: {"min": [-v] * n, "max": [v] * n, "mean": [0.0] * n, "std": [1.0] * n, "q01": [-v] * n, "q99": [v] * n}  # noqa: E731
    meta = {"new_embodiment": {"statistics": {
        "state": {"joints": lo(SPEC.state_dim - 1, 2.0), "gripper": lo(1, 4.0)},
        "action": {"arm": lo(SPEC.action_dim - 1, 0.5), "gripper": lo(1, 1.0)}}, "embodiment_tag": "new_embodiment"}}
    (d / "experiment_cfg" / "metadata.json").write_text(json.dumps(meta))
    loaded = load_release(str(d), "gr00t_n15", SPEC, dict(device="cpu", dtype="float32"))
    obs = make_obs(2, seed=9)
    (s_shift, s_scale), (a_shift, a_scale) = loaded.norm.affines()
    assert s_scale.tolist() == [2.0] * (SPEC.state_dim - 1) + [4.0] and a_scale.tolist() == [0.5] * (SPEC.action_dim - 1) + [1.0]
    loaded.norm.set(state=(torch.zeros(SPEC.state_dim), torch.ones(SPEC.state_dim)), action=(torch.zeros(SPEC.action_dim), torch.ones(SPEC.action_dim)))
    assert torch.equal(act(loaded, obs, True).actions, act(policy, obs, True).actions)  # same weights through the shards
