"""The broker's whole state and rules, without sockets or clocks: a message and the time go in,
the messages to send come out. ``brokers.broker`` is the socket shell around it.

    outs = state.handle(identity, msg, now)   # one decoded message from a worker
    outs = state.tick(now)                    # timers: dispatch due batches, deliver fragments,
                                              # heartbeat and expire workers
    state.unsent(out)                         # the shell could not send ``out`` (peer gone/full)

Sections, one module each: the worker registry (``registry``), dispatch and batching
(``dispatch``), trajectories and the fate of their steps (``trajectories``, ``ledger``),
admission (``admission``), what each simulator holds here (``holdings``), the latest weight
announcement (``weights``: versions, never bytes), the alternating modes' turns and async's
late start (``pacing``),
the STATUS figures (``status``). The sync barrier is here.
"""

from __future__ import annotations

from typing import Any, Callable

import structlog

from brokers import access
from brokers.admission import AdmissionController, admission_lag
from brokers.dispatch import Dispatcher
from brokers.holdings import PeerHoldings, inline_bytes
from brokers.outgoing import E_INTERNAL, Out, ShmBridge, error
from brokers.pacing import Alternation
from brokers.peer_rate import PeerRates
from brokers.registry import Registry, Worker
from brokers.stats import BrokerStats
from brokers.status import StatusCache, job_figures
from brokers.trajectories import TrajectoryRouter
from brokers.weights import WeightsAnnouncements
from rlvla3 import protocol as P
from rlvla3.config import JobConfig
from rlvla3.weights.announce import publications_per_version

log = structlog.get_logger()


class BrokerState:
    def __init__(self, cfg: JobConfig, now: float, run_id: str, host: str, pid: int = 0, pub: str = "",
                 bridge: ShmBridge | None = None) -> None:
        self.cfg = cfg
        self._cfg_dict = cfg.to_dict()  # every READY reply carries it; the broker never changes its config
        self.mode = cfg.run.mode
        self.run_id, self.host, self.pid, self.pub = run_id, host, pid, pub
        self.hb_s = cfg.broker.heartbeat_s
        self.world = max(1, cfg.workers.trainers)  # trainer ranks (0: the launcher starts none; one joins by hand)
        self.registry = Registry(cfg.broker.heartbeat_s * cfg.broker.liveness)
        self.stats = BrokerStats(started=now)
        # AReaL's capacity rule in decision steps; sync mode alternates and needs none.
        self.admission = AdmissionController(None if self.mode == "sync" else admission_lag(cfg.algo), cfg.algo.batch_steps)
        self._obs_window = self.admission.window(cfg.batching.max_batch)  # the largest OBS it can ever admit
        self.bridge = bridge or ShmBridge(host)
        b = cfg.broker
        self.holdings = PeerHoldings(b.max_peer_requests, b.max_peer_trajs, b.max_peer_bytes)
        self.dispatcher = Dispatcher(cfg, self.registry, self.admission, self.bridge, self.stats, self.holdings)
        self.trajs = TrajectoryRouter(self.registry, self.bridge, self.stats, grpo=cfg.algo.name == "grpo",
                                      admission=self.admission, hold_steps=cfg.algo.batch_steps, holdings=self.holdings,
                                      world=self.world, group_envs=cfg.env.group_size if cfg.env.group_mode == "parallel" else 1)
        self.weights = WeightsAnnouncements()
        self.curve = bool(cfg.broker.keys_dir)  # roles bound to key names (brokers.access)
        self.model_spec: tuple | None = None  # the tensors of the first accepted manifest
        self.reject_log = access.RejectLog(cfg.broker.reject_log_per_s)
        self.peer_rates = PeerRates(cfg.broker.max_peer_msgs_per_s)  # taken by the shell, per message read
        # Pacing: the alternating modes pause rollouts while a batch waits or a trainer updates;
        # async, with a late start, while an update's first epochs run.
        self.trainer_version = 0
        self.pacing = Alternation(cfg.algo.batch_steps, enabled=self.mode != "async",
                                  late_epochs=cfg.weights.collect_after_epochs, per_version=publications_per_version(cfg))
        self._last_hb = self._last_tick = now
        self.status_cache = StatusCache()

    # =========================================================================================
    # Messages in
    # =========================================================================================

    def handle(self, identity: bytes, msg: P.Message, now: float, key: str | None = None) -> list[Out]:
        """The replies to one decoded message. A bad message is answered with ERROR, never raised.
        ``key``: the CURVE key name the ZAP handler gave the sender (None with CURVE off)."""
        worker = self.registry.get(identity)
        if worker is not None and worker.key != key:  # its ROUTER identity, copied by another key
            return self.reject(identity, P.E_AUTH, "this identity joined with another key", msg.type, now)
        if worker is not None:
            worker.last_seen = now
        if msg.type == P.READY:
            try:
                return self._on_ready(identity, msg, now, key)
            except P.ProtocolError as err:
                return self.reject(identity, err.code, err.reason, msg.type, now)
        if msg.type == P.STATUS:
            return [self.status_cache.reply(identity, now, self.status)]
        if worker is None:
            return self.reject(identity, P.E_STATE, f"{msg.type} before READY: send READY first", msg.type, now)
        handler = self._HANDLERS.get(msg.type)
        if handler is None:
            return self.reject(identity, P.E_STATE, f"{msg.type} is not sent to the broker", msg.type, now)
        role = self._ROLE_OF.get(msg.type)
        if role is not None and worker.role != role:
            return self.reject(identity, P.E_ROLE, f"{msg.type} comes from a {role}, not a {worker.role}", msg.type, now)
        try:
            if msg.tensors:
                access.check_segments(worker, msg.tensors)
            return handler(self, worker, msg, now)
        except P.ProtocolError as err:
            return self.reject(identity, err.code, err.reason, msg.type, now)
        except (KeyError, ValueError, TypeError, IndexError) as err:
            return self.reject(identity, P.E_FIELD, f"{type(err).__name__}: {err}", msg.type, now)
        except Exception as err:  # noqa: BLE001 - a bug met by one message never stops the broker
            log.exception("message_failed", peer=identity.hex()[:16], type=msg.type)
            return self.reject(identity, E_INTERNAL, f"the broker failed on this {msg.type}: {err!r}", msg.type, now)

    def reject(self, identity: bytes, code: str, reason: str, ref_type: str | None, now: float) -> list[Out]:
        """ERROR to the sender; the log line is rate-limited per peer (``broker.reject_log_per_s``)."""
        self.stats.errors += 1
        self.reject_log(identity, now, code=code, reason=reason, type=ref_type)
        return [error(identity, code, reason, ref_type)]

    def _on_ready(self, identity: bytes, msg: P.Message, now: float, key: str | None) -> list[Out]:
        role = msg["role"]
        if role not in P.ROLES:
            raise P.ProtocolError(P.E_FIELD, f"role {role!r} not in {P.ROLES}")
        if self.curve and not access.role_allowed(key, role):
            raise P.ProtocolError(P.E_AUTH, f"key {key!r} may not join as {role}: a key named {role}* may "
                                            "(make one with `rlvla3 keys DIR --client NAME`)")
        reported = (msg.get("info") or {}).get("version")
        if role == "trainer" and isinstance(reported, int):  # checked before anything changes
            access.check_version_step(reported, self.version_reference(), self.cfg.broker.max_version_step, "READY")
        out: list[Out] = []
        if identity in self.registry:
            out += self._worker_gone(identity, "re_ready")
        w = Worker(identity=identity, role=role, host=msg["host"], pid=msg["pid"], name=str(msg.get("name", "")),
                   worker_id=self.registry.new_id(), last_seen=now, info=dict(msg.get("info") or {}), key=key,
                   bundles=bool(msg.get("bundles")))
        # The same worker (name, host, pid, key) on a new socket takes back its registration.
        old = self.registry.find_same(w)
        if old is not None:
            log.info("worker_reconnected", role=role, name=w.name, rank=old.rank)
            out += self._worker_gone(old.identity, "re_ready")
        reply: dict[str, Any] = {
            "role": "broker", "host": self.host, "pid": self.pid,
            "worker_id": w.worker_id, "run_id": self.run_id, "config": self._cfg_dict,
            "broker_host": self.host, "pub": self.pub, "heartbeat_s": self.hb_s,
            "liveness": self.cfg.broker.liveness, "version": self.weights.version,
        }
        if role == "simulator":
            w.slots = int(msg.get("slots") or self.cfg.env.slots)
            w.num_envs = int(msg.get("num_envs") or self.cfg.env.num_envs)
        elif role == "trainer":
            w.credits = int(msg.get("credits", 64))
            # A trainer of a formed group (rejoining a restarted broker) names its rank: fragments go
            # by rank (``trajectories.home_rank``), and WEIGHTS only from rank 0.
            w.rank = old.rank if old is not None else self.registry.trainer_rank(msg.get("rank"))
            if w.rank >= self.world:
                return out + self.reject(identity, P.E_STATE, f"the trainer group is full: workers.trainers="
                                         f"{self.cfg.workers.trainers} ranks have joined (start the broker with a "
                                         "larger workers.trainers)", P.READY, now)
            if isinstance(w.info.get("version"), int):  # after a broker restart: the trainer knows
                self.trainer_version = max(self.trainer_version, w.info["version"])
                self.admission.on_train(self.trainer_version, None)
            master = next((x for x in self.registry.of_role("trainer") if x.rank == 0), None)
            reply.update(rank=w.rank, world_size=self.world, trainer_version=self.trainer_version)
            if master is not None:
                reply["dist"] = master.info.get("dist")
        if role == "generator":
            self.dispatcher.add_generator(identity, int(msg.get("credits", 0)))
        if role == "simulator":  # its own total: counters survive a broker restart
            total = int(w.info.get("env_steps") or 0)
            self.stats.env_steps += self.registry.count_steps(w, total)
            w.info["env_steps"] = total
        self.registry.add(w)
        log.info("worker_joined", role=role, name=w.name, worker_id=w.worker_id, host=w.host, worker_pid=w.pid,
                 slots=w.slots)
        return out + [Out(identity, P.READY, reply)]

    def _on_obs(self, w: Worker, msg: P.Message, now: float) -> list[Out]:
        h = msg.header  # read as a dict: this runs for every request
        again = self.dispatcher.duplicate(w, h)  # a re-sent request: never served twice
        if again is not None:
            return again
        tensors = msg.tensors if "block" not in h else self._block(w, h["block"], msg.tensors)
        window = self._obs_window
        if window is not None and h["n"] > window and not h.get("eval"):
            raise P.ProtocolError(P.E_LIMIT, f"OBS of {h['n']} envs: no admission window holds more than {window} "
                                             "(algo.admission_lag + 1) * algo.batch_steps")
        nbytes = inline_bytes(tensors)
        self.holdings.admit_obs(w.identity, len(w.blocks), nbytes)
        self.dispatcher.on_obs(w, msg, now, nbytes, tensors)
        return []

    def _block(self, w: Worker, block: int, tensors: dict[str, Any]) -> dict[str, Any]:
        """An OBS's tensors by its slot block: an OBS that carries them (checked like any, by
        ``handle``) keeps them under the block's number; one that carries none names them. A
        simulator has at most two blocks per slot (the slot's front and back), all in shared
        memory: the broker keeps references, never bytes. Each counts ``holdings.BLOCK_BYTES``
        against the peer's ``broker.max_peer_bytes`` (a peer claiming 65,536 slots could hold 140 MB here)."""
        if not tensors:
            known = w.blocks.get(block)
            if known is None:
                raise P.ProtocolError(P.E_STATE, f"OBS names block {block}, whose tensors this connection never sent")
            return known
        if any(type(t) is not P.ShmRef for t in tensors.values()):
            raise P.ProtocolError(P.E_TENSOR, "a block's tensors are shared-memory references, not inline bytes")
        if block not in w.blocks:
            self.holdings.admit_block(w.identity, len(w.blocks), w.slots)
        w.blocks[block] = tensors
        return tensors

    def _on_traj(self, w: Worker, msg: P.Message, now: float) -> list[Out]:
        again = self.trajs.resent(w, msg["traj_id"])  # a reconnected simulator's copy: never routed twice
        if again is not None:
            return again
        nbytes = inline_bytes(msg.tensors)
        self.holdings.admit_traj(w.identity, len(w.blocks), nbytes)
        self.stats.traj_received += 1
        evaluating = bool(msg.get("eval"))
        if evaluating:
            if msg.get("done"):
                self.stats.add_eval(int(msg.get("eval_version", -1)), bool(msg.get("episode_success")),
                                    float(msg.get("episode_return", 0.0)), w.identity, int(msg.get("eval_round", 0)))
        else:
            self.stats.add_episodes(list(msg.get("episode_returns", [])), list(msg.get("episode_successes", [])))
        self.trajs.on_traj(w, msg, nbytes)
        if not evaluating:  # evaluation fragments are never trained on
            self.pacing.on_trajectory(msg["steps"])
            self.admission.on_trajectory(w.identity, msg["steps"])
        return []

    def _on_result(self, w: Worker, msg: P.Message, now: float) -> list[Out]:
        return self.dispatcher.on_result(w, msg, now)

    def _on_snapshot(self, w: Worker, msg: P.Message, now: float) -> list[Out]:
        return self.weights.on_snapshot(w.identity)

    def _on_traj_ack(self, w: Worker, msg: P.Message, now: float) -> list[Out]:
        out, fates = self.trajs.on_ack(w, msg)  # counted once, in the ledger
        # e.g. zero-variance groups, memory gone with its writer, a copy of a fragment the trainer already held
        never_trained = fates["discarded"] + fates["unreadable"] + fates["duplicate"]
        # Stale steps an update took (and masked) left admission's ``finished`` at TRAIN begin;
        # freeing them again would let admitted work outgrow the staleness bound, ever more as
        # more is dropped. Only stale steps never taken (GRPO groups pruned whole) free it here.
        taken = min(int(msg.get("stale_taken", 0)), fates["stale"])
        self.admission.on_discarded(fates["stale"] - taken + never_trained)
        # Pacing never counts stale steps: those pruned before a batch are covered by the
        # trainer's TRAIN starved.
        self.pacing.on_given_up(never_trained)
        return out

    def _on_weights(self, w: Worker, msg: P.Message, now: float) -> list[Out]:
        access.check_weights(w, msg["version"], msg.get("policy_version"), publications_per_version(self.cfg),
                             max(self.weights.version, self.trainer_version), self.cfg.broker.max_version_step, msg.get("store"))
        spec = access.manifest_spec(msg.get("manifest"))
        if spec is not None and self.model_spec is not None and spec != self.model_spec:
            raise P.ProtocolError(P.E_FIELD, "WEIGHTS manifest does not match the model's tensors (names, dtypes, "
                                             "shapes) announced by earlier versions")
        out = self.weights.on_weights(msg)
        if out:
            self.pacing.on_published(self.weights.latest.version)
            if spec is not None:
                self.model_spec = spec
        return out

    def _on_train(self, w: Worker, msg: P.Message, now: float) -> list[Out]:
        if msg["phase"] == "starved":  # GRPO: incomplete groups; an alternating pause must lift
            if self.training_pause:
                log.info("training_pause_lifted_starved", trainer=w.name, ready_steps=msg.get("ready_steps"))
            self.pacing.on_starved()
            return []
        access.check_version_step(msg["version"], self.version_reference(), self.cfg.broker.max_version_step, "TRAIN")
        self.trainer_version = max(self.trainer_version, msg["version"])
        steps = msg.get("steps")
        taken = steps if msg["phase"] == "begin" and isinstance(steps, int) and not isinstance(steps, bool) else None
        self.admission.on_train(self.trainer_version, taken)
        if msg["phase"] == "begin":
            self.pacing.on_begin(taken, msg["version"])
        else:
            if self.pacing.on_end():  # the first update a late start held to its end (it may recur)
                log.warning("late_start_held_whole_update", version=msg["version"], late_epochs=self.pacing.late_epochs,
                            hint="no weights were published K epochs into the update (a critic warm-up, algo.target_kl, "
                                 "or a trainer with fewer algo.epochs): rollouts waited for its end")
        stats = msg.get("stats")
        if isinstance(stats, dict):
            self.stats.trainer = stats
            for s, c in (stats.get("staleness_counts") or {}).items():
                try:
                    self.stats.staleness.record_value(max(1, int(s) + 1), max(0, int(c)))  # +1: hdr has no 0
                except (TypeError, ValueError):
                    pass
        return []

    def version_reference(self) -> int | None:
        """What trainers' version reports are bounded from: the newest version known, once this
        broker has accepted an announcement. Before that (a fresh or restarted broker) a trainer's
        report is taken as it is: a resumed trainer sends TRAIN with its checkpoint's version,
        which may be far ahead, before its first WEIGHTS (``access.check_version_step``)."""
        return None if self.weights.version < 0 else max(self.weights.version, self.trainer_version)

    def _on_heartbeat(self, w: Worker, msg: P.Message, now: float) -> list[Out]:
        credits = msg.get("credits")
        if isinstance(credits, int):
            if w.role == "generator":
                self.dispatcher.set_credits(w.identity, credits)
            elif w.role == "trainer":
                w.credits = max(0, credits)
        if isinstance(msg.get("info"), dict):
            w.info.update(msg["info"])
        if isinstance(msg.get("version"), int):
            w.info["version"] = msg["version"]
        return []

    def _on_disconnect(self, w: Worker, msg: P.Message, now: float) -> list[Out]:
        return self._worker_gone(w.identity, "disconnect")

    _HANDLERS: dict[str, Callable[..., list[Out]]] = {
        P.OBS: _on_obs, P.TRAJ: _on_traj, P.RESULT: _on_result, P.SNAPSHOT: _on_snapshot,
        P.TRAJ_ACK: _on_traj_ack, P.WEIGHTS: _on_weights, P.TRAIN: _on_train,
        P.HEARTBEAT: _on_heartbeat, P.DISCONNECT: _on_disconnect,
        P.TUNE: lambda self, w, msg, now: self._on_tune(w, msg, now),
    }
    _ROLE_OF = {
        P.OBS: "simulator", P.TRAJ: "simulator", P.RESULT: "generator", P.SNAPSHOT: "generator",
        P.TRAJ_ACK: "trainer", P.WEIGHTS: "trainer", P.TRAIN: "trainer", P.TUNE: "client",
    }

    @property
    def training_pause(self) -> bool:
        """The alternating modes hold rollouts back, or async's late start does (``brokers.pacing``)."""
        return self.pacing.paused

    # =========================================================================================
    # Timers
    # =========================================================================================

    def tick(self, now: float) -> list[Out]:
        """Dispatch due batches, deliver pending fragments, and heartbeat once per interval. Each
        step runs under a catch-all: a bug logs its traceback and the loop goes on.

        The loop ticks at least once per heartbeat interval (:meth:`wait_s`). A longer gap is time
        the broker itself was paused or starved, with its peers' heartbeats still unread in its
        socket: past one interval, the gap is not counted toward any peer's expiry or any batch's
        deadline."""
        gap = now - self._last_tick
        self._last_tick = now
        if gap > 2 * self.hb_s:
            self.registry.overlook(gap - self.hb_s)
            self.dispatcher.overlook(gap - self.hb_s)
            log.warning("broker_loop_late", gap_s=round(gap, 3), heartbeat_s=self.hb_s)
        out: list[Out] = []
        for step in (self.dispatcher.expire, self.dispatcher.adapt, self._dispatch, lambda _: self.trajs.deliver(), self._heartbeat):
            try:
                out += step(now)
            except Exception:  # noqa: BLE001
                self.stats.errors += 1
                log.exception("tick_failed", step=getattr(step, "__name__", "deliver"))
        return out

    def _dispatch(self, now: float) -> list[Out]:
        queue = self.dispatcher.queue
        if not len(queue) or self.pacing.holds():
            return []
        force = False
        if self.mode == "sync":
            if not self._barrier_reached():
                return []
            force = True
        budget = self.admission.budget(self.dispatcher.rule.max_batch)
        if budget is not None and budget <= 0:
            return []
        # Sync is on-policy: each batch is served with the newest announced weights, which the
        # generator may still be fetching when the batch arrives (workers/generator.py).
        min_version = self.weights.version if self.mode == "sync" and self.weights.version >= 0 else None
        return self.dispatcher.dispatch(now, force, budget, min_version)

    def _barrier_reached(self) -> bool:
        """Sync mode's barrier: every live training slot has its request queued and nothing is
        out (evaluation slots idle between rounds, so they are not waited for)."""
        queue = self.dispatcher.queue
        expected = sum(max(0, w.slots - self.cfg.env.eval_slots) for w in self.registry.of_role("simulator"))
        return not self.dispatcher.batches and len(queue) - queue.evals >= expected

    def _heartbeat(self, now: float) -> list[Out]:
        if now - self._last_hb < self.hb_s:
            return []
        self._last_hb = now
        out: list[Out] = []
        for w in self.registry.expired(now):
            out += self._worker_gone(w.identity, "expired")
        frames = P.encode(P.HEARTBEAT)  # encoded once for every worker: a large job's heartbeat stays cheap
        return out + [Out(w.identity, P.HEARTBEAT, frames=frames) for w in self.registry]

    def wait_s(self, now: float) -> float:
        """How long the shell may block in poll before ``tick`` has work."""
        timeout = self.hb_s
        held = (self.training_pause or (self.admission.enabled and self.admission.grant(1) <= 0)
                or (self.mode == "sync" and not self._barrier_reached()))  # else: a spin until the barrier
        due = None if held else self.dispatcher.wait_s(now)
        return timeout if due is None else min(timeout, due)

    def unsent(self, out: Out) -> None:
        """The shell could not send ``out``: batches and fragments go back to their queues."""
        if out.type == P.BATCH:
            self.dispatcher.unsent(out.fields["batch_id"])
        elif out.type == P.TRAJ:
            self.trajs.unsent(out.fields["gid"])

    def shutdown(self) -> list[Out]:
        return [Out(w.identity, P.DISCONNECT, {"reason": "broker_shutdown"}) for w in self.registry]

    # =========================================================================================
    # Workers leaving
    # =========================================================================================

    def _worker_gone(self, identity: bytes, reason: str) -> list[Out]:
        w = self.registry.remove(identity)
        if w is None:
            return []
        # one event per role (simulator_gone, generator_gone, trainer_gone): each fault its own name
        log.warning(f"{w.role}_gone", role=w.role, name=w.name, worker_id=w.worker_id, worker_pid=w.pid, reason=reason)
        out: list[Out] = []
        if w.role == "generator":
            self.dispatcher.generator_gone(identity)
        elif w.role == "simulator":
            self.dispatcher.simulator_gone(identity)
            self.admission.on_simulator_gone(identity)
        elif w.role == "trainer":
            if self.cfg.workers.trainers > 1 and reason != "re_ready":
                # A torch.distributed group cannot be re-formed around a lost rank: stop the
                # others; restarted ranks reload the run folder's latest checkpoint.
                for other in self.registry.of_role("trainer"):
                    log.warning("trainer_group_broken_disconnecting", rank=other.rank, lost_rank=w.rank)
                    out.append(Out(other.identity, P.DISCONNECT, {"reason": f"trainer rank {w.rank} lost"}))
            self.pacing.on_trainer_gone(self.trajs.trainer_gone(w))
        return out

    # =========================================================================================
    # STATUS
    # =========================================================================================

    def _on_tune(self, w: Worker, msg: P.Message, now: float) -> list[Out]:
        self.status_cache.clear()
        return self.dispatcher.on_tune(w, msg, now)

    def status(self, now: float) -> dict[str, Any]:
        """The live figures of the job (``brokers.status.job_figures``)."""
        return job_figures(self, now)
