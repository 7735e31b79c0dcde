"""Faults: a generator killed with SIGKILL mid-batch has its batch served by the other and no
trajectory is lost; a killed trainer's trajectories go to its replacement; a broker restart is
survived by every worker."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import zmq

from rlvla3 import protocol as P
from rlvla3.harness.jobs import per_worker
from rlvla3.status_client import built_after, wait_until

pytestmark = pytest.mark.slow


def test_generator_killed_mid_batch_is_requeued_and_nothing_lost(job_factory):
    # A slow forward pass keeps the doomed generator mid-batch often enough to catch it there.
    job = job_factory("workers.generators=0", "batching.credits=1")
    doomed = job.start_worker("generator", "doomed", ["--set", "model.options.forward_delay_ms=400"])
    job.wait(lambda f: (per_worker(f, "doomed").get("served") or 0) >= 2, 90, "doomed generator serving")
    job.start_worker("generator", "survivor")
    job.wait(lambda f: (per_worker(f, "survivor").get("served") or 0) >= 1, 90, "survivor serving")
    _stop_mid_batch(job, doomed, "doomed")
    os.kill(doomed.pid, signal.SIGKILL)
    fig = job.wait(lambda f: not per_worker(f, "doomed") and f["requeued"] >= 1, 60, "the dead generator's batch requeued")
    before = fig["env_steps"]
    fig = job.wait(lambda f: f["env_steps"] > before + 200 and f["traj"]["acked"] >= 4, 120, "stepping on without it")
    # Every simulator slot still progresses (none stuck waiting for the lost batch) ...
    sims = [w for w in fig["per_worker"] if w["role"] == "simulator"]
    assert sims and all((w["env_steps"] or 0) > 0 for w in sims)
    assert fig["traj"]["dropped"] == 0 and fig["errors"] == 0
    # ... and every trajectory received was handed to the trainer and acknowledged.
    fig = job.wait(lambda f: f["traj"]["received"] == f["traj"]["acked"] + f["trajs_pending"] + f["trajs_inflight"],
                   30, "trajectory accounting to balance")


def _stop_mid_batch(job, proc, name: str) -> None:
    """SIGSTOP the generator while the broker holds a batch in flight on it, kept only when
    figures built well after the stop still show one: stopped, it cannot send that RESULT, so the
    batch is still its own when it is killed. (A kill timed by one STATUS answer can land just
    after the forward pass ended, with nothing left to requeue: CI saw it.)"""

    def attempt() -> bool | None:
        before = job.wait(lambda f: (per_worker(f, name).get("inflight") or 0) >= 1, 60, f"a batch in flight on {name}")
        os.kill(proc.pid, signal.SIGSTOP)
        after = job.wait(built_after(before, 0.6), 10, "figures built after the stop")
        if (per_worker(after, name).get("inflight") or 0) >= 1:
            return True
        os.kill(proc.pid, signal.SIGCONT)  # its RESULT came in first: let it take another batch
        return None

    wait_until(attempt, 120, f"{name} stopped with a batch in flight")


def test_trainer_killed_its_trajectories_go_to_the_next(job_factory):
    job = job_factory("workers.trainers=0", "algo.batch_steps=100000")  # never trains: holds nothing back
    first = job.start_worker("trainer", "first", ["--set", "workers.torch_threads=1"])
    job.wait(lambda f: f["traj"]["acked"] >= 3, 90, "first trainer taking trajectories")
    os.kill(first.pid, signal.SIGKILL)
    fig = job.wait(lambda f: not per_worker(f, "first"), 30, "trainer expiry")
    received_then = fig["traj"]["received"]
    job.start_worker("trainer", "second")
    fig = job.wait(lambda f: f["traj"]["acked"] >= received_then and f["trajs_pending"] == 0, 90,
                   "everything received before the kill acknowledged by the new trainer")
    assert fig["traj"]["dropped"] == 0


def test_workers_survive_a_broker_restart_and_its_counters_are_rebuilt(job_factory):
    """... and the generator follows the new broker's PUB address (its READY reply says where):
    versions published after the restart reach it."""
    job = job_factory()
    fig = job.wait(lambda f: f["env_steps"] > 100 and f["trainer_version"] >= 1, 120, "stepping and training")
    endpoint, pub = job.endpoint, fig["run_id"]
    steps, version = fig["env_steps"], fig["trainer_version"]
    served = max(w["version"] or 0 for w in fig["per_worker"] if w["role"] == "generator")
    old_pub = json.loads((job.run_dir / "broker.json").read_text())["pub"]
    job.broker_proc.send_signal(signal.SIGKILL)
    job.broker_proc.wait(10)
    job.start_broker(endpoint, "tcp://127.0.0.1:0")  # same address, another PUB port; a new broker knows nobody
    assert json.loads((job.run_dir / "broker.json").read_text())["pub"] != old_pub
    fig = job.wait(lambda f: f["workers"] == {"simulator": 1, "generator": 1, "trainer": 1}, 120,
                   "workers re-joined the restarted broker")
    # The simulators' and trainer's own counts rebuild the counters: nothing starts from 0.
    assert fig["env_steps"] >= steps and fig["trainer_version"] >= version, (fig["env_steps"], steps)
    fig = job.wait(lambda f: f["env_steps"] > steps + 100, 120, "stepping on after the restart")
    assert fig["run_id"] != pub
    job.wait(lambda f: any((w["version"] or 0) > max(served, version) + 1 for w in f["per_worker"] if w["role"] == "generator"),
             120, "a version published after the restart served by the generator")
    assert "weights_sub_moved" in (job.run_dir / "generator0.log").read_text()


def test_a_reconnecting_trainer_takes_back_its_rank_and_nobody_else_can(job_factory, zctx):
    """A READY on a new socket with the trainer's name, host and pid is that trainer coming back
    (its first READY went unanswered, or it gave up on a silent broker): it gets its rank back.
    It used to be refused ("trainer group is full") and exit. Another pid is still refused."""
    job = job_factory()
    fig = job.wait(lambda f: f["policy_version"] >= 1, 120, "training")
    me = next(w for w in fig["per_worker"] if w["role"] == "trainer")

    def ready(pid: int) -> P.Message:
        sock = zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(job.endpoint)
            sock.send_multipart(P.encode(P.READY, {"role": "trainer", "host": me["host"], "pid": pid,
                                                   "name": me["name"], "credits": 1}))
            assert sock.poll(10_000), "no answer to READY"
            return P.decode(sock.recv_multipart())
        finally:
            sock.close()

    other = ready(me["pid"] + 1)
    assert other.type == P.ERROR and "trainer group is full" in other["reason"], other.header
    again = ready(me["pid"])
    assert again.type == P.READY and again["rank"] == 0, again.header
    # The real trainer's old identity was replaced: it READYs again and takes rank 0 back.
    version = fig["policy_version"]
    fig = job.wait(lambda f: f["workers"]["trainer"] == 1 and f["policy_version"] > version + 1, 120,
                   "the trainer training on at rank 0")
    assert all(p.poll() is None for p in job.workers), job.logs()


def test_a_rejection_flood_writes_a_bounded_log(job_factory, zctx):
    """10,000 messages a broker must refuse: each is answered and counted, but the log gets at
    most ``broker.reject_log_per_s`` lines per peer per second plus a count of the rest."""
    job = job_factory(start=False)
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(job.endpoint)
    flood = P.encode(P.HEARTBEAT, {})  # before READY: refused
    t0 = time.monotonic()
    try:
        for _ in range(10_000):
            sock.send_multipart(flood)
        job.wait(lambda f: f["errors"] >= 10_000, 120, "every message refused")
        log = job.run_dir / "broker.log"

        def summarised() -> bool:
            sock.send_multipart(flood)  # a message in a later second writes the summary
            return "message_rejections_suppressed" in log.read_text()

        wait_until(summarised, 30, "the suppressed rejections summed in one line", interval=0.2)
        elapsed = time.monotonic() - t0
    finally:
        sock.close()
    lines = log.read_text().count("message_rejected")
    assert lines <= job.cfg.broker.reject_log_per_s * (elapsed + 2), (lines, elapsed)


def test_a_request_whose_shared_memory_is_gone_fails_alone(job_factory):
    """A simulator killed with its request queued: its shared memory is unlinked (by its resource
    tracker) before the broker notices it left, and a generator that never mapped that memory
    gets the request in a batch. It leaves that request out, counts it, and serves the rest of the
    batch; nothing is re-queued. (A SIGTERM'd simulator withdraws its queued requests with its
    DISCONNECT; one that reaches a generator before the DISCONNECT reaches the broker is this case.)"""
    job = job_factory("workers.generators=0", "workers.trainers=0", "env.slots=1", "env.num_envs=2", "env.eval_slots=0",
                      "broker.liveness=60", start=False)
    doomed = job.start_worker("simulator", "doomed")
    job.start_worker("simulator", "survivor")
    job.wait(lambda f: f["queue_depth"] == 2, 90, "both simulators' requests queued (no generator yet)")
    os.kill(doomed.pid, signal.SIGKILL)
    wait_until(lambda: not list(Path("/dev/shm").glob(f"rlvla3_*_{doomed.pid}_*")), 30, "the killed simulator's memory unlinked")
    job.start_worker("generator", "gen")
    fig = job.wait(lambda f: f["requests_unreadable"] >= 1 and (per_worker(f, "survivor").get("env_steps") or 0) > 0,
                   90, "the unreadable request left out and the other served")
    assert fig["requeued"] == 0 and fig["queue_depth"] <= 1, fig
    assert "act_failed_resetting_slot" not in (job.run_dir / "survivor.log").read_text()
    assert "request_unreadable" in (job.run_dir / "gen.log").read_text()
