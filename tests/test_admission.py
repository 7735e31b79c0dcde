"""Admission control: with a deliberately slow trainer, the broker stops handing out work so
that samples stay within the admission lag of the trainer's version."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_slow_trainer_keeps_staleness_bounded(job_factory):
    # Two simulators and a fast generator against a trainer that takes many epochs per update.
    # The window is one batch ahead (admission_lag 1) while the filter would keep 4 versions.
    job = job_factory("workers.simulators=2", "run.mode=async", "algo.admission_lag=1", "algo.max_staleness=4",
                      "algo.batch_steps=64", "algo.epochs=40", "algo.minibatch_size=8")
    fig = job.wait(lambda f: f["trainer_version"] >= 4, 180, "four slow updates")
    adm = fig["admission"]
    assert fig["admission_waits"] > 0, "admission control never held work back"
    # The capacity rule: admitted-but-untrained work never exceeds (lag + 1) batches, the
    # admission lag's and not the filter's (it fills 4 + 1 batches with the lag at 4).
    assert adm["lag"] == 1 and adm["in_flight"] + adm["finished"] <= (1 + 1) * 64 + 8, adm
    st = fig["staleness"]
    assert st["count"] > 0
    # The lag, not the filter's bound, sets how stale samples are (histogram values are
    # staleness + 1): fragments of 8 steps overshoot it by at most one version, and nothing
    # comes near the filter.
    assert st["p50"] - 1 <= 1 and st["max"] - 1 <= 2, st
    assert fig["dropped_stale"] == 0


def test_stale_samples_masked_in_a_batch_free_no_admission_capacity(job_factory):
    # Fast simulators, a trainer slowed to 0.3 s an update, S = 3: fragments that span versions
    # get their oldest steps masked in the batch. Those steps left admission's count when the
    # batch was taken; were they freed again, each drop would widen the window and the queue
    # would grow past it, staler and staler, until most of the data is dropped.
    job = job_factory("run.mode=async", "algo.max_staleness=3", "train.min_update_s=0.3")
    window = (3 + 1) * 64  # (S + 1) batches, in steps
    queued: list[int] = []  # fragments waiting at the broker for the trainer, from version 10 on

    def watch(f: dict) -> bool:
        if f["trainer_version"] >= 10:
            queued.append(f["trajs_pending"])
        return f["trainer_version"] >= 40 and f["dropped_stale"] > 0

    # A loaded machine slows the simulators too, and then fewer fragments span S versions: the
    # run goes on past 40 updates until one has steps masked (the case this test is about).
    fig = job.wait(watch, 240, "40 slow updates and steps masked as stale (the case this test is about)")
    # fragments are at most env.fragment_len = 8 steps: the queue stays within the window
    assert max(queued) * 8 <= window, f"{max(queued)} fragments queued, the window is {window} steps"
    led = fig["acked_steps"]
    assert led["stale"] <= 0.15 * (led["trained"] + led["stale"]), led
