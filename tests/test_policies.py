"""The policy contract for every VLA family, on its tiny config, CPU float32.

PPO's importance ratio needs ``evaluate`` to reproduce ``act``'s log-probs; training needs
gradients everywhere; serving needs batching that does not change a sample's result.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from rlvla3.observation import Observation
from workers.envs.base import EnvSpec
from workers.policies.base import make_policy
from workers.release.layouts import load_release, save_release

ROOT = Path(__file__).resolve().parents[1]
SPEC = EnvSpec(cameras={"front": (48, 64), "wrist": (40, 40)}, state_dim=8, action_dim=7, max_episode_steps=50)
INSTRUCTIONS = ["pick up the cup", "open", "push the red block to the left", "close drawer"]

# (test id, family, config file, extra options)
CASES = [
    ("openvla_oft", "openvla_oft", "openvla_oft_tiny.yaml", {}),
    ("pi0", "pi0", "pi0_tiny.yaml", {}),
    ("pi0-noise", "pi0", "pi0_tiny.yaml", {"sampler": "noise"}),
    ("pi0-sde-one", "pi0", "pi0_tiny.yaml", {"stochastic_steps": "one"}),
    ("pi05", "pi05", "pi05_tiny.yaml", {}),
    ("pi05-critic-expert", "pi05", "pi05_tiny.yaml", {"critic": "expert"}),
    ("gr00t_n15", "gr00t_n15", "gr00t_n15_tiny.yaml", {}),
    ("gr00t_n15-noise", "gr00t_n15", "gr00t_n15_tiny.yaml", {"sampler": "noise"}),
]
MODULES = {"openvla_oft": "openvla_oft", "pi0": "pi0", "pi05": "pi05", "gr00t_n15": "gr00t"}


def build(family: str, cfg_file: str, extra: dict, **more):
    pytest.importorskip(f"workers.policies.{MODULES[family]}")
    model = yaml.safe_load((ROOT / "configs" / "models" / cfg_file).read_text())["model"]
    assert model["family"] == family
    opts = {**model.get("options", {}), "chunk_size": model["chunk_size"], "device": "cpu", "dtype": "float32"}
    return make_policy(family, {**opts, **extra, **more}, SPEC)


def make_obs(batch: int, seed: int = 0) -> Observation:
    rng = np.random.default_rng(seed)
    return Observation(
        {cam: rng.integers(0, 256, (batch, h, w, 3), dtype=np.uint8) for cam, (h, w) in SPEC.cameras.items()},
        rng.uniform(-1, 1, (batch, SPEC.state_dim)).astype(np.float32),
        [INSTRUCTIONS[i % len(INSTRUCTIONS)] for i in range(batch)],
    )


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case(request):
    _, family, cfg_file, extra = request.param
    torch.manual_seed(0)
    return family, cfg_file, extra, build(family, cfg_file, extra)


def level_len(policy) -> int:
    return {"token": policy.chunk_size * policy.action_dim, "action": policy.chunk_size, "chunk": 1}[policy.logprob_level]


def act(policy, obs, deterministic=False, **kw):
    """Every deterministic act here restarts the evaluation stream, as ``run_protocol`` does."""
    if deterministic:
        policy.seed_eval(0)
    with torch.inference_mode():
        return policy.act(obs, deterministic, **kw)


def flow_start(policy, batch: int, seed: int = 9) -> dict:
    """An explicit chain start for the flow families (nothing for the rest)."""
    if not hasattr(policy, "model_action_dim"):
        return {}
    return {"noise": torch.randn(batch, policy.chunk_size, policy.model_action_dim, generator=torch.Generator().manual_seed(seed))}


def test_act_shapes_and_dtypes(case):
    _, _, _, policy = case
    out = act(policy, make_obs(3))
    assert out.actions.shape == (3, policy.chunk_size, SPEC.action_dim) and out.actions.dtype == torch.float32
    assert out.logprob.shape == (3, level_len(policy)) and out.logprob.dtype == torch.float32
    assert out.value.shape == (3,) and out.value.dtype == torch.float32
    assert all(v.shape[0] == 3 for v in out.replay.values())
    assert torch.isfinite(out.actions).all() and torch.isfinite(out.logprob).all()


def test_evaluate_reproduces_act_logprobs(case):
    _, _, _, policy = case
    obs = make_obs(4, seed=1)
    out = act(policy, obs)
    ev = policy.evaluate(obs, out.actions, out.replay)
    assert ev.logprob.shape == out.logprob.shape
    torch.testing.assert_close(ev.logprob.detach(), out.logprob, atol=1e-5, rtol=0)
    torch.testing.assert_close(ev.value.detach(), out.value, atol=1e-5, rtol=0)
    assert torch.isfinite(ev.entropy).all()
    if policy.family == "openvla_oft":  # behaviour cloning scores given actions with no replay
        bare = policy.evaluate(obs, out.actions, {})
        # OpenVLA decodes its two highest bins to one centre; the action tokenizer encodes it as the
        # second, so a sampled first bin is the one token an action cannot name.
        named = out.replay["action_bins"] != 0
        torch.testing.assert_close(bare.logprob.detach()[named], out.logprob[named], atol=1e-5, rtol=0)


def test_gradients_reach_every_trainable_parameter(case):
    _, _, _, policy = case
    obs = make_obs(2, seed=2)
    out = act(policy, obs)
    policy.zero_grad(set_to_none=True)
    ev = policy.evaluate(obs, out.actions, out.replay)
    (ev.logprob.sum() + ev.value.sum() + ev.entropy.sum()).backward()
    dead = [n for n, p in policy.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.abs().sum() > 0)]
    assert not dead, f"no gradient reaches: {dead}"
    policy.zero_grad(set_to_none=True)


def test_deterministic_repeats_exactly(case):
    _, _, _, policy = case
    obs = make_obs(3, seed=3)
    a, b = act(policy, obs, True), act(policy, obs, True)
    assert torch.equal(a.actions, b.actions) and torch.equal(a.logprob, b.logprob) and torch.equal(a.value, b.value)
    drawn = flow_start(policy, 3, seed=0)  # what seed_eval(0) draws first
    if drawn:  # the ODE starts from the seeded prior, not from zero
        with torch.inference_mode():
            nxt = policy.act(obs, True)  # the stream goes on: new starts
            zero = policy.act(obs, True, noise=torch.zeros_like(drawn["noise"]))
        assert torch.equal(act(policy, obs, True, **drawn).actions, a.actions)
        assert not torch.allclose(nxt.actions, a.actions, atol=1e-4)
        assert not torch.allclose(zero.actions, a.actions, atol=1e-4)


def test_batched_matches_one_by_one(case):
    _, _, _, policy = case
    obs = make_obs(4, seed=4)  # instructions of different lengths: padding must not leak
    start = flow_start(policy, 4)
    batched = act(policy, obs, True, **start)
    sampled = act(policy, obs)
    ev = policy.evaluate(obs, sampled.actions, sampled.replay)
    for i in range(4):
        one_obs = obs.select([i])
        one = act(policy, one_obs, True, **{k: v[i : i + 1] for k, v in start.items()})
        torch.testing.assert_close(one.actions[0], batched.actions[i], atol=1e-4, rtol=0)
        torch.testing.assert_close(one.value[0], batched.value[i], atol=1e-4, rtol=0)
        replay = {k: v[i : i + 1] for k, v in sampled.replay.items()}
        one_ev = policy.evaluate(one_obs, sampled.actions[i : i + 1], replay)
        torch.testing.assert_close(one_ev.logprob[0], ev.logprob[i], atol=1e-4, rtol=1e-5)


def test_state_dict_round_trip(case):
    family, cfg_file, extra, policy = case
    other = build(family, cfg_file, extra, init_seed=123)
    obs = make_obs(2, seed=5)
    assert not torch.allclose(act(other, obs, True).actions, act(policy, obs, True).actions)
    other.load_state_dict(policy.state_dict())
    assert torch.equal(act(other, obs, True).actions, act(policy, obs, True).actions)


def test_from_pretrained_round_trip_and_missing(case, tmp_path):
    family, _, _, policy = case
    cls = type(policy)
    save_release(policy, str(tmp_path / "ck"))
    loaded = load_release(str(tmp_path / "ck"), cls.family, SPEC, dict(device="cpu", dtype="float32"))
    obs = make_obs(2, seed=6)
    assert torch.equal(act(loaded, obs, True).actions, act(policy, obs, True).actions)

    # A directory missing files names all of them.
    os.remove(tmp_path / "ck" / "tokenizer.json")
    os.remove(tmp_path / "ck" / "model.safetensors")
    with pytest.raises(FileNotFoundError) as err:
        load_release(str(tmp_path / "ck"), cls.family, SPEC, dict(device="cpu"))
    assert "tokenizer.json" in str(err.value) and "model.safetensors" in str(err.value)


def test_from_pretrained_names_missing_parameters(case, tmp_path):
    from safetensors.torch import load_file, save_file

    _, _, _, policy = case
    ck = tmp_path / "ck"
    save_release(policy, str(ck))
    sd = load_file(ck / "model.safetensors")
    victim = sorted(k for k in sd if "value_head" not in k and "noise_head" not in k)[0]
    del sd[victim]
    save_file(sd, ck / "model.safetensors")
    with pytest.raises(ValueError, match="missing parameters"):
        load_release(str(ck), policy.family, SPEC, dict(device="cpu"))


def test_every_family_registered():
    from workers.policies.base import policy_families

    present = [f for f, m in MODULES.items() if importlib.util.find_spec(f"workers.policies.{m}")]
    assert set(present) <= set(policy_families())


def test_pi0_loads_a_plain_transformers_release(tmp_path):
    """A release dir has only what transformers writes (PI0Config, released key names) and a
    tokenizer: chunk size comes from it, RL heads start fresh."""
    import json

    from safetensors.torch import load_file

    policy = build("pi0", "pi0_tiny.yaml", {})
    ck = tmp_path / "release"
    save_release(policy, str(ck))
    for extra in ("rlvla3.json", "rlvla3_rl_heads.safetensors"):
        os.remove(ck / extra)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["chunk_size"] = 3
    (ck / "config.json").write_text(json.dumps(cfg))
    sd = load_file(ck / "model.safetensors")
    assert any(k.startswith("paligemma_with_expert.") for k in sd)  # released names on disk
    loaded = load_release(str(ck), policy.family, SPEC, dict(device="cpu", dtype="float32"))
    assert loaded.chunk_size == 3
    assert act(loaded, make_obs(2), True).actions.shape == (2, 3, SPEC.action_dim)


@pytest.mark.parametrize("steps", ["all", "one"])
def test_ppo_moves_a_flow_chain_toward_positive_advantages(steps):
    """PPO through the Flow-SDE chain's log-prob: samples whose first action dimension is larger
    get positive advantages, and the deterministic (ODE) action, from the seeded prior, follows them up."""
    from rlvla3.config import AlgoConfig
    from workers.algorithms.ppo import make_optimizer, ppo_update

    torch.manual_seed(0)
    policy = build("pi05", "pi05_tiny.yaml", {"stochastic_steps": steps})
    policy.train()
    cfg = AlgoConfig(epochs=2, minibatch_size=32, lr=3e-4, vf_coef=0.0)
    opt = make_optimizer(policy.parameters(), cfg)
    obs = make_obs(64, seed=5)
    start = float(act(policy, obs, deterministic=True).actions[..., 0].mean())
    for _ in range(10):
        out = act(policy, obs)
        score = out.actions[..., 0].mean(1)
        batch = {"obs": obs, "actions": out.actions, "replay": out.replay, "behav_logprob": out.logprob,
                 "advantages": score - score.mean(), "values": out.value, "returns": None}
        ppo_update(policy, opt, batch, cfg)
    end = float(act(policy, obs, deterministic=True).actions[..., 0].mean())
    assert end > start + 0.05, (start, end)  # measured: +0.30 ("all"), +0.095 ("one")


def test_openvla_oft_expected_readout_reads_the_mean_of_the_bins():
    """``readout: expected`` reads a deterministic act as the mean of the action the head samples
    (here estimated from 4,000 samples of one observation), where argmax reads the most likely bin;
    sampling itself is the same under both readouts. The random head is near uniform over the 32
    bins, so its action rows are scaled until the most likely bin holds about half the mass."""
    from rlvla3.observation import Observation

    torch.manual_seed(0)
    argmax = build("openvla_oft", "openvla_oft_tiny.yaml", {})
    torch.manual_seed(0)
    expected = build("openvla_oft", "openvla_oft_tiny.yaml", {"readout": "expected"})
    for policy in (argmax, expected):
        with torch.no_grad():
            policy.llm.lm_head.weight[policy.base_vocab - policy.opts.n_bins: policy.base_vocab] *= 30.0
    one = make_obs(1, seed=4)
    torch.manual_seed(5)
    drawn = act(argmax, one)
    torch.manual_seed(5)
    assert torch.equal(act(expected, one).actions, drawn.actions)  # sampling: the same draw

    torch.manual_seed(6)
    samples = act(expected, Observation.concat([one] * 4000)).actions
    mean, spread = samples.mean(0), samples.std(0) / np.sqrt(len(samples))
    e, a = act(expected, one, True), act(argmax, one, True)
    assert (e.actions[0] - mean).abs().max() <= 5 * spread.max() + 1e-6
    assert (a.actions[0] - mean).abs().max() > 20 * spread.max()  # a bin centre is not the mean
    # The replayed tokens are the bins the expected action falls in, scored under the same head.
    assert torch.equal(e.replay["action_bins"], expected.action_bins(e.actions))
    assert torch.equal(act(expected, one, True).actions, e.actions)


def test_openvla_oft_refuses_an_unknown_readout():
    with pytest.raises(ValueError, match="readout 'mode' not in"):
        build("openvla_oft", "openvla_oft_tiny.yaml", {"readout": "mode"})


def test_pi05_refuses_an_unknown_critic():
    with pytest.raises(ValueError, match="critic 'prefix' not in"):
        build("pi05", "pi05_tiny.yaml", {"critic": "prefix"})


def test_pi05_expert_critic_is_an_rl_head_outside_the_release(tmp_path):
    """``critic: expert`` adds a state projection that no pi0.5 release has: the LeRobot files leave it
    out, rlvla3's heads file carries it, and a plain release (no heads file) starts it fresh."""
    from safetensors.torch import load_file

    policy = build("pi05", "pi05_tiny.yaml", {"critic": "expert"})
    with torch.no_grad():  # as training would leave it: not the seeded initialisation a load draws
        policy.value_in_proj.weight.mul_(3.0)
    ck = tmp_path / "ck"
    save_release(policy, str(ck))
    assert not any("value_in_proj" in k for k in load_file(ck / "model.safetensors"))
    assert {"value_in_proj.weight", "value_in_proj.bias"} <= set(load_file(ck / "rlvla3_rl_heads.safetensors"))
    obs = make_obs(2, seed=7)
    full = load_release(str(ck), "pi05", SPEC, dict(device="cpu", dtype="float32"))
    assert torch.equal(act(full, obs, True).value, act(policy, obs, True).value)
    os.remove(ck / "rlvla3_rl_heads.safetensors")
    plain = load_release(str(ck), "pi05", SPEC, dict(device="cpu", dtype="float32"))
    assert plain.opts.critic == "expert"
    assert torch.equal(act(plain, obs, True).actions, act(policy, obs, True).actions)
    assert not torch.allclose(act(plain, obs, True).value, act(policy, obs, True).value)
