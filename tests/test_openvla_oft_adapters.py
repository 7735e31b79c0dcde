"""OpenVLA-OFT folders as RLinf and OFT publish them besides the plain prismatic release: adapters
without their base (``model.base``), and RLinf's whole-model exports (value head, proprio projector
in the shards).

Layouts as the trainers write them (read from their code, see docs/checkpoints.md): RLinf's
``RLinf-OpenVLAOFT-*-Base-Lora`` adapter folders (``PeftModel.from_pretrained(model, lora_path)``
onto the whole model; ``adapter_config.json`` + ``adapter_model.safetensors`` with
``base_model.model.<prismatic name>.lora_A.weight``), RLinf's ``convert_pt_to_hf`` without merging
(the base's ``*.json`` copied, stale shard index included, adapters in ``lora_adapter/``), and its
plain export (``model-0000N-of-0000M.safetensors`` of the whole state dict). The adapter tensors
are the ones peft 0.11.1 wrote on the upstream tiny model (RLinf's target-module list is that
model's ``all-linear`` set), and the expected outputs are the adapted upstream model's
(``tests/vectors/openvla_oft_tiny_lora_reference.json``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from oft_reference import REFERENCE, VECTORS, draw, raw_image, write_upstream_folder  # noqa: E402

from rlvla3.config import from_dict  # noqa: E402
from rlvla3.observation import Observation  # noqa: E402
from workers.contract import EnvSpec  # noqa: E402
from workers.model import build_policy  # noqa: E402
from workers.release.layouts import load_release  # noqa: E402

TOL = 1e-4
CAMERAS = EnvSpec(cameras={"image": (224, 224), "wrist_image": (224, 224)}, state_dim=8, action_dim=7, max_episode_steps=100)
LORA = json.loads((VECTORS / "openvla_oft_tiny_lora_reference.json").read_text())
HUB_BASE = "RLinf/RLinf-OpenVLAOFT-ManiSkill-Base-Main"
OPTS = dict(device="cpu", dtype="float32", action_head="tokens", temperature=REFERENCE["temperature"])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("oft") / "base"
    write_upstream_folder(folder)
    return folder


def _adapter(folder: Path, base_name: str) -> Path:
    """The adapter files peft's ``save_pretrained`` writes (tensors checked against the upstream
    run's sha256), with ``base_model_name_or_path`` as the trainer recorded it."""
    folder.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    release = {k: draw(k, tuple(s)) for k, s in REFERENCE["tensor_shapes"].items()}
    tensors = {k: (release[k[len("base_model.model."):].replace(".base_layer.", ".")] if ".base_layer." in k else draw(k, tuple(s)) * 0.1)
               for k, s in LORA["adapter_shapes"].items()}
    assert all(hashlib.sha256(t.numpy().tobytes()).hexdigest() == LORA["adapter_sha256"][k] for k, t in tensors.items())
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps(dict(LORA["adapter_config"], base_model_name_or_path=base_name)))
    (folder / "README.md").write_text("---\nlibrary_name: peft\n---\n")
    return folder


def _obs(case: dict) -> Observation:
    (s1, h1, w1), (s2, h2, w2) = case["images"]
    return Observation(images={"image": raw_image(s1, h1, w1)[None], "wrist_image": raw_image(s2, h2, w2)[None]},
                       state=np.asarray([case["state"]], np.float32), instruction=[case["instruction"]])


def _acts_as(policy, want_cases: list[dict]) -> None:
    for case, want in zip(REFERENCE["cases"], want_cases):
        out = policy.act(_obs(case), deterministic=True)
        assert (out.replay["action_bins"][0] + policy.base_vocab - policy.opts.n_bins).tolist() == want["action_token_ids"]
        assert np.abs(out.actions[0].numpy() - np.asarray(want["actions"])).max() < TOL
        assert np.abs(out.logprob[0].numpy() - np.asarray(want["token_logprobs"])).max() < TOL


def test_rlinf_adapter_folder_loads_onto_model_base(base, tmp_path):
    """A bare adapter folder (RLinf's ``*-Base-Lora``, its base a hub id) with ``model.base`` set in
    the job config acts as the adapted upstream model; the base alone does not."""
    adapters = _adapter(tmp_path / "RLinf-OpenVLAOFT-ManiSkill-Base-Lora", HUB_BASE)
    cfg = from_dict({"model": {"family": "openvla_oft", "checkpoint": str(adapters), "base": str(base), "chunk_size": 8,
                               "dtype": "float32", "options": {"action_head": "tokens", "temperature": REFERENCE["temperature"]}}})
    policy = build_policy(cfg, CAMERAS, device="cpu")
    assert policy.chunk_size == 8 and policy.proprio_proj is not None  # statistics and .pt files from the base
    _acts_as(policy, LORA["cases"])
    plain = load_release(str(base), "openvla_oft", CAMERAS, OPTS)
    obs = _obs(REFERENCE["cases"][0])
    assert not torch.allclose(plain.act(obs, deterministic=True).logprob, policy.act(obs, deterministic=True).logprob, atol=1e-3)


def test_adapter_folder_without_a_base_names_the_setting_and_the_hub_id(base, tmp_path):
    adapters = _adapter(tmp_path / "lora_004000", HUB_BASE)
    with pytest.raises(FileNotFoundError, match=rf"no base weights; they were trained on '{HUB_BASE}': set model\.base"):
        load_release(str(adapters), "openvla_oft", CAMERAS, OPTS)
    with pytest.raises(FileNotFoundError, match=rf"model\.base '{tmp_path}/nowhere' is not a release folder.*'{HUB_BASE}'"):
        load_release(str(adapters), "openvla_oft", CAMERAS, OPTS, base=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="model.base is set .* holds its own weights"):
        load_release(str(base), "openvla_oft", CAMERAS, OPTS, base=str(base))
    with pytest.raises(ValueError, match="model.base is for openvla_oft"):
        load_release(str(adapters), "pi0", CAMERAS, {}, base=str(base))


def test_rlinf_unmerged_export_finds_its_recorded_base(base, tmp_path):
    """``convert_pt_to_hf`` with ``merge_lora_weighs: false``: the base's ``*.json`` (its shard index
    too, without the shards) and ``lora_adapter/``; the recorded base is a folder here, so no
    ``model.base`` is needed (as peft's ``AutoPeftModel`` reads it)."""
    out = tmp_path / "rlinf_export"
    out.mkdir()
    for f in base.iterdir():
        if f.suffix in (".json", ".md", ".py"):
            shutil.copy(f, out / f.name)
    _adapter(out / "lora_adapter", str(base))
    assert (out / "model.safetensors.index.json").is_file()
    _acts_as(load_release(str(out), "openvla_oft", CAMERAS, OPTS), LORA["cases"])


def test_rlinf_whole_model_export_with_value_head_and_proprio_in_the_shards(base, tmp_path):
    """RLinf's plain export (``save_state_dict_sharded_safetensors`` of the whole model): prismatic
    tensors plus RLinf's critic (``value_head.mlp.{0,2,4}``, hidden-512-128-chunks, action-level) and,
    from its ``official`` variant, ``proprio_projector.*``; no ``.pt`` files (only ``*.json`` are
    copied). Acts as the upstream model; the critic is not read (its shape is not ours), so the
    value equals a plain load's fresh head."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "rlinf_full"
    out.mkdir()
    for f in base.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    index = json.loads((base / "model.safetensors.index.json").read_text())
    sd = {k: t for shard in sorted(set(index["weight_map"].values())) for k, t in load_file(str(base / shard)).items()}
    hidden = sd["language_model.model.embed_tokens.weight"].shape[1]
    g = torch.Generator().manual_seed(0)
    sd.update({"value_head.mlp.0.weight": torch.randn(512, hidden, generator=g), "value_head.mlp.0.bias": torch.randn(512, generator=g),
               "value_head.mlp.2.weight": torch.randn(128, 512, generator=g), "value_head.mlp.2.bias": torch.randn(128, generator=g),
               "value_head.mlp.4.weight": torch.randn(8, 128, generator=g)})
    sd.update({k: draw(k, tuple(s)) for k, s in REFERENCE["tensor_shapes"].items() if k.startswith("proprio_projector.")})
    shard = "model-00001-of-00001.safetensors"
    save_file(dict(sorted(sd.items())), str(out / shard), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": sum(t.nbytes for t in sd.values())},
                                                                  "weight_map": {k: shard for k in sorted(sd)}}))
    policy = load_release(str(out), "openvla_oft", CAMERAS, OPTS)
    assert policy.proprio_proj is not None and policy.l1_head is None
    _acts_as(policy, REFERENCE["cases"])
    plain = load_release(str(base), "openvla_oft", CAMERAS, OPTS)
    obs = _obs(REFERENCE["cases"][0])
    assert torch.equal(policy.act(obs, deterministic=True).value, plain.act(obs, deterministic=True).value)

    # a proprio .pt beside them wins, as RLinf's load_proprio_projector_weights loads it after from_pretrained
    shutil.copy(base / "proprio_projector--150000_checkpoint.pt", out)
    sd = {k: (t * 3 if k.startswith("proprio_projector.") else t) for k, t in sd.items()}
    save_file(dict(sorted(sd.items())), str(out / shard), metadata={"format": "pt"})
    _acts_as(load_release(str(out), "openvla_oft", CAMERAS, OPTS), REFERENCE["cases"])


def test_oft_finetune_checkpoint_folders(base, tmp_path):
    """OFT's ``save_training_checkpoint``: statistics, processor files and ``.pt`` side files beside
    ``lora_adapter/`` (base = ``vla_path``, a hub id). Unmerged, the adapters load onto
    ``model.base`` with the checkpoint's own side files (the base here has none); merged, the
    weights already hold ``lora_adapter/`` and it is not merged again."""
    bare = tmp_path / "openvla-7b"
    shutil.copytree(base, bare, ignore=shutil.ignore_patterns("*.pt"))
    ckpt = tmp_path / "run--150000_chkpt"
    ckpt.mkdir()
    for f in base.iterdir():
        if f.suffix == ".pt" or f.name in ("dataset_statistics.json", "preprocessor_config.json", "tokenizer.json",
                                          "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(f, ckpt / f.name)
    _adapter(ckpt / "lora_adapter", "openvla/openvla-7b")
    policy = load_release(str(ckpt), "openvla_oft", CAMERAS, OPTS, base=str(bare))
    assert policy.proprio_proj is not None
    _acts_as(policy, LORA["cases"])

    merged = tmp_path / "merged--150000_chkpt"
    shutil.copytree(base, merged)
    _adapter(merged / "lora_adapter", "openvla/openvla-7b")
    _acts_as(load_release(str(merged), "openvla_oft", CAMERAS, OPTS), REFERENCE["cases"])
