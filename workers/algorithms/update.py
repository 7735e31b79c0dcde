"""One trainer update, top to bottom: advantages, equal batch lengths across ranks, decoupled
PPO (or GRPO through it), diagnostics. Typed in (:class:`TrainBatch`, :class:`TrainState`) and
typed out (:class:`UpdateResult`); no sockets, no counters, no versions to bump.

  1. advantages: PPO's GAE on the values of the critic the update starts from (one forward pass
     gives them with the proximal log-probs), bootstrapped from the observation after each
     fragment; or the group-relative scores the learner computed when the group completed (GRPO);
  2. several ranks: pad every rank's batch to the same length with masked samples, so all ranks
     run the same number of minibatches (DDP all-reduces gradients in each one);
  3. ``ppo_update``: proximal log-probs recomputed, decoupled clipped loss, epochs x minibatches
     (a PPO critic warm-up steps only the value head, advantages zeroed);
  4. replicas identical? (``algo.check_replicas``: a parameter checksum, all-reduced over ranks).

Samples staler than ``max_staleness`` arrive already masked (``TrainBatch.keep``, decided by the
learner with :func:`workers.algorithms.staleness.filter_stale`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from rlvla3.config import AlgoConfig
from workers.algorithms.gae import compute_gae_batch
from workers.algorithms.ppo import explained_variance, index_batch, make_optimizer, ppo_update, proximal_pass


@dataclass
class TrainBatch:
    """The decision steps of one update (N of them, fragment after fragment), as the learner
    assembled them.

    ``samples`` is ``ppo_update``'s batch layout: ``obs`` (images by camera, state,
    instruction), ``actions``, ``replay``, ``behav_logprob``, ``values``. ``lengths`` splits the
    N steps into fragments for GAE; ``bootstrap`` holds each fragment's observation after its
    last step (with that step's actions and replay as placeholders: value heads read the
    observation only).
    """

    samples: dict[str, Any]
    keep: np.ndarray
    """[N] bool: not too stale to train on."""
    staleness: np.ndarray
    """[N] trainer version minus behaviour version."""
    rewards: torch.Tensor
    """PPO: the rewards GAE sees (``workers.algorithms.rewards``: scaled, clipped)."""
    terminated: torch.Tensor
    lengths: list[int]
    bootstrap: dict[str, Any] | None
    """PPO: ``{"obs", "actions", "replay"}`` with one row per fragment; None for GRPO."""
    advantages: torch.Tensor | None
    """GRPO: [N] group-relative advantages; None for PPO (GAE computes them)."""
    env_steps: int
    """Env steps behind these decisions (a chunk may end early)."""
    finished: list[dict[str, Any]] = field(default_factory=list)
    """Headers of the episodes that end in this batch."""
    units: int = 0
    """What admission control counts: fragments (PPO) or episodes (GRPO)."""
    groups: int | None = None
    """GRPO: complete groups in the batch."""
    successors: list[int] | None = None
    """PPO: per fragment, the index of the one that continues its episode in this batch, or -1
    (GAE runs on into it: ``workers.algorithms.gae``)."""

    @property
    def dropped_stale(self) -> int:
        return int((~self.keep).sum())


@dataclass
class TrainState:
    """What an update steps: the bare policy, what ``ppo_update`` drives (the policy, or its DDP
    wrapper with several ranks), and the optimizers (the critic's steps only the value head)."""

    policy: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer
    critic_optimizer: torch.optim.Optimizer
    base_lrs: dict[int, list[float]] = field(default_factory=dict)
    """Per optimizer (by ``id``), each param group's rate before annealing (``algo.value_lr``:
    the critic's group has its own). Kept here, not in the groups: a checkpoint's optimizer
    state then has the keys it always had."""

    @classmethod
    def build(cls, policy: nn.Module, algo: AlgoConfig, model: nn.Module | None = None) -> "TrainState":
        critic = [p for n, p in policy.named_parameters() if "value" in n.split(".")[0] and p.requires_grad]
        value_lr = algo.value_lr or algo.lr
        if critic and value_lr != algo.lr:  # two groups, each annealed from its own rate
            ids = {id(p) for p in critic}
            actor = [p for p in policy.parameters() if id(p) not in ids]
            optimizer = make_optimizer([{"params": actor, "lr": algo.lr}, {"params": critic, "lr": value_lr}], algo)
        else:
            optimizer = make_optimizer(policy.parameters(), algo)
        critic_optimizer = make_optimizer([{"params": critic, "lr": value_lr}], algo) if critic else optimizer
        base_lrs = {id(o): [g["lr"] for g in o.param_groups] for o in (optimizer, critic_optimizer)}
        return cls(policy, model if model is not None else policy, optimizer, critic_optimizer, base_lrs)

    @property
    def distributed(self) -> bool:
        return self.model is not self.policy


@dataclass
class UpdateResult:
    """What one update did. ``trained`` is False when every sample was too stale (one rank
    alone: nothing stepped, the version stays)."""

    trained: bool
    samples: int
    """Samples trained on (not masked)."""
    batch_len: int
    """Rows stepped through, padding included (equal on every rank)."""
    dropped_stale: int
    staleness: np.ndarray
    env_steps: int
    episodes: int
    return_mean_batch: float
    success_mean_batch: float
    units: int
    groups: int | None
    update_s: float
    """Wall time of the update, a ``min_s`` pad included."""
    compute_s: float = 0.0
    """Of which computing (advantages, optimizer steps, checks): ``update_s`` without the pad."""
    diagnostics: dict[str, float] = field(default_factory=dict)
    """``ppo_update``'s statistics averaged over optimizer steps (losses, clip fractions, ...),
    and ``explained_variance`` for PPO."""
    critic_warmup: bool = False
    param_checksum: float | None = None

    def figures(self) -> dict[str, Any]:
        """The numbers of a metrics row (JSONL, TensorBoard, the broker's STATUS)."""
        row: dict[str, Any] = dict(self.diagnostics)
        if self.critic_warmup:
            row["critic_warmup"] = 1
        if self.param_checksum is not None:
            row["param_checksum"] = self.param_checksum
        if not self.trained:
            row["skipped"] = True
        row.update(update_s=self.update_s, compute_s=self.compute_s, samples=self.samples, batch_len=self.batch_len,
                   dropped_stale=self.dropped_stale, env_steps=self.env_steps, episodes=self.episodes,
                   return_mean_batch=self.return_mean_batch, success_mean_batch=self.success_mean_batch,
                   units=self.units)
        if self.groups is not None:
            row["groups"] = self.groups
        return row


def update(state: TrainState, batch: TrainBatch, algo: AlgoConfig, critic_warmup: bool = False,
           pad_to: int | None = None, min_s: float = 0.0, progress: float = 0.0,
           after_epoch: Callable[[int], None] | None = None) -> UpdateResult:
    """One update on ``batch``. ``pad_to`` (several ranks) is the longest batch of any rank;
    ``critic_warmup`` (PPO) steps the value head only; an update that trained lasts at least
    ``min_s`` seconds (``train.min_update_s``: the rest is slept, a benchmark's stand-in for a
    large model's update); ``progress`` is the share of the run's env steps consumed before this
    update (``algo.anneal_lr`` lowers the learning rate by it); ``after_epoch(e)`` runs between
    the policy's epochs (``weights.in_flight``), not in a critic warm-up."""
    t0 = time.perf_counter()
    done = batch.finished
    result = UpdateResult(
        trained=False, samples=int(batch.keep.sum()), batch_len=len(batch.keep), dropped_stale=batch.dropped_stale,
        staleness=batch.staleness, env_steps=batch.env_steps, episodes=len(done),
        return_mean_batch=float(np.mean([h.get("episode_return", 0.0) for h in done])) if done else float("nan"),
        success_mean_batch=float(np.mean([bool(h.get("episode_success")) for h in done])) if done else float("nan"),
        units=batch.units, groups=batch.groups, update_s=0.0,
    )

    # ---- 1. advantages ----------------------------------------------------------------------
    samples = dict(batch.samples)
    if batch.advantages is not None:  # GRPO: group-relative scores, broadcast to every step
        samples["advantages"] = batch.advantages.float()
    else:
        # PPO: the values GAE, the value targets and the value clip read are the critic's as
        # the update starts, as the bootstrap values are: a generator's values are as stale as
        # its weights, and GAE would then mix two critics in one sum.
        samples["prox_logprob"], samples["values"] = proximal_pass(state.model, samples, algo.minibatch_size)
        samples["advantages"], samples["returns"] = _gae(state, batch, samples["values"], algo)
        result.diagnostics["fragments_continued"] = sum(j >= 0 for j in batch.successors or ())
    samples["mask"] = torch.as_tensor(batch.keep)
    samples["fresh"] = torch.as_tensor(batch.staleness == 0)  # for the training-inference gap
    n = len(batch.keep)

    # ---- 2. several ranks: equal batch lengths (padding is masked out) ----------------------
    if pad_to is not None and pad_to > n:
        idx = torch.cat([torch.arange(n), torch.arange(pad_to - n) % n])
        samples = index_batch(samples, idx)
        samples["mask"] = torch.cat([samples["mask"][:n], torch.zeros(pad_to - n, dtype=torch.bool)])
    elif pad_to is None and not batch.keep.any():
        result.update_s = result.compute_s = time.perf_counter() - t0
        return result
    result.batch_len = len(samples["mask"])

    # ---- 3. PPO (or GRPO through PPO, no critic), proximal log-probs recomputed -------------
    if algo.anneal_lr:
        frac = max(0.0, 1.0 - progress)
        for opt in {id(o): o for o in (state.optimizer, state.critic_optimizer)}.values():
            for group, base in zip(opt.param_groups, state.base_lrs[id(opt)]):
                group["lr"] = base * frac
        result.diagnostics["lr"] = algo.lr * frac
    if algo.name == "ppo" and critic_warmup:
        # Critic warm-up: advantages zeroed and only the value head stepped, so a shared trunk
        # cannot drag a warm-started policy around while the critic learns the returns.
        samples["advantages"] = torch.zeros_like(samples["advantages"])
        # The policy stands still, so its KL from the actor (algo.target_kl) is the staleness alone.
        warmup = replace(algo, target_kl=0.0)
        result.diagnostics.update(ppo_update(state.model, state.critic_optimizer, samples, warmup))
        result.critic_warmup = True
    else:
        result.diagnostics.update(ppo_update(state.model, state.optimizer, samples, algo, after_epoch=after_epoch))
    # The statistics the policy keeps (observation normalisation) move only after the update,
    # so the update itself scores actions with the statistics the behaviour policy used.
    state.policy.update_statistics(batch.samples["obs"].select(np.flatnonzero(batch.keep)))
    if samples.get("returns") is not None:
        m = samples["mask"]
        result.diagnostics["explained_variance"] = explained_variance(samples["values"][m], samples["returns"][m])

    # ---- 4. replicas identical? (debug / tests) ---------------------------------------------
    if algo.check_replicas and state.distributed:
        from workers.algorithms.distributed import assert_replicas_identical

        result.param_checksum = assert_replicas_identical(state.model)
    elif algo.check_replicas:
        from workers.algorithms.distributed import parameter_checksum

        result.param_checksum = float(parameter_checksum(state.policy))
    result.trained = True
    result.compute_s = time.perf_counter() - t0
    if min_s > result.compute_s:
        time.sleep(min_s - result.compute_s)
    result.update_s = time.perf_counter() - t0
    return result


def _gae(state: TrainState, batch: TrainBatch, values: torch.Tensor, algo: AlgoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns ``[N]``, fragment by fragment, each run on into its successor."""
    from workers.algorithms.distributed import is_sharded

    b = batch.bootstrap
    if b is None:
        raise ValueError("a PPO batch needs the bootstrap observations of its fragments")
    dev = state.policy.device
    # The bare policy, not DDP (no collective for a forward pass); an FSDP-sharded one runs only
    # through its root, which gathers the shards (every rank calls this once per update).
    net = state.model if is_sharded(state.model) else state.policy
    with torch.no_grad():
        out = net.evaluate(b["obs"], b["actions"].to(dev), {k: v.to(dev) for k, v in b["replay"].items()})
    boot = out.value.float().cpu().tolist()
    lengths = list(batch.lengths)
    terminated = torch.split(batch.terminated, lengths)
    adv, ret = compute_gae_batch(torch.split(batch.rewards, lengths),
                                 torch.split(values, lengths), terminated,
                                 [0.0 if bool(t[-1]) else bv for t, bv in zip(terminated, boot)], algo.gamma, algo.lam,
                                 batch.successors)
    return adv.float(), ret.float()
