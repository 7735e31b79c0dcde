"""The broker's admission object (``brokers.admission``): the capacity rule by hand, and in a
simulated schedule with a slow trainer, driven through the calls the broker makes."""

import random
from dataclasses import dataclass, field

import pytest

from brokers.admission import AdmissionController


@dataclass
class Unit:
    """A request as admission sees it (``brokers.queue.PendingRequest`` has these fields)."""

    sim: bytes
    req_id: int
    n: int = 1
    slot: int = 0
    header: dict = field(default_factory=dict)


def start(ac: AdmissionController, unit: Unit) -> None:
    """What the broker does when a request goes out in a batch and comes back answered."""
    ac.on_dispatched([unit])
    ac.on_settled([unit])


def test_capacity_rule_by_hand():
    ac = AdmissionController(lag=1, batch_size=4)
    assert ac.capacity() == (1 + 0 + 1) * 4
    start(ac, Unit(b"a", 0, n=4))
    start(ac, Unit(b"b", 0, n=3))
    start(ac, Unit(b"c", 0, n=1))
    assert ac.capacity() == 0 and ac.grant(1) == 1  # nothing finished yet: the no-deadlock floor
    ac.on_trajectory(b"a", 3)
    ac.on_simulator_gone(b"c")  # lost: frees one
    assert ac.capacity() == 1
    ac.on_train(0, 3)  # the trainer took the three into the batch for version 1
    ac.on_train(1, None)
    # admitted = 4 consumed (a batch counts whole) + 0 finished + 4 in flight; the limit rose by one batch
    assert ac.capacity() == (1 + 1 + 1) * 4 - (4 + 0 + 4)
    ac.on_train(1, 5)  # a rank takes more than is finished: nothing goes negative, one batch counts
    assert ac.finished == 0 and ac.consumed == 2 * 4
    ac.on_trajectory(b"a", 9)  # more steps than it owes: only what it owes finishes
    assert ac.in_flight == 3 and ac.finished == 1


def test_requeued_and_eval_requests_are_counted_once():
    ac = AdmissionController(lag=0, batch_size=8)
    unit = Unit(b"s", 7, n=3)
    assert ac.cost(unit) == 3
    ac.on_dispatched([unit])  # its batch failed or its generator died: re-queued, not settled
    assert ac.cost(unit) == 0 and ac.in_flight == 3
    ac.on_dispatched([unit])
    assert ac.in_flight == 3
    assert ac.cost(Unit(b"s", 8, n=2, header={"eval": True})) == 0


def test_held_back_work_counts_one_wait_per_stretch():
    ac = AdmissionController(lag=0, batch_size=2)
    start(ac, Unit(b"s", 0, n=2))
    ac.on_trajectory(b"s", 2)  # a whole batch finished: no floor, capacity 0
    assert [ac.budget(1) for _ in range(3)] == [0, 0, 0] and ac.waits == 1
    ac.on_train(0, 2)
    ac.on_train(1, None)
    assert ac.budget(1) == 2 and ac.waits == 1
    start(ac, Unit(b"s", 1, n=2))
    ac.on_trajectory(b"s", 2)
    assert ac.budget(1) == 0 and ac.waits == 2


def test_resume_does_not_open_the_floodgates():
    ac = AdmissionController(lag=2, batch_size=8)
    ac.on_train(50, None)  # the broker meets a trainer resumed at version 50
    assert ac.capacity() == (2 + 1) * 8


def test_sync_mode_admits_everything():
    ac = AdmissionController(lag=None, batch_size=8)
    assert ac.grant(1) is None and ac.budget(1) is None and ac.cost(Unit(b"s", 0, n=4)) == 0
    start(ac, Unit(b"s", 0, n=4))
    ac.on_trajectory(b"s", 4)
    ac.on_train(3, 8)
    assert ac.figures() is None and ac.in_flight == ac.finished == 0


def simulate(
    max_staleness: int | None,
    durations: list[int],
    generators: int = 16,
    batch_size: int = 4,
    train_ticks: int = 12,
    updates: int = 15,
    minimum: int = 0,
) -> dict:
    """Discrete-time run: fast generators, a deliberately slow trainer consuming FIFO by finish.

    Every tick each idle generator asks to start a unit (with the version it would act with);
    the trainer, when idle and holding >= batch_size finished units, drops the too-stale ones,
    trains on a batch for ``train_ticks`` ticks and bumps its version. Work starts as the
    broker grants it, ``grant(minimum)``: with ``minimum=0`` the capacity rule alone, with more
    also the broker's no-deadlock floor (it grants ``batching.max_batch`` per dispatch pass).
    """
    rng = random.Random(0)
    ac = AdmissionController(max_staleness if max_staleness is not None else 10**9, batch_size)
    version = 0
    running: list[tuple[int, int, Unit]] = []  # (finish tick, behaviour version, unit)
    busy = 0
    ready: list[int] = []  # behaviour versions of finished units, in finish order
    trained, dropped, tick, done, k = [], 0, 0, 0, 0
    while done < updates:
        tick += 1
        # ---- generators
        for entry in [u for u in running if u[0] <= tick]:
            running.remove(entry)
            ac.on_trajectory(entry[2].sim, 1)
            ready.append(entry[1])
        while len(running) < generators and ac.grant(minimum) >= 1:
            k += 1
            unit = Unit(b"u%d" % k, k)
            start(ac, unit)
            running.append((tick + rng.choice(durations), version, unit))
            if minimum == 0:
                assert ac.admitted <= (ac.lag + version + 1) * batch_size
        # ---- trainer
        if busy and tick >= busy:
            busy = 0
            version += 1
            done += 1
            ac.on_train(version, None)
        if not busy:
            if max_staleness is not None:
                keep = [version - v <= max_staleness for v in ready]
                n_drop = keep.count(False)
                if n_drop:
                    ac.on_discarded(n_drop)
                    dropped += n_drop
                    ready = [v for v, kept in zip(ready, keep) if kept]
            if len(ready) >= batch_size:
                batch, ready = ready[:batch_size], ready[batch_size:]
                ac.on_train(version, batch_size)
                trained.extend(version - v for v in batch)
                busy = tick + train_ticks
    return {"max_trained": max(trained), "dropped": dropped, "trained": len(trained)}


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_admission_bounds_staleness_when_units_finish_in_order(eta):
    run = simulate(eta, durations=[3])
    assert run["max_trained"] <= eta
    assert run["dropped"] == 0  # nothing overtakes, so admission alone is enough
    if eta > 0:
        assert run["max_trained"] == eta  # and the bound is reached: the trainer is the bottleneck


def test_stragglers_are_caught_by_the_filter():
    run = simulate(1, durations=[1, 2, 3, 40])
    assert run["max_trained"] <= 1
    assert run["dropped"] > 0  # the 40-tick stragglers
    assert run["trained"] >= 14 * 4


def test_without_admission_a_slow_trainer_trains_on_stale_data():
    run = simulate(None, durations=[3])
    assert run["max_trained"] > 3


def test_no_deadlock_floor_admits_past_the_rule_and_the_filter_catches_it():
    # While less than a batch is finished the broker grants at least max_batch per pass, so
    # right after each batch is taken fast generators may start more than the rule allows.
    run = simulate(0, durations=[3], minimum=1)
    assert run["max_trained"] == 0
    assert run["dropped"] > 0
