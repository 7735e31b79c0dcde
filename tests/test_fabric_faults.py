"""Faults: a generator killed with SIGKILL mid-batch has its batch served by the other and no
trajectory is lost; a killed trainer's trajectories go to its replacement; a broker restart is
survived by every worker."""

from __future__ import annotations

import os
import signal

import pytest

pytestmark = pytest.mark.slow


def test_generator_killed_mid_batch_is_requeued_and_nothing_lost(job_factory):
    # A slow forward pass keeps the doomed generator mid-batch almost all the time.
    job = job_factory("workers.generators=0", "batching.credits=1")
    doomed = job.start_worker("generator", "doomed", ["--set", "model.options.forward_delay_ms=400"])
    job.wait(lambda f: ((job.worker(f, "doomed") or {}).get("served") or 0) >= 2, 90, "doomed generator serving")
    job.start_worker("generator", "survivor")
    job.wait(lambda f: ((job.worker(f, "survivor") or {}).get("served") or 0) >= 1, 90, "survivor serving")
    fig = job.wait(lambda f: ((job.worker(f, "doomed") or {}).get("inflight") or 0) >= 1, 60,
                   "a batch in flight on the doomed generator")
    os.kill(doomed.pid, signal.SIGKILL)
    fig = job.wait(lambda f: job.worker(f, "doomed") is None and f["requeued"] >= 1, 60, "the dead generator's batch requeued")
    before = fig["env_steps"]
    fig = job.wait(lambda f: f["env_steps"] > before + 200 and f["traj"]["acked"] >= 4, 120, "stepping on without it")
    # Every simulator slot still progresses (none stuck waiting for the lost batch) ...
    sims = [w for w in fig["per_worker"] if w["role"] == "simulator"]
    assert sims and all((w["env_steps"] or 0) > 0 for w in sims)
    assert fig["traj"]["dropped"] == 0 and fig["errors"] == 0
    # ... and every trajectory received was handed to the trainer and acknowledged.
    fig = job.wait(lambda f: f["traj"]["received"] == f["traj"]["acked"] + f["trajs_pending"] + f["trajs_inflight"],
                   30, "trajectory accounting to balance")


def test_trainer_killed_its_trajectories_go_to_the_next(job_factory):
    job = job_factory("workers.trainers=0", "algo.batch_steps=100000")  # never trains: holds nothing back
    first = job.start_worker("trainer", "first", ["--set", "workers.torch_threads=1"])
    job.wait(lambda f: f["traj"]["acked"] >= 3, 90, "first trainer taking trajectories")
    os.kill(first.pid, signal.SIGKILL)
    fig = job.wait(lambda f: job.worker(f, "first") is None, 30, "trainer expiry")
    received_then = fig["traj"]["received"]
    job.start_worker("trainer", "second")
    fig = job.wait(lambda f: f["traj"]["acked"] >= received_then and f["trajs_pending"] == 0, 90,
                   "everything received before the kill acknowledged by the new trainer")
    assert fig["traj"]["dropped"] == 0


def test_workers_survive_a_broker_restart(job_factory):
    job = job_factory()
    fig = job.wait(lambda f: f["env_steps"] > 100, 90, "stepping")
    endpoint, pub = job.endpoint, fig["run_id"]
    job.broker_proc.send_signal(signal.SIGKILL)
    job.broker_proc.wait(10)
    job.start_broker(endpoint, None)  # same address; a new broker knows nobody
    fig = job.wait(lambda f: f["workers"]["simulator"] == 1 and f["workers"]["generator"] == 1
                   and f["env_steps"] > 50, 120, "workers re-joined the restarted broker and stepping")
    assert fig["run_id"] != pub
