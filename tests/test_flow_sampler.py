"""The flow sampler's densities, checked against a Gaussian written out by hand."""

from __future__ import annotations

import math

import torch

from workers.policies.flow_sampler import FlowSampler, SamplerConfig


def linear_velocity(x: torch.Tensor, t: torch.Tensor):
    """A fixed velocity field so the transition mean is known in closed form."""
    return 0.5 * x + 0.25, None


def test_one_sde_transition_matches_hand_gaussian():
    torch.manual_seed(0)
    k, a = 4, 0.7
    sampler = FlowSampler(SamplerConfig(mode="sde", num_steps=k, noise_level=a), feature_dim=1, action_dim=3, score_dims=3)
    x0 = torch.randn(2, 5, 3)
    res = sampler.sample(linear_velocity, x0, deterministic=False)
    only_first = torch.zeros(2, k, dtype=torch.bool)
    only_first[:, 1] = True  # score the step from t = 0.75 to t = 0.5 alone
    lp, ent = sampler.score(linear_velocity, res.chain, only_first)

    t, dt = 0.75, -1.0 / k
    x, y = res.chain[:, 1].double(), res.chain[:, 2].double()
    v = 0.5 * x + 0.25
    sigma_t = a * math.sqrt(t / (1 - t))
    mean = x + dt * (v + sigma_t**2 / (2 * t) * (x + (1 - t) * v))
    var = sigma_t**2 * (-dt)
    by_hand = (-0.5 * (y - mean) ** 2 / var - 0.5 * math.log(2 * math.pi * var)).sum(-1)
    torch.testing.assert_close(lp.double(), by_hand, atol=1e-5, rtol=1e-6)
    ent_hand = torch.full_like(by_hand, 3 * 0.5 * math.log(2 * math.pi * math.e * var))
    torch.testing.assert_close(ent.double(), ent_hand, atol=1e-5, rtol=1e-6)


def test_chain_logprob_is_sum_of_steps_and_first_step_is_finite():
    torch.manual_seed(1)
    sampler = FlowSampler(SamplerConfig(mode="sde", num_steps=3), feature_dim=1, action_dim=2, score_dims=2)
    res = sampler.sample(linear_velocity, torch.randn(4, 2, 2), deterministic=False)
    assert torch.isfinite(res.logprob).all()
    total = torch.zeros_like(res.logprob)
    for step in range(3):
        m = torch.zeros(4, 3, dtype=torch.bool)
        m[:, step] = True
        total += sampler.score(linear_velocity, res.chain, m)[0]
    torch.testing.assert_close(total, res.logprob, atol=1e-5, rtol=1e-6)


def test_deterministic_follows_the_ode_and_scores_nothing():
    sampler = FlowSampler(SamplerConfig(mode="sde", num_steps=2), feature_dim=1, action_dim=3, score_dims=2)
    x0 = torch.randn(2, 3, 3)
    det = sampler.sample(linear_velocity, x0, deterministic=True)
    x = x0
    for _ in range(2):
        x = x - 0.5 * (0.5 * x + 0.25)
    torch.testing.assert_close(det.actions, x)
    assert not det.mask.any() and torch.equal(det.logprob, torch.zeros_like(det.logprob))
    sto = sampler.sample(linear_velocity, x0, deterministic=False)
    assert sto.mask.all()
    assert not torch.allclose(sto.actions[..., :2], det.actions[..., :2])


def test_one_step_mode_marks_a_single_step():
    sampler = FlowSampler(SamplerConfig(mode="sde", num_steps=5, stochastic_steps="one"), 1, 2, 2)
    res = sampler.sample(linear_velocity, torch.randn(6, 2, 2), deterministic=False)
    assert torch.equal(res.mask.sum(1), torch.ones(6, dtype=torch.long))
