"""Admission control: with a deliberately slow trainer, the broker stops handing out work so
that samples stay within max_staleness of the trainer's version."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_slow_trainer_keeps_staleness_bounded(job_factory):
    # Two simulators and a fast generator against a trainer that takes many epochs per update.
    job = job_factory("workers.simulators=2", "run.mode=async", "algo.max_staleness=1",
                      "algo.batch_steps=64", "algo.epochs=40", "algo.minibatch_size=8")
    fig = job.wait(lambda f: f["trainer_version"] >= 4, 180, "four slow updates")
    adm = fig["admission"]
    assert fig["admission_waits"] > 0, "admission control never held work back"
    # The capacity rule: admitted-but-untrained work never exceeds (S + 1) batches.
    assert adm["in_flight"] + adm["finished"] <= (adm["max_staleness"] + 1) * 64 + 8
    st = fig["staleness"]
    assert st["count"] > 0
    assert st["p50"] - 1 <= 1 and st["max"] - 1 <= 2  # histogram values are staleness + 1
    # Stragglers that still arrive too stale are dropped, and only a few of them.
    assert fig["dropped_stale"] <= 0.25 * fig["decision_steps"]
