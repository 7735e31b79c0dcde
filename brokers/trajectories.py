"""Trajectory routing: TRAJ fragments from simulators to trainers with free credits, and their
acks back to the simulators (which then free the fragments' shared memory).

A fragment out at a trainer that leaves goes back to the front of the queue. A simulator that
reconnects (a partition, a broker that went silent) sends again every fragment it has no ack
for: each fragment is known by its simulator (``Worker.same``, whatever socket it uses) and
``traj_id``, so a copy is never routed twice; one already acknowledged is acknowledged again, and
acks reach the simulator on its current socket. With PPO a trainer
holds at most about one update's worth of training steps without a reported fate
(``hold_steps``: it gets more once it holds fewer), so a trainer killed mid-run loses at most
that (``brokers/ledger.py``).

Each fragment has a home rank among the trainer ranks (:func:`home_rank`), decided from what
the fragment carries, so any broker, a restarted one too, sends it and every copy of it to the
same rank: a copy re-sent after its ack died with a broker reaches the rank that took the
original, which knows it (``workers.learner`` ``Learner.resent``) and never trains it twice. A
fragment waits while its home rank is busy or absent (a group with a rank gone cannot update
anyway); fragments for the other ranks go ahead.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import structlog

from brokers.admission import AdmissionController
from brokers.holdings import PeerHoldings
from brokers.ledger import AckLedger
from brokers.outgoing import Out, ShmBridge
from brokers.registry import Registry, Worker
from brokers.stats import BrokerStats
from rlvla3 import protocol as P

log = structlog.get_logger()

SEEN_PER_SIMULATOR = 8192
"""Fragment ids remembered per simulator for telling a re-send from a new fragment: far more than
a simulator holds unacknowledged."""
SEEN_GONE_SIMULATORS = 64
"""Simulators no longer registered whose ids are still remembered (the newest first): one cut off
by a partition comes back within its back-off, while every killed one would otherwise stay."""


def home_rank(writer: tuple, traj_id: int, env: int, world: int, group_envs: int | None) -> int:
    """The trainer rank a fragment goes to, from its simulator (``Worker.same``: host, pid and name
    survive a reconnect and a broker restart) and what it carries. PPO: by ``traj_id``, which a
    simulator counts up, so its consecutive fragments take the ranks in turn and the ranks' shares
    of every batch stay even. GRPO (``group_envs``: the envs one group spans, ``env.group_size``
    neighbouring ones or one env): by the group's envs, so a group completes on one rank."""
    if world == 1:
        return 0
    if group_envs is not None:
        return env // group_envs % world
    _, name, host, pid, _ = writer
    return (zlib.crc32(f"{host}\0{pid}\0{name}".encode()) + traj_id) % world


@dataclass
class Trajectory:
    gid: int  # broker-wide id, what trainers ack
    sim: bytes
    traj_id: int  # the simulator's id, what the simulator is acked with
    header: dict[str, Any]
    tensors: dict[str, Any]
    steps: int
    nbytes: int = 0  # bytes its inline tensors hold here (``holdings.inline_bytes``; none with shared memory)
    writer: tuple = ()  # the simulator's ``Worker.same``: it survives a reconnect, ``sim`` does not
    home: int = 0  # the trainer rank it goes to (``home_rank``)


class TrajectoryRouter:
    def __init__(self, registry: Registry, bridge: ShmBridge, stats: BrokerStats, grpo: bool,
                 admission: AdmissionController | None = None, hold_steps: int | None = None,
                 holdings: PeerHoldings | None = None, world: int = 1, group_envs: int = 1) -> None:
        self.registry = registry
        self.admission = admission
        self.bridge = bridge
        self.stats = stats
        self.grpo = grpo
        self.world = world  # trainer ranks
        self.group_envs = group_envs if grpo else None  # GRPO: the envs one group spans (``home_rank``)
        self.pending: deque[Trajectory] = deque()
        self.out: dict[int, tuple[bytes, Trajectory]] = {}  # gid -> (trainer, fragment)
        self._next_gid = 0
        self.ledger = AckLedger()  # the fate of every acknowledged step
        # Groups complete only with more fragments: GRPO trainers are not held back.
        self.hold_steps = None if grpo else hold_steps
        self._out_steps: dict[bytes, int] = {}  # trainer -> training steps delivered, not acked
        self._seen: OrderedDict[tuple, OrderedDict[int, bool]] = OrderedDict()  # simulator -> traj_id -> acked yet
        self.holdings = holdings or PeerHoldings()  # each simulator's fragments in pending, and their bytes

    def _enqueue(self, traj: Trajectory, front: bool = False) -> None:
        (self.pending.appendleft if front else self.pending.append)(traj)
        self.holdings.fragment(traj.sim, 1, traj.nbytes)

    def _left(self, traj: Trajectory) -> None:
        """A fragment left the queue for good (sent or dropped)."""
        self.holdings.fragment(traj.sim, -1, traj.nbytes)

    def resent(self, w: Worker, traj_id: int) -> list[Out] | None:
        """None for a fragment new from this simulator; for a copy of one already taken, what to
        send back: its ack again once a trainer took it, nothing while it is queued or out."""
        acked = self._seen.get(w.same, {}).get(traj_id)
        if acked is None:
            return None
        self.stats.traj_duplicates += 1
        return [Out(w.identity, P.TRAJ_ACK, {"traj_ids": [traj_id]})] if acked else []

    def on_traj(self, w: Worker, msg: P.Message, nbytes: int) -> None:
        home = home_rank(w.same, msg["traj_id"], msg.get("env") or 0, self.world, self.group_envs)
        self._next_gid += 1
        w.count_frames(msg.tensors)
        seen = self._seen.get(w.same)
        if seen is None:
            seen = self._seen[w.same] = OrderedDict()
            self._forget_gone()
        self._seen.move_to_end(w.same)
        seen[msg["traj_id"]] = False
        while len(seen) > SEEN_PER_SIMULATOR:  # a simulator re-sends only what it holds unacked
            seen.popitem(last=False)
        self._enqueue(Trajectory(self._next_gid, w.identity, msg["traj_id"], msg.header, msg.tensors, msg["steps"],
                                 nbytes, w.same, home))

    def deliver(self) -> list[Out]:
        """Hand pending fragments to their home ranks, those with free credits."""
        if not self.pending:  # (a timer step of every loop turn)
            return []
        ranks = {w.rank: w for w in self.registry.of_role("trainer")}
        if not ranks:
            return []
        sends: list[Out] = []
        kept: deque[Trajectory] = deque()
        while self.pending:
            traj = self.pending.popleft()
            training = not traj.header.get("eval")
            if all(w.credits <= len(w.trajs_inflight) for w in ranks.values()):
                kept.append(traj)
                break
            if self.registry.current(traj.writer) is None and any(isinstance(v, P.ShmRef) for v in traj.tensors.values()):
                self._left(traj)
                self._drop(traj)  # its writer died before a trainer took it
                log.warning("traj_dropped_writer_gone", traj_id=traj.traj_id)
                continue
            t = ranks.get(traj.home)
            # A rank holding an update's worth reports fates first; a GRPO trainer (its heartbeat
            # says so) holds incomplete groups by design: no bound.
            if (t is None or t.credits <= len(t.trajs_inflight)
                    or (training and self.hold_steps is not None and t.info.get("algo") != "grpo"
                        and self.holding(t.identity) >= self.hold_steps)):
                kept.append(traj)  # its rank is busy or absent: it waits, others go ahead
                continue
            try:
                tensors = {k: self.bridge.for_host(v, t.host) for k, v in traj.tensors.items()}
            except (KeyError, ValueError) as err:  # ProtocolError is a ValueError
                self._left(traj)
                self._drop(traj)
                log.warning("traj_dropped_unreadable", traj_id=traj.traj_id, error=str(err))
                continue
            self._left(traj)
            fields = {k: v for k, v in traj.header.items() if k not in ("v", "type", "tensors")}
            fields["gid"] = traj.gid
            _, name, host, pid, _ = traj.writer  # with traj_id it names the fragment across broker restarts
            fields["writer"] = {"host": host, "pid": pid, "name": name}
            t.count_frames(tensors)
            if training:
                self._out_steps[t.identity] = self._out_steps.get(t.identity, 0) + traj.steps
            t.trajs_inflight.add(traj.gid)
            self.out[traj.gid] = (t.identity, traj)
            self.stats.traj_delivered += 1
            sends.append(Out(t.identity, P.TRAJ, fields, tensors))
        kept.extend(self.pending)
        self.pending = kept
        return sends

    def holding(self, trainer: bytes) -> int:
        """Training steps a trainer holds or will soon: acknowledged without a fate, or on the way."""
        return self.ledger.held(trainer) + self._out_steps.get(trainer, 0)

    def _settled(self, trainer: bytes, traj: Trajectory) -> None:
        """A delivered fragment was acked or came back: it is no longer on the way."""
        if not traj.header.get("eval") and trainer in self._out_steps:
            self._out_steps[trainer] -= traj.steps

    def _forget_gone(self) -> None:
        """Keep the ids of at most ``SEEN_GONE_SIMULATORS`` simulators that are not registered,
        those seen last: the broker's memory stays bounded however many simulators come and go."""
        gone = [k for k in self._seen if self.registry.current(k) is None]  # oldest activity first
        for k in gone[: max(0, len(gone) - SEEN_GONE_SIMULATORS)]:
            del self._seen[k]

    def _drop(self, traj: Trajectory) -> None:
        """A fragment that will never reach a trainer: its steps free their admission capacity,
        and a copy sent again is a new fragment."""
        self.stats.traj_dropped += 1
        self._seen.get(traj.writer, {}).pop(traj.traj_id, None)
        if self.admission is not None and not traj.header.get("eval"):
            self.admission.on_discarded(traj.steps)

    def unsent(self, gid: int) -> None:
        """The shell could not send a fragment: it goes back to the front of the queue."""
        entry = self.out.pop(gid, None)
        if entry is None:
            return
        trainer = self.registry.get(entry[0])
        self._settled(entry[0], entry[1])
        if trainer is not None:
            trainer.trajs_inflight.discard(gid)
        self.stats.traj_delivered -= 1
        self._enqueue(entry[1], front=True)

    def on_ack(self, w: Worker, msg: P.Message) -> tuple[list[Out], dict[str, int]]:
        """A trainer acknowledges fragments it was sent (only those: an ack of another trainer's
        would free a simulator's buffers and credit the ledger for steps nobody holds) and reports
        the fates of steps it held. Returns the acks for the simulators and the fates, as the
        ledger counted them."""
        per_sim: dict[tuple, list[int]] = {}  # by simulator (``Worker.same``): acks go to its socket now
        for gid in msg["traj_ids"]:  # checked before anything changes
            if not isinstance(gid, int):
                raise P.ProtocolError(P.E_FIELD, "TRAJ_ACK.traj_ids must be integers")
            if gid in self.out and self.out[gid][0] != w.identity:
                raise P.ProtocolError(P.E_AUTH, f"TRAJ_ACK of fragment {gid}, which went to another trainer")
        for gid in msg["traj_ids"]:
            entry = self.out.pop(gid, None)
            w.trajs_inflight.discard(gid)
            if entry is None:
                continue
            self.stats.traj_acked += 1
            self._settled(entry[0], entry[1])
            self.ledger.on_acked(w.identity, entry[1].steps, bool(entry[1].header.get("eval")))
            seen = self._seen.get(entry[1].writer)
            if seen is not None and entry[1].traj_id in seen:
                seen[entry[1].traj_id] = True
            per_sim.setdefault(entry[1].writer, []).append(entry[1].traj_id)
        fates = self.ledger.on_report(w.identity, msg.header)
        sims = {writer: self.registry.current(writer) for writer in per_sim}
        return [Out(sims[writer].identity, P.TRAJ_ACK, {"traj_ids": ids}) for writer, ids in per_sim.items()
                if sims[writer] is not None], fates

    def trainer_gone(self, w: Worker) -> int:
        """A trainer left: its fragments in flight go back to the queue. Returns the training
        steps it had acknowledged and not reported a fate for (lost with it)."""
        self._out_steps.pop(w.identity, None)
        lost = self.ledger.trainer_gone(w.identity)
        if self.admission is not None:  # never to be trained: free their capacity (at most what is finished)
            self.admission.on_discarded(lost)
        for gid in sorted(w.trajs_inflight, reverse=True):
            entry = self.out.pop(gid, None)
            if entry is not None:
                self._enqueue(entry[1], front=True)
                self.stats.traj_requeued += 1
        return lost
