"""pi0.5 and pi0 against LeRobot 0.6.1 (and pi0.5's Flow-SDE against RLinf), from the test vectors
in ``tests/vectors/pi05`` (how they were made: that folder's README). Each folder here is LeRobot's
own ``save_pretrained`` output re-created tensor for tensor from the vector's seed; it loads with
only the documented tensors unread, and from raw images, instruction and state acts as LeRobot's
``predict_action_chunk`` did with the same initial noise; the flow-matching loss on fixed actions,
noise and times is LeRobot's; the Flow-SDE log-prob of a chain equals RLinf's formula."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from rlvla3.observation import Observation
from workers.contract import EnvSpec

VECTORS = Path(__file__).parent / "vectors" / "pi05"
SPEC = EnvSpec(cameras={"front": (48, 64), "wrist": (40, 40)}, state_dim=8, action_dim=7, max_episode_steps=50)


@pytest.fixture(scope="module")
def vector() -> dict:
    return json.loads((VECTORS / "pi05_lerobot_tiny.json").read_text())


def redraw(shapes: dict[str, list[int]], seed: int) -> dict[str, torch.Tensor]:
    """The vector's weights: keys in sorted order, N(0, 1) * fan_in^-1/2 (>= 2-d) or * 0.1 (1-d)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k in sorted(shapes):
        shape = shapes[k]
        out[k] = torch.randn(shape, generator=g) * ((math.prod(shape[1:]) ** -0.5) if len(shape) >= 2 else 0.1)
    return out


def write_folder(vec: dict, d: Path, tokenizer: bool = True) -> Path:
    """LeRobot 0.6.1's ``save_pretrained`` folder of the vector (config, weights, both processors)."""
    from safetensors.torch import save_file

    from workers.policies.vla_common import char_tokenizer

    d.mkdir(parents=True, exist_ok=True)
    save_file(redraw(vec["shapes"], vec["seed"]), d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(vec["config"], indent=4))
    stats = {f"{f}.{k}": torch.tensor(v, dtype=torch.float32) for f, s in vec["stats"].items() for k, v in s.items()}
    for name in ("preprocessor", "postprocessor"):
        (d / f"policy_{name}.json").write_text(json.dumps(vec[name], indent=2))
        for step in vec[name]["steps"]:
            if "state_file" in step:
                save_file(stats, d / step["state_file"])
    if tokenizer:  # LeRobot names PaliGemma's tokenizer; the vector was made with this one (plus <bos>)
        char_tokenizer().save_pretrained(str(d))
    return d


def observation(vec: dict) -> Observation:
    return Observation({c: np.array(v, dtype=np.uint8) for c, v in vec["images"].items()},
                       np.array(vec["state"], dtype=np.float32), list(vec["tasks"]))


@pytest.fixture(scope="module")
def policy(vector, tmp_path_factory):
    from workers.release.layouts import load_release

    d = write_folder(vector, tmp_path_factory.mktemp("pi05") / "lerobot")
    return load_release(str(d), "pi05", SPEC, {"dtype": "float32", "device": "cpu"})


def test_lerobot_folder_acts_as_lerobot_from_raw_inputs(policy, vector):
    assert policy.opts.num_steps == vector["config"]["num_inference_steps"] and policy.chunk_size == vector["config"]["chunk_size"]
    obs = observation(vector)
    out = policy.act(obs, deterministic=True, noise=torch.tensor(vector["noise"]))
    diff = (out.actions - torch.tensor(vector["actions"])).abs().max().item()
    assert diff < 1e-4, f"actions differ from LeRobot's by {diff}"


def test_prompt_tokens_are_lerobots(policy, vector):
    """State bins (np.digitize), cleaning (``_`` and newlines -> spaces, case kept) and layout."""
    import workers.policies.pi05 as pi05
    from workers.policies.vla_common import discretize_state, encode_text

    obs = policy.norm.state_in(observation(vector))
    bins = discretize_state(obs.state)
    prompts = [f"Task: {pi05.clean_task(t)}, State: {b};\nAction: " for t, b in zip(obs.instruction, bins)]
    ids, mask = encode_text(policy.tokenizer, prompts, policy.opts.max_text_len)
    assert [row[m.bool()].tolist() for row, m in zip(ids, mask)] == vector["tokens"]
    assert discretize_state(np.array([[-1.5, -1.0, -0.99, 0.0, 0.999, 1.0, 2.0]], np.float32)) == ["-1 0 1 128 255 255 255"]


def test_flow_sde_logprob_is_rlinfs(policy, vector):
    """RLinf's flow_sde step (its own functions, on LeRobot's velocity) at a fixed step index and
    noise level: our replayed log-prob of the same chain, summed over action dims."""
    s = vector["sde"]
    assert policy.sampler.cfg.mode == "sde" and policy.sampler.cfg.noise_level == s["noise_level"]
    chain = torch.tensor(s["chain"])
    mask = torch.zeros(chain.shape[0], s["num_steps"], dtype=torch.bool)
    mask[:, s["step_index"]] = True
    with torch.no_grad():
        lp = policy.evaluate(observation(vector), chain[:, -1, :, :SPEC.action_dim], {"chain": chain, "stochastic": mask}).logprob
    diff = (lp - torch.tensor(s["logprob_sum"])).abs().max().item()
    assert diff < 1e-4, f"log-prob differs from RLinf's by {diff}"


def test_gates_are_read(policy, vector):
    """The parity above is not blind to the adaptive norms' gates: without them actions move."""
    noise = torch.tensor(vector["noise"])
    dense = [m.dense for layer in policy.expert.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
    saved = [(d.weight.detach().clone(), d.bias.detach().clone()) for d in dense]
    try:
        with torch.no_grad():
            for d in dense:
                w = d.weight.shape[0] // 3
                d.weight[2 * w:] = 0
                d.bias[2 * w:] = 1
        moved = (policy.act(observation(vector), deterministic=True, noise=noise).actions - torch.tensor(vector["actions"])).abs().max()
    finally:
        with torch.no_grad():
            for d, (w, b) in zip(dense, saved):
                d.weight.copy_(w)
                d.bias.copy_(b)
    assert moved > 1e-3


def test_pi05_base_tensor_list_is_lerobots():
    """lerobot/pi05_base as LeRobot 0.6.1's class builds it (names and shapes, dumped on the meta
    device): every tensor but the unread ones lands on one of ours with its shape, and every one of
    ours but the RL heads, the statistics and the expert's stub table comes from one."""
    from workers.policies.pi05 import Pi05Options, Pi05Policy
    from workers.release.common import rename
    from workers.release.lerobot_pi import PI05_RULES, _unread, infer_arch

    rel = {k[len("model."):]: torch.Size(v) for k, v in json.loads((VECTORS / "pi05_base_tensors.json").read_text())["tensors"].items()}
    arch = infer_arch({"type": "pi05"}, {k: torch.empty(v, device="meta") for k, v in rel.items()})  # as a load reads it
    skip = _unread(rel, "pi05")
    assert sorted(k for k in rel if k.startswith(skip)) == ["paligemma_with_expert.gemma_expert.lm_head.weight",
                                                             "paligemma_with_expert.paligemma.lm_head.weight"]
    names = rename([k for k in rel if not k.startswith(skip)], PI05_RULES)
    with torch.device("meta"):
        ours = {k: v.shape for k, v in Pi05Policy(Pi05Options(size="3b", device="meta"), SPEC, arch=arch).state_dict().items()}
    assert [f"{k} {tuple(rel[k])} vs {tuple(ours.get(n, ()))}" for k, n in names.items() if ours.get(n) != rel[k]] == []
    left = {k for k in ours if not k.startswith(("value_head.", "sampler.", "norm."))} - set(names.values())
    assert left == {"expert.embed_tokens.weight"} and len(set(names.values())) == len(names)


def test_bad_folders_say_what_is_wrong(vector, tmp_path):
    from workers.release.layouts import load_release
    from workers.release.normalize import affine_from_stats

    d = write_folder(vector, tmp_path / "no_tok", tokenizer=False)
    with pytest.raises(FileNotFoundError, match="google/paligemma-3b-pt-224"):
        load_release(str(d), "pi05", SPEC, {"device": "cpu"})
    bad = dict(vector, shapes={k: ([v[0], v[1] * 2 // 3] if k.endswith("layers.1.input_layernorm.dense.weight") else v)
                               for k, v in vector["shapes"].items()})
    bad["shapes"] = {k: ([v[0] * 2 // 3] if k.endswith("norm.dense.bias") else v) for k, v in bad["shapes"].items()}
    d = write_folder(bad, tmp_path / "shapes")
    with pytest.raises(ValueError, match=r"LeRobot's pi05 layout.*gemma_expert\.model\.layers\.0\.input_layernorm\.dense\.bias \(64,\) vs \(96,\)"):
        load_release(str(d), "pi05", SPEC, {"device": "cpu"})
    half = {"q_proj.weight": (0, 2), "k_proj.weight": (0, 2), "v_proj.weight": (0, 2), "o_proj.weight": (1, 2)}
    narrow = {k: next(([d // 2 if i == ax else d for i, d in enumerate(v)] for end, (ax, _) in half.items()
                       if "gemma_expert" in k and k.endswith("self_attn." + end)), v) for k, v in vector["shapes"].items()}
    d = write_folder(dict(vector, shapes=narrow), tmp_path / "head_dim")  # expert heads 8 wide, the VLM's 16
    with pytest.raises(ValueError, match=r"attend jointly, so their head_dim must be equal: 16 vs 8"):
        load_release(str(d), "pi05", SPEC, {"device": "cpu"})
    relative = dict(vector, config=dict(vector["config"], use_relative_actions=True))
    d = write_folder(relative, tmp_path / "relative")
    with pytest.raises(ValueError, match="use_relative_actions"):
        load_release(str(d), "pi05", SPEC, {"device": "cpu"})
    with pytest.raises(ValueError, match="'QUANTILE5'"):
        affine_from_stats("QUANTILE5", {}, 3, 1e-8, False)


def test_flow_matching_loss_is_lerobots(policy, vector):
    """``sft_loss`` on fixed actions, noise and times equals ``PI05Pytorch.forward``'s loss."""
    v = vector["loss"]
    with torch.no_grad():
        loss = policy.sft_loss(observation(vector), torch.tensor(v["actions"]), noise=torch.tensor(v["noise"]), time=torch.tensor(v["time"]))
    assert abs(float(loss) - v["loss"]) < 1e-4, (float(loss), v["loss"])


@pytest.fixture(scope="module")
def pi0(tmp_path_factory):
    from workers.release.layouts import load_release

    vec = json.loads((VECTORS / "pi0_lerobot_tiny.json").read_text())
    d = write_folder(vec, tmp_path_factory.mktemp("pi0") / "lerobot")
    return vec, load_release(str(d), "pi0", SPEC, {"dtype": "float32", "device": "cpu"})


def test_pi0_lerobot_folder_acts_and_trains_as_lerobot(pi0):
    vec, policy = pi0
    out = policy.act(observation(vec), deterministic=True, noise=torch.tensor(vec["noise"]))
    diff = (out.actions - torch.tensor(vec["actions"])).abs().max().item()
    assert diff < 1e-4, f"actions differ from LeRobot's by {diff}"
    v = vec["loss"]
    with torch.no_grad():
        loss = policy.sft_loss(observation(vec), torch.tensor(v["actions"]), noise=torch.tensor(v["noise"]), time=torch.tensor(v["time"]))
    assert abs(float(loss) - v["loss"]) < 1e-4, (float(loss), v["loss"])


def test_export_is_lerobots_layout_and_reimports_identically(policy, vector, tmp_path):
    """The LeRobot export holds LeRobot's tensor names and shapes (the token table once, as
    ``lm_head``, which LeRobot copies into the table: its strict load passes), and re-imports
    acting exactly as before."""
    from safetensors.torch import load_file

    from workers.release.layouts import load_release, save_release

    save_release(policy, str(tmp_path / "out"), "lerobot")
    written = {k: list(v.shape) for k, v in load_file(str(tmp_path / "out" / "model.safetensors")).items()}
    table = "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
    assert {**written, table: vector["shapes"][table]} == vector["shapes"]
    again = load_release(str(tmp_path / "out"), "pi05", SPEC, {"device": "cpu"})
    noise = torch.tensor(vector["noise"])
    a, b = (p.act(observation(vector), deterministic=True, noise=noise).actions for p in (policy, again))
    assert torch.equal(a, b)
