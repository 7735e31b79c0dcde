"""The request queue and the dynamic batcher: pure logic, no sockets, so rules are testable.

A batch goes to a generator with a free credit as soon as the queued envs reach ``max_batch``
or the oldest request has waited ``max_wait_ms``. A request (one slot's envs) is never split.
With ``sticky`` assignment a slot stays with the generator that first served it (until that
generator leaves).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable


@dataclass
class PendingRequest:
    """One OBS request waiting for (or out for) generation."""

    sim: bytes  # simulator's ROUTER identity
    slot: int
    req_id: int
    n: int
    arrival: float
    episode_step: list[int]
    version: int
    header: dict[str, Any]
    tensors: dict[str, Any]
    host: str = ""
    starts: int = 0  # envs in this request that begin a new episode

    @property
    def slot_key(self) -> tuple[bytes, int]:
        return (self.sim, self.slot)


@dataclass
class GeneratorState:
    identity: bytes
    capacity: int = 0  # credits announced (0 until its weights are loaded)
    inflight: set[int] = field(default_factory=set)

    @property
    def free(self) -> int:
        return self.capacity - len(self.inflight)


class RequestQueue:
    """A priority queue of pending requests in the order of an ordering function."""

    def __init__(self, key: Callable[[PendingRequest], Any]) -> None:
        self.key = key
        self._heap: list[tuple[Any, int, PendingRequest]] = []
        self._seq = itertools.count()
        self._removed: set[int] = set()
        self.envs = 0

    def __len__(self) -> int:
        return len(self._heap) - len(self._removed)

    def push(self, req: PendingRequest) -> None:
        heapq.heappush(self._heap, (self.key(req), next(self._seq), req))
        self.envs += req.n

    def oldest_arrival(self) -> float | None:
        live = [r.arrival for _, s, r in self._heap if s not in self._removed]
        return min(live) if live else None

    def ordered(self) -> Iterable[tuple[int, PendingRequest]]:
        """Live entries in key order (a sorted copy: the queue is small)."""
        for _, seq, req in sorted(self._heap, key=lambda e: (e[0], e[1])):
            if seq not in self._removed:
                yield seq, req

    def take(self, seqs: Iterable[int]) -> None:
        for seq in seqs:
            self._removed.add(seq)
        self._compact()

    def remove_where(self, pred: Callable[[PendingRequest], bool]) -> list[PendingRequest]:
        gone = [(seq, r) for _, seq, r in self._heap if seq not in self._removed and pred(r)]
        self.take(seq for seq, _ in gone)
        return [r for _, r in gone]

    def _compact(self) -> None:
        if not self._removed:
            return
        keep = [e for e in self._heap if e[1] not in self._removed]
        self.envs = sum(e[2].n for e in keep)
        heapq.heapify(keep)
        self._heap = keep
        self._removed.clear()


@dataclass
class BatchRule:
    max_batch: int
    max_wait_s: float
    sticky: bool = False


def form_batches(
    queue: RequestQueue,
    generators: list[GeneratorState],
    rule: BatchRule,
    now: float,
    sticky_map: dict[tuple[bytes, int], bytes],
    force: bool = False,
    budget: int | None = None,
) -> list[tuple[GeneratorState, list[PendingRequest]]]:
    """Take batches off the queue for generators with free credits.

    An idle generator gets a batch as soon as one is due (full, or the oldest request has
    waited ``max_wait``); a generator already working gets a second batch only when it is full,
    so spare credits prefetch work without cutting batches small. ``force`` flushes whatever is
    queued (sync mode's barrier has been reached). ``budget`` caps the envs handed out in all
    (admission control); a request already handed out once (re-queued) does not count twice.
    """
    out: list[tuple[GeneratorState, list[PendingRequest]]] = []
    while len(queue):
        oldest = queue.oldest_arrival()
        due = force or queue.envs >= rule.max_batch or (oldest is not None and now - oldest >= rule.max_wait_s)
        if not due:
            break
        full = queue.envs >= rule.max_batch
        free = sorted((g for g in generators if g.free > 0 and (force or full or not g.inflight)),
                      key=lambda g: (len(g.inflight), -g.free))
        if not free:
            break
        formed = False
        for gen in free:
            picked: list[tuple[int, PendingRequest]] = []
            envs = 0
            for seq, req in queue.ordered():
                cost = 0 if (req.header.get("admitted") or req.header.get("eval")) else req.n
                if budget is not None and cost > budget:
                    continue
                if rule.sticky:
                    owner = sticky_map.get(req.slot_key)
                    if owner is not None and owner != gen.identity:
                        continue
                if picked and envs + req.n > rule.max_batch:
                    break
                picked.append((seq, req))
                envs += req.n
                if budget is not None:
                    budget -= cost
                if envs >= rule.max_batch:
                    break
            if not picked:
                continue
            queue.take(seq for seq, _ in picked)
            reqs = [r for _, r in picked]
            if rule.sticky:
                for r in reqs:
                    sticky_map.setdefault(r.slot_key, gen.identity)
            out.append((gen, reqs))
            gen.inflight.add(-len(out))  # placeholder credit until the broker names the batch
            formed = True
            break
        if not formed:
            break
    for gen, _ in out:  # drop placeholders; the broker adds real batch ids
        gen.inflight = {b for b in gen.inflight if b >= 0}
    return out
