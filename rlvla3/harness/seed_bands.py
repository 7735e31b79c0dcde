"""Async against sync over seeds: the test the learning issues state, in one place.

A curve is cut into tenths of the env-step axis; each run gives one mean per tenth. Async agrees
with sync where its mean over seeds lies inside sync's mean +- 2 standard errors over seeds, at
every tenth after the first 20% (``bench/jobs/gym_parity.py`` on returns, ``bench/jobs/learning.py``
on success). The final means are judged apart (``final_ratio``), with what seed noise lets one
ratio mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

FIRST_TENTH = 2
"""Index of the first tenth judged: the first 20% of the axis is warm-up."""


def tenth_means(steps: Sequence[float], values: Sequence[float], total: float,
                weights: Sequence[float] | None = None) -> list[float | None]:
    """Weighted mean of ``values`` whose ``steps`` fall in each tenth of ``(0, total]``; ``None``
    where none does (or every weight there is 0)."""
    at, ys = np.asarray(steps, float), np.asarray(values, float)
    w = np.ones_like(ys) if weights is None else np.asarray(weights, float)
    if not (len(at) == len(ys) == len(w)):
        raise ValueError(f"steps, values and weights differ in length: {len(at)}, {len(ys)}, {len(w)}")
    ok = np.isfinite(ys) & (w > 0)
    points: list[float | None] = []
    for k in range(10):
        inside = ok & (at > k * total / 10) & (at <= (k + 1) * total / 10)
        points.append(_short(float((w * ys)[inside].sum() / w[inside].sum())) if inside.any() else None)
    return points


def band_points(sync: list[list[float | None]], asyn: list[list[float | None]]) -> dict[str, Any] | None:
    """Per judged tenth: sync's mean and 2 SE over seeds, async's mean, and whether it is inside.
    ``None`` until sync has two seeds and async one."""
    if len(sync) < 2 or not asyn:
        return None
    points = []
    for k in range(FIRST_TENTH, 10):
        s = [c[k] for c in sync if c[k] is not None]
        a = [c[k] for c in asyn if c[k] is not None]
        if len(s) < 2 or not a:
            points.append({"tenth": k + 1, "within": None})
            continue
        mean, se = float(np.mean(s)), float(np.std(s, ddof=1) / np.sqrt(len(s)))
        am = float(np.mean(a))
        points.append({"tenth": k + 1, "sync": _short(mean), "sync_2se": _short(2 * se), "async": _short(am),
                       "within": bool(abs(am - mean) <= 2 * se)})
    return {"points": points, "all_within": all(p["within"] for p in points),
            "chance_if_equal": chance_if_equal(sync, len(asyn))}


def chance_if_equal(sync: list[list[float | None]], async_seeds: int, draws: int = 10_000) -> float | None:
    """How often the test passes when async *is* sync: the share of draws in which ``async_seeds``
    curves, drawn like sync's (a normal over the judged tenths with sync's mean and covariance
    across seeds, so neighbouring tenths move together), land inside the band of as many fresh
    sync draws as sync has seeds, at every judged tenth. It says how much a failed test can
    mean: with 5 seeds of Hopper-v4 it is ~0.4. Seeded, so a report is reproducible; ``None``
    with fewer than 3 complete sync curves (no covariance to speak of)."""
    rows = [c[FIRST_TENTH:] for c in sync if all(v is not None for v in c[FIRST_TENTH:])]
    if len(rows) < 3 or async_seeds < 1:
        return None
    x = np.asarray(rows, float)
    rng = np.random.default_rng(0)
    mean, cov = x.mean(axis=0), np.cov(x, rowvar=False)
    n = len(rows)
    s = rng.multivariate_normal(mean, cov, size=(draws, n), method="eigh")
    a = rng.multivariate_normal(mean, cov, size=(draws, async_seeds), method="eigh").mean(axis=1)
    band = 2 * s.std(axis=1, ddof=1) / np.sqrt(n)
    return _short(float(np.mean(np.all(np.abs(a - s.mean(axis=1)) <= band, axis=1))))


def final_ratio(sync: Sequence[float], asyn: Sequence[float], tolerance: float,
                draws: int = 10_000) -> dict[str, Any] | None:
    """Async's final mean over sync's, judged ``within`` when it is inside ``1 +- tolerance``, and
    what seed noise lets that mean: ``interval_95``, a bootstrap over seeds (each mode's finals
    drawn again with replacement, as many as it has), and ``chance_within_if_equal``, how often an
    async that *is* sync passes (both modes drawn from sync's finals). On bimodal finals
    (HalfCheetah's two gaits) one ratio moves a lot with a few seeds; these say how much. Seeded;
    ``None`` with fewer than 2 seeds a mode or a sync mean that is not positive."""
    s, a = np.asarray(sync, float), np.asarray(asyn, float)
    if len(s) < 2 or len(a) < 2 or s.mean() <= 0:
        return None
    ratio = float(a.mean() / s.mean())
    rng = np.random.default_rng(0)
    s_means = rng.choice(s, size=(draws, len(s))).mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):  # a redrawn sync mean of 0: that draw never passes
        boot = rng.choice(a, size=(draws, len(a))).mean(axis=1) / s_means
        same = rng.choice(s, size=(draws, len(a))).mean(axis=1) / s_means
    return {"ratio": round(ratio, 3), "within": bool(abs(ratio - 1) <= tolerance),
            "interval_95": [round(float(q), 3) for q in np.percentile(boot, [2.5, 97.5])],
            "chance_within_if_equal": _short(float(np.mean(np.abs(same - 1) <= tolerance)))}


def _short(x: float) -> float:
    """Five significant figures: enough for a return in the thousands and a success rate alike."""
    return float(f"{x:.5g}")
