"""The async-against-sync test over seeds (``rlvla3/harness/seed_bands.py``), on figures worked by hand."""

from __future__ import annotations

import pytest

from rlvla3.harness.seed_bands import band_points, chance_if_equal, final_ratio, tenth_means


def test_tenth_means_weigh_each_point_and_leave_empty_tenths_none():
    # 100 steps: tenths are (0, 10], (10, 20], ...; the point at 10 belongs to the first
    steps = [5, 10, 15, 95, 100]
    values = [1.0, 0.0, 4.0, 2.0, float("nan")]
    weights = [1, 3, 2, 1, 5]
    means = tenth_means(steps, values, 100, weights)
    assert means[0] == pytest.approx(0.25)  # (1*1 + 3*0) / 4
    assert means[1] == 4.0
    assert means[2:9] == [None] * 7
    assert means[9] == 2.0  # the NaN point counts for nothing
    assert tenth_means(steps, values, 100)[0] == 0.5  # unweighted
    with pytest.raises(ValueError, match="differ in length"):
        tenth_means([1, 2], [1.0], 10)


def test_band_points_judge_async_against_two_standard_errors_of_sync_after_the_first_fifth():
    sync = [[0.0] * 10, [1.0] * 10, [2.0] * 10]  # mean 1, sd 1, 2 SE = 2 / sqrt(3) = 1.1547
    inside = [[2.15] * 10]
    outside = [[0.0, 0.0, 2.16, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]
    got = band_points(sync, inside)
    assert [p["tenth"] for p in got["points"]] == list(range(3, 11))
    assert got["points"][0] == {"tenth": 3, "sync": 1.0, "sync_2se": 1.1547, "async": 2.15, "within": True}
    assert got["all_within"] is True
    missed = band_points(sync, outside)
    assert [p["within"] for p in missed["points"]] == [False] + [True] * 7 and missed["all_within"] is False
    # warm-up tenths are not judged: async far off in the first two changes nothing
    early = [[9.0, 9.0] + [1.0] * 8]
    assert band_points(sync, early)["all_within"] is True
    # too few seeds to say anything
    assert band_points(sync[:1], inside) is None and band_points(sync, []) is None
    gap = [list(c) for c in sync]
    for c in gap[1:]:
        c[4] = None
    assert band_points(gap, inside)["points"][2] == {"tenth": 5, "within": None}


def test_chance_if_equal_is_how_often_sync_passes_against_itself():
    # five sync curves whose tenths move as one: the test is then one t-like comparison,
    # P(|T_4| <= 0.82) ~ 0.54 for one async seed, P(|T_4| <= 1.91) ~ 0.87 for fifty
    sync = [[0.0] * 10, [1.0] * 10, [2.0] * 10, [1.5] * 10, [0.5] * 10]
    one, many = chance_if_equal(sync, 1), chance_if_equal(sync, 50)
    assert 0.5 < one < 0.58 and 0.84 < many < 0.9  # more async seeds: a tighter mean, passes more often
    assert chance_if_equal(sync, 1) == one  # seeded: the same report twice
    assert band_points(sync, [[1.0] * 10])["chance_if_equal"] == one
    # independent tenths pass all eight together far less often than tenths that move as one
    rng_rows = [[float(v) for v in row] for row in
                [[0, 1, 2, 0, 1, 2, 0, 1, 2, 0], [1, 2, 0, 1, 2, 0, 1, 2, 0, 1], [2, 0, 1, 2, 0, 1, 2, 0, 1, 2],
                 [0, 2, 1, 0, 2, 1, 0, 2, 1, 0], [1, 0, 2, 1, 0, 2, 1, 0, 2, 1]]]
    assert chance_if_equal(rng_rows, 1) < one
    assert chance_if_equal(sync[:2], 1) is None and chance_if_equal(sync, 0) is None


def test_final_ratio_says_what_seed_noise_lets_one_ratio_mean():
    # sync finals 1 and 3 (mean 2), async 2, 2, 2: the ratio is 1. Redrawn, sync's mean is 1, 2 or 3
    # (1/4, 1/2, 1/4), so async / sync is 2, 1 or 2/3: the 95% interval runs from 2/3 to 2.
    got = final_ratio([1.0, 3.0], [2.0, 2.0, 2.0], tolerance=0.10)
    assert got["ratio"] == 1.0 and got["within"] is True
    assert got["interval_95"] == [0.667, 2.0]
    # an async that is sync: three draws from {1, 3} land within 10% of two draws' mean only when
    # all five are 1 or all are 3: 2 * (1/4 * 1/8) = 1/16
    assert 0.05 < got["chance_within_if_equal"] < 0.075
    assert final_ratio([1.0, 3.0], [2.0, 2.0, 2.0], tolerance=0.10) == got  # seeded: the same report twice
    # one sync value: no noise, and the tolerance alone decides
    steady = final_ratio([2.0] * 4, [1.7, 1.7], tolerance=0.10)
    assert steady == {"ratio": 0.85, "within": False, "interval_95": [0.85, 0.85], "chance_within_if_equal": 1.0}
    assert final_ratio([2.0] * 4, [1.7, 1.7], tolerance=0.20)["within"] is True
    # too few seeds, or a sync mean a ratio cannot be taken of
    assert final_ratio([1.0], [1.0, 1.0], 0.1) is None and final_ratio([1.0, 1.0], [1.0], 0.1) is None
    assert final_ratio([-1.0, 1.0], [1.0, 1.0], 0.1) is None
