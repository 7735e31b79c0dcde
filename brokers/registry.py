"""The worker registry: who has said READY, in which role, and when each was last heard from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from rlvla3 import protocol as P


@dataclass
class Worker:
    identity: bytes  # its ROUTER identity
    role: str
    host: str
    pid: int
    name: str
    worker_id: int
    last_seen: float
    slots: int = 0  # simulators: request slots
    num_envs: int = 0
    credits: int = 0  # trainers: trajectory fragments it takes at once
    trajs_inflight: set[int] = field(default_factory=set)  # trainers: fragment gids not yet acked
    rank: int = -1  # trainers: rank in the DDP group
    info: dict[str, Any] = field(default_factory=dict)
    frames: dict[str, int] = field(default_factory=lambda: {"shm": 0, "inline": 0})
    """Tensors it sent (simulators: OBS, TRAJ) or was sent (generators, trainers), by how they
    travelled: a shared-memory reference within its host, inline bytes across hosts."""
    key: str | None = None  # the CURVE key name it joined with (None: CURVE off)
    segments: set[str] = field(default_factory=set)  # its shared-memory segments already checked (brokers.access)
    bundles: bool = False  # it reads BUNDLEs: what the broker has for it at once goes as one message
    blocks: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Simulators: each slot block's tensors (shared-memory references), by the number its OBS
    gives them: sent with the block's first OBS on this connection, named by number after."""

    @property
    def same(self) -> tuple[str, str, str, int, str | None]:
        """What a reconnecting worker must match to take back its registration."""
        return (self.role, self.name, self.host, self.pid, self.key)

    def count_frames(self, tensors: dict[str, Any]) -> None:
        frames = self.frames
        for t in tensors.values():
            frames["shm" if type(t) is P.ShmRef else "inline"] += 1


class Registry:
    """Workers by identity; liveness is ``last_seen`` against ``expiry_s``. ``env_steps`` keeps
    each simulator's reported total (by name, host, pid) after it leaves, so a worker that comes
    back is not counted twice and one met first after a broker restart is counted once."""

    MAX_COUNTED = 4096

    def __init__(self, expiry_s: float) -> None:
        self.expiry_s = expiry_s
        self.workers: dict[bytes, Worker] = {}
        self.env_steps: dict[tuple[str, str, int], int] = {}
        self._next_id = 0

    def current(self, same: tuple[str, str, str, int, str | None]) -> Worker | None:
        """The live registration of the worker ``same`` names (``Worker.same``), on whatever socket."""
        return next((x for x in self.workers.values() if x.same == same), None)

    def find_same(self, w: Worker) -> Worker | None:
        """A registration of the same worker under another identity (it reopened its socket)."""
        return next((x for x in self.workers.values() if x.same == w.same and x.identity != w.identity), None)

    def count_steps(self, w: Worker, total: int) -> int:
        """``w`` reports ``total`` env steps in all; returns how many the broker had not counted."""
        key = (w.name, w.host, w.pid)
        new = max(0, total - self.env_steps.get(key, 0))
        if key not in self.env_steps and len(self.env_steps) >= self.MAX_COUNTED:
            self.env_steps.pop(next(iter(self.env_steps)))
        self.env_steps[key] = max(total, self.env_steps.get(key, 0))
        return new

    def __contains__(self, identity: object) -> bool:
        return identity in self.workers

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self.workers.values()))

    def get(self, identity: bytes) -> Worker | None:
        return self.workers.get(identity)

    def of_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role]

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def trainer_rank(self, claimed: int | None) -> int:
        """The rank a joining trainer gets: the one it names (a trainer of a formed group keeps
        its rank through a broker restart, whichever rank comes back first), else the lowest free.
        Whether it fits the group is the caller's rule (``workers.trainers``)."""
        ranks = {w.rank for w in self.of_role("trainer")}
        if claimed is None:
            return next(r for r in range(len(ranks) + 1) if r not in ranks)
        if claimed in ranks:
            raise P.ProtocolError(P.E_STATE, f"trainer rank {claimed} cannot join: it has joined already")
        return claimed

    def add(self, w: Worker) -> None:
        self.workers[w.identity] = w

    def remove(self, identity: bytes) -> Worker | None:
        """The worker leaves; a simulator's env-step total is kept (``count_steps``)."""
        w = self.workers.pop(identity, None)
        if w is not None and w.role == "simulator":
            self.count_steps(w, int(w.info.get("env_steps") or 0))
        return w

    def expired(self, now: float) -> list[Worker]:
        return [w for w in self.workers.values() if now - w.last_seen > self.expiry_s]

    def overlook(self, gap_s: float) -> None:
        """The broker did not look for ``gap_s`` (its loop paused or starved): that silence is
        not held against any worker, whose messages from it may still wait unread."""
        for w in self.workers.values():
            w.last_seen += gap_s

    def counts(self) -> dict[str, int]:
        by_role = {r: 0 for r in ("simulator", "generator", "trainer")}
        for w in self.workers.values():
            if w.role in by_role:
                by_role[w.role] += 1
        return by_role
