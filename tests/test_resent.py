"""A fragment re-sent after a broker restart is never trained twice.

The window, made certain: the trainer is stopped (SIGSTOP) while the broker delivers it fragments,
so their acks never reach that broker; the broker is killed, a new one starts on its address and
the trainer goes on (SIGCONT). It reads the fragments the old broker sent and acks them into the
void; the simulator, which has no ack for them, sends them again to the new broker, which routes
them to the trainer again. The trainer knows them by their simulator and ``traj_id``: it acks
them with the fate ``duplicate`` and never trains them again, and both brokers' ledgers add up
with no step acknowledged twice (``rlvla3/harness/faults.py`` ``ledger_problems``).
"""

from __future__ import annotations

import os
import signal

import pytest

from rlvla3.harness.faults import LIVENESS, ledger_problems
from rlvla3.harness.jobs import Job, per_worker
from rlvla3.status_client import DeadlinePassed

pytestmark = pytest.mark.timeout(120)


def _stopped_holding_unacked(job: Job, trainer: int, tries: int = 5) -> dict:
    """The trainer SIGSTOPped with fragments delivered to it (so never acked); the broker's
    figures then. A trainer that holds an update's worth gets nothing more until it reports fates
    (``brokers/trajectories.py`` ``hold_steps``): then it goes on until its next update and is
    stopped again. Each stop stays within the liveness window (2 s): the broker keeps it in."""
    for _ in range(tries):
        os.kill(trainer, signal.SIGSTOP)
        try:
            return job.wait(lambda f: (per_worker(f, "trainer0").get("inflight") or 0) >= 1, 1.2,
                            "fragments delivered to the stopped trainer")
        except DeadlinePassed:
            os.kill(trainer, signal.SIGCONT)
            version = job.status()["trainer_version"]
            job.wait(lambda f: f["trainer_version"] > version, 30, "the trainer's next update")
    raise AssertionError(f"no fragment was delivered to the stopped trainer in {tries} tries")


def test_a_fragment_resent_after_a_broker_restart_is_acked_as_a_duplicate_not_trained(job_factory):
    job = job_factory(*LIVENESS)
    fig = job.wait(lambda f: f["trainer_version"] >= 1 and f["workers"]["simulator"] == 1, 90, "the job training")
    trainer = per_worker(fig, "trainer0")["pid"]
    old = _stopped_holding_unacked(job, trainer)
    try:
        job.broker_proc.send_signal(signal.SIGKILL)
        job.broker_proc.wait(10)
        job.start_broker(job.endpoint, "tcp://127.0.0.1:0")
    finally:
        os.kill(trainer, signal.SIGCONT)
    whole = {"simulator": 1, "generator": 1, "trainer": 1}
    fig = job.wait(lambda f: f["workers"] == whole, 30, "the workers to rejoin the new broker")
    # The simulator re-sends on its rejoin, before anything new: two updates later they have arrived.
    fig = job.wait(lambda f: f["trainer_version"] >= fig["trainer_version"] + 2, 30, "training to go on")
    assert fig["trainer"].get("duplicates", 0) >= 1, ("the trainer did not know the re-sent fragments (trained them "
                                                      "twice)", old["trajs_inflight"], job.logs())
    assert fig["trainer"]["duplicates"] <= old["trajs_inflight"], (fig["trainer"], old["trajs_inflight"])
    assert fig["acked_steps"]["duplicate"] > 0, fig["acked_steps"]  # their acks reached the new broker
    assert not ledger_problems(fig, old), (ledger_problems(fig, old), fig["acked_steps"], old["acked_steps"])
    assert not ledger_problems(old), old["acked_steps"]
    assert "traj_duplicate" in (job.run_dir / "trainer0.log").read_text()
