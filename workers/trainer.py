"""The trainer worker: a socket shell around the learner and the update (Sample Factory's split).

The socket thread receives trajectory fragments, copies them out of shared memory, acknowledges
them (TRAJ_ACK: from then on the trainer owns them) and hands them to the
:class:`~workers.learner.Learner`, which assembles units (fragments, or complete GRPO groups)
and prunes stale ones. When enough steps are ready, the shell takes units and submits one job
to the update thread, so heartbeats keep flowing during a long update:

    build_batch (workers.learner)  ->  update (workers.algorithms.update)  ->  UpdateResult

Back on the socket thread: version += 1; rank 0 announces WEIGHTS every ``publish_every``
updates and checkpoints every ``checkpoint_every`` versions, and at shutdown (SIGTERM included:
a preempted trainer leaves a checkpoint at its last version for ``rlvla3 run --resume``);
metrics go to the broker, JSONL and TensorBoard (``workers.metrics``).

Weights never go through the broker: rank 0 writes each version into its shared-memory weight
store (:class:`~rlvla3.weights.publisher.WeightPublisher`, which also serves other hosts over its
stream) and sends only the announcement (version + manifest + where the bytes are). Version 0
(or the resumed version) is written right after set-up, through the same path; later versions
are written at the end of the update job, on the update thread, where no optimizer step runs,
and announced from the socket thread.

Several ranks (``workers.trainers`` > 1): the broker hands each trainer a rank; every trainer
announces a rendezvous address in READY and the broker passes rank 0's to the others. The
ranks decide *together* when to update (``distributed.agree_to_update``, at most every
``ROUND_EVERY_S``): each offers its share of the batch, and all train once the shares add up to
``batch_steps``. Only rank 0 publishes and checkpoints.
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
from workers.learner import Fragment, Learner, Unit, build_batch
from workers.metrics import Counters, EvalTally, MetricsSink, update_row
from workers.model import build_policy

log = structlog.get_logger()

ROUND_EVERY_S = 0.05
"""Several ranks: at most this often a rank starts a collective 'shall we update?' round."""


@dataclass
class Trained:
    """An update ran; rank 0 wrote the version it made into the weight store when one is due."""

    result: UpdateResult
    announcement: dict[str, Any] | None  # WEIGHTS fields to send (no tensors), or None


@dataclass
class Deferred:
    """Several ranks: the round did not update; the units go back to the learner."""

    units: list[Unit]
    decision: str  # "wait" or "stop"
    taken: list[int]


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
        self.counters = Counters()
        self.evals = EvalTally()
        self.learner: Learner | None = None
        self.offload = None  # colocated placement: workers.algorithms.memory.TrainerOffload
        self.state: TrainState | None = None
        self.metrics: MetricsSink | None = None
        self.publisher: Any = None  # rank 0's WeightPublisher
        self.announcement: dict[str, Any] | None = None  # the last WEIGHTS fields sent
        self.last_round = 0.0
        self.round_steps = 0  # decision steps this rank offered in the current round
        self.last_update = self.last_wait_log = self.t_start = time.monotonic()
        from workers.algorithms.distributed import rendezvous_address

        self.dist_info = rendezvous_address(broker)

    def ready_fields(self) -> dict[str, Any]:
        # Every trainer offers a rendezvous address; the broker passes rank 0's to the others.
        # Our version too: a restarted broker rebuilds its trainer version from it.
        return {"credits": self.credits, "info": {"dist": self.dist_info, "version": self.version}}

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
            self._join_group()
        policy = build_policy(cfg, device=self.device)
        policy.train()
        if cfg.train.gradient_checkpointing:
            enable_gradient_checkpointing(policy)
        model = policy
        if cfg.train.fsdp:  # sharded before the optimizer is built: it steps the shards
            from workers.algorithms.distributed import broadcast_parameters, wrap_fsdp

            broadcast_parameters(policy, src=0)
            model = wrap_fsdp(policy)
        self.state = TrainState.build(policy, cfg.algo, model)
        self.learner = Learner(cfg, self.counters)
        self.version = int(self.welcome.get("trainer_version", 0))
        self.resumed_from = self._maybe_resume()
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
        first = self._gathered(everything=True)  # FSDP: every rank gathers, rank 0 keeps
        if self.rank == 0:
            from rlvla3.weights.publisher import WeightPublisher

            w = cfg.weights
            self.publisher = WeightPublisher(policy, str(self.welcome.get("run_id", "run")), shm=w.shm, stream_bind=w.stream_bind,
                                             advertise_host=w.advertise_host, host=self.host, copy_threads=w.copy_threads,
                                             tensors=first, cuda_ipc=w.cuda_ipc, delta=w.delta)
            self.announcement = self.publisher.publish(self.version, first)  # version 0 (or the resumed one)
        del first
        self.runner = self.new_runner("update")
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.metrics = MetricsSink(self.run_dir, self.rank)
        log.info("trainer_ready", algo=cfg.algo.name, batch_steps=cfg.algo.batch_steps, version=self.version, rank=self.rank,
                 world_size=self.world, resumed_from=self.resumed_from, params=sum(p.numel() for p in policy.parameters()))

    def _join_group(self) -> None:
        from workers.algorithms.distributed import init_trainer_group

        dist_info = self.dist_info if self.rank == 0 else self.welcome.get("dist")
        if not dist_info:
            # The broker gives the lowest free rank, so a rank > 0 exists only beside a rank 0
            # that announced its address; a missing one means rank 0 left: start again.
            raise SystemExit(f"trainer rank {self.rank}: the broker has no rendezvous address of rank 0; restart this trainer")
        log.info("trainer_group_joining", rank=self.rank, world_size=self.world, **dist_info)
        init_trainer_group(self.rank, self.world, dist_info["addr"], int(dist_info["port"]), device=self.device)

    @property
    def collective_checkpoints(self) -> bool:
        """Every rank saves and loads (FSDP shards, or DCP's files); else rank 0 alone."""
        return self.cfg.train.fsdp or (self.world > 1 and self.cfg.train.checkpoint_format == "sharded")

    def _gathered(self, everything: bool) -> list | None:
        """FSDP: the whole tensors rank 0 publishes (a collective, every rank calls it); None for
        an unsharded policy (the publisher reads the module itself)."""
        if not self.cfg.train.fsdp:
            return None
        from workers.algorithms.distributed import gather_tensors

        return gather_tensors(self.state.policy, keep=self.rank == 0, everything=everything)

    def _maybe_resume(self) -> str | None:
        """``--resume RUN_DIR``, or a trainer rejoining a running job with a checkpoint in its run folder."""
        from workers.checkpoint import latest_checkpoint, load_checkpoint

        src = self.resume
        if src is None and self.version > 0 and self.run_dir is not None and latest_checkpoint(self.run_dir) is not None:
            src = str(self.run_dir)
        found = src is not None and latest_checkpoint(src) is not None
        if self.collective_checkpoints:  # every rank loads its part, so every rank must see the files
            flags = torch.tensor([int(src is not None), int(found)], dtype=torch.int64)
            lo = flags.clone()
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            torch.distributed.all_reduce(lo, op=torch.distributed.ReduceOp.MIN)
            if int(flags[0]) and not int(lo[1]):
                raise SystemExit(f"trainer rank {self.rank}: resuming a sharded/FSDP group needs the checkpoint on "
                                 f"every rank (a shared run folder); this rank sees {'it' if found else 'none'}")
            if not int(flags[0]):
                return None
        elif src is None:
            return None
        elif self.rank > 0 and not found:
            return None  # another host: rank 0's weights arrive by broadcast
        saved = load_checkpoint(src, self.state.policy, self.state.optimizer)
        self.version = max(self.version, saved["version"])
        self.counters.restore(saved["counters"])
        return str(saved["path"])

    def start(self) -> None:
        if self.rank != 0:
            return
        if self.resumed_from is not None:
            # TRAIN first: the broker accepts WEIGHTS only a bounded step past the version it knows.
            self.send(P.TRAIN, {"phase": "end", "version": self.version, "stats": {"version": self.version, "resumed": True}})
        # Generators serve nothing until this first version is in (the broker keeps it as snapshot).
        self.send(P.WEIGHTS, self.announcement)

    def on_reconnected(self) -> None:
        if self.rank == 0 and self.announcement is not None:  # a restarted broker knows no version
            self.send(P.WEIGHTS, self.announcement)

    # -- receiving (socket thread) ------------------------------------------------------------

    def on_message(self, msg: P.Message) -> None:
        if msg.type != P.TRAJ:
            return
        gid = msg.get("gid")
        if isinstance(gid, int):
            self.acks.append(gid)  # readable or not: the simulator may free it
        try:
            frag = Fragment(msg.header, {name: self.attach.materialize(t, copy=True) for name, t in msg.tensors.items()})
            # At most the version the update in progress makes (another rank may publish it first).
            if frag.newest_version > self.version + int(self.training):
                raise ValueError(f"behaviour version {frag.newest_version} is ahead of the trainer's {self.version}")
        except (KeyError, ValueError) as err:
            log.warning("traj_unreadable", gid=gid, error=str(err))
            self.counters.unreadable += 1
            if not msg.get("eval"):  # the broker counts evaluation fragments as such
                self.learner.count_unreadable(int(msg.get("steps", 0)))
            return
        if msg.get("eval"):  # evaluation episodes are measured, never trained on
            self.counters.eval_fragments += 1
            if self.metrics is not None:
                self.metrics.put_eval_fragment(msg.header, frag.arrays)
            if msg.get("done"):
                self.counters.eval_episodes += 1
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
        share = math.ceil(batch_steps / self.world)
        if learner.grpo and self.cfg.run.mode != "async" and learner.received_steps >= share > learner.ready_steps:
            # An alternating broker paused at batch_steps delivered, but incomplete groups cannot
            # be trained on: ask it to hand out more work rather than wait for each other (again
            # after every further batch_steps, until the groups complete). Each rank sees its
            # share of the broker's count.
            learner.received_steps = 0
            self.send(P.TRAIN, {"phase": "starved", "version": self.version, "ready_steps": learner.ready_steps})
        if self.world == 1:
            if learner.ready_steps >= batch_steps:
                units = learner.take(batch_steps)
                self.training = True
                self._began(sum(u.steps for u in units))
                self.runner.submit(lambda: self._train(units, None), "update")
        elif now - self.last_round >= ROUND_EVERY_S:
            # Every rank takes part in every round, so rounds pair up across ranks. A rank offers
            # its share of the global batch; the update goes ahead once the ranks together hold
            # batch_steps (a sync-mode broker pauses at exactly that, however unevenly split).
            self.last_round = now
            units = learner.take(math.ceil(batch_steps / self.world))
            self.round_steps = sum(u.steps for u in units)
            available = learner.ready_steps + self.round_steps
            self.training = True
            round_ = (available, self.stopping)
            self.runner.submit(lambda: self._train(units, round_), "update")

    # -- the update (update thread) -----------------------------------------------------------

    def _train(self, units: list[Unit], round_: tuple[int, bool] | None) -> Trained | Deferred:
        pad_to = None
        if round_ is not None:  # several ranks: agree whether to update now, and on a batch length
            from workers.algorithms.distributed import agree_to_update

            available, stopping = round_
            agreed = agree_to_update(sum(u.steps for u in units), available, stopping, self.cfg.algo.batch_steps)
            if agreed.decision != "update":
                return Deferred(units, agreed.decision, agreed.taken)
            pad_to = agreed.pad_to
        algo = self.cfg.algo
        batch = build_batch(units, self.version, self.cfg)
        warmup = algo.name == "ppo" and self.counters.updates < algo.critic_warmup_updates
        if self.offload is not None:  # colocated: trainer state back on the device for the update
            self.offload.onload()
        progress = self.counters.env_steps_consumed / max(1, self.cfg.run.total_env_steps)
        result = update(self.state, batch, algo, critic_warmup=warmup, pad_to=pad_to, min_s=self.cfg.train.min_update_s,
                        progress=progress)
        announcement = None
        if result.trained and (self.counters.updates + 1) % max(1, algo.publish_every) == 0:
            # Here, on the update thread, no optimizer step runs while the store copies the
            # parameters (the socket thread only reads the counters until this job is done), and
            # before an offload moves them. FSDP: every rank gathers, rank 0 writes.
            gathered = self._gathered(everything=False)
            if self.publisher is not None:
                announcement = self.publisher.publish(self.version + 1, gathered)
        if self.offload is not None:  # and off again while the generators work
            log.info("trainer_state_offloaded", mb=round(self.offload.offload() / 2**20, 1))
        return Trained(result, announcement)

    # -- after an update (socket thread) ------------------------------------------------------

    def on_job_done(self, tag: Any, done: Trained | Deferred | None, error: BaseException | None) -> None:
        self.training = False
        if error is not None:
            log.error("update_failed", error=repr(error)[:1000])
            raise error
        if isinstance(done, Deferred):
            now = time.monotonic()
            if now - self.last_update > 10.0 and now - self.last_wait_log > 10.0:
                self.last_wait_log = now
                log.info("trainer_round_waiting", taken=done.taken, ready_steps=self.learner.ready_steps)
            self.learner.put_back(done.units)
            if done.decision == "stop":
                self._stop = True
            return
        result = done.result
        if self.world > 1:  # the round went ahead: the steps this rank took count as consumed
            self._began(self.round_steps)
        self._count(result)
        if result.trained and self.rank == 0 and done.announcement is not None:
            self.announcement = done.announcement
            self.send(P.WEIGHTS, done.announcement)
        every = self.cfg.algo.checkpoint_every
        if result.trained and every > 0 and self.version % every == 0 and (self.rank == 0 or self.collective_checkpoints):
            self._checkpoint()
        self._report(result)

    def _began(self, steps: int) -> None:
        """Tell the broker an update took ``steps``; both sides stop counting them as waiting."""
        self.learner.received_steps = max(0, self.learner.received_steps - steps)
        self.send(P.TRAIN, {"phase": "begin", "version": self.version, "steps": steps})

    def _count(self, result: UpdateResult) -> None:
        self.learner.count_dropped(result.dropped_stale)
        self.learner.count_trained(result.samples)
        self.last_update = time.monotonic()
        if result.trained:
            self.version += 1
            self.counters.updates += 1
            self.counters.samples_trained += result.samples
            self.counters.env_steps_consumed += result.env_steps

    def _checkpoint(self) -> None:
        if self.run_dir is None:
            return
        from workers.checkpoint import save_checkpoint

        keep = self.cfg.algo.keep_checkpoints or None
        fmt = self.cfg.train.checkpoint_format
        path = save_checkpoint(self.run_dir, self.state.policy, self.state.optimizer, self.version,
                               self.counters.as_dict(), self.cfg.to_yaml(), keep_last=keep, fmt=fmt)
        if self.rank == 0:
            log.info("checkpoint_saved", version=self.version, path=str(path), format=fmt)

    def _report(self, result: UpdateResult, to_broker: bool = True) -> None:
        """One metrics row: to the broker (rank 0's figures), the log, JSONL and TensorBoard."""
        elapsed = time.monotonic() - self.t_start
        figures = update_row(result, self.version, self.rank, self.counters, elapsed,
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
        if (self.rank == 0 or self.collective_checkpoints) and self.state is not None and self.counters.updates > 0:
            # The preemption hook: whatever stopped us, the last trained version is kept (with
            # several ranks saving together, only if every rank is still there to take part).
            if finished:
                self._checkpoint()
            else:
                log.warning("checkpoint_skipped_update_running", version=self.version)
        if self.metrics is not None:
            self.metrics.close()
        if self.publisher is not None:
            if finished:
                self.publisher.close()  # generators keep what they copied
            else:  # the update thread may still write into the store: unlink it, keep it mapped
                self.publisher.store.shm.unlink()
        if self.world > 1 and finished:
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
