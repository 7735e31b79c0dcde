"""OpenVLA-OFT as released: the upstream prismatic layout maps tensor for tensor at release size,
and a folder the upstream ``save_pretrained`` wrote loads and acts as the reference code does.

Reference outputs and the release tensor list come from the upstream classes run in their own
environment (tests/vectors/*.json, each with a note on how it was made).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from oft_reference import RELEASE_7B, REFERENCE, raw_image, write_upstream_folder  # noqa: E402

from rlvla3.observation import Observation  # noqa: E402
from workers.contract import EnvSpec  # noqa: E402
from workers.release import prismatic_names as names  # noqa: E402
from workers.release.layouts import load_release, save_release  # noqa: E402

TOL = 1e-4
CAMERAS = EnvSpec(cameras={"image": (224, 224), "wrist_image": (224, 224)}, state_dim=8, action_dim=7, max_episode_steps=100)
"""LIBERO's two cameras; the cases' raw images differ in size, and the policy resizes whatever it gets."""


def test_release_size_tensors_map_one_to_one_on_the_meta_device():
    """Every tensor the upstream class builds from the openvla-7b config (7.54 B parameters) has a
    counterpart of the right shape in the 7b policy, both ways, side files included."""
    from workers.policies.openvla_oft import OpenVLAOFTOptions, OpenVLAOFTPolicy
    from workers.release.openvla_oft import infer_arch

    release = {k: torch.empty(s, device="meta") for k, s in RELEASE_7B["tensors"].items()}
    assert sum(t.numel() for t in release.values()) == RELEASE_7B["parameters"] == 7_541_237_184
    arch = infer_arch(RELEASE_7B["config"], release)
    opts = OpenVLAOFTOptions(size="7b", chunk_size=8, device="meta", dtype="bfloat16", action_head="l1")
    policy = OpenVLAOFTPolicy(opts, CAMERAS, arch=arch)
    ours = {k: v for k, v in policy.state_dict().items()}
    converted, unmapped = names.to_ours(release)
    assert unmapped == []
    side = {**{f"proprio_proj.{'0' if k.startswith('fc1') else '2'}.{k.split('.', 1)[1]}": s for k, s in RELEASE_7B["proprio_projector"].items()},
            **{"l1_head." + k[len("model."):]: s for k, s in RELEASE_7B["action_head"].items()}}
    want = {k: list(v.shape) for k, v in converted.items()} | side
    fresh = ("value_head.", "norm.") + names.OURS_ONLY
    assert sorted(k for k in ours if not k.startswith(fresh)) == sorted(want)
    assert [k for k in want if list(ours[k].shape) != want[k]] == []
    back = names.to_release({k: v for k, v in ours.items() if k in converted})
    assert {k: list(v.shape) for k, v in back.items()} == RELEASE_7B["tensors"]
    assert arch["llm"]["rms_norm_eps"] == 1e-6  # the release's text_config leaves it at transformers 4.40's default


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    folder = tmp_path_factory.mktemp("oft") / "upstream"
    write_upstream_folder(folder)
    return folder


@pytest.fixture(scope="module")
def token_policy(upstream):
    return load_release(str(upstream), "openvla_oft", CAMERAS, dict(device="cpu", dtype="float32", action_head="tokens",
                                                                      temperature=REFERENCE["temperature"]))


def _obs(case: dict) -> Observation:
    (s1, h1, w1), (s2, h2, w2) = case["images"]
    return Observation(images={"image": raw_image(s1, h1, w1)[None], "wrist_image": raw_image(s2, h2, w2)[None]},
                       state=np.asarray([case["state"]], np.float32), instruction=[case["instruction"]])


def test_upstream_save_pretrained_folder_acts_as_the_reference(upstream, token_policy):
    """Raw images, instruction and state in; action token ids equal, actions, token log-probs and
    entropy within 1e-4 of the upstream predict_action's (two cameras, proprio, chunk 8 from LIBERO's
    statistics); the L1 head, the default when the folder has one, within 1e-4 too."""
    policy = token_policy
    assert policy.chunk_size == 8 and policy.proprio_proj is not None
    l1 = load_release(str(upstream), "openvla_oft", CAMERAS, dict(device="cpu", dtype="float32"))
    assert l1.opts.action_head == "l1"
    for case in REFERENCE["cases"]:
        obs = _obs(case)
        ids = [policy.tokenizer.bos_token_id] + policy._prompt_ids([case["instruction"]])[0]
        assert ids == case["input_ids"] + [29871]
        out = policy.act(obs, deterministic=True)
        tok = (out.replay["action_bins"][0] + policy.base_vocab - policy.opts.n_bins).tolist()
        assert tok == case["action_token_ids"]
        assert np.abs(out.actions[0].numpy() - np.asarray(case["actions"])).max() < TOL
        assert np.abs(out.logprob[0].numpy() - np.asarray(case["token_logprobs"])).max() < TOL
        ev = policy.evaluate(obs, out.actions, out.replay)
        assert np.abs(ev.entropy[0].detach().numpy() - np.asarray(case["entropy"])).max() < TOL
        assert torch.allclose(ev.logprob, out.logprob, atol=1e-6)
        assert np.abs(l1.act(obs, deterministic=True).actions[0].numpy() - np.asarray(case["l1_actions"])).max() < TOL


def test_export_reloads_with_identical_actions(token_policy, tmp_path):
    obs = _obs(REFERENCE["cases"][0])
    save_release(token_policy, str(tmp_path / "out"))
    again = load_release(str(tmp_path / "out"), "openvla_oft", CAMERAS, dict(device="cpu", dtype="float32"))
    assert again.opts.action_head == "tokens" and again.chunk_size == 8
    a, b = token_policy.act(obs, deterministic=True), again.act(obs, deterministic=True)
    assert torch.equal(a.replay["action_bins"], b.replay["action_bins"]) and torch.equal(a.actions, b.actions)
    assert torch.equal(a.value, b.value)


def test_bad_folders_name_what_is_wrong(upstream, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    spec, opts = CAMERAS, dict(device="cpu", dtype="float32")

    def copy(name):
        d = tmp_path / name
        shutil.copytree(upstream, d)
        return d

    def shard_of(d, key):
        index = json.loads((d / "model.safetensors.index.json").read_text())
        return d / index["weight_map"][key]

    key = "vision_backbone.featurizer.blocks.1.attn.qkv.weight"
    d = copy("missing")
    sd = load_file(shard_of(d, key))
    save_file({k: v for k, v in sd.items() if k != key}, str(shard_of(d, key)), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"prismatic OpenVLA release.*towers\.dino\.encoder\.layer\.1\.attention\.q_proj"):
        load_release(str(d), "openvla_oft", spec, opts)

    d = copy("unmapped")
    sd = load_file(shard_of(d, key))
    sd["vision_backbone.featurizer.blocks.1.attn.q_norm.weight"] = torch.ones(3)
    save_file(sd, str(shard_of(d, key)), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"read as a prismatic OpenVLA release: 1 tensors.*attn\.q_norm\.weight"):
        load_release(str(d), "openvla_oft", spec, opts)

    d = copy("shape")
    key = "projector.fc3.bias"
    sd = load_file(shard_of(d, key))
    sd[key] = torch.zeros(3)
    save_file(sd, str(shard_of(d, key)), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"prismatic OpenVLA release.*projector\.4\.bias \(3,\)"):
        load_release(str(d), "openvla_oft", spec, opts)

    d = copy("tokenizer")
    os.remove(d / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="tokenizer.json; the release keeps it beside config.json"):
        load_release(str(d), "openvla_oft", spec, opts)

    d = copy("stats")
    os.remove(d / "dataset_statistics.json")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(config, norm_stats=None)))
    with pytest.raises(FileNotFoundError, match="norm_stats' and in dataset_statistics.json"):
        load_release(str(d), "openvla_oft", spec, opts)

    d = copy("pickle")
    torch.save({"module.fc1.weight": torch.zeros(1), "payload": _NotATensor()}, d / "proprio_projector--150000_checkpoint.pt")
    with pytest.raises(ValueError, match="holds more than tensors"):
        load_release(str(d), "openvla_oft", spec, opts)


class _NotATensor:
    """Anything a pickle could carry besides tensors."""


def test_peft_lora_adapters_on_the_upstream_model_load_merged(upstream, tmp_path):
    """Adapters peft wrote on the upstream class (all-linear, as OFT fine-tunes: towers, projector,
    Llama, lm_head with its base layer) merge into the release and act as the adapted model did."""
    import hashlib
    import shutil

    from safetensors.torch import save_file

    from oft_reference import VECTORS, draw

    lora = json.loads((VECTORS / "openvla_oft_tiny_lora_reference.json").read_text())
    d = tmp_path / "lora"
    shutil.copytree(upstream, d)
    base = {k: draw(k, tuple(s)) for k, s in REFERENCE["tensor_shapes"].items()}
    tensors = {k: (base[k[len("base_model.model."):].replace(".base_layer.", ".")] if ".base_layer." in k else draw(k, tuple(s)) * 0.1)
               for k, s in lora["adapter_shapes"].items()}
    assert all(hashlib.sha256(t.numpy().tobytes()).hexdigest() == lora["adapter_sha256"][k] for k, t in tensors.items())
    save_file(tensors, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
    (d / "adapter_config.json").write_text(json.dumps(lora["adapter_config"]))
    policy = load_release(str(d), "openvla_oft", CAMERAS, dict(device="cpu", dtype="float32", action_head="tokens",
                                                                 temperature=REFERENCE["temperature"]))
    for case, want in zip(REFERENCE["cases"], lora["cases"]):
        obs = _obs(case)
        out = policy.act(obs, deterministic=True)
        assert (out.replay["action_bins"][0] + policy.base_vocab - policy.opts.n_bins).tolist() == want["action_token_ids"]
        assert np.abs(out.actions[0].numpy() - np.asarray(want["actions"])).max() < TOL
        assert np.abs(out.logprob[0].numpy() - np.asarray(want["token_logprobs"])).max() < TOL
        ev = policy.evaluate(obs, out.actions, out.replay)
        assert np.abs(ev.entropy[0].detach().numpy() - np.asarray(want["entropy"])).max() < TOL
