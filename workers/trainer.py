"""The trainer worker: take trajectory fragments, run decoupled PPO or GRPO, publish versions.

The socket thread only receives, acknowledges and sorts what arrives into *units* ready to
train on; updates run on a JobRunner thread so heartbeats keep flowing during a long update. A
fragment is acknowledged (TRAJ_ACK) as soon as its tensors are copied out of shared memory / the
message: from then on the trainer owns it.

Units:
  * PPO: one fragment (GAE runs per fragment, bootstrapped from its last observation).
  * GRPO: one complete *group* - ``group_size`` complete episodes that share (instruction,
    seed). Fragments wait in ``pending_eps`` until their episode is done, episodes wait in
    ``pending_groups`` until their group is full. By default the simulators run a group's
    episodes side by side in neighbouring envs (``env.group_mode: parallel``); with
    ``sequential`` a group is ``group_size`` consecutive episodes of one env, its first episode
    ages while the rest run, and ``algo.max_staleness`` must allow for that (stale groups are
    dropped and counted).

One update, top to bottom (``_update``):
  1. drop samples staler than ``max_staleness`` (masked, counted);
  2. advantages: GAE on behaviour values (PPO) or the group-relative scores computed when the
     group completed (GRPO, zero-variance groups already filtered and counted);
  3. several ranks: pad every rank's batch to the same length with masked samples, so all ranks
     run the same number of minibatches (DDP all-reduces gradients in each one);
  4. ``ppo_update``: proximal log-probs recomputed, decoupled clipped loss, epochs x minibatches;
  5. version += 1; rank 0 publishes WEIGHTS every ``publish_every`` updates and checkpoints
     every ``checkpoint_every`` versions; metrics to JSONL and TensorBoard.

Several ranks (``workers.trainers`` > 1): the broker hands each trainer a rank; every trainer
announces a rendezvous address in READY and the broker passes rank 0's to the others. The
ranks decide *together* when to update: each round all-gathers (steps ready, stopping) and all
ranks train once the sum reaches ``batch_steps``. Only rank 0 publishes and checkpoints.
"""

from __future__ import annotations

import json
import math
import queue
import socket
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import structlog
import torch

from rlvla3 import protocol as P
from workers.algorithms.gae import compute_gae
from workers.algorithms.grpo import GRPOConfig, grpo_advantages
from workers.algorithms.ppo import PPOConfig, explained_variance, index_batch, make_optimizer, ppo_update
from workers.base import WorkerBase
from workers.model import build_policy, state_tensors

log = structlog.get_logger()

ROUND_EVERY_S = 0.05
"""Several ranks: at most this often a rank starts a collective 'shall we update?' round."""


def ppo_config(cfg: Any) -> PPOConfig:
    """The PPOConfig of the job: PPO as configured, or GRPO's value-free variant."""
    a = cfg.algo
    if a.name == "grpo":
        return grpo_config(cfg).to_ppo()
    return PPOConfig(
        clip_eps=a.clip_eps, dual_clip=a.dual_clip if a.dual_clip > 1 else None,
        value_clip_eps=a.value_clip_eps if a.value_clip_eps > 0 else None, vf_coef=a.vf_coef,
        ent_coef=a.ent_coef, max_grad_norm=a.max_grad_norm, epochs=a.epochs, minibatch_size=a.minibatch_size,
        gamma=a.gamma, lam=a.lam, behav_weight_cap=a.behav_weight_cap, lr=a.lr, normalize_advantages=True,
    )


def grpo_config(cfg: Any) -> GRPOConfig:
    a = cfg.algo
    return GRPOConfig(
        group_size=a.group_size, clip_eps=a.clip_eps, dual_clip=a.dual_clip if a.dual_clip > 1 else None,
        ent_coef=a.ent_coef, max_grad_norm=a.max_grad_norm, epochs=a.epochs, minibatch_size=a.minibatch_size,
        behav_weight_cap=a.behav_weight_cap, lr=a.lr,
    )


def rendezvous_host(broker_url: str) -> str:
    """The local address other trainers can reach us at: the one that routes to the broker."""
    host = urlparse(broker_url).hostname or "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "*", "0.0.0.0"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))  # UDP: no packet is sent, the kernel only picks a route
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------
# What arrives
# ---------------------------------------------------------------------------------------------


class Fragment:
    """A received trajectory fragment, copied into process memory."""

    def __init__(self, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        self.header = header
        self.arrays = arrays
        self.steps = int(arrays["reward"].shape[0])
        self.advantages: np.ndarray | None = None  # GRPO: filled when the group completes

    @property
    def episode_key(self) -> tuple[Any, Any]:
        return (self.header.get("env"), self.header.get("episode"))

    @property
    def group_key(self) -> tuple[Any, Any]:
        return (self.header.get("instruction", ""), self.header.get("seed"))

    @property
    def oldest_version(self) -> int:
        return int(self.arrays["version"].min())


@dataclass
class Unit:
    """What one update takes whole: a fragment (PPO) or a complete group of episodes (GRPO)."""

    frags: list[Fragment]
    steps: int
    episodes: int = 0

    @property
    def oldest_version(self) -> int:
        return min(f.oldest_version for f in self.frags)


@dataclass
class Counters:
    """Totals since the trainer started (or resumed: they are checkpointed)."""

    updates: int = 0
    samples_trained: int = 0
    env_steps_consumed: int = 0
    dropped_stale: int = 0
    groups_complete: int = 0
    groups_filtered_zero_variance: int = 0
    groups_dropped_stale: int = 0
    eval_episodes: int = 0
    eval_fragments: int = 0
    unreadable: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class EvalTally:
    """Success of evaluation episodes per policy version (from fragments with ``eval: true``)."""

    per_version: dict[int, list[int]] = field(default_factory=dict)  # version -> [episodes, successes]
    fresh: set[int] = field(default_factory=set)

    def add(self, version: int, success: bool) -> None:
        n = self.per_version.setdefault(version, [0, 0])
        n[0] += 1
        n[1] += int(bool(success))
        self.fresh.add(version)

    def take_fresh(self) -> dict[str, dict[str, float]]:
        out = {str(v): {"episodes": self.per_version[v][0], "success": self.per_version[v][1] / self.per_version[v][0]}
               for v in sorted(self.fresh)}
        self.fresh.clear()
        return out


class MetricsSink:
    """JSONL and TensorBoard writing on a thread of its own: importing TensorBoard takes seconds
    and event files are I/O, neither belongs on the socket thread or in the trainer's start-up."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        suffix = "" if rank == 0 else f".rank{rank}"
        self.jsonl = open(run_dir / f"trainer_metrics{suffix}.jsonl", "a", buffering=1)
        self.tb_dir = run_dir / "tb" if rank == 0 else None
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="metrics", daemon=True)
        self.thread.start()

    def put(self, row: dict[str, Any], staleness: np.ndarray, evals: dict[str, dict[str, float]]) -> None:
        self.q.put((row, staleness, evals))

    def close(self, timeout: float = 10.0) -> None:
        self.q.put(None)
        self.thread.join(timeout)

    def _loop(self) -> None:
        tb = None
        if self.tb_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                tb = SummaryWriter(str(self.tb_dir))
            except ImportError as exc:  # JSONL still works
                log.warning("tensorboard_unavailable", error=str(exc))
        try:
            while True:
                item = self.q.get()
                if item is None:
                    return
                row, staleness, evals = item
                self.jsonl.write(json.dumps(row) + "\n")
                if tb is None:
                    continue
                step = int(row["version"])
                for k, v in row.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("version", "rank", "t") and math.isfinite(v):
                        tb.add_scalar(f"train/{k}", v, step)
                if len(staleness):
                    tb.add_histogram("train/staleness", np.asarray(staleness, np.int64), step)
                for v, e in evals.items():
                    tb.add_scalar("eval/success", e["success"], int(v))
        finally:
            self.jsonl.close()
            if tb is not None:
                tb.close()


# ---------------------------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------------------------


class TrainerWorker(WorkerBase):
    role = "trainer"

    def __init__(self, broker: str, run_dir: str | None = None, credits: int = 256, resume: str | None = None, **kw: Any) -> None:
        super().__init__(broker, **kw)
        self.run_dir = Path(run_dir) if run_dir else None
        self.resume = resume
        self.credits = credits
        self.version = 0
        self.rank, self.world = 0, 1
        self.training = False
        self.acks: list[int] = []
        self.received_since_update = 0  # decision steps received since the last update
        self.dropped_unacked = 0  # dropped-for-staleness steps not yet reported in a TRAJ_ACK
        self.discarded_unacked = 0  # steps never trained on for another reason (zero-variance groups)
        self.c = Counters()
        self.evals = EvalTally()
        # PPO / GRPO units ready to train on, and GRPO's waiting rooms
        self.ready: deque[Unit] = deque()
        self.ready_steps = 0
        self.pending_eps: dict[tuple, list[Fragment]] = {}
        self.pending_groups: dict[tuple, list[list[Fragment]]] = {}
        self.dropped_groups: OrderedDict[tuple, None] = OrderedDict()  # groups whose later episodes we discard
        self.last_round = 0.0
        self.last_update = self.last_wait_log = time.monotonic()
        self.stopping = False
        self.t_start = time.monotonic()
        self.metrics: MetricsSink | None = None
        self.ddp = None
        host = rendezvous_host(broker)
        self.dist_info = {"addr": host, "port": free_port(host)}

    def ready_fields(self) -> dict[str, Any]:
        # Every trainer offers a rendezvous address; the broker passes rank 0's to the others.
        return {"credits": self.credits, "info": {"dist": self.dist_info}}

    def heartbeat_fields(self) -> dict[str, Any]:
        return {"credits": self.credits, "version": self.version}

    # -- set-up (off the socket thread) -------------------------------------------------------

    def setup(self) -> None:
        cfg = self.cfg
        a = cfg.algo
        torch.set_num_threads(max(1, cfg.workers.torch_threads))
        if a.name == "grpo" and cfg.env.group_size != a.group_size:
            raise SystemExit(f"trainer: algo.group_size ({a.group_size}) must equal env.group_size ({cfg.env.group_size}): "
                             "the simulators start env.group_size episodes from one seed")
        self.rank = int(self.welcome.get("rank", 0))
        self.world = max(1, int(self.welcome.get("world_size", 1)))
        if self.world > 1:
            self._join_group()

        self.policy = build_policy(cfg, device=self.device)
        self.policy.train()
        self.ppo = ppo_config(cfg)
        self.grpo = grpo_config(cfg) if a.name == "grpo" else None
        self.optimizer = make_optimizer(self.policy.parameters(), self.ppo)
        critic = [p for n, p in self.policy.named_parameters() if "value" in n.split(".")[0]]
        self.critic_optimizer = make_optimizer(critic, self.ppo) if critic else self.optimizer
        self.version = int(self.welcome.get("trainer_version", 0))
        self.resumed_from = self._maybe_resume()
        if self.world > 1:
            from workers.algorithms.distributed import broadcast_parameters, wrap_ddp

            v = torch.tensor([self.version], dtype=torch.int64)
            torch.distributed.broadcast(v, src=0)
            self.version = int(v)
            broadcast_parameters(self.policy, src=0)
            self.ddp = wrap_ddp(self.policy)
        self.model = self.ddp if self.ddp is not None else self.policy  # what ppo_update steps
        self.runner = self.new_runner("update")
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.metrics = MetricsSink(self.run_dir, self.rank)
        log.info("trainer_ready", algo=a.name, batch_steps=a.batch_steps, version=self.version, rank=self.rank,
                 world_size=self.world, resumed_from=self.resumed_from,
                 params=sum(p.numel() for p in self.policy.parameters()))

    def _join_group(self) -> None:
        from workers.algorithms.distributed import init_trainer_group

        dist_info = self.dist_info if self.rank == 0 else self.welcome.get("dist")
        if not dist_info:
            # The broker gives the lowest free rank, so a rank > 0 exists only beside a rank 0
            # that announced its address; a missing one means rank 0 left: start again.
            raise SystemExit(f"trainer rank {self.rank}: the broker has no rendezvous address of rank 0; restart this trainer")
        log.info("trainer_group_joining", rank=self.rank, world_size=self.world, **dist_info)
        init_trainer_group(self.rank, self.world, dist_info["addr"], int(dist_info["port"]), device=self.device)

    def _maybe_resume(self) -> str | None:
        """``--resume RUN_DIR``, or a trainer rejoining a running job with a checkpoint in its run folder."""
        from workers.checkpoint import latest_checkpoint, load_checkpoint

        src = self.resume
        if src is None and self.version > 0 and self.run_dir is not None and latest_checkpoint(self.run_dir) is not None:
            src = str(self.run_dir)
        if src is None:
            return None
        if self.rank > 0 and latest_checkpoint(src) is None:
            return None  # another host: rank 0's weights arrive by broadcast
        state = load_checkpoint(src, self.policy, self.optimizer)
        self.version = max(self.version, state["version"])
        for k, v in state["counters"].items():
            if hasattr(self.c, k):
                setattr(self.c, k, int(v))
        return str(state["path"])

    def start(self) -> None:
        if self.resumed_from is not None and self.rank == 0:
            # Generators swap to the resumed weights at once (the broker keeps them as snapshot).
            self._publish()
            self.send(P.TRAIN, {"phase": "end", "version": self.version, "stats": {"version": self.version, "resumed": True}})

    # -- receiving (socket thread) ------------------------------------------------------------

    def on_message(self, msg: P.Message) -> None:
        if msg.type != P.TRAJ:
            return
        gid = msg.get("gid")
        try:
            arrays = {name: self.attach.materialize(t, copy=True) for name, t in msg.tensors.items()}
            frag = Fragment(msg.header, arrays)
        except (KeyError, ValueError) as err:  # unreadable: ack it so the sim frees it, count it
            log.warning("traj_unreadable", gid=gid, error=str(err))
            self.c.unreadable += 1
            if isinstance(gid, int):
                self.acks.append(gid)
            return
        if isinstance(gid, int):
            self.acks.append(gid)
        if msg.get("eval"):  # evaluation episodes are measured, never trained on
            self.c.eval_fragments += 1
            if msg.get("done"):
                self.c.eval_episodes += 1
                version = msg.get("eval_version")
                version = int(version) if isinstance(version, int) else int(frag.arrays["version"].max())
                self.evals.add(version, bool(msg.get("episode_success")))
            return
        self.received_since_update += frag.steps
        if self.grpo is None:
            self._add_unit(Unit([frag], frag.steps, int(bool(frag.header.get("done")))))
        else:
            self._grpo_receive(frag)

    def _add_unit(self, unit: Unit) -> None:
        self.ready.append(unit)
        self.ready_steps += unit.steps

    # -- GRPO: fragments -> episodes -> groups ------------------------------------------------

    def _grpo_receive(self, frag: Fragment) -> None:
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
        if len(group) >= self.grpo.group_size:
            del self.pending_groups[gkey]
            self._grpo_complete(gkey, group[: self.grpo.group_size])

    def _grpo_complete(self, gkey: tuple, episodes: list[list[Fragment]]) -> None:
        """Score the group's episodes against each other; zero-variance groups carry no signal."""
        self.c.groups_complete += 1
        use_success = self.cfg.algo.grpo_reward == "success"
        last = [ep[-1].header for ep in episodes]
        scores = torch.tensor([float(h.get("episode_success", False)) if use_success else float(h.get("episode_return", 0.0))
                               for h in last])
        adv, keep, stats = grpo_advantages(scores, torch.zeros(len(episodes), dtype=torch.long), self.grpo)
        if stats["groups_filtered_zero_variance"]:
            self.c.groups_filtered_zero_variance += 1
            # Never trained on: hand the steps back to the broker's admission budget, or once
            # every group succeeds nothing is consumed and rollouts stall.
            self.discarded_unacked += sum(f.steps for ep in episodes for f in ep)
            return
        frags = []
        for ep, a in zip(episodes, adv.tolist()):
            for f in ep:
                f.advantages = np.full(f.steps, a, np.float32)
                frags.append(f)
        self._add_unit(Unit(frags, sum(f.steps for f in frags), len(episodes)))

    def _prune_stale_groups(self) -> None:
        """Drop GRPO groups (waiting or ready) holding a sample staler than ``max_staleness``."""
        limit = self.version - self.cfg.algo.max_staleness
        stale_keys = set()
        for key, frags in list(self.pending_eps.items()):
            if min(f.oldest_version for f in frags) < limit:
                stale_keys.add(frags[0].group_key)
        for gkey, eps in self.pending_groups.items():
            if min(f.oldest_version for ep in eps for f in ep) < limit:
                stale_keys.add(gkey)
        for gkey in stale_keys:
            self._forget_group(gkey)
            self.c.groups_dropped_stale += 1
        for key in [k for k, frags in self.pending_eps.items() if frags[0].group_key in stale_keys]:
            self._drop_steps(sum(f.steps for f in self.pending_eps.pop(key)))
        for gkey in stale_keys:
            for ep in self.pending_groups.pop(gkey, []):
                self._drop_steps(sum(f.steps for f in ep))
        keep: deque[Unit] = deque()
        for u in self.ready:
            if u.oldest_version < limit:
                self.c.groups_dropped_stale += 1
                self.ready_steps -= u.steps
                self._drop_steps(u.steps)
            else:
                keep.append(u)
        self.ready = keep

    def _forget_group(self, gkey: tuple) -> None:
        self.dropped_groups[gkey] = None
        while len(self.dropped_groups) > 100_000:
            self.dropped_groups.popitem(last=False)

    def _drop_steps(self, n: int) -> None:
        self.c.dropped_stale += n
        self.dropped_unacked += n

    # -- deciding to update (socket thread) ---------------------------------------------------

    def tick(self, now: float) -> None:
        if self.acks or self.dropped_unacked or self.discarded_unacked:
            self.send(P.TRAJ_ACK, {"traj_ids": self.acks, "dropped_stale": self.dropped_unacked,
                                   "discarded": self.discarded_unacked})
            self.acks, self.dropped_unacked, self.discarded_unacked = [], 0, 0
        if self.training:
            return
        if self.grpo is not None:
            self._prune_stale_groups()
        batch_steps = self.cfg.algo.batch_steps
        if (self.grpo is not None and self.cfg.run.mode != "async"
                and self.received_since_update >= batch_steps and self.ready_steps < batch_steps):
            # An alternating broker paused at batch_steps delivered, but incomplete groups cannot
            # be trained on: ask it to hand out more work rather than wait for each other (again
            # after every further batch_steps, until the groups complete).
            self.received_since_update = 0
            self.send(P.TRAIN, {"phase": "starved", "version": self.version, "ready_steps": self.ready_steps})
        if self.world == 1:
            if self.ready_steps >= batch_steps:
                units = self._take(batch_steps)
                self.training = True
                self.send(P.TRAIN, {"phase": "begin", "version": self.version, "steps": sum(u.steps for u in units)})
                self.runner.submit(lambda: self._update(units, pad_to=None), "update")
        elif now - self.last_round >= ROUND_EVERY_S:
            # Every rank takes part in every round, so rounds pair up across ranks. A rank offers
            # its share of the global batch; the update goes ahead once the ranks together hold
            # batch_steps (a sync-mode broker pauses at exactly that, however unevenly split).
            self.last_round = now
            units = self._take(math.ceil(batch_steps / self.world))
            available = self.ready_steps + sum(u.steps for u in units)
            self.training = True
            stopping = self.stopping
            self.runner.submit(lambda: self._round(units, available, stopping), "round")

    def _take(self, steps: int) -> list[Unit]:
        units, n = [], 0
        while self.ready and n < steps:
            u = self.ready.popleft()
            units.append(u)
            n += u.steps
        self.ready_steps -= n
        return units

    def _round(self, units: list[Unit], available: int, stopping: bool) -> dict[str, Any]:
        """Several ranks: agree whether to update now, and on a common batch length."""
        import torch.distributed as dist

        local = torch.tensor([sum(u.steps for u in units), available, int(stopping)], dtype=torch.int64)
        gathered = [torch.zeros_like(local) for _ in range(self.world)]
        dist.all_gather(gathered, local)
        taken = [int(g[0]) for g in gathered]
        if any(int(g[2]) for g in gathered):
            return {"round": "stop", "units": units}
        if sum(int(g[1]) for g in gathered) < self.cfg.algo.batch_steps or min(taken) == 0:
            return {"round": "wait", "units": units, "taken": taken}
        return self._update(units, pad_to=max(taken))

    # -- the update (update thread) -----------------------------------------------------------

    def _update(self, units: list[Unit], pad_to: int | None) -> dict[str, Any]:
        t0 = time.perf_counter()
        a = self.cfg.algo
        frags = [f for u in units for f in u.frags]

        # ---- 1. staleness: mask samples older than max_staleness ----------------------------
        versions = np.concatenate([f.arrays["version"] for f in frags])
        staleness = self.version - versions
        keep = staleness <= a.max_staleness
        dropped = int((~keep).sum())

        # ---- 2. advantages ------------------------------------------------------------------
        warmup = False
        if self.grpo is not None:  # group-relative scores, broadcast to every decision step
            advantages = torch.as_tensor(np.concatenate([f.advantages for f in frags]))
            returns = None
        else:  # GAE on behaviour values, bootstrapped from the observation after each fragment
            boot = self._bootstrap_values(frags)
            advs, rets = [], []
            for f, bv in zip(frags, boot):
                terminated = torch.as_tensor(f.arrays["terminated"])
                reward = torch.as_tensor(f.arrays["reward"]) * a.reward_scale
                adv, ret = compute_gae(reward, torch.as_tensor(f.arrays["value"]),
                                       terminated, 0.0 if bool(terminated[-1]) else bv, a.gamma, a.lam)
                advs.append(adv)
                rets.append(ret)
            advantages, returns = torch.cat(advs).float(), torch.cat(rets).float()
            warmup = self.c.updates < a.critic_warmup_updates

        batch = self._batch(frags)
        batch["advantages"] = advantages.float()
        if returns is not None:
            batch["returns"] = returns
        batch["mask"] = torch.as_tensor(keep)
        n = len(keep)

        # ---- 3. several ranks: equal batch lengths (padding is masked out) ------------------
        if pad_to is not None and pad_to > n:
            idx = torch.cat([torch.arange(n), torch.arange(pad_to - n) % n])
            batch = index_batch(batch, idx)
            batch["mask"] = torch.cat([batch["mask"][:n], torch.zeros(pad_to - n, dtype=torch.bool)])
        elif self.world == 1 and not keep.any():
            return {"skipped": True, "dropped_stale": dropped, "staleness": staleness, "units": units}

        # ---- 4. PPO (or GRPO through PPO with vf_coef 0), proximal log-probs recomputed -----
        if self.grpo is None and warmup:
            # Critic warm-up: advantages zeroed and only the value head stepped, so a shared trunk
            # cannot drag a warm-started policy around while the critic learns the returns.
            batch["advantages"] = torch.zeros_like(batch["advantages"])
            stats = ppo_update(self.model, self.critic_optimizer, batch, self.ppo)
            stats["critic_warmup"] = 1
        else:
            stats = ppo_update(self.model, self.optimizer, batch, self.ppo)
        if returns is not None:
            stats["explained_variance"] = explained_variance(batch["values"][batch["mask"]], batch["returns"][batch["mask"]])

        # ---- 5. replicas identical? (debug / tests) -----------------------------------------
        if self.world > 1 and a.check_replicas:
            from workers.algorithms.distributed import assert_replicas_identical

            stats["param_checksum"] = assert_replicas_identical(self.ddp)
        elif a.check_replicas:
            from workers.algorithms.distributed import parameter_checksum

            stats["param_checksum"] = float(parameter_checksum(self.policy))

        done = [f.header for f in frags if f.header.get("done")]
        stats.update({
            "update_s": time.perf_counter() - t0, "samples": int(keep.sum()), "batch_len": int(len(batch["mask"])),
            "dropped_stale": dropped, "env_steps": int(sum(int(f.arrays["steps"].sum()) for f in frags)),
            "episodes": len(done),
            "return_mean_batch": float(np.mean([h.get("episode_return", 0.0) for h in done])) if done else float("nan"),
            "success_mean_batch": float(np.mean([bool(h.get("episode_success")) for h in done])) if done else float("nan"),
        })
        # admission control counts units: fragments (PPO) or episodes (GRPO)
        stats["units"] = sum(u.episodes for u in units) if self.grpo is not None else len(frags)
        if self.grpo is not None:
            stats["groups"] = len(units)
        stats["staleness"] = staleness
        return stats

    def _bootstrap_values(self, frags: list[Fragment]) -> list[float]:
        """V(s_N) of each fragment's observation after its last step (value heads read the
        observation only, so the last step's actions and replay serve as placeholders)."""
        obs = {
            "images": {k[len("obs/images/"):]: np.stack([f.arrays[k][-1] for f in frags])
                       for k in frags[0].arrays if k.startswith("obs/images/")},
            "state": np.stack([f.arrays["obs/state"][-1] for f in frags]),
            "instruction": [f.header.get("instruction", "") for f in frags],
        }
        actions = torch.as_tensor(np.stack([f.arrays["actions"][-1] for f in frags]))
        replay = {k[len("replay/"):]: torch.as_tensor(np.stack([f.arrays[k][-1] for f in frags]))
                  for k in frags[0].arrays if k.startswith("replay/")}
        dev = self.policy.device
        with torch.no_grad():  # the bare policy, not DDP: no collective for a forward pass
            out = self.policy.evaluate(obs, actions.to(dev), {k: v.to(dev) for k, v in replay.items()})
        return out.value.float().cpu().tolist()

    def _batch(self, frags: list[Fragment]) -> dict[str, Any]:
        cams = [k for k in frags[0].arrays if k.startswith("obs/images/")]
        obs = {
            "images": {k[len("obs/images/"):]: np.concatenate([f.arrays[k][:-1] for f in frags]) for k in cams},
            "state": np.concatenate([f.arrays["obs/state"][:-1] for f in frags]),
            "instruction": [f.header.get("instruction", "") for f in frags for _ in range(f.steps)],
        }
        replay = {k[len("replay/"):]: torch.as_tensor(np.concatenate([f.arrays[k] for f in frags]))
                  for k in frags[0].arrays if k.startswith("replay/")}
        return {
            "obs": obs,
            "actions": torch.as_tensor(np.concatenate([f.arrays["actions"] for f in frags])),
            "replay": replay,
            "behav_logprob": torch.as_tensor(np.concatenate([f.arrays["logprob"] for f in frags])),
            "values": torch.as_tensor(np.concatenate([f.arrays["value"] for f in frags])),
        }

    # -- after an update (socket thread) ------------------------------------------------------

    def on_job_done(self, tag: Any, result: Any, error: BaseException | None) -> None:
        self.training = False
        if not (isinstance(result, dict) and result.get("round") in ("wait", "stop")):
            self.received_since_update = 0
        if error is not None:
            log.error("update_failed", error=repr(error)[:1000])
            raise error
        if result.get("round") in ("wait", "stop"):
            if time.monotonic() - self.last_update > 10.0 and time.monotonic() - self.last_wait_log > 10.0:
                self.last_wait_log = time.monotonic()
                log.info("trainer_round_waiting", taken=result.get("taken"), ready_steps=self.ready_steps)
            units = result["units"]
            for u in reversed(units):  # back to the front, in order
                self.ready.appendleft(u)
            self.ready_steps += sum(u.steps for u in units)
            if result["round"] == "stop":
                self._stop = True
            return
        staleness = result.pop("staleness")
        result.pop("units", None)
        counts = Counter(int(s) for s in staleness.tolist())
        self.c.dropped_stale += result.get("dropped_stale", 0)
        self.dropped_unacked += result.get("dropped_stale", 0)
        self.last_update = time.monotonic()
        if not result.get("skipped"):
            self.version += 1
            self.c.updates += 1
            self.c.samples_trained += result.get("samples", 0)
            self.c.env_steps_consumed += result.get("env_steps", 0)
            if self.rank == 0:
                if self.c.updates % max(1, self.cfg.algo.publish_every) == 0:
                    self._publish()
                every = self.cfg.algo.checkpoint_every
                if every > 0 and self.version % every == 0:
                    self._checkpoint()
        self._log_metrics(result, counts, staleness)

    def _publish(self) -> None:
        self.send(P.WEIGHTS, {"version": self.version, "published_at": time.time_ns()}, state_tensors(self.policy))

    def _checkpoint(self) -> None:
        if self.run_dir is None:
            return
        from workers.checkpoint import save_checkpoint

        keep = self.cfg.algo.keep_checkpoints or None
        path = save_checkpoint(self.run_dir, self.policy, self.optimizer, self.version, self.c.as_dict(),
                               self.cfg.to_yaml(), keep_last=keep)
        log.info("checkpoint_saved", version=self.version, path=str(path))

    # -- metrics -------------------------------------------------------------------------------

    def _log_metrics(self, result: dict[str, Any], counts: Counter, staleness: np.ndarray) -> None:
        elapsed = time.monotonic() - self.t_start
        figures: dict[str, Any] = {k: (round(v, 6) if isinstance(v, float) else v)
                                   for k, v in result.items() if isinstance(v, (int, float))}
        figures.update({
            "version": self.version, "rank": self.rank, "dropped_stale_total": self.c.dropped_stale,
            "staleness_counts": {str(k): v for k, v in sorted(counts.items())},
            "env_steps_consumed": self.c.env_steps_consumed,
            "env_steps_per_s": round(self.c.env_steps_consumed / max(elapsed, 1e-9), 2),
        })
        if self.grpo is not None:
            figures.update({k: getattr(self.c, k) for k in ("groups_complete", "groups_filtered_zero_variance", "groups_dropped_stale")})
            figures["groups_pending"] = len(self.pending_groups)
        fresh_evals = self.evals.take_fresh()
        if fresh_evals:
            figures["eval"] = fresh_evals
        if self.rank == 0:
            self.send(P.TRAIN, {"phase": "end", "version": self.version, "stats": figures})
        else:
            self.send(P.TRAIN, {"phase": "end", "version": self.version})
        log.info("update_done", version=self.version, **{k: figures[k] for k in ("policy_loss", "value_loss", "approx_kl", "clip_frac", "update_s", "samples") if k in figures})
        if self.metrics is not None:
            self.metrics.put({"t": time.time(), "elapsed_s": round(elapsed, 3), **figures}, staleness, fresh_evals)

    # -- shutdown -----------------------------------------------------------------------------

    def teardown(self) -> None:
        runner = getattr(self, "runner", None)
        finished = True
        if runner is not None:
            # An update in progress ends before weights are saved; with several ranks a round may
            # wait on a rank that is gone, so give up sooner.
            runner.join(timeout=30 if self.world == 1 else 5)
            finished = not runner._thread.is_alive()
        if self.rank == 0 and self.cfg is not None and hasattr(self, "policy") and self.c.updates > 0:
            if finished:
                self._checkpoint()
            else:
                log.warning("checkpoint_skipped_update_running", version=self.version)
        if self.metrics is not None:
            self.metrics.close()
        if self.world > 1 and finished:
            from workers.algorithms.distributed import destroy_trainer_group

            destroy_trainer_group()
