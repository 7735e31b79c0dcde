"""The trainer worker: a socket shell around the learner and the update (Sample Factory's split).

The socket thread receives trajectory fragments, copies them out of shared memory, acknowledges
them (TRAJ_ACK: from then on the trainer owns them) and hands them to the
:class:`~workers.learner.Learner`, which assembles units (fragments, or complete GRPO groups)
and prunes stale ones. When enough steps are ready, the shell takes units and submits one job
to the update thread, so heartbeats keep flowing during a long update:

    build_batch (workers.learner)  ->  update (workers.algorithms.update)  ->  UpdateResult

Back on the socket thread: version += 1; rank 0 announces WEIGHTS every ``publish_every``
updates (with ``weights.in_flight``, in async, also between the update's epochs) and checkpoints every ``checkpoint_every`` versions, and at shutdown (SIGTERM included:
a preempted trainer leaves a checkpoint at its last version for ``rlvla3 run --resume``);
metrics go to the broker, JSONL and TensorBoard (``workers.metrics``).

The parts, one module each: publishing weights (``trainer_publish``: weights never go through
the broker, only their announcement), resuming and checkpointing (``trainer_checkpoints``), and
with several ranks the group and the rounds in which the ranks agree to update
(``trainer_rounds``). The learner keeps every count (``workers.learner``).
"""

from __future__ import annotations

import math
import queue
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from rlvla3 import protocol as P
from workers.algorithms.memory import enable_gradient_checkpointing, make_offload
from workers.algorithms.update import TrainState, UpdateResult, update
from workers.base import WorkerBase
from workers.fragment_schema import FragmentSchema
from workers.learner import Fragment, Learner, Unit, build_batch
from workers.metrics import EvalTally, MetricsSink, update_row
from workers.model import build_policy, freeze_prefixes
from workers.trainer_checkpoints import Checkpoints
from workers.trainer_publish import Publishing
from workers.trainer_rounds import Deferred, Rounds, join_group

log = structlog.get_logger()


@dataclass
class Trained:
    """An update ran; rank 0 wrote the version it made into the weight store when one is due."""

    result: UpdateResult
    announcement: dict[str, Any] | None  # WEIGHTS fields to send (no tensors), or None


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
        self.stopping = False
        self.acks: list[int] = []
        self.evals = EvalTally()
        self.learner: Learner | None = None
        self.offload = None  # colocated placement: workers.algorithms.memory.TrainerOffload
        self.state: TrainState | None = None
        self.metrics: MetricsSink | None = None
        self.publishing: Publishing | None = None
        self.checkpoints: Checkpoints | None = None
        self.rounds: Rounds | None = None
        self.last_update = self.t_start = time.monotonic()
        from workers.algorithms.distributed import rendezvous_address

        self.dist_info = rendezvous_address(broker)

    def ready_fields(self) -> dict[str, Any]:
        # Every trainer offers a rendezvous address; the broker passes rank 0's to the others.
        # Our version too: a restarted broker rebuilds its trainer version from it. Once in a
        # group, our rank: a restarted broker keeps it (it routes fragments by rank).
        rank = {"rank": self.rank} if self.learner is not None else {}
        return {"credits": self.credits, "info": {"dist": self.dist_info, "version": self.version}, **rank}

    def heartbeat_fields(self) -> dict[str, Any]:
        algo = {"info": {"algo": self.cfg.algo.name}} if self.cfg is not None else {}  # GRPO holds groups
        return {"credits": self.credits, "version": self.version, **algo}

    # -- set-up (off the socket thread) -------------------------------------------------------

    def setup(self) -> None:
        cfg = self.cfg
        torch.set_num_threads(max(1, cfg.workers.torch_threads))
        self.rank = int(self.welcome.get("rank", 0))
        self.world = max(1, int(self.welcome.get("world_size", 1)))
        if self.world > 1:
            join_group(self.rank, self.world, self.dist_info, self.welcome, self.device, cfg)
            self.rounds = Rounds(self.world, cfg.algo.batch_steps)
        policy = build_policy(cfg, device=self.device)
        policy.train()
        self.schema = FragmentSchema(policy)
        if cfg.algo.frozen:  # before the optimizer and version 0: versions carry what trains
            log.info("trainer_frozen", prefixes=cfg.algo.frozen, tensors=freeze_prefixes(policy, cfg.algo.frozen))
        if cfg.train.gradient_checkpointing:
            enable_gradient_checkpointing(policy)
        model = policy
        if cfg.train.fsdp:  # sharded before the optimizer is built: it steps the shards
            from workers.algorithms.distributed import broadcast_parameters, wrap_fsdp

            broadcast_parameters(policy, src=0)
            model = wrap_fsdp(policy)
        self.state = TrainState.build(policy, cfg.algo, model)
        self.learner = Learner(cfg)
        self.version = int(self.welcome.get("trainer_version", 0))
        self.checkpoints = Checkpoints(cfg, self.run_dir, self.resume, self.rank, self.world)
        self.version, self.resumed_from = self.checkpoints.resume(self.state, self.version, self.learner)
        if self.rank == 0:
            # A version the broker already announced may name another store's bytes (a trainer
            # that restarted): publish past it, so generators fetch this trainer's weights whole.
            self.version = max(self.version, int(self.welcome.get("version", -1)) + 1)
        if self.world > 1:
            from workers.algorithms.distributed import broadcast_parameters, wrap_ddp

            v = torch.tensor([self.version], dtype=torch.int64)
            torch.distributed.broadcast(v, src=0)
            self.version = int(v)
            if not cfg.train.fsdp:
                broadcast_parameters(policy, src=0)
                self.state.model = wrap_ddp(policy)
        pl = cfg.placement
        self.offload = None if cfg.train.fsdp else make_offload(pl.mode, pl.offload, policy, [self.state.optimizer, self.state.critic_optimizer], policy.device)
        log.info("trainer_placement", mode=pl.mode, offload=pl.offload, offloading=self.offload is not None, fsdp=cfg.train.fsdp)
        self.publishing = Publishing(cfg, self.rank, self.job)
        self.publishing.open(self.state, str(self.welcome.get("run_id", "run")), self.host, self.version)  # version 0 (or the resumed one)
        self.runner = self.new_runner("update")
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.metrics = MetricsSink(self.run_dir, self.rank)
        log.info("trainer_ready", algo=cfg.algo.name, batch_steps=cfg.algo.batch_steps, version=self.version, rank=self.rank,
                 world_size=self.world, resumed_from=self.resumed_from, params=sum(p.numel() for p in policy.parameters()))

    def start(self) -> None:
        if self.rank != 0:
            return
        if self.resumed_from is not None:
            # TRAIN first: the broker accepts WEIGHTS only a bounded step past the version it knows.
            self.send(P.TRAIN, {"phase": "end", "version": self.version, "stats": {"version": self.version, "resumed": True}})
        # Generators serve nothing until this first version is in (the broker keeps it as snapshot).
        self.send(P.WEIGHTS, self.publishing.announcement)

    def on_reconnected(self) -> None:
        announcement = self.publishing.announcement if self.publishing is not None else None
        if self.rank == 0 and announcement is not None:  # a restarted broker knows no version
            self.send(P.WEIGHTS, announcement)

    # -- receiving (socket thread) ------------------------------------------------------------

    def on_message(self, msg: P.Message) -> None:
        if msg.type != P.TRAJ:
            return
        gid = msg.get("gid")
        if isinstance(gid, int):
            self.acks.append(gid)  # readable or not, a copy or not: the simulator may free it
        if self.learner.resent(msg.header):
            log.warning("traj_duplicate", gid=gid, traj_id=msg["traj_id"], writer=msg["writer"])
            return
        evaluation = bool(msg.get("eval"))
        try:
            frag = Fragment(msg.header, {name: self.attach.materialize(t, copy=True) for name, t in msg.tensors.items()})
            # At most the version the update in progress makes (another rank may publish it first).
            if frag.newest_version > self.version + int(self.training):
                raise ValueError(f"behaviour version {frag.newest_version} is ahead of the trainer's {self.version}")
            observations = self.schema.check(frag.arrays, evaluation)  # training ones must stack
        except (KeyError, ValueError) as err:
            log.warning("traj_unreadable", gid=gid, error=str(err))
            self.learner.count_unreadable(int(msg.get("steps", 0)), evaluation)
            return
        if evaluation:  # evaluation episodes are measured, never trained on
            self.learner.count_eval(bool(msg.get("done")))
            if self.metrics is not None:
                self.metrics.put_eval_fragment(msg.header, observations)
            if msg.get("done"):
                version = msg.get("eval_version")
                self.evals.add(int(version) if isinstance(version, int) else frag.newest_version, bool(msg.get("episode_success")))
            return
        self.learner.add(frag)

    # -- deciding to update (socket thread) ---------------------------------------------------

    def tick(self, now: float) -> None:
        fates = self.learner.take_unreported()
        if self.acks or any(fates.values()):
            self.send(P.TRAJ_ACK, {"traj_ids": self.acks, **fates})
            self.acks = []
        if self.training:
            return
        learner, batch_steps = self.learner, self.cfg.algo.batch_steps
        learner.prune_stale(self.version)
        if learner.starved(math.ceil(batch_steps / self.world)):  # incomplete groups: the broker must hand out more
            self.send(P.TRAIN, {"phase": "starved", "version": self.version, "ready_steps": learner.ready_steps})
        if self.rounds is None:
            if learner.ready_steps >= batch_steps:
                units = learner.take(batch_steps)
                self.training = True
                self._began(sum(u.steps for u in units))
                self.runner.submit(lambda: self._train(units, None), "update")
            return
        offer = self.rounds.offer(learner, now, self.stopping)
        if offer is not None:
            units, round_ = offer
            self.training = True
            self.runner.submit(lambda: self._train(units, round_), "update")

    # -- the update (update thread) -----------------------------------------------------------

    def _train(self, units: list[Unit], round_: tuple[int, bool] | None) -> Trained | Deferred:
        pad_to = None
        if round_ is not None:  # several ranks: agree whether to update now, and on a batch length
            deferred, pad_to = self.rounds.agree(units, round_)
            if deferred is not None:
                return deferred
        algo = self.cfg.algo
        counters = self.learner.counters  # read only: the socket thread waits for this job
        batch = build_batch(units, self.version, self.cfg)
        warmup = algo.name == "ppo" and counters.updates < algo.critic_warmup_updates
        if self.offload is not None:  # colocated: trainer state back on the device for the update
            self.offload.onload()
        progress = counters.env_steps_consumed / max(1, self.cfg.run.total_env_steps)
        between = None
        if self.publishing.in_flight:
            version = self.version  # the socket thread changes it only after this job

            def between(epoch: int) -> None:
                self.runner.report("in_flight", self.publishing.between_epochs(version, epoch))
        result = update(self.state, batch, algo, critic_warmup=warmup, pad_to=pad_to, min_s=self.cfg.train.min_update_s,
                        progress=progress, after_epoch=between)
        announcement = None
        if result.trained and self.publishing.due(counters.updates):
            # Here, on the update thread, no optimizer step runs while the store copies the
            # parameters (the socket thread only reads the counters until this job is done), and
            # before an offload moves them. FSDP: every rank gathers, rank 0 writes.
            announcement = self.publishing.publish(self.state, self.version + 1)
        if self.offload is not None:  # and off again while the generators work
            log.info("trainer_state_offloaded", mb=round(self.offload.offload() / 2**20, 1))
        return Trained(result, announcement)

    # -- after an update (socket thread) ------------------------------------------------------

    def on_job_done(self, tag: Any, done: Trained | Deferred | None, error: BaseException | None) -> None:
        if tag == "in_flight":  # weights published between two epochs; the update goes on
            self.publishing.announcement = done
            self.send(P.WEIGHTS, done)
            return
        self.training = False
        if error is not None:
            log.error("update_failed", error=repr(error)[:1000])
            raise error
        if isinstance(done, Deferred):
            if self.rounds.deferred(done, self.learner, self.last_update):
                self._stop = True
            return
        result = done.result
        if self.rounds is not None:  # the round went ahead: the steps this rank took count as consumed
            self._began(self.rounds.offered)
        self._count(result)
        if result.trained and self.rank == 0 and done.announcement is not None:
            self.publishing.announcement = done.announcement
            self.send(P.WEIGHTS, done.announcement)
        if result.trained and self.checkpoints.due(self.version):
            self._checkpoint()
        self._report(result)

    def _began(self, steps: int) -> None:
        """Tell the broker an update took ``steps``; both sides stop counting them as waiting."""
        self.learner.consumed(steps)
        self.send(P.TRAIN, {"phase": "begin", "version": self.version, "steps": steps})

    def _count(self, result: UpdateResult) -> None:
        self.learner.count_update(result)
        self.last_update = time.monotonic()
        if result.trained:
            self.version += 1

    def _checkpoint(self) -> None:
        self.checkpoints.save(self.state, self.version, self.learner)

    def _report(self, result: UpdateResult, to_broker: bool = True) -> None:
        """One metrics row: to the broker (rank 0's figures), the log, JSONL and TensorBoard."""
        elapsed = time.monotonic() - self.t_start
        figures = update_row(result, self.version, self.rank, self.learner.counters, elapsed,
                             len(self.learner.pending_groups) if self.learner.grpo else None)
        fresh_evals = self.evals.take_fresh()
        if fresh_evals:
            figures["eval"] = fresh_evals
        if to_broker:
            self.send(P.TRAIN, {"phase": "end", "version": self.version, **({"stats": figures} if self.rank == 0 else {})})
        log.info("update_done", version=self.version, **{k: figures[k] for k in ("policy_loss", "value_loss", "approx_kl", "clip_frac", "update_s", "samples") if k in figures})
        if self.metrics is not None:
            self.metrics.put({"t": time.time(), "elapsed_s": round(elapsed, 3), **figures}, result.staleness, fresh_evals)

    # -- shutdown (DISCONNECT, SIGTERM, SIGINT) -----------------------------------------------

    def teardown(self) -> None:
        runner = getattr(self, "runner", None)
        finished = True
        if runner is not None:
            # An update in progress ends before weights are saved; with several ranks a round may
            # wait on a rank that is gone, so give up sooner.
            runner.join(timeout=30 if self.world == 1 else 5)
            finished = not runner._thread.is_alive()
            if finished:
                self._settle(runner)
        if self.checkpoints is not None and self.checkpoints.saves and self.state is not None and self.learner.counters.updates > 0:
            # The preemption hook: whatever stopped us, the last trained version is kept (with
            # several ranks saving together, only if every rank is still there to take part).
            if finished:
                self._checkpoint()
            else:
                log.warning("checkpoint_skipped_update_running", version=self.version)
        if self.metrics is not None:
            self.metrics.close()
        if self.publishing is not None:
            self.publishing.close(finished)
        if self.world > 1 and finished and not (self.checkpoints is not None and self.checkpoints.group_lost):
            from workers.algorithms.distributed import destroy_trainer_group

            destroy_trainer_group()

    def _settle(self, runner: Any) -> None:
        """An update that finished after the loop stopped still counts: the checkpoint's version
        must name the weights it holds (the broker is gone from us: metrics only)."""
        while True:
            try:
                _tag, result, error = runner.results.get_nowait()
            except queue.Empty:
                return
            if error is None and isinstance(result, Trained):
                self._count(result.result)
                self._report(result.result, to_broker=False)
