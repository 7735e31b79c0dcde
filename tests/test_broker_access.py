"""Who may do what at the broker, on ``BrokerState`` with scripted messages: roles bound to CURVE
key names, WEIGHTS only from rank 0 in bounded steps with rank 0's own store, trainers' version
reports bounded, acks only from the trainer a fragment went to, shared memory only the sender's own, a
reconnecting worker takes back its place, per-peer caps, counters rebuilt after a restart, and
a rejection flood that logs a bounded number of lines."""

from __future__ import annotations

import numpy as np
import pytest
from structlog.testing import capture_logs

from brokers.holdings import BLOCK_BYTES
from rlvla3 import protocol as P
from tests.brokerscript import HOST, Script, announcement, of_type

SIM, GEN, T0, T1, EVE = b"sim", b"gen", b"t0", b"t1", b"eve"


def ready(s: Script, who: bytes, role: str, key: str | None = None, pid: int = 1, name: str | None = None, **fields):
    return s.send(who, P.READY, {"role": role, "host": HOST, "pid": pid, "name": name or who.decode(), **fields}, key=key)


def code(outs) -> str | None:
    errors = of_type(outs, P.ERROR)
    return errors[-1].fields["code"] if errors else None


def test_with_curve_a_role_needs_a_key_named_for_it_and_every_message_the_key_it_joined_with():
    s = Script("broker.keys_dir=/keys", "workers.trainers=1")
    assert code(ready(s, EVE, "trainer", key="simulator")) == P.E_AUTH
    assert code(ready(s, EVE, "simulator", key="client")) == P.E_AUTH
    assert of_type(s.send(EVE, P.STATUS, key="client"), P.STATUS)  # any allowlisted key may ask STATUS
    assert of_type(ready(s, T0, "trainer", key="trainer-a"), P.READY)
    # Another key using the trainer's ROUTER identity is refused, whatever it sends.
    assert code(s.send(T0, P.WEIGHTS, announcement(1), key="simulator")) == P.E_AUTH
    assert code(ready(s, T0, "trainer", key="simulator")) == P.E_AUTH
    assert s.state.weights.version == -1
    assert of_type(s.send(T0, P.WEIGHTS, announcement(1), key="trainer-a"), P.WEIGHTS)


def test_weights_only_from_rank_0_in_bounded_steps_and_with_the_same_model():
    s = Script("workers.trainers=2", "broker.max_version_step=10")
    s.trainer(T0)
    s.trainer(T1)
    assert code(s.send(T1, P.WEIGHTS, announcement(1))) == P.E_ROLE
    assert code(s.send(T0, P.WEIGHTS, announcement(2**50))) == P.E_VERSION
    assert of_type(s.send(T0, P.WEIGHTS, announcement(5)), P.WEIGHTS)
    assert code(s.send(T0, P.WEIGHTS, announcement(16))) == P.E_VERSION  # 5 + 10 is the most
    assert code(s.send(T0, P.WEIGHTS, announcement(6, shape=(3, 2)))) == P.E_FIELD
    assert of_type(s.send(T0, P.WEIGHTS, announcement(15)), P.WEIGHTS)
    assert s.state.weights.version == 15


def test_in_flight_publications_stay_in_their_policy_versions_span():
    """``weights.in_flight`` with 4 epochs: publication 4v + k acts as policy version v. The
    broker's version (what admission, sync batches and restarted trainers read) is the policy
    version; a publication outside its span, or one acting as an older version, is refused."""
    s = Script("weights.in_flight=true", "algo.epochs=4", "broker.max_version_step=10")
    s.trainer(T0)
    assert of_type(s.send(T0, P.WEIGHTS, {**announcement(8), "policy_version": 2}), P.WEIGHTS)  # version 2 itself
    assert s.state.weights.version == 2
    assert of_type(s.send(T0, P.WEIGHTS, {**announcement(9), "policy_version": 2}), P.WEIGHTS)  # 1 epoch into v2's update
    assert s.state.weights.version == 2 and s.state.weights.latest.version == 9
    assert code(s.send(T0, P.WEIGHTS, {**announcement(2**50), "policy_version": 2})) == P.E_FIELD  # outside v2's span
    assert code(s.send(T0, P.WEIGHTS, {**announcement(2**50), "policy_version": 2**48})) == P.E_VERSION  # too far ahead
    assert code(s.send(T0, P.WEIGHTS, announcement(11))) == P.E_FIELD  # 11 is 3 epochs into v2, not v11
    assert of_type(s.send(T0, P.WEIGHTS, {**announcement(12), "policy_version": 3}), P.WEIGHTS)
    assert s.state.weights.version == 3
    for v in range(13, 2000, 10):  # far past max_version_step in publications, in steps of 10 versions
        assert of_type(s.send(T0, P.WEIGHTS, {**announcement(4 * v + 3), "policy_version": v}), P.WEIGHTS)
    assert s.state.weights.version == 1993 and s.state.weights.latest.version == 7975


def test_without_in_flight_a_publication_is_its_policy_version():
    s = Script("workers.trainers=1")
    s.trainer(T0)
    assert code(s.send(T0, P.WEIGHTS, {**announcement(5), "policy_version": 4})) == P.E_FIELD
    assert of_type(s.send(T0, P.WEIGHTS, {**announcement(5), "policy_version": 5}), P.WEIGHTS)
    assert s.state.weights.version == 5


def test_trainer_version_reports_move_in_bounded_steps_once_a_version_is_announced():
    s = Script("workers.trainers=2", "broker.max_version_step=10")
    s.trainer(T0)
    # A fresh broker knows no version: a resumed trainer's TRAIN (far ahead) comes before its WEIGHTS.
    assert s.send(T0, P.TRAIN, {"phase": "end", "version": 5000}) == []
    assert of_type(s.send(T0, P.WEIGHTS, announcement(5000)), P.WEIGHTS)
    with pytest.raises(P.ProtocolError, match="version"):  # past any id (2^53): refused by decode
        P.decode(P.encode(P.TRAIN, {"phase": "end", "version": 2**62}))
    assert code(s.send(T0, P.TRAIN, {"phase": "begin", "version": 2**50})) == P.E_VERSION
    assert code(ready(s, T1, "trainer", pid=2, info={"version": 6000})) == P.E_VERSION
    assert s.state.trainer_version == 5000 and s.state.status(s.now)["workers"]["trainer"] == 1
    assert s.send(T0, P.TRAIN, {"phase": "end", "version": 5010}) == []  # 5000 + 10 is the most
    assert of_type(ready(s, T1, "trainer", pid=2, info={"version": 5010}), P.READY)
    assert s.state.trainer_version == 5010


def test_a_weight_store_must_be_rank_0s_own_segment():
    s = Script("workers.trainers=1")
    s.trainer(T0)  # pid 1 on HOST
    for seg, host in (("rlvla3_run_2_w1", HOST), ("rlvla3_run_1_w1", "elsewhere"), ("rlvla3_run_1_3", HOST)):
        ann = dict(announcement(1), store={"host": host, "seg": seg, "size": 1 << 20})
        assert code(s.send(T0, P.WEIGHTS, ann)) == P.E_AUTH, seg
    assert s.state.weights.version == -1
    ann = dict(announcement(1), store={"host": HOST, "seg": "rlvla3_run_1_w1", "size": 1 << 20})
    assert of_type(s.send(T0, P.WEIGHTS, ann), P.WEIGHTS)


def test_a_trainer_acks_only_the_fragments_it_was_sent():
    s = Script("workers.trainers=2")
    s.simulator(SIM)
    s.trainer(T0, credits=1)
    s.trainer(T1, credits=1)
    s.traj(SIM, 1, steps=4)
    [sent] = of_type(s.tick(), P.TRAJ)
    other = T1 if sent.to == T0 else T0
    assert code(s.send(other, P.TRAJ_ACK, {"traj_ids": [sent.fields["gid"]], "trained": 4})) == P.E_AUTH
    assert s.state.trajs.ledger.figures()["acked"] == 0 and sent.fields["gid"] in s.state.trajs.out
    acks = s.send(sent.to, P.TRAJ_ACK, {"traj_ids": [sent.fields["gid"]]})
    assert [o.fields["traj_ids"] for o in of_type(acks, P.TRAJ_ACK, SIM)] == [[1]]
    assert s.state.trajs.ledger.figures()["acked"] == 4


def test_a_peer_may_name_only_its_own_shared_memory():
    s = Script()
    s.simulator(SIM)  # pid 1 on HOST
    fields = {"slot": 0, "req_id": 1, "n": 2, "instruction": ["go"] * 2, "episode_step": [1, 1]}
    for seg, host in (("rlvla3_run_77_1", HOST), ("rlvla3_run_1_1", "elsewhere"), ("rlvla3_other", HOST)):
        ref = P.ShmRef(seg, 0, 4, "uint8", (2, 2), host)
        assert code(s.send(SIM, P.OBS, fields, {"image": ref})) == P.E_AUTH, seg
    assert s.send(SIM, P.OBS, fields, {"image": P.ShmRef("rlvla3_run_1_1", 0, 4, "uint8", (2, 2), HOST)}) == []


def test_a_reconnecting_worker_takes_back_its_rank_and_nobody_else_can():
    s = Script("workers.trainers=1")
    assert ready(s, T0, "trainer", pid=7, name="trainer-7")[-1].fields["rank"] == 0
    # Another process cannot have rank 0 while the first holds it ...
    assert code(ready(s, EVE, "trainer", pid=8, name="trainer-7")) == P.E_STATE
    # ... the same one on a new socket (same name, host, pid) takes it back.
    assert ready(s, T1, "trainer", pid=7, name="trainer-7")[-1].fields["rank"] == 0
    assert [w.identity for w in s.state.registry] == [T1]
    # A simulator whose first READY went unanswered READYs again on a new socket: registered once.
    ready(s, b"sim-a", "simulator", pid=9, name="sim-9", slots=2, num_envs=4)
    ready(s, b"sim-b", "simulator", pid=9, name="sim-9", slots=2, num_envs=4)
    assert s.state.status(s.now)["workers"] == {"simulator": 1, "generator": 0, "trainer": 1}


def test_with_curve_the_same_worker_with_another_key_takes_nothing_back():
    s = Script("broker.keys_dir=/keys", "workers.trainers=1")
    ready(s, T0, "trainer", key="trainer0", pid=7, name="t")
    assert code(ready(s, T1, "trainer", key="trainer1", pid=7, name="t")) == P.E_STATE  # group full
    assert [w.identity for w in s.state.registry] == [T0]


def test_a_request_no_admission_window_holds_is_refused_on_arrival():
    s = Script("run.mode=async", "algo.max_staleness=0", "algo.batch_steps=4", "batching.max_batch=2")
    s.simulator(SIM, slots=1, num_envs=8)
    s.generator(GEN)
    outs = s.send(SIM, P.OBS, {"slot": 0, "req_id": 1, "n": 5, "instruction": ["go"] * 5, "episode_step": [1] * 5},
                  {"image": np.zeros((5, 2), np.uint8)})
    assert code(outs) == P.E_LIMIT and "admission window" in of_type(outs, P.ERROR)[0].fields["reason"]
    assert len(s.state.dispatcher.queue) == 0
    assert of_type(s.tick(1.0), P.BATCH) == [] and s.state.wait_s(s.now) > 0  # nothing to spin on


def test_per_peer_caps_on_requests_trajectories_and_bytes():
    s = Script("broker.max_peer_requests=2", "broker.max_peer_trajs=1", "broker.max_peer_bytes=100")
    s.simulator(SIM, slots=4, num_envs=8)
    s.obs(SIM, 0)
    s.obs(SIM, 1)  # no generator: both stay queued
    outs = s.send(SIM, P.OBS, {"slot": 2, "req_id": 1, "n": 2, "instruction": ["go"] * 2, "episode_step": [1, 1]},
                  {"image": np.zeros((2, 2), np.uint8)})
    assert code(outs) == P.E_LIMIT and "max_peer_requests" in of_type(outs, P.ERROR)[0].fields["reason"]
    assert s.traj(SIM, 1, steps=4) == []  # no trainer: it waits
    assert code(s.traj(SIM, 2, steps=4)) == P.E_LIMIT
    s.trainer(T0)
    assert of_type(s.tick(), P.TRAJ)  # fragment 1 goes to the trainer: the simulator's queue is empty again
    assert not of_type(s.traj(SIM, 3, steps=4), P.ERROR)
    s2 = Script("broker.max_peer_bytes=100")
    s2.simulator(SIM)
    big = s2.send(SIM, P.TRAJ, {"traj_id": 1, "slot": 0, "steps": 1}, {"reward": np.zeros(101, np.uint8)})
    assert code(big) == P.E_LIMIT and "max_peer_bytes" in of_type(big, P.ERROR)[0].fields["reason"]


def test_counters_are_rebuilt_from_the_workers_after_a_restart_and_never_counted_twice():
    s = Script()  # a fresh broker meets a running job
    ready(s, SIM, "simulator", pid=3, name="sim-3", slots=2, num_envs=4, info={"env_steps": 500})
    ready(s, T0, "trainer", pid=4, name="tr", credits=8, info={"version": 7})
    fig = s.state.status(s.now)
    assert fig["env_steps"] == 500 and fig["trainer_version"] == 7
    s.obs(SIM, 0, env_steps=20)
    assert s.state.status(s.now)["env_steps"] == 520
    # The same simulator on a new socket reports its total: nothing is counted twice.
    ready(s, b"sim-again", "simulator", pid=3, name="sim-3", slots=2, num_envs=4, info={"env_steps": 530})
    assert s.state.status(s.now)["env_steps"] == 530
    # WEIGHTS is bounded from the trainer's version, not from the empty snapshot.
    assert of_type(s.send(T0, P.WEIGHTS, announcement(8)), P.WEIGHTS)


def test_a_rejection_flood_logs_a_bounded_number_of_lines():
    s = Script("broker.reject_log_per_s=5")
    with capture_logs() as logs:
        for i in range(1000):
            s.now = i * 0.002  # 2 s of flood
            s.send(EVE, P.OBS, {"slot": 0, "req_id": 1, "n": 1, "instruction": ["x"], "episode_step": [0]})
        s.now = 3.0
        s.send(EVE, P.SNAPSHOT)
    rejected = [e for e in logs if e["event"] == "message_rejected"]
    summaries = [e for e in logs if e["event"] == "message_rejections_suppressed"]
    assert len(rejected) == 5 * 2 + 1  # two seconds of flood, then one in a fresh second
    assert sum(e["count"] for e in summaries) + len(rejected) == 1001
    assert s.state.status(s.now)["errors"] == 1001  # every one is still counted and answered


def test_a_slot_block_is_named_only_after_its_own_simulator_sent_it_and_stays_within_its_bounds():
    """An OBS with ``block`` and shared-memory tensors keeps them under that number; later OBS name
    the number alone and are served with those tensors. Unknown numbers, another simulator's
    numbers, inline bytes as a block and more than two blocks per slot are refused."""
    s = Script()
    s.simulator(SIM, slots=2)  # pid 1 on HOST
    s.simulator(EVE, slots=2)
    s.generator(b"gen", credits=4)
    fields = {"slot": 0, "n": 2, "instruction": ["go"] * 2, "episode_step": [1, 1]}
    ref = P.ShmRef("rlvla3_run_1_1", 64, 4, "uint8", (2, 2), HOST)
    assert code(s.send(SIM, P.OBS, {**fields, "req_id": 1, "block": 3})) == P.E_STATE  # never sent
    assert code(s.send(SIM, P.OBS, {**fields, "req_id": 1, "block": 3}, {"image": np.zeros((2, 2), np.uint8)})) == P.E_TENSOR
    assert s.send(SIM, P.OBS, {**fields, "req_id": 1, "block": 3}, {"image": ref}) == []
    assert code(s.send(EVE, P.OBS, {**fields, "req_id": 1, "block": 3})) == P.E_STATE  # SIM's, not EVE's
    batch = of_type(s.tick(1.0), P.BATCH)[0]
    s.result(batch)
    assert s.send(SIM, P.OBS, {**fields, "req_id": 2, "block": 3}) == []  # the number alone
    batch = of_type(s.tick(1.0), P.BATCH)[0]
    assert batch.tensors == {"r0/image": ref}
    for block in (0, 1, 2):  # two slots: four blocks at most
        s.send(SIM, P.OBS, {**fields, "slot": 1, "req_id": 10 + block, "block": block}, {"image": ref})
    assert code(s.send(SIM, P.OBS, {**fields, "slot": 1, "req_id": 20, "block": 4}, {"image": ref})) == P.E_LIMIT
    assert sorted(s.state.registry.get(SIM).blocks) == [0, 1, 2, 3] and not s.state.registry.get(EVE).blocks


def test_slot_blocks_count_against_the_peers_byte_cap():
    """A simulator that claims many slots cannot grow the broker's block table past its
    ``broker.max_peer_bytes`` (each block counts ``BLOCK_BYTES``)."""
    s = Script(f"broker.max_peer_bytes={3 * BLOCK_BYTES}", "broker.max_peer_requests=100")
    s.simulator(SIM, slots=60000)
    ref = P.ShmRef("rlvla3_run_1_1", 64, 4, "uint8", (2, 2), HOST)
    codes = [code(s.send(SIM, P.OBS, {"slot": b, "req_id": 1, "n": 2, "instruction": ["go"] * 2,
                                      "episode_step": [1, 1], "block": b}, {"image": ref})) for b in range(5)]
    assert codes == [None, None, None, P.E_LIMIT, P.E_LIMIT]
    assert len(s.state.registry.get(SIM).blocks) == 3
