"""The training-inference mismatch metric: a fresh sample's generator log-probs against the
trainer's recomputed ones (numerics only), apart from stale samples (the policy moved)."""

import numpy as np
import torch

from rlvla3.config import load
from rlvla3.harness.bench import random_observation
from workers.algorithms.ppo import ppo_update
from workers.algorithms.ppo import make_optimizer
from workers.model import build_policy, job_spec


def test_gap_is_zero_on_fresh_fp32_samples_and_counts_stale_drift() -> None:
    cfg = load("configs/synthetic_openvla_oft.yaml", ["workers.device=cpu", "model.dtype=float32", "algo.epochs=1",
                                                      "algo.minibatch_size=3"])
    policy = build_policy(cfg)
    spec, rng, n = job_spec(cfg), np.random.default_rng(0), 6
    obs = random_observation(spec, n, rng, "reach")
    out = policy.act(obs)  # the generator's call: one batch of 6
    behav = out.logprob.clone()
    behav[3:] += 0.25  # samples 3..5 were acted by an older version: their log-probs differ
    fresh = torch.tensor([True] * 3 + [False] * 3)
    batch = {"obs": obs, "actions": out.actions, "replay": out.replay, "behav_logprob": behav,
             "advantages": torch.zeros(n), "returns": torch.zeros(n), "values": out.value, "fresh": fresh}
    stats = ppo_update(policy, make_optimizer(policy.parameters(), cfg.algo), batch, cfg.algo)
    # The trainer recomputes in minibatches of 3 (another batch shape than the generator's 6).
    assert stats["logprob_gap_fresh"] < 1e-5 and stats["logprob_gap_fresh_max"] < 1e-4
    assert abs(stats["logprob_gap"] - 0.125) < 1e-4  # half the units off by 0.25
