"""Staleness helpers and the admission controller in a simulated schedule with a slow trainer."""

import random

import pytest
import torch

from workers.algorithms.staleness import AdmissionController, filter_stale, staleness, staleness_histogram


def test_staleness_filter_and_histogram():
    versions = torch.tensor([10, 9, 7, 10, 6])
    assert staleness(versions, 10).tolist() == [0, 1, 3, 0, 4]
    keep, dropped = filter_stale(versions, 10, max_staleness=2)
    assert keep.tolist() == [True, True, False, True, False] and dropped == 2
    keep, dropped = filter_stale(versions, 10, max_staleness=None)
    assert keep.all() and dropped == 0
    assert staleness_histogram(staleness(versions, 10)) == {0: 2, 1: 1, 3: 1, 4: 1}
    with pytest.raises(ValueError):
        filter_stale(torch.tensor([11]), 10, 2)


def test_capacity_rule_by_hand():
    ac = AdmissionController(max_staleness=1, batch_size=4)
    assert ac.capacity() == (1 + 0 + 1) * 4
    ac.on_started(8)
    assert not ac.can_start()
    ac.on_finished(3)
    ac.on_finished(1, accepted=False)  # lost: frees one slot
    assert ac.capacity() == 1
    ac.on_consumed(3)
    ac.on_version(1)
    # admitted = 3 consumed + 0 finished + 4 in flight; the limit rose by one batch
    assert ac.capacity() == (1 + 1 + 1) * 4 - (3 + 0 + 4)
    with pytest.raises(ValueError):
        ac.on_consumed(1)  # nothing finished is waiting


def test_resume_does_not_open_the_floodgates():
    ac = AdmissionController(max_staleness=2, batch_size=8, version=50)
    assert ac.capacity() == (2 + 1) * 8


def simulate(
    max_staleness: int | None,
    durations: list[int],
    generators: int = 16,
    batch_size: int = 4,
    train_ticks: int = 12,
    updates: int = 15,
) -> dict:
    """Discrete-time run: fast generators, a deliberately slow trainer consuming FIFO by finish.

    Every tick each idle generator asks to start a unit (with the version it would act with);
    the trainer, when idle and holding >= batch_size finished units, drops the too-stale ones,
    trains on a batch for ``train_ticks`` ticks and bumps its version.
    """
    rng = random.Random(0)
    ac = AdmissionController(max_staleness if max_staleness is not None else 10**9, batch_size)
    version = 0
    running: list[tuple[int, int]] = []  # (finish tick, behaviour version)
    busy = 0
    ready: list[int] = []  # behaviour versions of finished units, in finish order
    trained, dropped, tick, done = [], 0, 0, 0
    while done < updates:
        tick += 1
        # ---- generators
        for unit in [u for u in running if u[0] <= tick]:
            running.remove(unit)
            ac.on_finished()
            ready.append(unit[1])
        while len(running) < generators and ac.can_start():
            ac.on_started()
            running.append((tick + rng.choice(durations), version))
        assert ac.admitted <= (ac.max_staleness + version + 1) * batch_size
        # ---- trainer
        if busy and tick >= busy:
            busy = 0
            version += 1
            done += 1
            ac.on_version(version)
        if not busy:
            if max_staleness is not None:
                keep, n_drop = filter_stale(torch.tensor(ready + [version]), version, max_staleness)
                if n_drop:
                    ac.on_discarded(n_drop)
                    dropped += n_drop
                    ready = [v for v, k in zip(ready, keep.tolist()) if k]
            if len(ready) >= batch_size:
                batch, ready = ready[:batch_size], ready[batch_size:]
                ac.on_consumed(batch_size)
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
