"""The request queue and the dynamic batcher: pure logic, no sockets, so rules are testable.

A batch goes to a generator with a free credit as soon as the queued envs reach ``max_batch``
or the oldest request has waited ``max_wait_ms``. A request (one slot's envs) is never split.
With ``sticky`` assignment a slot stays with the generator that first served it (until that
generator leaves). A request whose batch failed goes again in a batch of its own, so one bad
request fails alone and the others of its batch are served.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from brokers.holdings import PeerHoldings


@dataclass(slots=True)
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
    attempts: int = 0  # batches of this request that failed on a generator
    nbytes: int = 0  # bytes its inline tensors hold here (``holdings.inline_bytes``; none with shared memory)

    @property
    def slot_key(self) -> tuple[bytes, int]:
        return (self.sim, self.slot)


@dataclass
class GeneratorState:
    identity: bytes
    credits: int = 0  # batches it takes at once, as announced (0 until its weights are loaded)
    inflight: set[int] = field(default_factory=set)
    batches: int = 0  # batches formed for it so far: idle generators take turns (fewest first)

    @property
    def free(self) -> int:
        return self.credits - len(self.inflight)


class RequestQueue:
    """Pending requests, served in the order of an ordering function.

    The broker asks it on every OBS (how much this simulator holds), on every loop turn (the
    oldest arrival) and per batch formed, with hundreds queued at saturation; so counts are kept
    as requests come and go, and the order too: ``_order`` holds ``(key, seq)`` sorted. A push
    whose key is not below the last appends (FIFO's every push but a re-queued one), others
    insert in place; a batch taken from the front is one slice off it.
    """

    def __init__(self, key: Callable[[PendingRequest], Any], holdings: PeerHoldings | None = None) -> None:
        self.key = key
        self.holdings = holdings or PeerHoldings()
        """Each simulator's queued requests and their bytes, shared with the trajectory router."""
        self._items: dict[int, PendingRequest] = {}  # seq -> request, in push order
        self._order: list[tuple[Any, int]] = []  # (key, seq) sorted: ties in push order
        self._seq = itertools.count()
        self.envs = 0
        self.evals = 0  # evaluation requests queued (sync mode's barrier does not wait for them)
        self._in_order = True  # arrivals never decrease in push order: the first entry is the oldest
        self._last_arrival = 0.0

    def __len__(self) -> int:
        return len(self._items)

    def push(self, req: PendingRequest) -> None:
        if not self._items:
            self._in_order = True
        elif req.arrival < self._last_arrival:  # a re-queued request keeps its arrival
            self._in_order = False
        self._last_arrival = req.arrival
        seq = next(self._seq)
        self._items[seq] = req
        entry = (self.key(req), seq)
        if not self._order or self._order[-1] < entry:
            self._order.append(entry)
        else:
            bisect.insort(self._order, entry)
        self._count(req, 1)

    def _count(self, req: PendingRequest, sign: int) -> None:
        self.envs += sign * req.n
        self.evals += sign * bool(req.header.get("eval"))
        self.holdings.request(req.sim, sign, req.nbytes)

    def oldest_arrival(self) -> float | None:
        """Asked every loop turn: the first entry's, unless a request was queued again."""
        if not self._items:
            return None
        if self._in_order:
            return next(iter(self._items.values())).arrival
        return min(r.arrival for r in self._items.values())

    def ordered(self) -> Iterator[tuple[int, PendingRequest]]:
        """Live entries in key order (ties: push order). Take nothing while iterating."""
        items = self._items
        for _, seq in self._order:
            yield seq, items[seq]

    def take(self, seqs: Iterable[int]) -> None:
        taken = set()
        for seq in seqs:
            req = self._items.pop(seq, None)
            if req is not None:
                self._count(req, -1)
                taken.add(seq)
        if not taken:
            return
        order, k = self._order, len(taken)
        if all(seq in taken for _, seq in order[:k]):  # the front: a batch taken in order
            del order[:k]
        else:
            self._order = [e for e in order if e[1] not in taken]

    def remove_where(self, pred: Callable[[PendingRequest], bool]) -> list[PendingRequest]:
        gone = [(seq, r) for seq, r in self._items.items() if pred(r)]
        self.take(seq for seq, _ in gone)
        return [r for _, r in gone]


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
    cost: Callable[[PendingRequest], int] | None = None,
) -> list[tuple[GeneratorState, list[PendingRequest]]]:
    """Take batches off the queue for generators with free credits.

    An idle generator gets a batch as soon as one is due (full, or the oldest request has
    waited ``max_wait``); a generator already working gets a second batch only when it is full,
    so spare credits prefetch work without cutting batches small. ``force`` flushes whatever is
    queued (sync mode's barrier has been reached). ``budget`` caps the ``cost`` of what is handed
    out in all (admission control: ``brokers.admission``; a re-queued request costs nothing).
    """
    out: list[tuple[GeneratorState, list[PendingRequest]]] = []
    oldest = queue.oldest_arrival()
    if oldest is None or not any(g.free > 0 for g in generators):
        return out
    if not (force or queue.envs >= rule.max_batch or now - oldest >= rule.max_wait_s):
        return out  # nothing is due
    formed_for: dict[bytes, int] = {}  # batches formed here per generator, not yet in its inflight
    while len(queue):
        full = queue.envs >= rule.max_batch
        if not (force or full or now - queue.oldest_arrival() >= rule.max_wait_s):
            break
        busy = {g.identity: len(g.inflight) + formed_for.get(g.identity, 0) for g in generators}
        free = sorted((g for g in generators if g.free > formed_for.get(g.identity, 0) and (force or full or not busy[g.identity])),
                      key=lambda g: (busy[g.identity], -(g.free - formed_for.get(g.identity, 0)), g.batches))
        formed = False
        for gen in free:
            picked: list[tuple[int, PendingRequest]] = []
            envs = 0
            for seq, req in queue.ordered():  # from the front: a batch costs its size, not the queue's
                if req.attempts and picked:
                    continue  # a request whose batch failed is retried alone: a bad one fails alone
                units = req.n if cost is None else cost(req)
                if budget is not None and units > budget:
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
                    budget -= units
                if envs >= rule.max_batch or req.attempts:
                    break
            if not picked:
                continue
            queue.take(seq for seq, _ in picked)
            reqs = [r for _, r in picked]
            if rule.sticky:
                for r in reqs:
                    sticky_map.setdefault(r.slot_key, gen.identity)
            out.append((gen, reqs))
            gen.batches += 1
            formed_for[gen.identity] = formed_for.get(gen.identity, 0) + 1
            formed = True
            break
        if not formed:
            break
    return out
