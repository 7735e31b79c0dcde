"""Trainer precision and memory: bf16 parameters stepped through an fp32 master (MasterAdam),
its state surviving a checkpoint, and gradient checkpointing recomputing layers in backward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from rlvla3.config import load
from rlvla3.harness.bench import random_observation
from rlvla3.observation import Observation
from workers.algorithms.memory import enable_gradient_checkpointing
from workers.algorithms.ppo import make_optimizer
from workers.algorithms.precision import MasterAdam
from workers.checkpoint import load_checkpoint, save_checkpoint
from workers.model import build_policy, job_spec


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    torch.manual_seed(1)
    for _ in range(n):
        x = torch.randn(8, 6)
        opt.zero_grad()
        model(x.to(next(model.parameters()).dtype)).float().pow(2).mean().backward()
        opt.step()


def test_master_adam_is_adam_in_fp32() -> None:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    b = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    b.load_state_dict(a.state_dict())
    _steps(a, torch.optim.Adam(a.parameters(), lr=1e-2, eps=1e-5), 20)
    _steps(b, MasterAdam(b.parameters(), lr=1e-2, eps=1e-5), 20)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_bf16_steps_below_resolution_accumulate_in_the_master() -> None:
    plain = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    mixed = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opts = [torch.optim.Adam([plain], lr=1e-4), MasterAdam([mixed], lr=1e-4)]
    for _ in range(200):  # each step ~1e-4; bf16's spacing at 1.0 is 2^-7
        for p, opt in zip((plain, mixed), opts):
            p.grad = torch.ones_like(p)
            opt.step()
    assert torch.equal(plain, torch.ones_like(plain))  # bf16 Adam: every step rounded away
    master = opts[1].state[mixed]["master"]
    assert master.dtype == torch.float32 and abs(float(master[0]) - 0.98) < 1e-3
    assert mixed.dtype == torch.bfloat16 and torch.equal(mixed, master.to(torch.bfloat16))


def test_bf16_policy_gets_master_adam_and_resumes_it(tmp_path) -> None:
    cfg = load("configs/synthetic_openvla_oft.yaml", ["workers.device=cpu", "model.dtype=bfloat16"])
    policy = build_policy(cfg)
    assert {p.dtype for p in policy.parameters()} == {torch.bfloat16}
    opt = make_optimizer(policy.parameters(), cfg.algo)
    assert isinstance(opt, MasterAdam)
    obs = _obs(cfg)
    out = policy.act(obs)
    policy.evaluate(obs, out.actions, out.replay).logprob.float().mean().backward()
    opt.step()
    save_checkpoint(tmp_path, policy, opt, 1, {}, cfg.to_yaml())
    again = build_policy(cfg)
    opt2 = make_optimizer(again.parameters(), cfg.algo)
    load_checkpoint(tmp_path, again, opt2)
    for p, q in zip(policy.parameters(), again.parameters()):
        assert torch.equal(p, q)
        if p in opt.state:
            for key in ("master", "exp_avg", "exp_avg_sq"):
                assert opt2.state[q][key].dtype == torch.float32
                assert torch.equal(opt.state[p][key], opt2.state[q][key])


def _obs(cfg, n: int = 4) -> Observation:
    spec, rng = job_spec(cfg), np.random.default_rng(0)
    return random_observation(spec, n, rng, "reach")


def test_gradient_checkpointing_keeps_fewer_activations_and_the_same_gradients() -> None:
    cfg = load("configs/synthetic_openvla_oft.yaml", ["workers.device=cpu", "model.dtype=float32"])
    obs = _obs(cfg)
    grads, saved = [], []
    for checkpointing in (False, True):
        policy = build_policy(cfg)
        policy.train()
        if checkpointing:
            assert enable_gradient_checkpointing(policy) == 3  # SigLIP, DINOv2, Llama
        out = policy.act(obs, deterministic=True)
        nbytes = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            nbytes[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # what backward keeps
            ev = policy.evaluate(obs, out.actions, out.replay)
        (ev.logprob.mean() + ev.value.pow(2).mean()).backward()
        saved.append(nbytes[0])
        grads.append({k: p.grad.clone() for k, p in policy.named_parameters() if p.grad is not None})
    assert saved[1] < 0.7 * saved[0], saved  # layer activations were not kept
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config", ["configs/synthetic_pi0.yaml", "configs/synthetic_pi05.yaml"])
def test_gradient_checkpointing_of_a_cache_reading_expert_gives_the_same_gradients(config: str) -> None:
    """pi0/pi0.5's expert reads the KV cache its VLM writes: only the vision tower may recompute."""
    cfg = load(config, ["workers.device=cpu", "model.dtype=float32"])
    obs = _obs(cfg, 2)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        policy = build_policy(cfg)
        policy.train()
        if checkpointing:
            assert enable_gradient_checkpointing(policy) == 1
        torch.manual_seed(1)
        out = policy.act(obs, deterministic=True)
        ev = policy.evaluate(obs, out.actions, out.replay)
        (ev.logprob.mean() + ev.value.pow(2).mean()).backward()
        grads.append({k: p.grad.clone() for k, p in policy.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=1e-5, atol=1e-6)
