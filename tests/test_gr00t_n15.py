"""GR00T N1.5 as released, against LeRobot 0.4.4's GR00TN15 (test vectors made with it in its own
environment; see tests/vectors/gr00t_n15/README.md): the release-size tensor list, a folder the
upstream class wrote with its own ``save_pretrained`` and the actions it computed, and the prompt
ids LeRobot's GR00T processor steps (Eagle 2.5's processor) make from raw instructions."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rlvla3.observation import Observation
from workers.contract import EnvSpec
from workers.policies.gr00t import Gr00tOptions, Gr00tPolicy
from workers.release.common import RL_HEADS, NORM, inverted, rename
from workers.release.gr00t_n15 import RELEASE_RULES

VECTORS = Path(__file__).parent / "vectors" / "gr00t_n15"
SPEC = EnvSpec(cameras={"front": (48, 64)}, state_dim=8, action_dim=7, max_episode_steps=50)
TINY_SPEC = EnvSpec(cameras={"front": (32, 32)}, state_dim=8, action_dim=7, max_episode_steps=50)


def test_release_size_tensors_equal_upstream():
    want = json.loads((VECTORS / "release_tensors.json").read_text())
    with torch.device("meta"):
        policy = Gr00tPolicy(Gr00tOptions(size="3b", chunk_size=16, device="meta", dtype="float32"), SPEC)
    sd = {k: v for k, v in policy.state_dict().items() if not k.startswith(RL_HEADS + (NORM,))}
    names = rename(sd, inverted(RELEASE_RULES))
    ours = {names[k]: list(v.shape) for k, v in sd.items()}
    assert ours == want["tensors"]
    params = {id(p): p.numel() for n, p in policy.named_parameters() if not n.startswith(RL_HEADS)}
    assert sum(params.values()) == want["num_parameters"] == 2_413_522_880


class RecordedPrompt:
    """The prompt ids the first upstream action run (``tiny_parity.json``) was fed, given as ids
    before the chat format was matched. Only the tests on that vector use it (its actions, RLinf's
    flow-SDE log-probs and the SFT loss all depend on those ids through the VL features, and the
    script that made them is lost); ``test_raw_inputs_give_upstream_actions`` runs the real
    prompt builder against ``tiny_e2e.json``."""

    def __init__(self, template: str, ids: list[int]) -> None:
        self.template, self.ids = template, torch.tensor([ids])

    def __call__(self, instructions: list[str], images: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.ids.expand(len(instructions), -1)
        return ids, torch.ones_like(ids)


def load_tiny(folder, tok, ref, **opts):
    from workers.release.layouts import load_release

    policy = load_release(str(folder), "gr00t_n15", TINY_SPEC, dict(size="tiny", device="cpu", dtype="float32", **opts), str(tok))
    policy.prompt = RecordedPrompt(policy.prompt.template, ref["input_ids"])
    return policy


def tiny_reference(tmp_path):
    """The upstream-written tiny folder (as published: no tokenizer) and the reference run."""
    import shutil

    from workers.policies.vla_common import char_tokenizer

    ref = json.loads((VECTORS / "tiny_parity.json").read_text())
    folder = tmp_path / "upstream"
    shutil.copytree(VECTORS / "tiny_folder", folder)
    tok = tmp_path / "tokenizer"
    char_tokenizer().save_pretrained(tok)
    obs = Observation({"front": np.asarray(ref["image"], np.uint8)}, np.asarray(ref["state"], np.float32), [ref["instruction"]])
    return ref, folder, tok, obs


def test_upstream_saved_folder_matches_reference_actions(tmp_path):
    from workers.policies.eagle_prompt import N15_CHAT_TEMPLATE, write_chat_template
    from workers.release.layouts import load_release, save_release

    ref, folder, tok, obs = tiny_reference(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.tokenizer"):
        load_release(str(folder), "gr00t_n15", TINY_SPEC, dict(size="tiny", device="cpu"))
    template = N15_CHAT_TEMPLATE.replace("You are a helpful assistant.", "You are a robot.")
    write_chat_template(str(tok), template)  # model.tokenizer's folder carries the prompt's template
    policy = load_tiny(folder, tok, ref)
    noise = torch.tensor(ref["noise"])
    with torch.inference_mode():
        got = policy.act(obs, deterministic=True, noise=noise).actions
    want = torch.tensor(ref["env_actions"])
    assert (got - want).abs().max().item() < 1e-4, (got - want).abs().max().item()

    save_release(policy, str(tmp_path / "export"))
    again = load_release(str(tmp_path / "export"), "gr00t_n15", TINY_SPEC, dict(device="cpu", dtype="float32"))
    assert again.prompt.template == template  # the exporter wrote the template back
    assert "You are a robot." in again.prompt.text("wave", 1)
    again.prompt = RecordedPrompt(template, ref["input_ids"])
    with torch.inference_mode():
        assert torch.equal(again.act(obs, deterministic=True, noise=noise).actions, got)


def e2e_policy(tmp_path):
    """The upstream-written tiny folder loaded with the tokenizer folder the end-to-end reference
    read: rlvla3's char tokenizer (the loader adds Eagle's prompt tokens, ids 99-103) and N1.5's
    processor chat template as ``chat_template.json``."""
    import shutil

    from workers.policies.eagle_prompt import N15_CHAT_TEMPLATE, write_chat_template
    from workers.policies.vla_common import char_tokenizer
    from workers.release.layouts import load_release

    folder = tmp_path / "upstream"
    shutil.copytree(VECTORS / "tiny_folder", folder)
    tok = tmp_path / "tokenizer"
    char_tokenizer().save_pretrained(tok)
    write_chat_template(str(tok), N15_CHAT_TEMPLATE)
    policy = load_release(str(folder), "gr00t_n15", TINY_SPEC, dict(size="tiny", device="cpu", dtype="float32"), str(tok))
    return policy, folder


def e2e_obs(case) -> Observation:
    b = len(case["image"])
    return Observation({"front": np.asarray(case["image"], np.uint8)}, np.asarray(case["state"], np.float32),
                       [case["instruction"]] * b)


def test_raw_inputs_give_upstream_actions(tmp_path):
    """Issue 25 item 5, end to end: a raw uint8 image, instruction and state through the policy's
    own prompt builder, image processing, min-max statistics (the folder's ``new_embodiment``),
    sampler and un-normalisation, against LeRobot 0.4.4's preprocessor -> ``GR00TN15.get_action``
    -> postprocessor with the same initial noise (``tiny_e2e.json``, made by a script outside the
    project; see the vectors' README). Cases: ``pick up the cup``, an instruction with capitals,
    an underscore and an apostrophe, a batch of 2; then the first two as one mixed-task batch
    (left-padded here; upstream ran each alone) and the folder exported and loaded back."""
    from workers.release.layouts import load_release, save_release

    ref = json.loads((VECTORS / "tiny_e2e.json").read_text())
    policy, _ = e2e_policy(tmp_path)
    got_by_case, diffs = {}, {}
    for case in ref["cases"]:
        b = len(case["image"])
        ids, mask = policy.prompt([case["instruction"]] * b, 1)
        assert ids.tolist() == case["input_ids"], case["name"]
        assert mask.tolist() == case["attention_mask"], case["name"]
        with torch.inference_mode():
            got = policy.act(e2e_obs(case), deterministic=True, noise=torch.tensor(case["noise"])).actions
        diffs[case["name"]] = (got - torch.tensor(case["env_actions"])).abs().max().item()
        got_by_case[case["name"]] = got
    print("max abs diff vs upstream:", diffs)
    assert max(diffs.values()) < 1e-4, diffs

    one, caps = ref["cases"][0], ref["cases"][1]
    mixed = Observation({"front": np.asarray(one["image"] + caps["image"], np.uint8)},
                        np.asarray(one["state"] + caps["state"], np.float32), [one["instruction"], caps["instruction"]])
    with torch.inference_mode():
        got = policy.act(mixed, deterministic=True, noise=torch.tensor(one["noise"] + caps["noise"])).actions
    want = torch.tensor(one["env_actions"] + caps["env_actions"])
    print("mixed batch max abs diff:", (got - want).abs().max().item())
    assert (got - want).abs().max().item() < 1e-4, (got - want).abs().max().item()

    save_release(policy, str(tmp_path / "export"))
    again = load_release(str(tmp_path / "export"), "gr00t_n15", TINY_SPEC, dict(device="cpu", dtype="float32"))
    with torch.inference_mode():
        assert torch.equal(again.act(e2e_obs(one), deterministic=True, noise=torch.tensor(one["noise"])).actions,
                           got_by_case["cup"])


def test_bad_embodiment_and_widths_are_refused(tmp_path):
    from workers.release.layouts import load_release

    _, folder, tok, _ = tiny_reference(tmp_path)
    load = lambda spec, **o: load_release(str(folder), "gr00t_n15", spec, dict(size="tiny", device="cpu", **o), str(tok))  # noqa: E731
    with pytest.raises(ValueError, match=r"embodiment 'gr1' has no statistics.*\['new_embodiment'\]"):
        load(TINY_SPEC, embodiment="gr1")
    with pytest.raises(ValueError, match="unknown embodiment 'robot9'"):
        load(TINY_SPEC, embodiment="robot9")
    with pytest.raises(ValueError, match="cover 8 dims; the env's state has 9"):
        load(dataclasses.replace(TINY_SPEC, state_dim=9))
    with pytest.raises(ValueError, match="widths 65/7 exceed the embodiment encoders' 64/32"):
        load(dataclasses.replace(TINY_SPEC, state_dim=65))
    with pytest.raises(ValueError, match="max_text_len 32 would not be read: N1.5 keeps its whole prompt"):
        load(TINY_SPEC, max_text_len=32)


def test_flow_sde_logprob_equals_rlinf(tmp_path):
    """RLinf's N1.5 flow-SDE (noise at one random denoising step, the step replayed by the
    trainer): the log-prob of a chain RLinf's function sampled, per chosen step, and act's own
    log-prob re-scored by evaluate (the PPO ratio at version 0)."""
    ref, folder, tok, obs = tiny_reference(tmp_path)
    rl = ref["rlinf_flow_sde"]
    policy = load_tiny(folder, tok, ref, sampler="sde", noise_level=rl["noise_level"], num_steps=rl["num_steps"])
    for step, want in rl["by_step"].items():
        chain = torch.tensor(want["chain"])
        mask = torch.zeros(1, rl["num_steps"], dtype=torch.bool)
        mask[0, int(step)] = True
        with torch.no_grad():
            got = policy.evaluate(obs, chain[:, -1, :, :7], {"chain": chain, "stochastic": mask}).logprob
        assert (got - torch.tensor([want["logprob"]])).abs().max().item() < 1e-4, (step, got, want["logprob"])

    with torch.inference_mode():
        out = policy.act(obs)
    assert out.replay["stochastic"].sum().item() == 1  # one random step per chunk, stored with the trajectory
    with torch.no_grad():
        again = policy.evaluate(obs, out.actions, out.replay).logprob
    assert (again - out.logprob).abs().max().item() < 1e-5


def test_flow_matching_loss_equals_reference(tmp_path):
    """N1.5's SFT loss on fixed actions, noise and time, against the upstream head's forward."""
    ref, folder, tok, obs = tiny_reference(tmp_path)
    policy = load_tiny(folder, tok, ref)
    sft = ref["sft"]
    target = torch.tensor(sft["actions"])
    with torch.no_grad():
        ctx = policy._context(policy.norm.state_in(obs))
        loss = policy.action_head.loss(ctx["vl"], ctx["pad"], ctx["state"], target, torch.tensor(sft["noise"]),
                                       torch.tensor(sft["tau"]), ctx["cat"], torch.ones_like(target))
    assert abs(loss.item() - sft["loss"]) < 1e-4, (loss.item(), sft["loss"])
    a = torch.tensor(ref["env_actions"])
    policy.train()
    policy.sft_loss(obs, a).backward()  # the objective rlvla3 sft trains this family on
    assert policy.action_head.model.proj_out_2.weight.grad is not None
    assert policy.backbone.eagle_model.language_model.model.embed_tokens.weight.grad is None  # frozen by default


def test_image_preprocessing_equals_eagle_processor():
    """Eagle 2.5's image processor as N1.5 calls it (one tile, no thumbnail), down- and upscaling."""
    from workers.policies.gr00t import eagle_pixels

    ref = json.loads((VECTORS / "eagle_image.json").read_text())
    rng = np.random.default_rng(3)
    for case in ref["cases"]:
        img = rng.integers(0, 256, (*case["hw"], 3), dtype=np.uint8)
        got = eagle_pixels({"c": img[None]}, ["c"], case["tile"], torch.device("cpu"), torch.float32)[0, 0]
        level = lambda v: (torch.as_tensor(v, dtype=torch.float32) / 255 - 0.5) / 0.5  # noqa: E731
        if "levels" in case:
            assert (got - level(case["levels"])).abs().max().item() < 1e-6, case["hw"]
        else:
            assert (got.flatten()[::97] - level(case["every_97th"])).abs().max().item() < 1e-6, case["hw"]
            assert abs(got.double().sum().item() - case["sum"]) < 1e-2


def test_prompt_equals_lerobot_eagle_processor():
    """The prompt ids and mask LeRobot 0.4.4's GR00T steps (pack -> Eagle encode -> collate) made
    from raw instructions with a tiny tokenizer laid out as Eagle's N1.5 folder: 1 and 2 cameras,
    an instruction with an underscore, capitals, a newline and an apostrophe, an empty one, and
    batches of different lengths (left-padded). Built through the release-size policy, so the
    ``<IMG_CONTEXT>`` count per camera is its vision tower's."""
    from workers.policies.eagle_prompt import N15_CHAT_TEMPLATE
    from workers.release.gr00t_n15 import load_tokenizer

    ref = json.loads((VECTORS / "eagle_text.json").read_text())
    tok, template = load_tokenizer("", str(VECTORS / "eagle_tokenizer"))
    assert template == N15_CHAT_TEMPLATE and tok.chat_template != template  # the processor's, not Qwen3's
    with torch.device("meta"):
        policy = Gr00tPolicy(Gr00tOptions(size="3b", device="meta", dtype="float32"), SPEC, tokenizer=tok, chat_template=template)
    assert policy.prompt.tokens_per_image == ref["tokens_per_tile"] == 256
    assert ref["padding_side"] == "left"
    for case in ref["cases"]:
        ids, mask = policy.prompt(case["instructions"], case["cameras"])
        assert ids.tolist() == case["input_ids"], case["name"]
        assert mask.tolist() == case["attention_mask"], case["name"]
    assert policy.image_token_id == tok.convert_tokens_to_ids("<IMG_CONTEXT>")
    assert len({c["name"] for c in ref["cases"]}) == 8


def test_release_act_bench_times_the_folder_beside_a_reference_command(tmp_path):
    """``bench/stages/release_act.py`` on the upstream-written folder: rounds alternate the
    reference command (here a stand-in printing fixed figures, as the upstream timing scripts
    print theirs) and our act(); its JSON holds both sides per round and the ratio of medians."""
    import sys

    from rlvla3.harness.jobs import run_command
    from tests.jobs import last_json

    _, folder, tok, _ = tiny_reference(tmp_path)
    ref = f"{sys.executable} -c \"import json, sys; print(json.dumps({{b: 2.0 for b in sys.argv[1].split(',')}}))\""
    proc = run_command([sys.executable, str(Path(__file__).parents[1] / "bench" / "stages" / "release_act.py"), str(folder),
                        "--family", "gr00t_n15", "--cameras", "front:32x32", "--tokenizer", str(tok), "--option", "size=tiny",
                        "--batches", "1,2", "--rounds", "2", "--reps", "1", "--reference", ref, "--out", str(tmp_path / "out")],
                       timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    assert out["family"] == "gr00t_n15" and out["options"] == {"size": "tiny"} and out["threads"] == 2
    assert out["reference"] == {"1": [2.0, 2.0], "2": [2.0, 2.0]}
    assert all(len(v) == 2 and min(v) > 0 for v in out["ours"].values())
    assert abs(out["ratio"]["1"] - sum(out["ours"]["1"]) / 2 / 2.0) < 1e-3  # median of two rounds over the reference's 2.0
    assert json.loads((tmp_path / "out" / "release_act.json").read_text()) == out
