"""Behaviour cloning from the synthetic task's scripted expert raises the deterministic policy's
success, and writes a checkpoint that ``model.checkpoint`` starts RL from."""

import numpy as np
import pytest
import torch

from rlvla3.config import load
from workers.model import build_policy
from workers.sft import collect_demos, load_demos, run_sft, save_demos

FAST_ENV = ("env.options.latency={kind: constant, mean_ms: 0.0}", "env.options.image_size=8")


def test_bc_raises_success_and_checkpoint_loads(tmp_path):
    cfg = load("synthetic.yaml", list(FAST_ENV))
    fig = run_sft(cfg, tmp_path / "sft", episodes=96, epochs=40, eval_episodes=24)
    assert fig["loss_last"] < fig["loss_first"]
    assert fig["success_after"] >= fig["success_before"] + 0.25, fig

    warm = build_policy(load("synthetic.yaml", [*FAST_ENV, f"model.checkpoint={tmp_path / 'sft'}"]))
    from safetensors.torch import load_file

    cloned = load_file(str(tmp_path / "sft" / "model.safetensors"))
    for k, v in warm.state_dict().items():
        assert torch.equal(v, cloned[k]), k


def test_recorded_demos_roundtrip(tmp_path):
    cfg = load("synthetic.yaml", [*FAST_ENV, "model.chunk_size=2"])
    demos = collect_demos(cfg, episodes=8)
    assert demos["actions"].shape[1:] == (2, 2) and demos["state"].shape[1] == 4
    assert demos["images/top"].shape[0] == demos["state"].shape[0]
    save_demos(tmp_path / "d.npz", demos)
    back = load_demos(tmp_path / "d.npz")
    assert all(np.array_equal(back[k], demos[k]) for k in demos)
    fig = run_sft(cfg, tmp_path / "out", epochs=2, demos_path=str(tmp_path / "d.npz"), eval_episodes=0)
    assert fig["decisions"] == len(demos["state"]) and (tmp_path / "out" / "model.safetensors").is_file()



@pytest.mark.parametrize("config", ["synthetic_pi0.yaml", "synthetic_pi05.yaml", "synthetic_gr00t_n15.yaml"])
def test_flow_matching_families_clone_by_flow_matching(config, tmp_path):
    """pi0, pi0.5 and GR00T train on expert chunks by their flow-matching loss (no sampler replay
    needed); the loss falls and the RL heads (critic, Flow-Noise head) are left as they were."""
    from rlvla3.observation import Observation
    from workers.sft import behaviour_clone

    cfg = load(config, list(FAST_ENV) + ["env.options.image_size=16", "model.options.sampler=noise"])
    demos = collect_demos(cfg, episodes=6)
    policy = build_policy(cfg, device="cpu")
    heads = {k: v.clone() for k, v in policy.state_dict().items() if k.startswith(("value_head.", "sampler.noise_head."))}
    assert any(k.startswith("sampler.noise_head.") for k in heads)
    obs = Observation.from_tensors(demos, [str(s) for s in demos["instruction"]])
    actions = torch.as_tensor(demos["actions"])
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(len(actions), policy.chunk_size, policy.model_action_dim, generator=g)
    times = torch.rand(len(actions), generator=g)
    with torch.no_grad():
        before = float(policy.sft_loss(obs, actions, noise=noise, time=times))
    torch.manual_seed(0)
    behaviour_clone(policy, demos, epochs=4, lr=1e-3, minibatch_size=32)
    with torch.no_grad():
        assert float(policy.sft_loss(obs, actions, noise=noise, time=times)) < before
    after = policy.state_dict()
    assert all(torch.equal(after[k], v) for k, v in heads.items())
