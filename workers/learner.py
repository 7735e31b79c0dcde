"""The learner: what arrives becomes *units* ready to train on, and units become a batch.

No sockets and no torch modules: the trainer's shell (``workers.trainer``) hands it fragments
it already copied out of shared memory, asks it for units when it may update, and reports what
it dropped to the broker. The learner keeps the counts: the running totals (``counters``, which
checkpoints carry), the steps received and not yet trained (``received_steps``), and each
step's fate until TRAJ_ACK reports it (``unreported``).

Units:
  * PPO: one fragment. GAE runs on into the next fragment of the same episode when the batch
    holds it (:func:`successors`), else bootstraps from the fragment's last observation.
  * GRPO: one complete *group*, ``env.group_size`` complete episodes that share (instruction,
    seed). Fragments wait in ``pending_eps`` until their episode is done, episodes wait in
    ``pending_groups`` until their group is full. By default the simulators run a group's
    episodes side by side in neighbouring envs (``env.group_mode: parallel``); with
    ``sequential`` a group is ``group_size`` consecutive episodes of one env, its first episode
    ages while the rest run, and ``algo.max_staleness`` must allow for that.

Staleness is decided here, by one function (:func:`~workers.algorithms.staleness.filter_stale`):
GRPO groups holding a too-stale sample are dropped whole before they are taken
(:meth:`Learner.prune_stale`), and the samples of a batch staler than ``max_staleness`` are
masked (:func:`build_batch`). Both count into ``dropped_stale``.
"""

from __future__ import annotations

import sys
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlvla3 import names
from rlvla3.config import JobConfig
from rlvla3.observation import Observation
from workers.algorithms.grpo import broadcast_episode_advantages, grpo_advantages
from workers.algorithms.rewards import ReturnNormalizer, training_rewards
from workers.algorithms.staleness import filter_stale
from workers.algorithms.update import TrainBatch
from workers.metrics import Counters
from workers.trajectory import fragment_observation

FORGET_GROUPS = 100_000
"""Dropped GRPO groups remembered (so their late episodes are dropped too)."""
UNREPORTED = ("dropped_stale", "stale_taken", "discarded", "trained", "unreadable", "duplicate")
"""TRAJ_ACK's fields, in steps: each step's fate, and ``stale_taken``, the part of
``dropped_stale`` that an update had taken (and masked): the broker's admission counted those
consumed when the update began, so only the rest frees capacity."""
RECENT_FRAGMENTS = 16_384
"""Fragments remembered (3.3 MB) for telling a re-sent copy from a new fragment. A copy
reaches the trainer only through a new broker, among the first fragments it routes after the
rejoin (a simulator re-sends what has no ack as soon as it rejoins), so what the trainer takes
between the two copies is what the old broker had out to it (at most its credits, 256 by default)
and what the new broker routes ahead of the copy: far fewer."""


class Fragment:
    """A received trajectory fragment, copied into process memory."""

    def __init__(self, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        self.header = header
        self.arrays = arrays
        self.steps = int(arrays["reward"].shape[0])
        self.advantages: np.ndarray | None = None  # GRPO: filled when the group completes
        self.train_rewards: np.ndarray | None = None  # PPO: filled on arrival (workers.algorithms.rewards)

    @property
    def episode_key(self) -> tuple[Any, Any]:
        return (self.header.get("env"), self.header.get("episode"))

    @property
    def group_key(self) -> tuple[Any, Any]:
        return (self.header.get("instruction", ""), self.header.get("seed"))

    @property
    def oldest_version(self) -> int:
        return int(self.arrays["version"].min())

    @property
    def newest_version(self) -> int:
        return int(self.arrays["version"].max())


@dataclass
class Unit:
    """What one update takes whole: a fragment (PPO) or a complete group of episodes (GRPO)."""

    frags: list[Fragment]
    steps: int
    episodes: int = 0

    @property
    def oldest_version(self) -> int:
        return min(f.oldest_version for f in self.frags)


class Learner:
    """Group assembly, staleness pruning and the queue of units ready to train on."""

    def __init__(self, cfg: JobConfig) -> None:
        self.algo = cfg.algo
        self.grpo = cfg.algo.name == "grpo"
        self.alternating = cfg.run.mode != "async"
        self.group_size = cfg.env.group_size
        self.counters = Counters()
        """Totals since the trainer started (or resumed: checkpoints carry them)."""
        self.reward_norm = ReturnNormalizer(cfg.algo.gamma) if cfg.algo.reward_norm else None
        self.ready: deque[Unit] = deque()
        self.ready_steps = 0
        self.received_steps = 0
        """Decision steps received and not yet taken into an update: the trainer's mirror of an
        alternating broker's count (brokers/pacing.py), so that a pause the broker holds because
        of steps in incomplete groups is always seen here too (lowered by each update's steps,
        :meth:`consumed`, and zeroed when starvation is reported, :meth:`starved`)."""
        self.pending_eps: dict[tuple, list[Fragment]] = {}
        self.pending_groups: dict[tuple, list[list[Fragment]]] = {}
        self.dropped_groups: OrderedDict[tuple, None] = OrderedDict()  # their later episodes are discarded
        # Steps per fate (brokers/ledger.py) not yet reported to the broker in TRAJ_ACK: dropped
        # as stale (and how many of those an update took), discarded for another reason
        # (zero-variance groups), trained, unreadable, a copy.
        self.unreported = dict.fromkeys(UNREPORTED, 0)
        self.recent: OrderedDict[tuple, None] = OrderedDict()  # (host, pid, name, traj_id), oldest first

    # -- arrivals -----------------------------------------------------------------------------

    def resent(self, header: dict[str, Any]) -> bool:
        """Whether a fragment is a copy of one this trainer already took, known by its simulator
        (as the broker registered it) and the simulator's ``traj_id``: a simulator sends again
        everything without an ack to a new broker, and an ack in flight dies with the old one. A
        copy is counted and never trained again; its steps are reported as ``duplicate`` (the first
        copy's fate is theirs), so the new broker's ledger adds up."""
        writer = header.get("writer")
        if writer is None:
            return False
        # names interned: one copy of each simulator's host and name, however many ids are kept
        key = (sys.intern(writer["host"]), writer["pid"], sys.intern(writer["name"]), header["traj_id"])
        if key not in self.recent:
            self.recent[key] = None
            if len(self.recent) > RECENT_FRAGMENTS:
                self.recent.popitem(last=False)
            return False
        self.counters.duplicates += 1
        if not header.get("eval"):  # evaluation steps are never a trainer's to report
            self.unreported["duplicate"] += int(header["steps"])
        return True

    def add(self, frag: Fragment) -> None:
        """A training fragment (evaluation fragments never come here)."""
        self.received_steps += frag.steps
        if self.grpo:
            self._add_to_group(frag)
        else:
            done = bool(frag.header.get("done"))
            frag.train_rewards = training_rewards(self.algo, self.reward_norm, frag.header.get("env"),
                                                  frag.arrays["reward"], done)
            self._ready(Unit([frag], frag.steps, int(done)))

    def _ready(self, unit: Unit) -> None:
        self.ready.append(unit)
        self.ready_steps += unit.steps

    def _add_to_group(self, frag: Fragment) -> None:
        gkey = frag.group_key
        if gkey in self.dropped_groups:
            self._drop_steps(frag.steps)
            return
        ep = self.pending_eps.setdefault(frag.episode_key, [])
        ep.append(frag)
        if not frag.header.get("done"):
            return
        del self.pending_eps[frag.episode_key]
        group = self.pending_groups.setdefault(gkey, [])
        group.append(ep)
        if len(group) >= self.group_size:
            del self.pending_groups[gkey]
            self._complete_group(group[: self.group_size])

    def _complete_group(self, episodes: list[list[Fragment]]) -> None:
        """Score the group's episodes against each other; zero-variance groups carry no signal."""
        self.counters.groups_complete += 1
        use_success = self.algo.grpo_reward == "success"
        last = [ep[-1].header for ep in episodes]
        scores = torch.tensor([float(h.get("episode_success", False)) if use_success else float(h.get("episode_return", 0.0))
                               for h in last])
        adv, _keep, stats = grpo_advantages(scores, torch.zeros(len(episodes), dtype=torch.long),
                                            scale_by_std=self.algo.grpo_std_scale)
        if stats["groups_filtered_zero_variance"]:
            self.counters.groups_filtered_zero_variance += 1
            # Never trained on: hand the steps back to the broker's admission budget, or once
            # every group succeeds nothing is consumed and rollouts stall.
            self.unreported["discarded"] += sum(f.steps for ep in episodes for f in ep)
            return
        frags = [f for ep in episodes for f in ep]
        episode_of_step = torch.cat([torch.full((f.steps,), e, dtype=torch.long)
                                     for e, ep in enumerate(episodes) for f in ep])
        # Each episode weighs the same in the loss, whatever its length (the loss is a mean over
        # steps): an episode that succeeds ends early, so by steps the failures would outweigh it,
        # and pushing down the likelihood of sampled actions widens the policy instead of aiming it.
        lengths = torch.tensor([float(sum(f.steps for f in ep)) for ep in episodes])
        adv = adv.float() * lengths.mean() / lengths
        steps_adv = broadcast_episode_advantages(adv, episode_of_step).numpy()
        start = 0
        for f in frags:
            f.advantages = steps_adv[start:start + f.steps]
            start += f.steps
        self._ready(Unit(frags, start, len(episodes)))

    # -- staleness ----------------------------------------------------------------------------

    def prune_stale(self, version: int) -> None:
        """GRPO: drop groups (waiting or ready) holding a sample staler than ``max_staleness``:
        a group trains whole or not at all."""
        if not self.grpo:
            return  # PPO masks stale samples in build_batch
        waiting = [(frags[0].group_key, min(f.oldest_version for f in frags)) for frags in self.pending_eps.values()]
        waiting += [(gkey, min(f.oldest_version for ep in eps for f in ep)) for gkey, eps in self.pending_groups.items()]
        ready = list(self.ready)
        oldest = [v for _, v in waiting] + [u.oldest_version for u in ready]
        if not oldest:
            return
        keep, dropped = filter_stale(torch.tensor(oldest, dtype=torch.int64), version, self.algo.max_staleness)
        if not dropped:
            return
        keep_list = keep.tolist()
        stale_keys = {gkey for (gkey, _), k in zip(waiting, keep_list) if not k}
        for gkey in stale_keys:
            self._forget_group(gkey)
            self.counters.groups_dropped_stale += 1
        for key in [k for k, frags in self.pending_eps.items() if frags[0].group_key in stale_keys]:
            self._drop_steps(sum(f.steps for f in self.pending_eps.pop(key)))
        for gkey in stale_keys:
            for ep in self.pending_groups.pop(gkey, []):
                self._drop_steps(sum(f.steps for f in ep))
        self.ready = deque()
        self.ready_steps = 0
        for u, k in zip(ready, keep_list[len(waiting):]):
            if k:
                self._ready(u)
            else:
                self.counters.groups_dropped_stale += 1
                self._drop_steps(u.steps)

    def _forget_group(self, gkey: tuple) -> None:
        self.dropped_groups[gkey] = None
        while len(self.dropped_groups) > FORGET_GROUPS:
            self.dropped_groups.popitem(last=False)

    def _drop_steps(self, n: int) -> None:
        self.counters.dropped_stale += n
        self.unreported["dropped_stale"] += n

    def count_update(self, result: Any) -> None:
        """An update's :class:`UpdateResult`: the samples it masked as stale and those it trained
        on; when it stepped, one more update and its samples and env steps in the totals."""
        self._drop_steps(result.dropped_stale)
        self.unreported["stale_taken"] += result.dropped_stale
        self.unreported["trained"] += result.samples
        if result.trained:
            self.counters.updates += 1
            self.counters.samples_trained += result.samples
            self.counters.env_steps_consumed += result.env_steps

    def count_unreadable(self, steps: int, evaluation: bool) -> None:
        """A fragment the trainer could not read; a training one's ``steps`` are reported (the
        broker counts evaluation fragments as such)."""
        self.counters.unreadable += 1
        if not evaluation:
            self.unreported["unreadable"] += steps

    def count_eval(self, done: bool) -> None:
        """An evaluation fragment, measured and never trained on; ``done``: its episode ended."""
        self.counters.eval_fragments += 1
        if done:
            self.counters.eval_episodes += 1

    def consumed(self, steps: int) -> None:
        """An update took ``steps``: they no longer wait, here as at the broker."""
        self.received_steps = max(0, self.received_steps - steps)

    def starved(self, share: int) -> bool:
        """GRPO under an alternating broker: True (once per further ``share`` received) when a
        share of steps arrived but incomplete groups leave less than that ready to train on. The
        broker paused at ``batch_steps`` delivered then, so it must be told to hand out more work
        rather than both sides waiting; each rank sees its share of the broker's count."""
        if self.grpo and self.alternating and self.received_steps >= share > self.ready_steps:
            self.received_steps = 0
            return True
        return False

    def take_unreported(self) -> dict[str, int]:
        """Steps per fate since the last call, as TRAJ_ACK fields (``brokers/ledger.py``)."""
        out = self.unreported
        self.unreported = dict.fromkeys(UNREPORTED, 0)
        return out

    # -- taking units -------------------------------------------------------------------------

    def take(self, steps: int) -> list[Unit]:
        """Whole units from the front until they hold at least ``steps`` (or none are left)."""
        units, n = [], 0
        while self.ready and n < steps:
            u = self.ready.popleft()
            units.append(u)
            n += u.steps
        self.ready_steps -= n
        return units

    def put_back(self, units: list[Unit]) -> None:
        """Units taken for an update that did not happen go back to the front, in order."""
        for u in reversed(units):
            self.ready.appendleft(u)
        self.ready_steps += sum(u.steps for u in units)


# ---------------------------------------------------------------------------------------------
# Units -> one batch (runs on the update thread: reads the units, touches no learner state)
# ---------------------------------------------------------------------------------------------


def successors(frags: list[Fragment]) -> list[int]:
    """For each fragment, the index of the fragment in ``frags`` that continues its episode, or -1.

    One simulator (``writer``, as the broker registered it) numbers its fragments (``traj_id``)
    in the order it ships them, so the next fragment of an episode (slot, env, episode) is the
    one with the next higher number. It continues this one only if nothing was lost between:
    its first observation must equal this one's observation after its last step. A fragment
    that ended its episode has no successor.
    """
    last: dict[tuple, int] = {}
    out = [-1] * len(frags)
    order = sorted(range(len(frags)), key=lambda i: frags[i].header.get("traj_id", 0))
    for i in order:
        h = frags[i].header
        w = h.get("writer")
        if w is None or h.get("traj_id") is None:
            continue
        key = (w.get("host"), w.get("pid"), w.get("name"), h.get("slot"), h.get("env"), h.get("episode"))
        prev = last.get(key)
        if prev is not None and not frags[prev].header.get("done") and _continues(frags[prev], frags[i]):
            out[prev] = i
        last[key] = i
    return out


def _continues(a: Fragment, b: Fragment) -> bool:
    """``b``'s first observation is ``a``'s observation after its last step, in every tensor."""
    obs_a, obs_b = names.under_prefix(names.FRAGMENT_OBS, a.arrays), names.under_prefix(names.FRAGMENT_OBS, b.arrays)
    return bool(obs_a) and obs_a.keys() == obs_b.keys() and all(
        np.array_equal(obs_a[k][-1], obs_b[k][0]) for k in obs_a)


def build_batch(units: list[Unit], version: int, cfg: JobConfig) -> TrainBatch:
    """Concatenate the units' fragments into one :class:`TrainBatch`, stale samples masked."""
    frags = [f for u in units for f in u.frags]
    grpo = cfg.algo.name == "grpo"
    versions = torch.as_tensor(np.concatenate([f.arrays["version"] for f in frags]), dtype=torch.int64)
    keep, _dropped = filter_stale(versions, version, cfg.algo.max_staleness)
    observations = [fragment_observation(f.arrays, f.header.get("instruction", "")) for f in frags]
    replay = [names.under_prefix(names.REPLAY, f.arrays) for f in frags]
    # The keys every fragment has: a generator batch that mixed evaluation and training envs
    # answered with both acts' replay keys, so some fragments carry extra ones.
    keys = sorted(set.intersection(*(set(r) for r in replay)))
    samples = {
        "obs": Observation.concat([o.select(slice(0, -1)) for o in observations]),
        "actions": torch.as_tensor(np.concatenate([f.arrays["actions"] for f in frags])),
        "replay": {k: torch.as_tensor(np.concatenate([r[k] for r in replay])) for k in keys},
        "behav_logprob": torch.as_tensor(np.concatenate([f.arrays["logprob"] for f in frags])),
        "values": torch.as_tensor(np.concatenate([f.arrays["value"] for f in frags])),
    }
    bootstrap = None
    if not grpo:  # each fragment's observation after its last step, for V(s_N)
        bootstrap = {
            "obs": Observation.concat([o.select(slice(-1, None)) for o in observations]),
            "actions": torch.as_tensor(np.stack([f.arrays["actions"][-1] for f in frags])),
            "replay": {k: torch.as_tensor(np.stack([r[k][-1] for r in replay])) for k in keys},
        }
    return TrainBatch(
        samples=samples,
        keep=keep.numpy(),
        staleness=(version - versions).numpy(),
        rewards=torch.as_tensor(np.concatenate([f.arrays["reward"] if grpo else f.train_rewards for f in frags])),
        terminated=torch.as_tensor(np.concatenate([f.arrays["terminated"] for f in frags])),
        lengths=[f.steps for f in frags],
        bootstrap=bootstrap,
        successors=None if grpo else successors(frags),
        advantages=torch.as_tensor(np.concatenate([f.advantages for f in frags])) if grpo else None,
        env_steps=int(sum(int(f.arrays["steps"].sum()) for f in frags)),
        finished=[f.header for f in frags if f.header.get("done")],
        units=sum(u.episodes for u in units) if grpo else len(frags),
        groups=len(units) if grpo else None,
    )
