"""A job across several hosts for real: every host is a network namespace with its own hostname
and /dev/shm (``rlvla3/harness/netns.py``), joined by veth pairs on one bridge, and the job runs with
CURVE on, as it would across machines.

    head   (10.213.0.1)  broker, simulator sim-head, generator gen-head
    train  (10.213.0.2)  trainer
    far    (10.213.0.3)  simulator sim-far, generator gen-far     (killed mid-run)
    late   (10.213.0.4)  simulator sim-late                        (added mid-run)

Checked from the broker's STATUS: each host has its own host id; frames travel as shared memory
within the head host and inline across hosts; a simulator host added mid-run gets work; killing
every process of one host loses no acknowledged step (``acked_steps``: every step acknowledged
by the trainer is trained, stale, discarded or still held by it) and the job goes on.

Skipped, with the reason, only where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from brokers.ledger import ACKED_PARTS
from rlvla3.config import load
from rlvla3.harness.jobs import SMALL_JOB, per_worker as per
from rlvla3.harness.netns import NetnsJob, unavailable

REASON = unavailable()
pytestmark = [pytest.mark.multihost, pytest.mark.timeout(900),
              pytest.mark.skipif(REASON is not None, reason=f"multihost: {REASON}")]



def test_job_across_namespace_hosts_with_curve(tmp_path: Path):
    cfg = load("synthetic.yaml", SMALL_JOB)
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(cfg.to_yaml())
    c = NetnsJob(tmp_path)
    try:
        c.start_broker(cfg_path)
        c.worker("head", "simulator", "sim-head")
        c.worker("head", "generator", "gen-head")
        c.worker("train", "trainer", "trainer", "--run-dir", str(tmp_path / "run"))
        c.worker("far", "simulator", "sim-far")
        c.worker("far", "generator", "gen-far")

        # ---- every host has its own host id; frames: shm within the head, inline across ----
        fig = c.wait(lambda f: f["workers"] == {"simulator": 2, "generator": 2, "trainer": 1}
                     and f["trainer_version"] >= 1 and all(per(f, n).get("frames", {}).get("inline", 0) > 0
                                                            for n in ("sim-far", "gen-far", "trainer")),
                     600, "all five workers to join over CURVE, frames to flow and one update")
        hosts = {w["name"]: w["host"] for w in fig["per_worker"]}
        assert hosts["sim-head"] == hosts["gen-head"]
        assert len({hosts["sim-head"], hosts["trainer"], hosts["sim-far"]}) == 3, hosts
        assert hosts["sim-far"] == hosts["gen-far"]
        assert per(fig, "sim-head")["frames"]["shm"] > 0 and per(fig, "sim-head")["frames"]["inline"] == 0
        assert per(fig, "sim-far")["frames"]["shm"] == 0  # another host than the broker's: inline only
        assert per(fig, "gen-far")["frames"]["shm"] == 0  # the broker inlines head-host shm for it
        assert per(fig, "trainer")["frames"]["shm"] == 0
        c.wait(lambda f: per(f, "gen-head").get("frames", {}).get("shm", 0) > 0, 120,
               "the head host's generator to read the head simulator's shared memory")

        # ---- a simulator host added mid-run gets work -------------------------------------------
        c.worker("late", "simulator", "sim-late")
        fig = c.wait(lambda f: (per(f, "sim-late").get("env_steps") or 0) > 0, 300, "sim-late (a new host) to get work")
        assert per(fig, "sim-late")["host"] not in set(hosts.values())

        # ---- kill every process of one host: nothing acknowledged is lost ----------------------
        before = c.status()
        killed = c.hosts.kill_host(c.hosts.hosts["far"])
        assert len(killed) >= 3  # holder, sim-far, gen-far
        fig = c.wait(lambda f: f["workers"] == {"simulator": 2, "generator": 1, "trainer": 1}, 120,
                     "the broker to see the far host's workers gone")
        fig = c.wait(lambda f: f["trainer_version"] >= before["trainer_version"] + 2
                     and f["env_steps"] > before["env_steps"], 300, "the job to go on after the host died")
        acked = fig["acked_steps"]
        assert acked["acked"] > 0 and acked["trained"] > 0, acked
        assert acked["lost_with_trainer"] == 0 and acked["trainers_lost"] == 0, acked
        assert acked["acked"] == sum(acked[k] for k in ACKED_PARTS), acked
        assert per(fig, "sim-late")["frames"]["inline"] > 0 and per(fig, "sim-late")["frames"]["shm"] == 0
    finally:
        c.close()
    assert not c.hosts.hosts
