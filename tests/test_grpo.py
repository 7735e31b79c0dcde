"""GRPO: group-relative advantages, zero-variance filtering, and the value-free update."""

import math

import pytest
import torch

from rlvla3.config import AlgoConfig, ConfigError, load
from workers.algorithms.grpo import broadcast_episode_advantages, grpo_advantages
from workers.algorithms.ppo import ppo_loss


def test_advantages_and_filtering_by_hand():
    # group 0: 1 0 1 0 -> mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.8660
    # group 1: all succeed, group 2: all fail -> filtered
    # group 7 (ids need not be contiguous): 3 1 2 -> mean 2, std sqrt(2 / 2) = 1 -> 1 -1 0
    # group 9: one episode only -> no variance, filtered
    returns = torch.tensor([1.0, 0.0, 1.0, 0.0, 1, 1, 1, 1, 0, 0, 0, 0, 3, 1, 2, 5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 7, 7, 7, 9])
    adv, keep, stats = grpo_advantages(returns, groups, std_eps=0.0)

    a = 0.5 / math.sqrt(1 / 3)
    assert adv.tolist() == pytest.approx([a, -a, a, -a] + [0.0] * 8 + [1.0, -1.0, 0.0] + [0.0])
    assert keep.tolist() == [True] * 4 + [False] * 8 + [True] * 3 + [False]
    assert stats == {"groups": 5, "groups_filtered_zero_variance": 3, "episodes_kept": 7}


def test_interleaved_groups_and_mean_only_variant():
    returns = torch.tensor([1.0, 4.0, 3.0, 0.0])
    groups = torch.tensor([5, 6, 5, 6])
    adv, keep, _ = grpo_advantages(returns, groups, scale_by_std=False)
    assert adv.tolist() == pytest.approx([-1.0, 2.0, 1.0, -2.0])
    assert keep.all()


def test_broadcast_to_decision_steps():
    episode_adv = torch.tensor([0.5, -1.0, 2.0])
    step_episode = torch.tensor([0, 0, 0, 1, 2, 2])
    assert broadcast_episode_advantages(episode_adv, step_episode).tolist() == [0.5, 0.5, 0.5, -1.0, 2.0, 2.0]


def test_grpo_loss_is_ppo_surrogate_without_value_term():
    """The update runs GRPO through ppo_loss with no returns: the value term drops out."""
    g = torch.Generator().manual_seed(0)
    behav = torch.randn(12, 3, generator=g)
    prox = behav + 0.1 * torch.randn(12, 3, generator=g)
    new = (prox + 0.2 * torch.randn(12, 3, generator=g)).requires_grad_(True)
    adv = torch.randn(12, generator=g)
    cfg = AlgoConfig(name="grpo", ent_coef=0.0)
    loss, stats = ppo_loss(new, prox, behav, adv, torch.zeros(12), torch.zeros(12), None, None, cfg)
    ref, _ = ppo_loss(new, prox, behav, adv, None, None, None, None, AlgoConfig(name="grpo", ent_coef=0.0, vf_coef=0.0))
    assert float(loss.detach()) == pytest.approx(float(ref.detach()))
    assert stats["value_loss"] == 0.0


def test_group_size_must_allow_variance():
    with pytest.raises(ConfigError, match="env.group_size"):
        load("synthetic.yaml", ["algo.name=grpo", "env.group_size=1"])
