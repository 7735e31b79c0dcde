"""The broker: one ROUTER for every worker, one PUB for weight versions. Owns no model, no env.

It keeps the worker registry (liveness), the slot registry, the request queue with its ordering
function, the dynamic batcher with generator credits, the trajectory router with acks, and the
latest weight snapshot. The loop below reads top to bottom: receive, handle, dispatch, deliver,
heartbeat. Every send is non-blocking: one slow or dead peer never stalls the rest.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq

from brokers.queue import BatchRule, GeneratorState, PendingRequest, RequestQueue, form_batches
from brokers.stats import BrokerStats
from rlvla3 import auth
from rlvla3 import protocol as P
from rlvla3.config import JobConfig
from rlvla3.ordering import get_ordering
from rlvla3.shm import ShmAttachments, host_id, to_inline
from workers.algorithms.staleness import AdmissionController

log = structlog.get_logger()


@dataclass
class Worker:
    identity: bytes
    role: str
    host: str
    pid: int
    name: str
    worker_id: int
    last_seen: float
    slots: int = 0
    num_envs: int = 0
    trainer_credits: int = 0
    trajs_inflight: set[int] = field(default_factory=set)
    rank: int = -1
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trajectory:
    gid: int
    sim: bytes
    traj_id: int
    header: dict[str, Any]
    tensors: dict[str, Any]
    steps: int


class Broker:
    def __init__(self, cfg: JobConfig, bind: str | None = None, pub: str | None = None, run_id: str | None = None) -> None:
        self.cfg = cfg
        self.bind = bind or cfg.broker.bind
        self.pub_addr = pub or cfg.broker.pub
        self.run_id = run_id or uuid.uuid4().hex[:10]
        self.host = host_id()
        self.hb_s = cfg.broker.heartbeat_s
        self.expiry_s = cfg.broker.heartbeat_s * cfg.broker.liveness
        self.mode = cfg.run.mode

        self.ctx = zmq.Context.instance()
        # -- auth (h-wire): CURVE + ZAP allowlist with a key folder; ipc:// files owner-only --
        keys = cfg.broker.keys_dir
        self.authenticator = auth.start_authenticator(self.ctx, keys) if keys else None
        self.router = self.ctx.socket(zmq.ROUTER)
        if keys:
            auth.configure_server(self.router, keys)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.router.setsockopt(zmq.LINGER, P.LINGER_MS)
        self.router.setsockopt(zmq.SNDHWM, P.SOCKET_HWM)
        self.router.setsockopt(zmq.RCVHWM, P.SOCKET_HWM)
        self.router.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
        auth.bind_private(self.router, self.bind)
        self.bound = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, P.LINGER_MS)
        self.pub.setsockopt(zmq.SNDHWM, 16)
        if keys:
            auth.configure_server(self.pub, keys)
        auth.bind_private(self.pub, self.pub_addr)
        self.pub_bound = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()

        self.workers: dict[bytes, Worker] = {}
        self.generators: dict[bytes, GeneratorState] = {}
        self.queue = RequestQueue(get_ordering(cfg.batching.ordering))
        self.rule = BatchRule(cfg.batching.max_batch, cfg.batching.max_wait_ms / 1000.0, cfg.batching.assignment == "sticky")
        self.sticky: dict[tuple[bytes, int], bytes] = {}
        self.batches: dict[int, tuple[bytes, list[PendingRequest], float]] = {}
        self.next_batch = 0
        self.next_worker = 0
        self.trajs: deque[Trajectory] = deque()
        self.trajs_out: dict[int, tuple[bytes, Trajectory]] = {}
        self.next_gid = 0
        self.snapshot: tuple[int, list[Any]] | None = None
        self.version = -1
        self.trainer_version = 0
        self.steps_since_update = 0
        self.training_pause = False
        self.attach = ShmAttachments()
        self.stats = BrokerStats()
        # Admission control (AReaL's capacity rule) in decision steps: a request is handed out
        # only while dispatched-but-untrained work cannot outrun the trainer by more than
        # max_staleness updates. Sync mode needs none: it alternates.
        self.admission = AdmissionController(cfg.algo.max_staleness, cfg.algo.batch_steps) if self.mode != "sync" else None
        self.inflight_by_sim: dict[bytes, int] = {}
        self._held = False
        self.traj_owner: dict[tuple[bytes, Any], bytes] = {}  # GRPO: (sim, env) -> trainer
        self._stop = False
        self._last_hb = time.monotonic()
        log.info("broker_started", bind=self.bound, pub=self.pub_bound, run_id=self.run_id, mode=self.mode, curve=bool(keys))

    # =========================================================================================
    # Main loop
    # =========================================================================================

    def run(self, until: float | None = None) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop and (until is None or time.monotonic() < until):
            events = dict(poller.poll(self._poll_timeout_ms()))
            if self.router in events:
                for _ in range(256):  # drain, but come back to dispatch regularly
                    try:
                        frames = self.router.recv_multipart(zmq.DONTWAIT, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames)
            now = time.monotonic()
            self._dispatch(now)
            self._deliver_trajs()
            if now - self._last_hb >= self.hb_s:
                self._heartbeat(now)
        self.close()

    def stop(self) -> None:
        self._stop = True

    def close(self) -> None:
        for ident in list(self.workers):
            self._send(ident, P.encode(P.DISCONNECT, {"reason": "broker_shutdown"}))
        self.attach.close()
        self.router.close(linger=P.LINGER_MS)
        self.pub.close(linger=0)
        if self.authenticator is not None:  # auth (h-wire)
            self.authenticator.stop()
        log.info("broker_stopped", **{k: v for k, v in self.stats.snapshot().items() if isinstance(v, int)})

    def _poll_timeout_ms(self) -> int:
        timeout = self.hb_s
        held = self.training_pause or (self.admission is not None and self.admission.grant(1) <= 0)
        oldest = None if held else self.queue.oldest_arrival()
        # Only an idle generator is served on the wait deadline (a busy one takes full batches,
        # which only a new request can make): otherwise the loop would spin past the deadline.
        if oldest is not None and any(g.free > 0 and not g.inflight for g in self.generators.values()):
            timeout = min(timeout, max(0.0, oldest + self.rule.max_wait_s - time.monotonic()))
        return max(0, int(timeout * 1000))

    # =========================================================================================
    # Receiving
    # =========================================================================================

    def _handle(self, frames: list[Any]) -> None:
        identity = frames[0].bytes
        try:
            msg = P.decode(frames[1:])
        except P.ProtocolError as err:
            self._reject(identity, err.code, err.reason, None)
            return
        now = time.monotonic()
        worker = self.workers.get(identity)
        if worker is not None:
            worker.last_seen = now
        if msg.type == P.READY:
            self._on_ready(identity, msg, now)
            return
        if msg.type == P.STATUS:
            self._send(identity, P.encode(P.STATUS, {"figures": self.status()}))
            return
        if worker is None:
            self._reject(identity, P.E_STATE, f"{msg.type} before READY: send READY first", msg.type)
            return
        handler = self._HANDLERS.get(msg.type)
        if handler is None:
            self._reject(identity, P.E_STATE, f"{msg.type} is not sent to the broker", msg.type)
            return
        role = self._ROLE_OF.get(msg.type)
        if role is not None and worker.role != role:
            self._reject(identity, P.E_ROLE, f"{msg.type} comes from a {role}, not a {worker.role}", msg.type)
            return
        try:
            handler(self, worker, msg, now)
        except P.ProtocolError as err:
            self._reject(identity, err.code, err.reason, msg.type)
        except (KeyError, ValueError, TypeError, IndexError) as err:
            self._reject(identity, P.E_FIELD, f"{type(err).__name__}: {err}", msg.type)

    def _reject(self, identity: bytes, code: str, reason: str, ref_type: str | None) -> None:
        self.stats.errors += 1
        log.warning("message_rejected", peer=identity.hex()[:16], code=code, reason=reason, type=ref_type)
        self._send(identity, P.error_frames(code, reason, ref_type))

    def _on_ready(self, identity: bytes, msg: P.Message, now: float) -> None:
        role = msg["role"]
        if role not in P.ROLES:
            raise_role = f"role {role!r} not in {P.ROLES}"
            self._reject(identity, P.E_FIELD, raise_role, P.READY)
            return
        if identity in self.workers:
            self._worker_gone(identity, "re_ready")
        self.next_worker += 1
        w = Worker(
            identity=identity, role=role, host=msg["host"], pid=msg["pid"], name=str(msg.get("name", "")),
            worker_id=self.next_worker, last_seen=now, info=dict(msg.get("info") or {}),
        )
        reply: dict[str, Any] = {
            "role": "broker", "host": self.host, "pid": os.getpid(),
            "worker_id": w.worker_id, "run_id": self.run_id, "config": self.cfg.to_dict(),
            "broker_host": self.host, "pub": self.pub_bound, "heartbeat_s": self.hb_s,
            "liveness": self.cfg.broker.liveness, "version": self.version,
        }
        if role == "simulator":
            w.slots = int(msg.get("slots") or self.cfg.env.slots)
            w.num_envs = int(msg.get("num_envs") or self.cfg.env.num_envs)
        elif role == "generator":
            self.generators[identity] = GeneratorState(identity, capacity=int(msg.get("credits", 0)))
        elif role == "trainer":
            w.trainer_credits = int(msg.get("credits", 64))
            ranks = {x.rank for x in self.workers.values() if x.role == "trainer"}
            w.rank = next(r for r in range(len(ranks) + 1) if r not in ranks)
            world = max(1, self.cfg.workers.trainers)  # 0: the launcher starts none; one joins by hand
            if w.rank >= world:
                self._reject(identity, P.E_STATE, f"the trainer group is full: workers.trainers={self.cfg.workers.trainers} "
                             "ranks have joined (start the broker with a larger workers.trainers)", P.READY)
                return
            reply["rank"] = w.rank
            reply["world_size"] = world
            reply["trainer_version"] = self.trainer_version
            master = next((x for x in self.workers.values() if x.role == "trainer" and x.rank == 0), None)
            if master is not None:
                reply["dist"] = master.info.get("dist")
        self.workers[identity] = w
        log.info("worker_joined", role=role, name=w.name, worker_id=w.worker_id, host=w.host, worker_pid=w.pid, slots=w.slots)
        self._send(identity, P.encode(P.READY, reply))

    # -- simulators ---------------------------------------------------------------------------

    def _on_obs(self, w: Worker, msg: P.Message, now: float) -> None:
        n = msg["n"]
        if n < 1 or len(msg["instruction"]) != n or len(msg["episode_step"]) != n:
            raise P.ProtocolError(P.E_FIELD, "OBS: n, instruction and episode_step disagree")
        if not (0 <= msg["slot"] < max(w.slots, 1)):
            raise P.ProtocolError(P.E_FIELD, f"OBS: slot {msg['slot']} out of range (worker has {w.slots})")
        req = PendingRequest(
            sim=w.identity, slot=msg["slot"], req_id=msg["req_id"], n=n, arrival=now,
            episode_step=list(msg["episode_step"]), version=int(msg.get("version", -1)),
            header=msg.header, tensors=msg.tensors, host=w.host,
            starts=sum(1 for s in msg["episode_step"] if s == 0),
        )
        self.stats.requests += 1
        self.stats.env_steps += int(msg.get("env_steps", 0))
        w.info["env_steps"] = int(w.info.get("env_steps") or 0) + int(msg.get("env_steps", 0))
        self.stats.decision_steps += int(msg.get("decision_steps", 0))
        self.stats.env_restarts += int(msg.get("env_restarts", 0))
        self.queue.push(req)

    def _on_traj(self, w: Worker, msg: P.Message, now: float) -> None:
        self.stats.traj_received += 1
        if msg.get("eval"):
            if msg.get("done"):
                self.stats.add_eval(int(msg.get("eval_version", -1)), bool(msg.get("episode_success")),
                                    float(msg.get("episode_return", 0.0)))
        else:
            self.stats.add_episodes(list(msg.get("episode_returns", [])), list(msg.get("episode_successes", [])))
        self.next_gid += 1
        self.trajs.append(Trajectory(self.next_gid, w.identity, msg["traj_id"], msg.header, msg.tensors, msg["steps"]))
        if not msg.get("eval"):  # evaluation fragments are never trained on
            self.steps_since_update += msg["steps"]
        if self.admission is not None and not msg.get("eval"):
            n = min(int(msg["steps"]), self.inflight_by_sim.get(w.identity, 0))
            self.inflight_by_sim[w.identity] = self.inflight_by_sim.get(w.identity, 0) - n
            self.admission.on_finished(n)
        if self.mode != "async" and self.steps_since_update >= self.cfg.algo.batch_steps:
            self.training_pause = True

    # -- generators ---------------------------------------------------------------------------

    def _on_result(self, w: Worker, msg: P.Message, now: float) -> None:
        batch_id = msg["batch_id"]
        entry = self.batches.pop(batch_id, None)
        gen = self.generators.get(w.identity)
        if gen is not None:
            gen.inflight.discard(batch_id)
        if entry is None:
            log.warning("result_unknown_batch", batch_id=batch_id, generator=w.name)
            return
        _, reqs, sent_at = entry
        w.info["served"] = int(w.info.get("served") or 0) + 1
        w.info["version"] = msg["version"]
        if msg.get("error"):
            log.warning("batch_failed", batch_id=batch_id, generator=w.name, error=str(msg["error"])[:300])
            for r in reqs:
                r.header["attempts"] = int(r.header.get("attempts", 0)) + 1
                if r.header["attempts"] < 3:
                    self.queue.push(r)
                    self.stats.requeued += 1
                elif r.sim in self.workers:
                    self._send(r.sim, P.encode(P.ACT, {"slot": r.slot, "req_id": r.req_id, "version": -1,
                                                       "error": str(msg["error"])[:300]}))
            return
        self.stats.generate_us.record_value(max(1, int((now - sent_at) * 1e6)))
        per_request = P.by_request(msg.tensors)
        queue_us = msg.get("queue_us") if isinstance(msg.get("queue_us"), list) else []
        for i, req in enumerate(reqs):
            tensors = per_request.get(i, {})
            if req.sim not in self.workers:
                continue  # its simulator left; nothing to deliver
            fields = {
                "slot": req.slot, "req_id": req.req_id, "version": msg["version"],
                "queue_us": int(queue_us[i]) if i < len(queue_us) else 0,
                "forward_us": int(msg.get("forward_us", 0)),
            }
            self._send(req.sim, P.encode(P.ACT, fields, tensors))

    def _on_snapshot(self, w: Worker, msg: P.Message, now: float) -> None:
        if self.snapshot is None:
            self._send(w.identity, P.encode(P.WEIGHTS, {"version": -1}))
        else:
            self._send(w.identity, self.snapshot[1])

    # -- trainers -----------------------------------------------------------------------------

    def _on_traj_ack(self, w: Worker, msg: P.Message, now: float) -> None:
        per_sim: dict[bytes, list[int]] = {}
        for gid in msg["traj_ids"]:
            if not isinstance(gid, int):
                raise P.ProtocolError(P.E_FIELD, "TRAJ_ACK.traj_ids must be integers")
            entry = self.trajs_out.pop(gid, None)
            w.trajs_inflight.discard(gid)
            if entry is None:
                continue
            self.stats.traj_acked += 1
            per_sim.setdefault(entry[1].sim, []).append(entry[1].traj_id)
        dropped = int(msg.get("dropped_stale", 0))
        discarded = int(msg.get("discarded", 0))  # never trained on, e.g. zero-variance GRPO groups
        self.stats.dropped_stale += dropped
        self.stats.discarded += discarded
        if self.admission is not None and dropped + discarded > 0:
            self.admission.on_discarded(min(dropped + discarded, self.admission.finished))
        for sim, ids in per_sim.items():
            if sim in self.workers:
                self._send(sim, P.encode(P.TRAJ_ACK, {"traj_ids": ids}))

    def _on_weights(self, w: Worker, msg: P.Message, now: float) -> None:
        version = msg["version"]
        if version <= self.version:
            log.info("weights_ignored_old", version=version, current=self.version)
            return
        frames = P.encode(P.WEIGHTS, {"version": version, "published_at": msg.get("published_at")}, dict(msg.tensors))
        self.snapshot = (version, frames)
        self.version = version
        try:
            self.pub.send_multipart([b"W", *frames], zmq.DONTWAIT, copy=False)
        except zmq.Again:
            log.warning("weights_pub_full", version=version)
        self.steps_since_update = 0
        self.training_pause = False
        log.info("weights_published", version=version, tensors=len(msg.tensors))

    def _on_train(self, w: Worker, msg: P.Message, now: float) -> None:
        if msg["phase"] == "starved":  # GRPO: incomplete groups; an alternating pause must lift
            if self.training_pause:
                log.info("training_pause_lifted_starved", trainer=w.name, ready_steps=msg.get("ready_steps"))
            self.training_pause = False
            self.steps_since_update = 0
            return
        self.trainer_version = max(self.trainer_version, msg["version"])
        if self.admission is not None:
            self.admission.follow_trainer(self.trainer_version)
            if msg["phase"] == "begin" and isinstance(msg.get("steps"), int):
                self.admission.on_batch_taken(msg["steps"])
        stats = msg.get("stats")
        if isinstance(stats, dict):
            self.stats.trainer = stats
            for s, c in (stats.get("staleness_counts") or {}).items():
                try:
                    self.stats.staleness.record_value(max(1, int(s) + 1), max(0, int(c)))  # +1: hdr has no 0
                except (TypeError, ValueError):
                    pass

    # -- everyone -----------------------------------------------------------------------------

    def _on_heartbeat(self, w: Worker, msg: P.Message, now: float) -> None:
        credits = msg.get("credits")
        if w.role == "generator" and isinstance(credits, int):
            self.generators[w.identity].capacity = max(0, credits)
        if w.role == "trainer" and isinstance(credits, int):
            w.trainer_credits = max(0, credits)
        if isinstance(msg.get("info"), dict):
            w.info.update(msg["info"])
        if isinstance(msg.get("version"), int):
            w.info["version"] = msg["version"]

    def _on_disconnect(self, w: Worker, msg: P.Message, now: float) -> None:
        self._worker_gone(w.identity, "disconnect")

    _HANDLERS = {
        P.OBS: _on_obs, P.TRAJ: _on_traj, P.RESULT: _on_result, P.SNAPSHOT: _on_snapshot,
        P.TRAJ_ACK: _on_traj_ack, P.WEIGHTS: _on_weights, P.TRAIN: _on_train,
        P.HEARTBEAT: _on_heartbeat, P.DISCONNECT: _on_disconnect,
    }
    _ROLE_OF = {
        P.OBS: "simulator", P.TRAJ: "simulator", P.RESULT: "generator", P.SNAPSHOT: "generator",
        P.TRAJ_ACK: "trainer", P.WEIGHTS: "trainer", P.TRAIN: "trainer",
    }

    # =========================================================================================
    # Dispatching batches
    # =========================================================================================

    def _dispatch(self, now: float) -> None:
        if not len(self.queue) or self.training_pause:
            return
        force = False
        if self.mode == "sync":
            # Barrier: every live training slot has its request queued and nothing is out
            # (evaluation slots idle between rounds, so they are not waited for).
            expected = sum(max(0, w.slots - self.cfg.env.eval_slots) for w in self.workers.values() if w.role == "simulator")
            if self.batches or len(self.queue) - self.queue.evals < expected:
                return
            force = True
        budget = None
        if self.admission is not None:
            budget = self.admission.grant(self.cfg.batching.max_batch)
            if budget <= 0:
                if not self._held:
                    self._held = True
                    self.stats.admission_waits += 1  # times work was held back, not loop turns
                return
            self._held = False
        t0 = time.perf_counter_ns()
        formed = form_batches(self.queue, list(self.generators.values()), self.rule, now, self.sticky, force=force, budget=budget)
        for gen, reqs in formed:
            if self.admission is not None:
                for r in reqs:
                    if not r.header.get("admitted") and not r.header.get("eval"):  # re-queued: counted already
                        r.header["admitted"] = True
                        self.admission.on_started(r.n)
                        self.inflight_by_sim[r.sim] = self.inflight_by_sim.get(r.sim, 0) + r.n
            self._send_batch(gen, reqs, now, t0)

    def _send_batch(self, gen: GeneratorState, reqs: list[PendingRequest], now: float, t0: int) -> None:
        self.next_batch += 1
        batch_id = self.next_batch
        gen_host = self.workers[gen.identity].host
        tensors: dict[str, Any] = {}
        meta = []
        for i, r in enumerate(reqs):
            for name, t in r.tensors.items():
                tensors[f"r{i}/{name}"] = self._for_host(t, gen_host)
            meta.append({
                "req_id": r.req_id, "slot": r.slot, "n": r.n, "instruction": r.header["instruction"],
                "episode_step": r.episode_step, "deterministic": r.header.get("deterministic", [False] * r.n),
            })
            self.stats.queue_wait_us.record_value(max(1, int((now - r.arrival) * 1e6)))
        frames = P.encode(P.BATCH, {"batch_id": batch_id, "requests": meta, "queue_us": [int((now - r.arrival) * 1e6) for r in reqs]}, tensors)
        if not self._send(gen.identity, frames):
            for r in reqs:
                self.queue.push(r)
            return
        gen.inflight.add(batch_id)
        self.batches[batch_id] = (gen.identity, reqs, time.monotonic())
        self.stats.batches += 1
        self.stats.batch_size.record_value(sum(r.n for r in reqs))
        self.stats.batch_form_us.record_value(max(1, (time.perf_counter_ns() - t0) // 1000))

    def _for_host(self, t: Any, reader_host: str) -> Any:
        """Pass a shm reference to a reader on the writer's host; otherwise inline the bytes."""
        if isinstance(t, P.ShmRef) and t.host != reader_host:
            if t.host != self.host:
                raise P.ProtocolError(P.E_TENSOR, f"segment {t.seg} is on {t.host}, unreachable from here")
            return to_inline(self.attach, t)
        return t

    # =========================================================================================
    # Routing trajectories
    # =========================================================================================

    def _deliver_trajs(self) -> None:
        """Hand pending fragments to trainers with free credits, least loaded first. With GRPO,
        every fragment of one (simulator, env) goes to the same trainer rank: a group is
        consecutive episodes of one env and must complete on one rank."""
        if not self.trajs:
            return
        trainers = {w.identity: w for w in self.workers.values() if w.role == "trainer"}
        if not trainers:
            return
        sticky = self.cfg.algo.name == "grpo" and len(trainers) > 1
        kept: deque[Trajectory] = deque()
        while self.trajs:
            traj = self.trajs.popleft()
            free = [w for w in trainers.values() if w.trainer_credits > len(w.trajs_inflight)]
            if not free:
                kept.append(traj)
                break
            if traj.sim not in self.workers and any(isinstance(v, P.ShmRef) for v in traj.tensors.values()):
                self.stats.traj_dropped += 1  # its writer died before a trainer took it
                log.warning("traj_dropped_writer_gone", traj_id=traj.traj_id)
                continue
            t = min(free, key=lambda w: len(w.trajs_inflight) - w.trainer_credits)
            if sticky:
                key = (traj.sim, traj.header.get("env"))
                owner = trainers.get(self.traj_owner.get(key, b""))
                if owner is None:
                    self.traj_owner[key] = t.identity
                elif owner.trainer_credits <= len(owner.trajs_inflight):
                    kept.append(traj)  # its rank is busy: wait, others may go ahead
                    continue
                else:
                    t = owner
            try:
                tensors = {k: self._for_host(v, t.host) for k, v in traj.tensors.items()}
            except (KeyError, P.ProtocolError) as err:
                self.stats.traj_dropped += 1
                log.warning("traj_dropped_unreadable", traj_id=traj.traj_id, error=str(err))
                continue
            fields = {k: v for k, v in traj.header.items() if k not in ("v", "type", "tensors")}
            fields["gid"] = traj.gid
            if not self._send(t.identity, P.encode(P.TRAJ, fields, tensors)):
                kept.append(traj)
                break
            t.trajs_inflight.add(traj.gid)
            self.trajs_out[traj.gid] = (t.identity, traj)
            self.stats.traj_delivered += 1
        kept.extend(self.trajs)
        self.trajs = kept

    # =========================================================================================
    # Liveness
    # =========================================================================================

    def _heartbeat(self, now: float) -> None:
        self._last_hb = now
        for ident, w in list(self.workers.items()):
            if now - w.last_seen > self.expiry_s:
                self._worker_gone(ident, "expired")
            else:
                self._send(ident, P.encode(P.HEARTBEAT))

    def _worker_gone(self, identity: bytes, reason: str) -> None:
        w = self.workers.pop(identity, None)
        if w is None:
            return
        log.warning("worker_gone", role=w.role, name=w.name, worker_id=w.worker_id, worker_pid=w.pid, reason=reason)
        if w.role == "generator":
            gen = self.generators.pop(identity, None)
            for batch_id in list(gen.inflight if gen else []):
                entry = self.batches.pop(batch_id, None)
                if entry is None:
                    continue
                for r in entry[1]:
                    self.queue.push(r)  # keeps its arrival time: served first again
                    self.stats.requeued += 1
                log.warning("batch_requeued", batch_id=batch_id, requests=len(entry[1]))
            for key in [k for k, g in self.sticky.items() if g == identity]:
                del self.sticky[key]
        elif w.role == "simulator":
            self.queue.remove_where(lambda r: r.sim == identity)
            lost = self.inflight_by_sim.pop(identity, 0)
            if self.admission is not None and lost:
                self.admission.on_finished(lost, accepted=False)
            for key in [k for k in self.sticky if k[0] == identity]:
                del self.sticky[key]
        elif w.role == "trainer":
            self.traj_owner = {k: v for k, v in self.traj_owner.items() if v != identity}
            if self.cfg.workers.trainers > 1 and reason != "re_ready":
                # A torch.distributed group cannot be re-formed around a lost rank: stop the
                # others; restarted ranks reload the run folder's latest checkpoint.
                for other in [x for x in self.workers.values() if x.role == "trainer"]:
                    log.warning("trainer_group_broken_disconnecting", rank=other.rank, lost_rank=w.rank)
                    self._send(other.identity, P.encode(P.DISCONNECT, {"reason": f"trainer rank {w.rank} lost"}))
            for gid in sorted(w.trajs_inflight, reverse=True):
                entry = self.trajs_out.pop(gid, None)
                if entry is not None:
                    self.trajs.appendleft(entry[1])
                    self.stats.traj_requeued += 1

    def _send(self, identity: bytes, frames: list[Any]) -> bool:
        try:
            self.router.send_multipart([identity, *frames], zmq.DONTWAIT, copy=False)
            return True
        except zmq.ZMQError as err:  # EHOSTUNREACH (peer gone) or EAGAIN (peer's queue full)
            log.warning("send_failed", peer=identity.hex()[:16], error=err.strerror)
            return False

    # =========================================================================================
    # STATUS
    # =========================================================================================

    def status(self) -> dict[str, Any]:
        by_role: dict[str, int] = {r: 0 for r in ("simulator", "generator", "trainer")}
        for w in self.workers.values():
            if w.role in by_role:
                by_role[w.role] += 1
        fig = self.stats.snapshot()
        fig.update({
            "run_id": self.run_id,
            "mode": self.mode,
            "workers": by_role,
            "slots": sum(w.slots for w in self.workers.values() if w.role == "simulator"),
            "queue_depth": len(self.queue),
            "queued_envs": self.queue.envs,
            "batches_inflight": len(self.batches),
            "trajs_pending": len(self.trajs),
            "trajs_inflight": len(self.trajs_out),
            "policy_version": self.version,
            "trainer_version": self.trainer_version,
            "training_pause": self.training_pause,
            "admission": None if self.admission is None else {
                "capacity": self.admission.capacity(), "in_flight": self.admission.in_flight,
                "finished": self.admission.finished, "consumed": self.admission.consumed,
                "version": self.admission.version, "max_staleness": self.admission.max_staleness,
            },
            "per_worker": [
                {"name": w.name, "role": w.role, "worker_id": w.worker_id, "host": w.host, "pid": w.pid,
                 "version": w.info.get("version"), "served": w.info.get("served"), "env_steps": w.info.get("env_steps"),
                 "credits": self.generators[w.identity].capacity if w.identity in self.generators else None,
                 "inflight": len(self.generators[w.identity].inflight) if w.identity in self.generators
                 else len(w.trajs_inflight)}
                for w in self.workers.values()
            ],
        })
        return fig
