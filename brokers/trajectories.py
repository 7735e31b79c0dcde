"""Trajectory routing: TRAJ fragments from simulators to trainers with free credits, and their
acks back to the simulators (which then free the fragments' shared memory).

A fragment out at a trainer that leaves goes back to the front of the queue. With GRPO and
several trainer ranks, every fragment of one (simulator, env) goes to the same rank: a group is
consecutive episodes of one env and must complete on one rank.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import structlog

from brokers.outgoing import Out, ShmBridge
from brokers.queue import inline_bytes
from brokers.registry import Registry, Worker
from brokers.stats import BrokerStats
from rlvla3 import protocol as P

log = structlog.get_logger()


@dataclass
class Trajectory:
    gid: int  # broker-wide id, what trainers ack
    sim: bytes
    traj_id: int  # the simulator's id, what the simulator is acked with
    header: dict[str, Any]
    tensors: dict[str, Any]
    steps: int


class TrajectoryRouter:
    def __init__(self, registry: Registry, bridge: ShmBridge, stats: BrokerStats, grpo: bool) -> None:
        self.registry = registry
        self.bridge = bridge
        self.stats = stats
        self.grpo = grpo
        self.pending: deque[Trajectory] = deque()
        self.out: dict[int, tuple[bytes, Trajectory]] = {}  # gid -> (trainer, fragment)
        self.owner: dict[tuple[bytes, Any], bytes] = {}  # GRPO: (simulator, env) -> trainer
        self._next_gid = 0

    def on_traj(self, w: Worker, msg: P.Message) -> None:
        self._next_gid += 1
        self.pending.append(Trajectory(self._next_gid, w.identity, msg["traj_id"], msg.header, msg.tensors, msg["steps"]))

    def held_by(self, sim: bytes) -> tuple[int, int]:
        """How many of ``sim``'s fragments wait for a trainer and the inline bytes they hold."""
        mine = [t for t in self.pending if t.sim == sim]
        return len(mine), sum(inline_bytes(t.tensors) for t in mine)

    def deliver(self) -> list[Out]:
        """Hand pending fragments to trainers with free credits, least loaded first."""
        trainers = {w.identity: w for w in self.registry.of_role("trainer")}
        if not self.pending or not trainers:
            return []
        sticky = self.grpo and len(trainers) > 1
        sends: list[Out] = []
        kept: deque[Trajectory] = deque()
        while self.pending:
            traj = self.pending.popleft()
            free = [w for w in trainers.values() if w.credits > len(w.trajs_inflight)]
            if not free:
                kept.append(traj)
                break
            if traj.sim not in self.registry and any(isinstance(v, P.ShmRef) for v in traj.tensors.values()):
                self.stats.traj_dropped += 1  # its writer died before a trainer took it
                log.warning("traj_dropped_writer_gone", traj_id=traj.traj_id)
                continue
            t = min(free, key=lambda w: len(w.trajs_inflight) - w.credits)
            if sticky:
                key = (traj.sim, traj.header.get("env"))
                owner = trainers.get(self.owner.get(key, b""))
                if owner is None:
                    self.owner[key] = t.identity
                elif owner.credits <= len(owner.trajs_inflight):
                    kept.append(traj)  # its rank is busy: wait, others may go ahead
                    continue
                else:
                    t = owner
            try:
                tensors = {k: self.bridge.for_host(v, t.host) for k, v in traj.tensors.items()}
            except (KeyError, ValueError) as err:  # ProtocolError is a ValueError
                self.stats.traj_dropped += 1
                log.warning("traj_dropped_unreadable", traj_id=traj.traj_id, error=str(err))
                continue
            fields = {k: v for k, v in traj.header.items() if k not in ("v", "type", "tensors")}
            fields["gid"] = traj.gid
            t.trajs_inflight.add(traj.gid)
            self.out[traj.gid] = (t.identity, traj)
            self.stats.traj_delivered += 1
            sends.append(Out(t.identity, P.TRAJ, fields, tensors))
        kept.extend(self.pending)
        self.pending = kept
        return sends

    def unsent(self, gid: int) -> None:
        """The shell could not send a fragment: it goes back to the front of the queue."""
        entry = self.out.pop(gid, None)
        if entry is None:
            return
        trainer = self.registry.get(entry[0])
        if trainer is not None:
            trainer.trajs_inflight.discard(gid)
        self.stats.traj_delivered -= 1
        self.pending.appendleft(entry[1])

    def on_ack(self, w: Worker, msg: P.Message) -> list[Out]:
        per_sim: dict[bytes, list[int]] = {}
        for gid in msg["traj_ids"]:
            if not isinstance(gid, int):
                raise P.ProtocolError(P.E_FIELD, "TRAJ_ACK.traj_ids must be integers")
        for gid in msg["traj_ids"]:
            entry = self.out.pop(gid, None)
            w.trajs_inflight.discard(gid)
            if entry is None:
                continue
            self.stats.traj_acked += 1
            per_sim.setdefault(entry[1].sim, []).append(entry[1].traj_id)
        return [Out(sim, P.TRAJ_ACK, {"traj_ids": ids}) for sim, ids in per_sim.items() if sim in self.registry]

    def trainer_gone(self, w: Worker) -> None:
        self.owner = {k: v for k, v in self.owner.items() if v != w.identity}
        for gid in sorted(w.trajs_inflight, reverse=True):
            entry = self.out.pop(gid, None)
            if entry is not None:
                self.pending.appendleft(entry[1])
                self.stats.traj_requeued += 1
