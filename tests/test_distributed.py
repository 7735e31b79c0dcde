"""Two real CPU trainer processes (gloo over tcp://127.0.0.1) stay identical through a DDP update."""

import json
import socket

import numpy as np
import torch
import torch.multiprocessing as mp
from torch import nn

from rlvla3.observation import Observation
from workers.algorithms.distributed import (
    assert_replicas_identical,
    broadcast_parameters,
    destroy_trainer_group,
    init_trainer_group,
    parameter_checksum,
    wrap_ddp,
)
from rlvla3.config import AlgoConfig
from workers.algorithms.ppo import make_optimizer, ppo_update
from workers.envs.base import EnvSpec
from workers.policies.base import ActOutput, EvalOutput, Policy

SPEC = EnvSpec(cameras={}, state_dim=3, action_dim=2, max_episode_steps=10)


class SmallPolicy(Policy):
    """Gaussian chunk policy with a value head; log-probs per action (L = chunk size)."""

    family = "small-test"
    logprob_level = "action"

    def __init__(self) -> None:
        super().__init__(SPEC, chunk_size=2)
        self.mean = nn.Linear(3, 4)
        self.log_std = nn.Parameter(torch.zeros(2))
        self.value_head = nn.Linear(3, 1)

    def _dist(self, obs):
        s = torch.as_tensor(obs.state)
        mu = self.mean(s).view(-1, 2, 2)
        return torch.distributions.Normal(mu, self.log_std.exp().expand_as(mu)), s

    def act(self, obs, deterministic=False):
        with torch.no_grad():
            dist, s = self._dist(obs)
            a = dist.sample()
            return ActOutput(a, dist.log_prob(a).sum(-1), self.value_head(s).squeeze(-1), {})

    def evaluate(self, obs, actions, replay):
        dist, s = self._dist(obs)
        return EvalOutput(dist.log_prob(actions).sum(-1), dist.entropy().sum(-1), self.value_head(s).squeeze(-1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(rank: int, world_size: int, port: int, out_dir: str) -> None:
    backend = init_trainer_group(rank, world_size, "127.0.0.1", port)
    try:
        torch.manual_seed(100 + rank)  # different initial weights on purpose
        policy = SmallPolicy()
        local_before = float(parameter_checksum(policy))
        ddp = wrap_ddp(policy)  # broadcasts rank 0's weights
        start = assert_replicas_identical(ddp)

        # Each rank trains on its own data (as the broker spreads trajectories across ranks).
        rng = np.random.default_rng(rank)
        obs = Observation({}, rng.standard_normal((32, 3)).astype(np.float32), [""] * 32)
        out = ddp.act(obs)
        batch = {
            "obs": obs,
            "actions": out.actions,
            "replay": out.replay,
            "behav_logprob": out.logprob,
            "advantages": out.actions[:, :, 0].sum(-1),
            "returns": torch.as_tensor(rng.standard_normal(32).astype(np.float32)),
            "values": out.value,
        }
        cfg = AlgoConfig(epochs=2, minibatch_size=8, lr=1e-2)
        stats = ppo_update(ddp, make_optimizer(ddp.parameters(), cfg), batch, cfg)
        # A KL stop reads the ranks' mean, so both ranks leave after the same epoch (a rank
        # stopping alone would leave the other's all-reduce waiting).
        stop = AlgoConfig(epochs=4, minibatch_size=8, lr=1e-2, target_kl=1e-9)
        stopped = ppo_update(ddp, make_optimizer(ddp.parameters(), stop), batch, stop)
        after = assert_replicas_identical(ddp)

        # A replica that drifted is detected, and a broadcast repairs it.
        if rank == 1:
            with torch.no_grad():
                policy.log_std.add_(0.5)
        try:
            assert_replicas_identical(ddp)
            drift_detected = False
        except AssertionError:
            drift_detected = True
        broadcast_parameters(ddp, src=0)
        repaired = assert_replicas_identical(ddp)

        result = dict(
            backend=backend,
            local_before=local_before,
            start=start,
            after=after,
            repaired=repaired,
            drift_detected=drift_detected,
            optimizer_steps=stats["optimizer_steps"],
            stopped_steps=stopped["optimizer_steps"],
        )
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(result, f)
    finally:
        destroy_trainer_group()


def test_two_cpu_ranks_identical_after_ddp_update(tmp_path):
    mp.spawn(_trainer, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))

    assert r0["backend"] == r1["backend"] == "gloo"
    assert r0["local_before"] != r1["local_before"]  # they really started apart
    assert r0["start"] == r1["start"] == r0["local_before"]  # DDP took rank 0's weights
    assert r0["after"] == r1["after"] != r0["start"]  # both moved, identically
    assert r0["drift_detected"] and r1["drift_detected"]  # every rank learns of the drift
    assert r0["repaired"] == r1["repaired"] == r0["after"]
    assert r0["optimizer_steps"] == r1["optimizer_steps"] == 8
    assert r0["stopped_steps"] == r1["stopped_steps"] == 4  # one epoch of 4 minibatches, on both
