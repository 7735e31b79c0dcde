"""Ordering functions and the dynamic batcher's rules: flush on size, flush on wait, credits,
sticky slots; the same rules observed on a live broker."""

from __future__ import annotations

import itertools
import random

import pytest

from brokers.queue import BatchRule, GeneratorState, PendingRequest, RequestQueue, form_batches
from brokers.ordering import get_ordering


def req(slot: int, n: int = 2, arrival: float = 0.0, steps=None, version: int = -1, sim: bytes = b"s") -> PendingRequest:
    return PendingRequest(sim=sim, slot=slot, req_id=slot, n=n, arrival=arrival,
                          episode_step=steps or [0] * n, version=version, header={}, tensors={})


def queue_of(*reqs, ordering="arrival") -> RequestQueue:
    q = RequestQueue(get_ordering(ordering))
    for r in reqs:
        q.push(r)
    return q


def test_flush_on_size_not_before():
    q = queue_of(req(0, arrival=0.0), req(1, arrival=0.001))
    gen = GeneratorState(b"g", credits=1)
    rule = BatchRule(max_batch=8, max_wait_s=1.0)
    assert form_batches(q, [gen], rule, now=0.01, sticky_map={}) == []  # 4 envs < 8, not waited
    q.push(req(2, arrival=0.002))
    q.push(req(3, arrival=0.003))
    out = form_batches(q, [gen], rule, now=0.01, sticky_map={})
    assert len(out) == 1 and sum(r.n for r in out[0][1]) == 8 and len(q) == 0


def test_flush_on_wait():
    q = queue_of(req(0, arrival=0.0))
    gen = GeneratorState(b"g", credits=1)
    rule = BatchRule(max_batch=64, max_wait_s=0.005)
    assert form_batches(q, [gen], rule, now=0.004, sticky_map={}) == []
    out = form_batches(q, [gen], rule, now=0.006, sticky_map={})
    assert [r.slot for r in out[0][1]] == [0]


def test_oldest_arrival_with_a_request_queued_again():
    q = queue_of(req(0, arrival=1.0), req(1, arrival=2.0))
    assert q.oldest_arrival() == 1.0
    q.take([0])
    assert q.oldest_arrival() == 2.0
    q.push(req(2, arrival=0.5))  # a failed batch's request goes back with its arrival
    q.push(req(3, arrival=3.0))
    assert q.oldest_arrival() == 0.5
    q.remove_where(lambda r: r.arrival < 1.0)
    assert q.oldest_arrival() == 2.0
    q.remove_where(lambda r: True)
    assert q.oldest_arrival() is None
    q.push(req(4, arrival=5.0))
    assert q.oldest_arrival() == 5.0


def test_batch_never_exceeds_max_and_never_splits_a_request():
    q = queue_of(*(req(i, n=3, arrival=i) for i in range(5)))
    gen = GeneratorState(b"g", credits=10)
    out = form_batches(q, [gen], BatchRule(max_batch=7, max_wait_s=0.0), now=100, sticky_map={})
    sizes = [sum(r.n for r in reqs) for _, reqs in out]
    assert sizes == [6, 6] and len(q) == 1  # no request split; nothing over max_batch


def test_busy_generator_prefetches_only_full_batches():
    gen = GeneratorState(b"g", credits=2)
    rule = BatchRule(max_batch=4, max_wait_s=0.001)
    q = queue_of(req(0, n=2, arrival=0.0))
    assert len(form_batches(q, [gen], rule, now=1.0, sticky_map={})) == 1  # idle: flush on wait
    gen.inflight.add(1)
    q = queue_of(req(1, n=2, arrival=0.0))
    assert form_batches(q, [gen], rule, now=1.0, sticky_map={}) == []  # busy: waits to fill up
    q.push(req(2, n=2, arrival=0.5))
    out = form_batches(q, [gen], rule, now=1.0, sticky_map={})
    assert [sum(r.n for r in reqs) for _, reqs in out] == [4]


def test_credits_bound_batches_in_flight_and_favour_free_generators():
    q = queue_of(*(req(i, n=2, arrival=i) for i in range(6)))
    fast, slow = GeneratorState(b"fast", credits=2), GeneratorState(b"slow", credits=1)
    slow.inflight.add(99)  # slow still holds its only credit
    out = form_batches(q, [fast, slow], BatchRule(max_batch=2, max_wait_s=0.0), now=100, sticky_map={})
    assert [g.identity for g, _ in out] == [b"fast", b"fast"]  # no credit, no batch
    assert len(q) == 4


def test_sticky_assignment_keeps_a_slot_on_its_generator():
    sticky: dict = {}
    a, b = GeneratorState(b"a", credits=1), GeneratorState(b"b", credits=1)
    rule = BatchRule(max_batch=2, max_wait_s=0.0, sticky=True)
    q = queue_of(req(0, arrival=0), req(1, arrival=1))
    first = form_batches(q, [a, b], rule, now=10, sticky_map=sticky)
    owners = {reqs[0].slot: g.identity for g, reqs in first}
    a.inflight.clear(), b.inflight.clear()
    for _ in range(3):
        q = queue_of(req(1, arrival=0), req(0, arrival=1))
        out = form_batches(q, [b, a], rule, now=10, sticky_map=sticky)
        assert {reqs[0].slot: g.identity for g, reqs in out} == owners
        a.inflight.clear(), b.inflight.clear()


@pytest.mark.parametrize("ordering, expected", [
    ("arrival", [0, 1, 2]),
    ("episode_progress", [2, 1, 0]),
    ("policy_version", [1, 2, 0]),
])
def test_orderings(ordering, expected):
    q = queue_of(req(0, arrival=0.0, steps=[1, 1], version=5),
                 req(1, arrival=1.0, steps=[3, 0], version=1),
                 req(2, arrival=2.0, steps=[9, 9], version=2), ordering=ordering)
    assert [r.slot for _, r in q.ordered()] == expected


@pytest.mark.parametrize("ordering", ["arrival", "episode_progress", "policy_version"])
def test_kept_order_is_a_full_sort_through_pushes_and_takes(ordering):
    # The queue keeps its order as requests come and go (appends, inserts, slices off the
    # front, takes from the middle); it must always equal a sort of what is queued.
    rng = random.Random(7)
    key = get_ordering(ordering)
    q, live, seqs = RequestQueue(key), {}, itertools.count()
    for step in range(400):
        if rng.random() < 0.6 or not live:
            r = req(step, arrival=step if rng.random() < 0.8 else rng.uniform(0, step),  # some re-queued
                    steps=[rng.randrange(5)] * 2, version=rng.randrange(3))
            q.push(r)
            live[next(seqs)] = r
        else:
            ordered = [seq for seq, _ in q.ordered()]
            taken = ordered[:rng.randrange(1, 4)] if rng.random() < 0.5 else rng.sample(ordered, min(3, len(ordered)))
            q.take(taken)
            for seq in taken:
                del live[seq]
        expected = sorted(live, key=lambda s: (key(live[s]), s))
        assert [seq for seq, _ in q.ordered()] == expected
        assert len(q) == len(live) and q.envs == 2 * len(live)


def test_custom_ordering_by_module_path():
    fn = get_ordering("tests.orderings:newest_first")
    q = RequestQueue(fn)
    for i in range(3):
        q.push(req(i, arrival=float(i)))
    assert [r.slot for _, r in q.ordered()] == [2, 1, 0]
    with pytest.raises(ValueError, match="nope"):
        get_ordering("nope")


def test_live_broker_batches_are_bounded_and_flush_on_wait(job_factory):
    # 4 sims x 2 slots x 2 envs = 16 envs; max_batch 4: every batch has <= 4 envs. With one
    # slow-ish generator, requests pile up and full batches form; in quiet moments the wait flushes.
    job = job_factory("workers.simulators=2", "batching.max_batch=4", "batching.max_wait_ms=20",
                      "model.options.forward_delay_ms=5")
    fig = job.wait(lambda f: f["batches"] >= 40, 90, "40 batches")
    bs = fig["batch_size"]
    assert bs["max"] <= 4 and bs["p50"] >= 2
    assert fig["queue_wait_us"]["count"] >= 40 and fig["errors"] == 0
