"""GAE against numbers worked out by hand (gamma = 0.9, lambda = 0.8 unless said otherwise)."""

import pytest
import torch

from workers.algorithms.gae import compute_gae, compute_gae_batch

REWARDS = torch.tensor([1.0, 0.0, 2.0])
VALUES = torch.tensor([0.5, 1.0, 1.5])


def test_terminated_fragment_ignores_last_value():
    # t=2: delta = 2 - 1.5 = 0.5                     A2 = 0.5
    # t=1: delta = 0 + 0.9*1.5 - 1.0 = 0.35          A1 = 0.35 + 0.72*0.5  = 0.71
    # t=0: delta = 1 + 0.9*1.0 - 0.5 = 1.4           A0 = 1.4  + 0.72*0.71 = 1.9112
    adv, ret = compute_gae(REWARDS, VALUES, torch.tensor([False, False, True]), 100.0, gamma=0.9, lam=0.8)
    assert adv.tolist() == pytest.approx([1.9112, 0.71, 0.5])
    assert ret.tolist() == pytest.approx([2.4112, 1.71, 2.0])


def test_truncated_fragment_bootstraps_final_value():
    # last_value = V(final obs) = 2.0
    # t=2: delta = 2 + 0.9*2.0 - 1.5 = 2.3           A2 = 2.3
    # t=1: delta = 0.35                               A1 = 0.35 + 0.72*2.3   = 2.006
    # t=0: delta = 1.4                                A0 = 1.4  + 0.72*2.006 = 2.84432
    adv, ret = compute_gae(REWARDS, VALUES, torch.tensor([False, False, False]), 2.0, gamma=0.9, lam=0.8)
    assert adv.tolist() == pytest.approx([2.84432, 2.006, 2.3])
    assert ret.tolist() == pytest.approx([3.34432, 3.006, 3.8])


def test_termination_mid_fragment_cuts_the_chain():
    # gamma = 0.5, lambda = 1; episode ends at t=1, a new one starts at t=2 (bootstrapped by 4.0)
    # t=2: delta = 3 + 0.5*4 - 1 = 4                  A2 = 4
    # t=1: delta = 2 - 1 = 1 (terminated)             A1 = 1   (nothing flows back from t=2)
    # t=0: delta = 1 + 0.5*1 - 1 = 0.5                A0 = 0.5 + 0.5*1 = 1.0
    adv, _ = compute_gae(
        torch.tensor([1.0, 2.0, 3.0]), torch.ones(3), torch.tensor([False, True, False]), 4.0, gamma=0.5, lam=1.0
    )
    assert adv.tolist() == pytest.approx([1.0, 1.0, 4.0])


def test_lambda_one_gives_monte_carlo_returns():
    r = torch.tensor([0.0, 0.0, 1.0, 0.5])
    v = torch.tensor([0.3, -0.2, 0.7, 0.1])
    _, ret = compute_gae(r, v, torch.tensor([False, False, False, True]), 0.0, gamma=0.9, lam=1.0)
    expected = [0.81 * 1.0 + 0.729 * 0.5, 0.9 * 1.0 + 0.81 * 0.5, 1.0 + 0.9 * 0.5, 0.5]
    assert ret.tolist() == pytest.approx(expected)


def test_batch_concatenates_independent_fragments():
    d_term = torch.tensor([False, False, True])
    d_trunc = torch.tensor([False, False, False])
    adv, ret = compute_gae_batch([REWARDS, REWARDS], [VALUES, VALUES], [d_term, d_trunc], [100.0, 2.0], 0.9, 0.8)
    assert adv.tolist() == pytest.approx([1.9112, 0.71, 0.5, 2.84432, 2.006, 2.3])
    assert ret.shape == (6,)


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError):
        compute_gae(REWARDS, VALUES[:2], torch.zeros(3, dtype=torch.bool), 0.0, 0.9, 0.8)


def test_chained_fragments_equal_one_long_fragment():
    # one 12-step fragment cut in three, handed over out of order: 0 -> 2 -> 1 in the batch
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(12, generator=g), torch.randn(12, generator=g)
    d = torch.zeros(12, dtype=torch.bool)
    d[6] = True  # an episode end inside a piece is still honoured
    whole_adv, whole_ret = compute_gae(r, v, d, 0.7, gamma=0.99, lam=0.95)
    cuts = [slice(0, 4), slice(8, 12), slice(4, 8)]
    adv, ret = compute_gae_batch([r[c] for c in cuts], [v[c] for c in cuts], [d[c] for c in cuts],
                                 [123.0, 0.7, -55.0], 0.99, 0.95, successors=[2, -1, 1])
    assert torch.allclose(adv, torch.cat([whole_adv[c] for c in cuts]), atol=1e-6)
    assert torch.allclose(ret, torch.cat([whole_ret[c] for c in cuts]), atol=1e-6)
    # without the links each piece bootstraps its own last value instead
    cut_adv, _ = compute_gae_batch([r[c] for c in cuts], [v[c] for c in cuts], [d[c] for c in cuts],
                                   [123.0, 0.7, -55.0], 0.99, 0.95)
    assert not torch.allclose(cut_adv[:4], whole_adv[:4])


@pytest.mark.parametrize("successors, why", [
    ([1, 1, -1], "distinct"), ([1, 0, -1], "cycle"), ([3, -1, -1], "distinct"), ([-1, -1], "one entry"),
    ([-1, 2, -1], "terminated"),
])
def test_bad_successors_are_refused(successors, why):
    dones = [torch.zeros(3, dtype=torch.bool), torch.tensor([False, False, True]), torch.zeros(3, dtype=torch.bool)]
    with pytest.raises(ValueError, match=why):
        compute_gae_batch([REWARDS] * 3, [VALUES] * 3, dones, [0.0] * 3, 0.9, 0.8, successors=successors)
