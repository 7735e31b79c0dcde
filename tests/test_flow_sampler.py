"""The flow sampler's densities, checked against a Gaussian written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from workers.policies.flow_sampler import FlowSampler, SamplerConfig


def linear_velocity(x: torch.Tensor, t: torch.Tensor):
    """A fixed velocity field so the transition mean is known in closed form (features: zeros)."""
    return 0.5 * x + 0.25, torch.zeros_like(x[..., :1])


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


def point_mass_velocity(target: float):
    """The exact flow-matching velocity when every action is ``target``: ``(x - target) / t``."""
    def velocity(x: torch.Tensor, t: torch.Tensor):
        return (x - target) / t.view(-1, 1, 1), torch.zeros_like(x[..., :1])
    return velocity


def test_a_scored_start_scores_the_draws_spread_in_its_first_step():
    """From zero, the first step's std is the Flow-SDE std widened by the drawn start's share
    (``c = 1 + dt * (1 + sigma_1^2 / 2)``); the padded dims keep their draw and no noise."""
    torch.manual_seed(2)
    k, a = 4, 0.5
    sampler = FlowSampler(SamplerConfig(mode="sde", num_steps=k, noise_level=a, start="scored"), 1, 3, score_dims=2)
    x0 = torch.randn(5, 2, 3)
    res = sampler.sample(linear_velocity, x0, deterministic=False)
    assert torch.equal(res.chain[:, 0, :, :2], torch.zeros(5, 2, 2))
    assert torch.equal(res.chain[:, 0, :, 2], x0[..., 2])
    only_first = torch.zeros(5, k, dtype=torch.bool)
    only_first[:, 0] = True
    lp, _ = sampler.score(linear_velocity, res.chain, only_first)
    dt, sigma2 = -1.0 / k, a * a * k
    x, y = res.chain[:, 0].double(), res.chain[:, 1].double()
    mean = x + dt * ((0.5 * x + 0.25) + sigma2 / 2 * x)
    var = sigma2 * (-dt) + (1 + dt * (1 + sigma2 / 2)) ** 2
    by_hand = (-0.5 * (y - mean) ** 2 / var - 0.5 * math.log(2 * math.pi * var))[..., :2].sum(-1)
    torch.testing.assert_close(lp.double(), by_hand, atol=1e-5, rtol=1e-6)
    det = sampler.sample(linear_velocity, x0, deterministic=True)
    torch.testing.assert_close(det.chain[:, 0], x0)  # a deterministic chain starts from its draw

    torch.nn.init.constant_(sampler.start_head.bias, math.log(0.5) / sampler.cfg.start_gain)  # half the draw's spread
    lp_half, _ = sampler.score(linear_velocity, res.chain, only_first)
    var_half = var / 4
    half_by_hand = (-0.5 * (y - mean) ** 2 / var_half - 0.5 * math.log(2 * math.pi * var_half))[..., :2].sum(-1)
    torch.testing.assert_close(lp_half.double(), half_by_hand, atol=1e-5, rtol=1e-6)
    det = sampler.sample(linear_velocity, x0, deterministic=True)
    torch.testing.assert_close(det.chain[:, 0, :, :2], 0.5 * x0[..., :2])
    torch.testing.assert_close(det.chain[:, 0, :, 2], x0[..., 2])


@pytest.mark.parametrize("mode", ["sde", "noise"])
def test_a_scored_start_samples_what_a_drawn_start_samples(mode):
    """For the exact velocity of a point mass the two starts give the same first-step and final
    distributions: the scored start moves the draw's spread into a density, not into the actions."""
    torch.manual_seed(3)
    k, n = 4, 20000
    vel = point_mass_velocity(0.3)
    out = {}
    for start in ("drawn", "scored"):
        sampler = FlowSampler(SamplerConfig(mode=mode, num_steps=k, start=start), 1, 1, score_dims=1)
        if mode == "noise":
            torch.nn.init.zeros_(sampler.noise_head.weight)
            torch.nn.init.zeros_(sampler.noise_head.bias)
        with torch.no_grad():
            res = sampler.sample(vel, torch.randn(n, 1, 1), deterministic=False)
        out[start] = (res.chain[:, 1].flatten(), res.actions.flatten())
    for i in range(2):
        drawn, scored = out["drawn"][i], out["scored"][i]
        assert abs(float(drawn.mean() - scored.mean())) < 0.02, (i, drawn.mean(), scored.mean())
        assert abs(float(drawn.std() / scored.std()) - 1.0) < 0.03, (i, drawn.std(), scored.std())


def test_a_scored_start_needs_a_stochastic_sampler_and_keeps_its_first_step_in_one_step_mode():
    with pytest.raises(ValueError, match="start: scored needs a stochastic sampler"):
        SamplerConfig(mode="ode", start="scored")
    with pytest.raises(ValueError, match="sampler start 'zero' not in"):
        SamplerConfig(start="zero")
    with pytest.raises(ValueError, match="start_gain must be > 0"):
        SamplerConfig(start="scored", start_gain=0.0)
    sampler = FlowSampler(SamplerConfig(mode="sde", num_steps=5, stochastic_steps="one", start="scored"), 1, 2, 2)
    res = sampler.sample(linear_velocity, torch.randn(50, 2, 2), deterministic=False)
    assert res.mask[:, 0].all() and (res.mask.sum(1) <= 2).all() and (res.mask.sum(1) == 2).any()
