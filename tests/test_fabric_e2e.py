"""End to end on real processes: 2 simulators, 2 generators, 1 trainer in each mode; workers
joining mid-run (one job), the late generator getting the current weights; shared memory cleaned up."""

from __future__ import annotations

import pytest

from rlvla3.harness.jobs import per_worker
from rlvla3.shm import segments_of_run

pytestmark = pytest.mark.slow

TWO_TWO_ONE = ("workers.simulators=2", "workers.generators=2", "workers.trainers=1")


@pytest.mark.parametrize("mode", ["sync", "async_rollout", "async"])
def test_job_runs_in_each_mode(job_factory, mode):
    job = job_factory(*TWO_TWO_ONE, f"run.mode={mode}")
    fig = job.wait(lambda f: f["policy_version"] >= 2 and f["episodes"] >= 4, 120, f"2 versions in {mode}")
    assert fig["workers"] == {"simulator": 2, "generator": 2, "trainer": 1}
    assert fig["errors"] == 0 and fig["traj"]["dropped"] == 0
    assert fig["peer_rate"]["dropped"] == 0  # real workers are never throttled by the default cap
    assert fig["env_steps"] > 0 and fig["traj"]["acked"] > 0
    served = [w["served"] or 0 for w in fig["per_worker"] if w["role"] == "generator"]
    assert len(served) == 2
    if mode == "sync":  # barrier: every batch holds all 4 slots' requests (8 envs) at most
        assert fig["batch_size"]["max"] <= 8
        # so each simulator's two ACTs of a batch reach it as one BUNDLE (workers say `bundles`)
        assert fig["bundles"]["out"] > 0 and fig["bundles"]["out_parts"] >= 2 * fig["bundles"]["out"]
    run_id = fig["run_id"]
    job.stop()
    assert segments_of_run(run_id) == [], "shared-memory segments left after shutdown"


def test_workers_join_mid_run_and_a_late_generator_gets_current_weights(job_factory):
    """One job: a simulator and a generator join once it steps and has published three versions;
    the late simulator's slots are served and the late generator serves the current weights."""
    job = job_factory()
    job.wait(lambda f: f["env_steps"] > 200 and f["policy_version"] >= 3, 120, "stepping, three published versions")
    job.start_worker("simulator", "late_sim", ["--index", "7"])
    job.start_worker("generator", "late_gen", ["--set", "model.options.forward_delay_ms=1"])
    fig = job.wait(
        lambda f: per_worker(f, "late_sim").get("role") == "simulator"
        and (per_worker(f, "late_gen").get("served") or 0) > 5,
        90, "late generator serving batches",
    )
    base = fig["env_steps"]
    assert per_worker(fig, "late_gen")["version"] >= 3  # the current weights, not its own build
    # The late simulator's slots get served: its own step count grows.
    job.wait(lambda f: (per_worker(f, "late_sim").get("env_steps") or 0) > 50, 60, "late simulator stepping")
    assert fig["slots"] == 4 and fig["errors"] == 0 and base > 0
