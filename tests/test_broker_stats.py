"""STATUS figures: the numpy percentiles match hdrh's own methods, percentiles refresh at most
once a second while counters are always current, and a live broker reports its loop stall."""

from __future__ import annotations

import random

import pytest

from brokers.stats import BrokerStats, _hist, _pcts, record_many


@pytest.mark.parametrize("top", [50, 1_000_000, 60_000_000])
def test_percentiles_match_hdrh(top):
    rng = random.Random(top)
    h = _hist()
    for _ in range(5000):
        h.record_value(rng.randint(1, top))
    assert _pcts(h) == {
        "count": 5000, "p50": h.get_value_at_percentile(50), "p90": h.get_value_at_percentile(90),
        "p99": h.get_value_at_percentile(99), "max": h.get_max_value(), "mean": round(h.get_mean_value(), 1),
    }
    assert _pcts(_hist()) == {"count": 0}


def test_record_many_is_hdrh_record_value():
    rng = random.Random(3)
    values = [rng.choice([0, 1, 2047, 2048, 4095]) for _ in range(50)] + [rng.randint(1, 2**27) for _ in range(5000)]
    one, many = _hist(), _hist()
    for v in values:
        one.record_value(max(1, v))
    record_many(many, values)
    assert list(many.counts) == list(one.counts)
    assert (many.total_count, many.min_value, many.max_value) == (one.total_count, one.min_value, one.max_value)


def test_percentiles_refresh_once_a_second_and_counters_always():
    st = BrokerStats(started=0.0)
    assert st.snapshot(0.5)["generate_us"] == {"count": 0}
    st.generate_us.record_value(10)
    assert st.snapshot(0.6)["generate_us"]["p50"] == 10  # was empty: refreshed at once
    st.generate_us.record_value(2000)
    st.batches += 1
    fig = st.snapshot(1.5)
    assert fig["generate_us"]["count"] == 2 and fig["generate_us"]["max"] == 10 and fig["batches"] == 1
    assert st.snapshot(1.6)["generate_us"]["max"] > 1000


def test_a_live_broker_reports_its_longest_loop_turn(job_factory):
    job = job_factory(start=False)
    fig = job.wait(lambda f: "max_loop_stall_ms" in f, 30, "STATUS from the broker")
    assert 0.0 <= fig["max_loop_stall_ms"] < 10_000


def test_loop_stall_figures_keep_the_longest_turn_ever_and_of_the_last_seconds():
    st = BrokerStats(started=0.0)
    st.loop_turn(0.050, 0.004, 1.2)  # 50 ms of wall time, 4 ms of it on the loop's CPU
    st.loop_turn(0.002, 0.001, 5.0)
    fig = st.snapshot(5.5)
    assert (fig["max_loop_stall_ms"], fig["loop_stall_ms_recent"], fig["loop_stall_cpu_ms_recent"]) == (50.0, 50.0, 4.0)
    fig = st.snapshot(12.5)  # the 50 ms turn is older than STALL_WINDOW_S
    assert (fig["max_loop_stall_ms"], fig["loop_stall_ms_recent"], fig["loop_stall_cpu_ms_recent"]) == (50.0, 2.0, 1.0)
