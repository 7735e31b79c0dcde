"""Decoupled PPO loss against a hand-computed minibatch, its reductions, and one real update."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from rlvla3.observation import Observation

from rlvla3.config import AlgoConfig, ConfigError, from_dict
from workers.algorithms.ppo import (
    proximal_pass,
    index_batch,
    make_optimizer,
    ppo_loss,
    ppo_update,
)
from workers.envs.base import EnvSpec
from workers.policies.base import ActOutput, EvalOutput, Policy

ln = math.log

# ---------------------------------------------------------------------------------------------
# The hand example: four samples, L = 1, eps = 0.2, dual clip c = 3, behaviour weight cap 2
#
#   sample  A     behav   prox   new    w = min(prox/behav, 2)   r = new/prox   objective (pessimistic)       -w*obj
#   0       +1    0.5     0.5    0.55   1                        1.1            min(1.1, 1.1) = 1.1           -1.1
#   1       +2    0.4     0.5    0.75   1.25                     1.5 (clipped)  min(3.0, 1.2*2 = 2.4) = 2.4   -3.0
#   2       -1    0.3     0.3    1.2    1                        4.0            min(-4, -1.2) = -4 -> dual: max(-4, 3*-1) = -3   +3.0
#   3       -0.5  0.1     0.5    0.45   5 -> capped 2            0.9            min(-0.45, -0.45) = -0.45     +0.9
#
#   policy_loss = (-1.1 - 3.0 + 3.0 + 0.9) / 4 = -0.05
#
#   value (clip 0.2):  old    new   R     (new-R)^2   clipped v          (v_c-R)^2   max
#   0                  1.0    1.5   2.0   0.25        1.0+0.2 = 1.2      0.64        0.64
#   1                  0.0    0.1   0.0   0.01        0.1                0.01        0.01
#   2                  0.5    0.5   1.0   0.25        0.5                0.25        0.25
#   3                  2.0    1.0   1.0   0.0         2.0-0.2 = 1.8      0.64        0.64
#   value_loss = 0.5 * (0.64 + 0.01 + 0.25 + 0.64) / 4 = 0.1925
#
#   entropy = mean(1, 2, 3, 2) = 2.0
#   loss = -0.05 + 0.5 * 0.1925 - 0.01 * 2.0 = 0.02625
# ---------------------------------------------------------------------------------------------

BEHAV = [0.5, 0.4, 0.3, 0.1]
PROX = [0.5, 0.5, 0.3, 0.5]
NEW = [0.55, 0.75, 1.2, 0.45]
ADV = [1.0, 2.0, -1.0, -0.5]
OLD_V = [1.0, 0.0, 0.5, 2.0]
NEW_V = [1.5, 0.1, 0.5, 1.0]
RET = [2.0, 0.0, 1.0, 1.0]
ENT = [1.0, 2.0, 3.0, 2.0]

CFG = AlgoConfig(
    clip_eps=0.2, dual_clip=3.0, behav_weight_cap=2.0, value_clip_eps=0.2, vf_coef=0.5, ent_coef=0.01
)


def _hand_tensors(split_units: bool = False):
    def lp(ps):
        t = torch.tensor([[ln(p)] for p in ps], dtype=torch.float64)
        if split_units:  # the same chunk log-prob spread over two units
            t = torch.cat([t - 0.3, torch.full_like(t, 0.3)], dim=1)
        return t

    new = lp(NEW).requires_grad_(True)
    return dict(
        new_logprob=new,
        prox_logprob=lp(PROX),
        behav_logprob=lp(BEHAV),
        advantages=torch.tensor(ADV, dtype=torch.float64),
        new_value=torch.tensor(NEW_V, dtype=torch.float64, requires_grad=True),
        old_value=torch.tensor(OLD_V, dtype=torch.float64),
        returns=torch.tensor(RET, dtype=torch.float64),
        entropy=torch.tensor(ENT, dtype=torch.float64),
    )


def test_hand_computed_decoupled_loss():
    t = _hand_tensors()
    loss, stats = ppo_loss(**t, cfg=CFG)

    assert stats["policy_loss"] == pytest.approx(-0.05)
    assert stats["value_loss"] == pytest.approx(0.1925)
    assert stats["entropy"] == pytest.approx(2.0)
    assert float(loss.detach()) == pytest.approx(0.02625)
    assert stats["clip_frac"] == pytest.approx(0.5)  # samples 1 and 2 leave [0.8, 1.2]
    assert stats["dual_clip_frac"] == pytest.approx(0.25)  # sample 2
    assert stats["behav_weight_mean"] == pytest.approx((1 + 1.25 + 1 + 2) / 4)
    assert stats["behav_weight_capped_frac"] == pytest.approx(0.25)  # sample 3
    k3 = [(r - 1) - ln(r) for r in (1.1, 1.5, 4.0, 0.9)]
    assert stats["approx_kl"] == pytest.approx(sum(k3) / 4)

    # Gradients: only unclipped samples move the policy, each by -w * r * A / B.
    loss.backward()
    expected = [-1 * 1.1 * 1.0 / 4, 0.0, 0.0, -2 * 0.9 * -0.5 / 4]
    assert t["new_logprob"].grad[:, 0].tolist() == pytest.approx(expected)
    # Value: d/dv of 0.5*0.5*mean(max(...)): samples 0 and 3 are clipped (no gradient).
    assert t["new_value"].grad.tolist() == pytest.approx([0.0, 0.5 * 0.5 * 2 * 0.1 / 4, 0.5 * 0.5 * 2 * -0.5 / 4, 0.0])


def test_behaviour_trust_region_clips_around_the_actor():
    """trust_region="behaviour" on the hand example: r = new/behav, w = 1.

    sample  A     r = new/behav   objective                                -obj
    0       +1    1.1             1.1                                      -1.1
    1       +2    1.875           min(3.75, 1.2*2 = 2.4) = 2.4 (clipped)   -2.4
    2       -1    4.0             min(-4, -1.2) = -4 -> dual: -3           +3.0
    3       -0.5  4.5             min(-2.25, -0.6) = -2.25 -> dual: -1.5   +1.5
    policy_loss = (-1.1 - 2.4 + 3.0 + 1.5) / 4 = 0.25; only sample 0 keeps a gradient.
    """
    t = _hand_tensors()
    cfg = AlgoConfig(**{**CFG.__dict__, "trust_region": "behaviour"})
    loss, stats = ppo_loss(**t, cfg=cfg)
    assert stats["policy_loss"] == pytest.approx(0.25)
    assert stats["behav_weight_mean"] == pytest.approx(1.0)
    assert stats["clip_frac"] == pytest.approx(0.75)
    loss.backward()
    assert t["new_logprob"].grad[:, 0].tolist() == pytest.approx([-1.1 / 4, 0.0, 0.0, 0.0])


def test_chunk_level_sums_units_before_the_ratio():
    cfg = AlgoConfig(**{**CFG.__dict__, "ratio_level": "chunk"})
    loss, stats = ppo_loss(**_hand_tensors(split_units=True), cfg=cfg)
    assert stats["policy_loss"] == pytest.approx(-0.05)
    assert float(loss.detach()) == pytest.approx(0.02625)


def test_mask_removes_samples():
    t = _hand_tensors()
    _, stats = ppo_loss(**t, cfg=CFG, mask=torch.tensor([True, True, True, False]))
    assert stats["policy_loss"] == pytest.approx((-1.1 - 3.0 + 3.0) / 3)
    assert stats["value_loss"] == pytest.approx(0.5 * (0.64 + 0.01 + 0.25) / 3)


def test_fresh_samples_reduce_to_standard_ppo():
    """prox == behav: w = 1 everywhere, so the loss is CleanRL's clipped surrogate."""
    g = torch.Generator().manual_seed(0)
    b, l = 64, 5
    behav = torch.randn(b, l, generator=g)
    new = (behav + 0.3 * torch.randn(b, l, generator=g)).requires_grad_(True)
    adv = torch.randn(b, generator=g)
    cfg = AlgoConfig(dual_clip=0.0, behav_weight_cap=1.0, vf_coef=0.0, ent_coef=0.0)
    loss, stats = ppo_loss(new, behav.clone(), behav, adv, None, None, None, None, cfg)

    ratio = torch.exp(new - behav)
    a = adv[:, None]
    standard = torch.max(-a * ratio, -a * ratio.clamp(0.8, 1.2)).mean()
    assert float(loss.detach()) == pytest.approx(float(standard.detach()), rel=1e-6)
    assert stats["behav_weight_mean"] == 1.0 and stats["behav_weight_capped_frac"] == 0.0
    g1 = torch.autograd.grad(loss, new)[0]
    g2 = torch.autograd.grad(standard, new)[0]
    assert torch.allclose(g1, g2)


# ---------------------------------------------------------------------------------------------
# A tiny Gaussian policy (action-level log-probs) to drive ppo_update end to end
# ---------------------------------------------------------------------------------------------

SPEC = EnvSpec(cameras={"wrist": (4, 4)}, state_dim=3, action_dim=2, max_episode_steps=10)


class TinyPolicy(Policy):
    family = "tiny-test"
    logprob_level = "action"

    def __init__(self, spec: EnvSpec = SPEC, chunk_size: int = 2) -> None:
        super().__init__(spec, chunk_size)
        self.mean = nn.Linear(spec.state_dim, chunk_size * spec.action_dim)
        self.log_std = nn.Parameter(torch.full((spec.action_dim,), -0.5))
        self.value_head = nn.Linear(spec.state_dim, 1)

    def _dist(self, obs):
        s = torch.as_tensor(obs.state, dtype=torch.float32, device=self.device)
        mu = self.mean(s).view(-1, self.chunk_size, self.action_dim)
        return torch.distributions.Normal(mu, self.log_std.exp().expand_as(mu)), s

    def act(self, obs, deterministic=False):
        with torch.no_grad():
            dist, s = self._dist(obs)
            a = dist.mean if deterministic else dist.sample()
            return ActOutput(a, dist.log_prob(a).sum(-1), self.value_head(s).squeeze(-1), {})

    def evaluate(self, obs, actions, replay):
        dist, s = self._dist(obs)
        return EvalOutput(dist.log_prob(actions).sum(-1), dist.entropy().sum(-1), self.value_head(s).squeeze(-1))


def make_obs(n: int, rng: np.random.Generator) -> Observation:
    return Observation(
        {"wrist": rng.integers(0, 255, (n, 4, 4, 3), dtype=np.uint8)},
        rng.standard_normal((n, 3)).astype(np.float32),
        [f"task {i}" for i in range(n)],
    )


def make_batch(policy: Policy, n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    obs = make_obs(n, rng)
    out = policy.act(obs)
    returns = torch.as_tensor(rng.standard_normal(n).astype(np.float32))
    # Reward actions whose first component is positive, so the update has a direction.
    adv = out.actions[:, :, 0].sum(-1)
    return {
        "obs": obs,
        "actions": out.actions,
        "replay": out.replay,
        "behav_logprob": out.logprob,
        "advantages": adv,
        "returns": returns,
        "values": out.value,
    }


def test_index_batch_slices_obs_and_tensors():
    torch.manual_seed(0)
    batch = make_batch(TinyPolicy(), 6)
    mb = index_batch(batch, torch.tensor([4, 1]))
    assert mb["obs"].instruction == ["task 4", "task 1"]
    assert mb["obs"].images["wrist"].shape == (2, 4, 4, 3)
    np.testing.assert_array_equal(mb["obs"].state, batch["obs"].state[[4, 1]])
    assert torch.equal(mb["actions"], batch["actions"][[4, 1]])


def test_proximal_logprobs_match_behaviour_for_an_unchanged_policy():
    torch.manual_seed(0)
    policy = TinyPolicy()
    batch = make_batch(policy, 10)
    prox = proximal_pass(policy, batch, chunk=3)[0]
    assert prox.shape == (10, 2) and not prox.requires_grad
    assert torch.allclose(prox, batch["behav_logprob"], atol=1e-5)


def test_an_epoch_splits_into_near_equal_minibatches():
    """69 samples at minibatch_size 16: five minibatches of 13-14, never 16+16+16+16+5 (a step
    from a handful of samples whose advantages need not average zero)."""
    torch.manual_seed(0)
    policy = TinyPolicy()
    cfg = AlgoConfig(epochs=2, minibatch_size=16, lr=1e-3)
    sizes: list[int] = []
    evaluate = policy.evaluate

    def counted(obs, actions, replay):  # the test's own policy, its calls counted
        sizes.append(len(actions))
        return evaluate(obs, actions, replay)

    policy.evaluate = counted

    batch = make_batch(policy, 69)
    batch["prox_logprob"] = batch["behav_logprob"].clone()  # only the clipped epochs call evaluate
    stats = ppo_update(policy, make_optimizer(policy.parameters(), cfg), batch, cfg)

    assert stats["optimizer_steps"] == 2 * 5
    assert sorted(set(sizes)) == [13, 14] and sum(sizes) == 2 * 69


def test_ppo_update_runs_epochs_and_moves_the_policy_toward_the_advantage():
    torch.manual_seed(0)
    policy = TinyPolicy()
    cfg = AlgoConfig(epochs=3, minibatch_size=16, lr=1e-2, ent_coef=0.01)
    opt = make_optimizer(policy.parameters(), cfg)
    batch = make_batch(policy, 64)
    bias_before = float(policy.mean.bias.detach().view(2, 2)[:, 0].mean())

    stats = ppo_update(policy, opt, batch, cfg)

    assert stats["optimizer_steps"] == 3 * 4
    for key in ("policy_loss", "value_loss", "entropy", "clip_frac", "approx_kl", "grad_norm", "explained_variance"):
        assert math.isfinite(stats[key]), key
    assert stats["behav_weight_mean"] == pytest.approx(1.0, abs=1e-4)  # fresh samples
    assert float(policy.mean.bias.detach().view(2, 2)[:, 0].mean()) > bias_before


def test_target_kl_stops_the_epochs_once_the_policy_has_moved_that_far():
    """CleanRL's ``target_kl``, read per epoch: an epoch whose mean approx KL passes the target is
    the update's last; a target the update never reaches leaves every epoch."""
    runs = {}
    for target in (1e-9, 10.0):
        torch.manual_seed(0)
        policy = TinyPolicy()
        cfg = AlgoConfig(epochs=5, minibatch_size=16, lr=1e-2, target_kl=target)
        runs[target] = ppo_update(policy, make_optimizer(policy.parameters(), cfg), make_batch(policy, 64), cfg)
    assert runs[1e-9]["epochs_run"] == 1 and runs[1e-9]["optimizer_steps"] == 4
    assert runs[1e-9]["approx_kl"] > 1e-9
    assert runs[10.0]["epochs_run"] == 5 and runs[10.0]["optimizer_steps"] == 5 * 4


def _update_log_std(adv_norm: str, seed: int, moved_on: float) -> float:
    """log-std after one 10-epoch update on a batch acted before the policy's mean moved on by
    ``moved_on`` toward the advantage (the first action component): a stale batch."""
    torch.manual_seed(seed)
    policy = TinyPolicy()
    batch = make_batch(policy, 512, seed=seed)
    with torch.no_grad():
        policy.mean.bias.view(2, 2)[:, 0] += moved_on
    cfg = AlgoConfig(epochs=10, minibatch_size=64, lr=3e-3, adv_norm=adv_norm, dual_clip=0, max_grad_norm=0.5)
    ppo_update(policy, make_optimizer(policy.parameters(), cfg), batch, cfg)
    return float(policy.log_std.detach().sum())


def test_proximal_adv_norm_keeps_a_stale_batch_from_narrowing_the_gaussian():
    """A policy that already moved toward the advantage has a positive mean advantage on the batch
    it acted before; centred as acted (``batch``), every sample then asks for a higher
    likelihood, and ten epochs grant it by narrowing the Gaussian onto the batch. Centred under
    the proximal policy the width stays (log-std sum starts at -1.0)."""
    for seed in range(3):
        narrowed = _update_log_std("batch", seed, moved_on=0.3)
        kept = _update_log_std("proximal", seed, moved_on=0.3)
        assert narrowed < -1.05 and kept > -1.03 and kept - narrowed > 0.07, (seed, narrowed, kept)


def test_proximal_adv_norm_is_batch_norm_on_fresh_samples():
    """Fresh samples weigh 1 each: the two standardisations give the same update (sync)."""
    assert _update_log_std("proximal", 0, moved_on=0.0) == pytest.approx(_update_log_std("batch", 0, moved_on=0.0),
                                                                        abs=1e-6)


def test_proximal_adv_norm_survives_ratios_that_underflow():
    """Long decisions sum many units' log-ratios: weights of e^-200 each must still standardise
    (in log space), not divide zero by zero."""
    torch.manual_seed(0)
    policy = TinyPolicy()
    batch = make_batch(policy, 64)
    batch["prox_logprob"] = batch["behav_logprob"] - 100.0  # two units: e^-200 a sample
    cfg = AlgoConfig(epochs=1, minibatch_size=32, adv_norm="proximal")
    stats = ppo_update(policy, make_optimizer(policy.parameters(), cfg), batch, cfg)
    assert math.isfinite(stats["loss"]) and all(torch.isfinite(p).all() for p in policy.parameters())


def test_first_step_ratio_is_one_with_recomputed_proximal():
    torch.manual_seed(1)
    policy = TinyPolicy()
    cfg = AlgoConfig(epochs=1, minibatch_size=32)
    batch = make_batch(policy, 32)
    stats = ppo_update(policy, make_optimizer(policy.parameters(), cfg), batch, cfg)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert stats["clip_frac"] == 0.0


def test_config_rejects_bad_values():
    for bad in ({"ratio_level": "token"}, {"dual_clip": 0.9}, {"behav_weight_cap": 0.5}, {"trust_region": "actor"},
                {"target_kl": -0.01}, {"adv_norm": "group"}):
        with pytest.raises(ConfigError, match=f"algo.{next(iter(bad))}"):
            from_dict({"algo": bad})


def test_bf16_logprobs_are_scored_in_float32():
    t = {k: v.detach().float() for k, v in _hand_tensors().items()}
    for k in ("new_logprob", "prox_logprob", "behav_logprob", "new_value"):
        t[k] = t[k].to(torch.bfloat16)
    t["new_logprob"].requires_grad_(True)
    loss, stats = ppo_loss(**t, cfg=CFG)
    assert loss.dtype == torch.float32
    assert stats["policy_loss"] == pytest.approx(-0.05, abs=0.05)  # bf16 inputs, float32 arithmetic
    loss.backward()
    assert t["new_logprob"].grad.dtype == torch.bfloat16
