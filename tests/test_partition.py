"""Network partitions between hosts: a host's cable out of the switch for a few seconds, then back.

    head   (10.213.0.1)  broker, trainer, simulator sim-head, generator gen-head
    simh   (10.213.0.2)  simulator sim-far
    genh   (10.213.0.3)  generator gen-far

Each case cuts one host for ``CUT_S`` (longer than the broker's liveness, so it is declared gone):
a simulator host, a generator host, and the broker's own host (cut off from all the others).
While a worker host is cut, the rest of the job keeps stepping and training; after the heal,
every host rejoins within its reconnect back-off plus 5 s; and the ledger stays exact: every
acknowledged step has one fate, none is lost, and no step is acknowledged twice (the acked steps
never exceed the decision steps served). A reconnected simulator sends again what it has no ack
for; the broker knows those fragments (``brokers/trajectories.py`` ``resent``) and requests
(``dispatch.duplicate``) and routes neither twice.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rlvla3 import protocol as P
from rlvla3.config import load
from rlvla3.harness.jobs import SMALL_JOB, per_worker as per
from rlvla3.harness.netns import NetnsJob, unavailable

REASON = unavailable()
pytestmark = [pytest.mark.multihost, pytest.mark.timeout(900),
              pytest.mark.skipif(REASON is not None, reason=f"multihost: {REASON}")]

CUT_S = 6.0
LIVENESS = ("broker.heartbeat_s=0.5", "broker.liveness=4")
"""A peer silent for 2 s is gone: a cut of ``CUT_S`` is a real partition, not a hiccup."""
FATES = ("evaluation", "trained", "stale", "discarded", "unreadable", "lost_with_trainer", "held_by_trainers")
ALL = {"simulator": 2, "generator": 2, "trainer": 1}


def exact(fig: dict) -> dict:
    a = fig["acked_steps"]
    assert a["acked"] == sum(a[k] for k in FATES), a
    assert a["lost_with_trainer"] == 0 and a["trainers_lost"] == 0, a
    assert a["acked"] <= fig["decision_steps"], ("steps acknowledged twice", a, fig["decision_steps"])
    return a


def test_partitions_of_a_simulator_a_generator_and_the_broker_host(tmp_path: Path):
    cfg = load("synthetic.yaml", [*SMALL_JOB, *LIVENESS])
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(cfg.to_yaml())
    c = NetnsJob(tmp_path)
    try:
        c.start_broker(cfg_path)
        c.worker("head", "trainer", "trainer", "--run-dir", str(tmp_path / "run"))
        c.worker("head", "simulator", "sim-head")
        c.worker("head", "generator", "gen-head")
        c.worker("simh", "simulator", "sim-far")
        c.worker("genh", "generator", "gen-far")
        c.wait(lambda f: f["workers"] == ALL and f["trainer_version"] >= 1
               and all((per(f, n).get("env_steps") or 0) > 0 for n in ("sim-head", "sim-far")), 600,
               "all five workers to join and train")
        rejoin_bound = P.RECONNECT_MAX_S + 5.0

        for host, gone in (("simh", {"simulator": 1, "generator": 2, "trainer": 1}),
                           ("genh", {"simulator": 2, "generator": 1, "trainer": 1})):
            before = c.status()
            c.hosts.cut(c.hosts.hosts[host])
            t_cut = time.monotonic()
            fig = c.wait(lambda f: f["workers"] == gone, 30, f"the broker to see {host}'s worker gone")
            detected_s = time.monotonic() - t_cut
            # the rest of the job keeps stepping and training while the host is away
            fig = c.wait(lambda f: f["env_steps"] > before["env_steps"] + 50
                         and f["trainer_version"] > before["trainer_version"], 60, f"the job to go on without {host}")
            time.sleep(max(0.0, CUT_S - (time.monotonic() - t_cut)))  # the cut lasts CUT_S
            c.hosts.heal(c.hosts.hosts[host])
            t_heal = time.monotonic()
            fig = c.wait(lambda f: f["workers"] == ALL, rejoin_bound, f"{host} to rejoin after the heal")
            print(f"{host}: detected in {detected_s:.1f} s, rejoined {time.monotonic() - t_heal:.1f} s after the heal")
            exact(fig)

        # ---- the broker's host cut off from all the others ------------------------------------
        head = c.hosts.hosts["head"]
        far = c.status()
        far_steps = per(far, "sim-far")["env_steps"]
        # head is where the broker is; cutting it cuts it from simh and genh (the workers on head stay)
        c.hosts.cut(head)
        time.sleep(CUT_S)  # the far workers hear nothing; they keep their state and unacked data
        c.hosts.heal(head)
        t_heal = time.monotonic()
        fig = c.wait(lambda f: f["workers"] == ALL and (per(f, "sim-far").get("env_steps") or 0) > far_steps + 20,
                     rejoin_bound, "the far hosts to rejoin the broker's host and step again")
        print(f"head: far hosts back {time.monotonic() - t_heal:.1f} s after the heal")
        before = fig
        fig = c.wait(lambda f: f["trainer_version"] >= before["trainer_version"] + 2, 120, "training to go on")
        a = exact(fig)
        assert a["trained"] > 0
        print(f"re-sent fragments recognised and not routed again: {fig['traj']['duplicates']}; "
              f"re-sent requests not served again: {fig['duplicates']}")
    finally:
        c.close()
