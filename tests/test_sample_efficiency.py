"""Async PPO reaches the sync return per env step, within seed noise (the paper's claim: more
throughput at equal sample efficiency), on the synthetic task. The four jobs run at once (the
figure is per env step, not per second) and each stops when its trainer has trained on ``STEPS``
env steps (``env_steps_consumed``, the axis of the parity curves in ``bench/jobs/gym_parity.py``).

Not when the simulators have collected ``STEPS``: async admits up to a batch ahead of training.
With two CPU burners beside the four jobs (session 46), at 6,000 collected steps the async
trainers had trained on 5,632 and 5,677 steps (22 updates), sync's on 5,888 and 6,144, on a curve
still steep there: async read 3.48 and 4.81 against sync's 5.31 and 5.25, and the suite saw the
same gap fail this test in 2 of about 10 runs (sessions 44 and 46). At 6,144 trained steps the
same async jobs read 4.45 and 5.26. The gap was the admission window, not what an env step teaches.

Async runs with ``algo.max_staleness=1``: with the default bound (4) and a trainer starved of CPU
(the suite runs two test files at once), up to five 256-step batches of the 6,000 come from
policies several versions old, and async's return at 6,000 steps fell to 3.4-4.1 against sync's
5.3; with a bound of 1 it stays at 4.7-5.3 under the same load."""

from __future__ import annotations

import statistics

import pytest

from rlvla3.status_client import wait_until

pytestmark = pytest.mark.slow

STEPS = 6000
RECIPE = ("env.num_envs=8", "env.slots=4", "env.fragment_len=16", "algo.batch_steps=256",
          "algo.minibatch_size=64", "algo.epochs=4", "model.options.hidden=64", "env.options.image_size=16",
          "workers.simulators=1", "algo.max_staleness=1")


def final_returns(job_factory, runs: list[tuple[str, int]]) -> dict[tuple[str, int], float]:
    """Start one job per (mode, seed) at once; each one's recent return when its trainer had
    trained on ``STEPS`` env steps."""
    jobs = {run: job_factory(*RECIPE, f"run.mode={run[0]}", f"run.seed={run[1]}") for run in runs}
    returns: dict[tuple[str, int], float] = {}

    def all_done() -> bool:
        for run, job in jobs.items():
            if run in returns:
                continue
            job.assert_alive()
            f = job.status()
            if (f.get("trainer") or {}).get("env_steps_consumed", 0) >= STEPS and f["return_recent"] is not None:
                returns[run] = float(f["return_recent"])
                job.stop()  # the others get its CPU
        return len(returns) == len(jobs)

    wait_until(all_done, 300, f"{STEPS} steps trained in every job", interval=0.1)
    return returns


def test_async_matches_sync_return_per_env_step(job_factory):
    returns = final_returns(job_factory, [(mode, seed) for mode in ("sync", "async") for seed in (1, 2)])
    sync = [returns["sync", s] for s in (1, 2)]
    asyn = [returns["async", s] for s in (1, 2)]
    noise = max(statistics.pstdev(sync), statistics.pstdev(asyn), 0.5)
    # both learned (a random policy's return is about 0 on this task) ...
    assert min(sync) > 1.5 and min(asyn) > 1.5, (sync, asyn)
    # ... and async is no worse per env step than sync, beyond seed noise
    assert statistics.mean(asyn) >= statistics.mean(sync) - 2 * noise, (sync, asyn)
