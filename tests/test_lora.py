"""LoRA on OpenVLA-OFT: adapters change nothing at version 0, only they (and the fresh RL heads)
train, and after version 0 the weight store receives only those tensors."""

from __future__ import annotations

import uuid

import numpy as np
import torch

from rlvla3.config import load
from rlvla3.harness.bench import random_observation
from rlvla3.observation import Observation
from rlvla3.weights.announce import parse_announcement
from rlvla3.weights.publisher import WeightPublisher
from workers.algorithms.ppo import make_optimizer
from workers.model import build_policy, job_spec

HEADS = ("value_head.", "proprio_proj.")


def _cfg(*sets: str):
    return load("configs/synthetic_openvla_oft.yaml", ["workers.device=cpu", "model.dtype=float32", *sets])


def _obs(cfg, n: int = 3) -> Observation:
    spec, rng = job_spec(cfg), np.random.default_rng(0)
    return random_observation(spec, n, rng, "reach the target")


def _adapted(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def test_lora_trains_only_adapters_and_heads() -> None:
    base = build_policy(_cfg())
    lora = build_policy(_cfg("model.lora.enabled=true", "model.lora.rank=4"))
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert any(_adapted(n) for n in trainable)
    assert all(_adapted(n) or n.startswith(HEADS) for n in trainable), trainable
    assert {n for n, _ in base.named_parameters()} <= {n for n, _ in lora.named_parameters()}  # base names kept
    obs = _obs(_cfg())
    a, b = base.act(obs, deterministic=True), lora.act(obs, deterministic=True)
    assert torch.equal(a.actions, b.actions) and torch.allclose(a.logprob, b.logprob)  # B = 0 at version 0

    opt = make_optimizer(lora.parameters(), _cfg().algo)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for p in lora.parameters() if p.requires_grad}
    out = lora.evaluate(obs, b.actions, b.replay)
    (-out.logprob.mean() + out.value.pow(2).mean()).backward()
    opt.step()
    changed = {n for n, p in lora.named_parameters() if p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0}
    assert any(".lora_B." in n for n in changed)
    assert all(p.grad is None for n, p in lora.named_parameters() if not p.requires_grad)


def test_lora_run_publishes_only_adapter_tensors_after_v0() -> None:
    policy = build_policy(_cfg("model.lora.enabled=true", "model.lora.train_also=[]"))
    pub = WeightPublisher(policy, "lo" + uuid.uuid4().hex[:8], stream_bind="")
    try:
        v0 = parse_announcement(pub.publish(0)).manifest.entries
        v1 = parse_announcement(pub.publish(1)).manifest.entries
    finally:
        pub.close()
    assert {n for n, _ in policy.named_parameters()} <= {e.name for e in v0}  # version 0: everything
    fresh = [e for e in v1 if e.since == 1]  # written for version 1 (the rest: frozen at 0)
    assert fresh and all(_adapted(e.name) for e in fresh), [e.name for e in fresh if not _adapted(e.name)]
    assert {e.name for e in fresh} == {n for n, p in policy.named_parameters() if _adapted(n)}
    assert all(e.since == 0 and not e.trainable for e in v1 if not _adapted(e.name))  # base: once, at v0
