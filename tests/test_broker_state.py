"""The broker's rules on ``BrokerState`` with scripted message sequences (no sockets): dispatch,
the sync barrier, the async_rollout pause, admission, and re-queueing when a worker dies."""

from __future__ import annotations

import numpy as np
import pytest

from brokers.outgoing import Out
from rlvla3 import protocol as P
from rlvla3.config import ConfigError
from tests.brokerscript import HOST, Script, announcement, of_type, served

SIM, SIM2, GEN, GEN2, TRAINER = b"sim", b"sim2", b"gen", b"gen2", b"trainer"


def one_batch_out(*overrides: str) -> tuple[Script, Out]:
    """A simulator's request out at GEN (one credit) in a batch of its own; GEN2 joins after."""
    s = Script("batching.max_batch=2", *overrides)
    s.simulator(SIM)
    s.generator(GEN, credits=1)
    s.obs(SIM, 0)
    [batch] = of_type(s.tick(1.0), P.BATCH, GEN)
    s.generator(GEN2, credits=1)
    return s, batch


def test_dispatch_batches_on_size_or_wait_and_routes_actions_back():
    s = Script("batching.max_batch=4", "batching.max_wait_ms=5")
    s.simulator(SIM)
    s.generator(GEN, credits=1)
    s.obs(SIM, 0)
    assert of_type(s.tick(0.001), P.BATCH) == []  # 2 envs < 4 and not waited
    s.obs(SIM, 1)
    [batch] = of_type(s.tick(), P.BATCH, GEN)  # 4 envs: full
    assert served(batch) == [(0, 1), (1, 1)]
    assert set(batch.tensors) == {"r0/image", "r1/image"}
    acts = s.result(batch, version=3)
    assert [(a.to, a.fields["slot"], a.fields["req_id"], a.fields["version"]) for a in acts] == \
        [(SIM, 0, 1, 3), (SIM, 1, 1, 3)]
    assert np.frombuffer(acts[1].tensors["action"].buffer, np.float32)[0] == 1
    s.obs(SIM, 0)
    assert of_type(s.tick(0.004), P.BATCH) == []
    [late] = of_type(s.tick(0.002), P.BATCH)  # waited max_wait_ms: a batch of one request
    assert served(late) == [(0, 2)]
    assert s.state.status(s.now)["batches"] == 2


def test_a_generator_takes_no_more_batches_than_its_credits():
    s = Script("batching.max_batch=2")
    s.simulator(SIM, slots=4, num_envs=8)
    s.generator(GEN, credits=0)  # weights not loaded yet
    for slot in range(4):
        s.obs(SIM, slot)
    assert of_type(s.tick(1.0), P.BATCH) == []
    s.send(GEN, P.HEARTBEAT, {"credits": 2})
    assert len(of_type(s.tick(), P.BATCH)) == 2
    assert s.state.status(s.now)["per_worker"][1]["credits"] == 2


def test_sync_barrier_waits_for_every_live_training_slot():
    s = Script("run.mode=sync", "batching.max_batch=64", "env.slots=2", "env.eval_slots=1")
    s.simulator(SIM, slots=2)
    s.simulator(SIM2, slots=2)
    s.generator(GEN, credits=1)
    s.obs(SIM, 0)
    s.obs(SIM, 1, eval=True)  # evaluation slots are not waited for, but ride along
    assert of_type(s.tick(1.0), P.BATCH) == []  # SIM2's training slot has not asked yet
    s.obs(SIM2, 0)
    [batch] = of_type(s.tick(), P.BATCH)  # barrier reached: flushed although not full
    assert sorted(served(batch)) == [(0, 1), (0, 1), (1, 1)]
    s.obs(SIM, 0)
    s.obs(SIM2, 0)
    assert of_type(s.tick(1.0), P.BATCH) == []  # the round's batch is still out
    s.result(batch)
    assert len(of_type(s.tick(), P.BATCH)) == 1
    # A simulator that leaves is no longer waited for.
    s.obs(SIM, 0)
    s.send(SIM2, P.DISCONNECT)
    assert of_type(s.tick(), P.BATCH) == []  # the batch of the previous round is out
    s.result(of_type(s.sent, P.BATCH)[-1])
    assert len(of_type(s.tick(), P.BATCH)) == 1


def test_async_rollout_pauses_while_a_batch_waits_or_the_trainer_updates():
    s = Script("run.mode=async_rollout", "algo.batch_steps=8", "batching.max_batch=2")
    s.simulator(SIM)
    s.generator(GEN, credits=4)
    s.trainer(TRAINER)
    s.traj(SIM, 1, steps=8)
    assert s.state.training_pause
    [frag] = of_type(s.tick(), P.TRAJ, TRAINER)  # fragments still flow to the trainer
    s.obs(SIM, 0)
    assert of_type(s.tick(1.0), P.BATCH) == []  # a batch waits for the trainer: rollouts wait
    assert s.state.wait_s(s.now) == s.state.hb_s  # and the loop does not spin on the queue
    s.send(TRAINER, P.TRAJ_ACK, {"traj_ids": [frag.fields["gid"]]})
    s.send(TRAINER, P.TRAIN, {"phase": "begin", "version": 0, "steps": 8})
    assert s.state.training_pause and of_type(s.tick(1.0), P.BATCH) == []  # the trainer took it: it updates
    s.traj(SIM, 2, steps=5)  # in flight when the pause began: counts toward the next batch
    s.weights(TRAINER, 1)
    assert s.state.training_pause  # announced, but the update has not ended
    s.send(TRAINER, P.TRAIN, {"phase": "end", "version": 1})
    assert not s.state.training_pause
    assert len(of_type(s.tick(), P.BATCH)) == 1
    s.traj(SIM, 3, steps=3)  # 5 + 3: the next batch is in (counting did not restart at version 1)
    assert s.state.training_pause and s.state.status(s.now)["pacing"] == {"waiting": 8, "updating": False}
    # GRPO's trainer asks an alternating broker to go on while its groups are incomplete.
    s.send(TRAINER, P.TRAIN, {"phase": "starved", "version": 1})
    assert not s.state.training_pause
    # A trainer that leaves mid-update does not hold the rollouts for ever.
    s.traj(SIM, 4, steps=2)
    s.send(TRAINER, P.TRAIN, {"phase": "begin", "version": 1, "steps": 8})
    assert s.state.training_pause
    s.send(TRAINER, P.DISCONNECT)
    assert not s.state.training_pause


def test_async_mode_never_pauses():
    s = Script("run.mode=async", "algo.batch_steps=8")
    s.simulator(SIM)
    s.traj(SIM, 1, steps=80)
    assert not s.state.training_pause


def test_a_late_start_holds_rollouts_until_the_update_publishes_its_kth_epoch():
    """``weights.collect_after_epochs: 3`` of 4 epochs: while the update from version 2 runs,
    rollouts wait for publication 4 * 2 + 3. An update that publishes nothing between its epochs
    (a critic warm-up, a KL stop) holds them until its own weights come, and the broker counts
    it; a trainer that leaves mid-update lifts the wait. Between updates nothing waits."""
    s = Script("run.mode=async", "weights.in_flight=true", "algo.epochs=4", "weights.collect_after_epochs=3",
               "algo.batch_steps=8", "batching.max_batch=2", "broker.max_version_step=10")
    s.simulator(SIM)
    s.generator(GEN, credits=8)
    s.trainer(TRAINER)

    def served(dt: float = 0.0) -> int:
        """Batches dispatched now, each answered at once so its slot may ask again."""
        batches = of_type(s.tick(dt), P.BATCH)
        for b in batches:
            s.result(b)
        return len(batches)

    def publish(publication: int, policy: int) -> None:
        s.send(TRAINER, P.WEIGHTS, {**announcement(publication), "policy_version": policy})

    publish(8, 2)
    s.obs(SIM, 0)
    assert served() == 1  # no update runs: rollouts go on
    s.send(TRAINER, P.TRAIN, {"phase": "begin", "version": 2, "steps": 8})
    s.obs(SIM, 0)
    assert s.state.training_pause and served(0.1) == 0
    assert s.state.wait_s(s.now) == s.state.hb_s  # the loop does not spin on the held queue
    for k in (1, 2):
        publish(8 + k, 2)
        assert s.state.training_pause and served(0.1) == 0, k
    publish(11, 2)  # 3 epochs into the update
    assert not s.state.training_pause and served() == 1
    publish(12, 3)
    s.send(TRAINER, P.TRAIN, {"phase": "end", "version": 3})
    s.obs(SIM, 0)
    assert not s.state.training_pause and served() == 1
    s.send(TRAINER, P.TRAIN, {"phase": "begin", "version": 3, "steps": 8})  # the next update: wait again
    s.obs(SIM, 0)
    assert s.state.training_pause and served(0.1) == 0
    publish(16, 4)  # no in-flight publication: the update's own weights end the wait
    assert not s.state.training_pause and served() == 1
    s.send(TRAINER, P.TRAIN, {"phase": "end", "version": 4})
    s.send(TRAINER, P.TRAIN, {"phase": "begin", "version": 4, "steps": 8})
    s.obs(SIM, 1)
    assert s.state.training_pause and served(0.1) == 0
    assert s.state.status(s.now)["pacing"] == {"waiting": 0, "updating": True, "late_epochs": 3, "late_waits": 3,
                                                "late_whole": 1}
    s.send(TRAINER, P.DISCONNECT)
    assert not s.state.training_pause and served() == 1


def test_a_late_start_is_kept_and_ignored_in_the_alternating_modes():
    """One config runs in every mode: sync holds rollouts for the whole update anyway."""
    s = Script("run.mode=sync", "weights.in_flight=true", "algo.epochs=4", "weights.collect_after_epochs=3")
    assert s.state.pacing.late_epochs == 0 and "late_epochs" not in s.state.status(s.now)["pacing"]


def test_a_late_start_needs_weights_in_flight_and_one_trainer():
    for overrides in (["weights.collect_after_epochs=3"], ["weights.in_flight=true", "weights.collect_after_epochs=4"],
                      ["weights.in_flight=true", "weights.collect_after_epochs=-1"],
                      ["weights.in_flight=true", "weights.collect_after_epochs=2", "workers.trainers=2"]):
        with pytest.raises(ConfigError, match="collect_after_epochs"):
            Script("run.mode=async", "algo.epochs=4", *overrides)


def test_admission_holds_work_until_the_trainer_takes_a_batch():
    # The admission lag, not the staleness filter's bound, sizes the window.
    s = Script("run.mode=async", "algo.max_staleness=4", "algo.admission_lag=0", "algo.batch_steps=4", "batching.max_batch=2")
    s.simulator(SIM, slots=2, num_envs=4)
    s.generator(GEN, credits=4)
    s.trainer(TRAINER)
    for slot in (0, 1):
        s.obs(SIM, slot)
    assert len(of_type(s.tick(1.0), P.BATCH)) == 2  # 4 steps: the whole capacity
    for b in of_type(s.sent, P.BATCH):
        s.result(b)
    s.traj(SIM, 1, steps=4)  # a batch is finished: no floor any more
    s.obs(SIM, 0)
    assert of_type(s.tick(1.0), P.BATCH) == []
    fig = s.state.status(s.now)
    assert fig["admission_waits"] == 1 and fig["admission"]["capacity"] == 0
    assert s.state.wait_s(s.now) == s.state.hb_s
    s.send(TRAINER, P.TRAIN, {"phase": "begin", "version": 0, "steps": 4})
    s.send(TRAINER, P.TRAIN, {"phase": "end", "version": 1})
    assert len(of_type(s.tick(), P.BATCH)) == 1
    assert s.state.status(s.now)["admission"] == {"capacity": 2, "in_flight": 2, "finished": 0, "consumed": 4,
                                                  "version": 1, "lag": 0}
    # The batch's fates come back: stale steps the update took and masked (``stale_taken``) left
    # ``finished`` when it began, and freeing them again would widen the window; stale steps never
    # taken (GRPO groups pruned whole) do free it.
    s.traj(SIM, 2, steps=2)
    [first] = of_type(s.sent, P.TRAJ, TRAINER)
    s.send(TRAINER, P.TRAJ_ACK, {"traj_ids": [first.fields["gid"]], "trained": 3, "dropped_stale": 1, "stale_taken": 1})
    assert s.state.admission.finished == 2 and s.state.status(s.now)["dropped_stale"] == 1
    [second] = of_type(s.tick(), P.TRAJ, TRAINER)
    s.send(TRAINER, P.TRAJ_ACK, {"traj_ids": [second.fields["gid"]], "dropped_stale": 2})
    assert s.state.admission.finished == 0


def test_wire_headers_carry_no_admission_bookkeeping():
    s = Script("run.mode=async", "batching.max_batch=2")
    s.simulator(SIM)
    s.generator(GEN, credits=1)
    s.obs(SIM, 0)
    [batch] = of_type(s.tick(1.0), P.BATCH)
    s.result(batch, error="boom")  # failed once: re-queued
    [again] = of_type(s.tick(1.0), P.BATCH)
    assert served(again) == served(batch)
    req = s.state.dispatcher.batches[again.fields["batch_id"]].requests[0]
    assert "admitted" not in req.header and "attempts" not in req.header
    assert s.state.admission.in_flight == 2  # counted once


def test_a_request_that_keeps_failing_is_answered_with_an_error():
    s = Script("batching.max_batch=2")
    s.simulator(SIM)
    s.generator(GEN, credits=1)
    s.obs(SIM, 0)
    outs = []
    for _ in range(3):
        [batch] = of_type(s.tick(1.0), P.BATCH)
        outs = s.result(batch, error="cuda oom")
    [act] = outs
    assert act.to == SIM and act.fields["version"] == -1 and act.fields["error"] == "cuda oom"
    assert s.state.status(s.now)["requeued"] == 2 and of_type(s.tick(1.0), P.BATCH) == []


def test_a_dead_generators_batches_are_served_by_another():
    s, lost = one_batch_out("broker.heartbeat_s=1", "broker.liveness=3")
    for _ in range(3):  # GEN falls silent; SIM and GEN2 heartbeat
        s.send(SIM, P.HEARTBEAT)
        s.send(GEN2, P.HEARTBEAT)
        s.tick(1.1)
    assert GEN not in s.state.registry
    [again] = of_type(s.sent, P.BATCH, GEN2)
    assert served(again) == served(lost)
    assert s.state.status(s.now)["requeued"] == 1
    [late] = s.result(lost)  # a late answer from the dead generator: refused, nothing delivered
    assert late.type == P.ERROR and late.fields["code"] == P.E_STATE
    assert [a.fields["req_id"] for a in s.result(again)] == [1]


def test_a_broker_loop_that_was_paused_does_not_expire_peers_for_the_silence_it_did_not_watch():
    s = Script("broker.heartbeat_s=1", "broker.liveness=3")
    s.simulator(SIM)
    s.generator(GEN, credits=1)
    s.tick(0.9)
    s.tick(3.5)  # the loop paused (SIGSTOP, a starved host) past the 3 s window: heartbeats wait unread
    assert SIM in s.state.registry and GEN in s.state.registry
    for _ in range(4):  # awake again: SIM's heartbeats are read, GEN stays silent
        s.send(SIM, P.HEARTBEAT)
        s.tick(0.9)
    assert SIM in s.state.registry and GEN not in s.state.registry


def test_a_broker_loop_that_was_paused_keeps_the_batches_it_had_out():
    s, batch = one_batch_out("broker.heartbeat_s=1", "broker.liveness=60", "batching.batch_timeout_s=5")
    s.tick(8.0)  # paused past the batch's deadline: its RESULT may wait unread in the socket
    assert s.state.status(s.now)["requeued"] == 0 and of_type(s.sent, P.BATCH, GEN2) == []
    assert [a.fields["req_id"] for a in s.result(batch)] == [1]  # answered, not refused as late
    s2, _ = one_batch_out("broker.heartbeat_s=1", "broker.liveness=60", "batching.batch_timeout_s=5")
    for _ in range(6):  # the loop awake and looking: the deadline holds
        s2.tick(1.0)
    assert s2.state.status(s2.now)["requeued"] == 1


def test_a_dead_trainers_fragments_go_to_the_next_trainer():
    s = Script()
    s.simulator(SIM)
    s.trainer(TRAINER, credits=2)
    for i in range(3):
        s.traj(SIM, i, steps=4)
    assert len(of_type(s.tick(), P.TRAJ, TRAINER)) == 2  # its credits
    s.send(TRAINER, P.DISCONNECT)
    s.trainer(b"trainer2", credits=8)
    frags = of_type(s.tick(), P.TRAJ, b"trainer2")
    assert [f.fields["traj_id"] for f in frags] == [0, 1, 2]
    acks = s.send(b"trainer2", P.TRAJ_ACK, {"traj_ids": [f.fields["gid"] for f in frags]})
    assert [(a.to, a.fields["traj_ids"]) for a in acks] == [(SIM, [0, 1, 2])]


def test_a_fragment_names_its_registered_simulator_and_a_copy_the_trainer_held_is_acked_as_duplicate():
    s = Script()
    s.simulator(SIM)
    s.trainer(TRAINER)
    s.traj(SIM, 5, steps=4, writer={"host": "elsewhere", "pid": 9, "name": "sim2"})  # its own word is not taken
    [frag] = of_type(s.tick(), P.TRAJ, TRAINER)
    assert frag.fields["writer"] == {"host": HOST, "pid": 1, "name": "sim"} and frag.fields["traj_id"] == 5
    acks = s.send(TRAINER, P.TRAJ_ACK, {"traj_ids": [frag.fields["gid"]], "duplicate": 4})
    assert [(a.to, a.fields["traj_ids"]) for a in acks] == [(SIM, [5])]  # the simulator stops re-sending it
    ledger = s.state.trajs.ledger.figures()
    assert ledger["acked"] == ledger["duplicate"] == 4 and ledger["held_by_trainers"] == ledger["over_reported"] == 0


def _routed(s: Script, trainers: tuple[bytes, ...], ids: range) -> dict[bytes, list[int]]:
    for i in ids:
        s.traj(SIM, i, steps=4)
    out = s.tick()
    return {t: [f.fields["traj_id"] for f in of_type(out, P.TRAJ, t)] for t in trainers}


def test_each_fragment_goes_to_its_home_rank_at_every_broker():
    """Two ranks: a simulator's consecutive fragments take the ranks in turn, and a restarted
    broker, which the ranks rejoin in the other order (naming their ranks), sends each copy to
    the rank that took the original; a rank that is not there is waited for."""
    s = Script("workers.trainers=2")
    s.simulator(SIM)
    assert [s.trainer(t).fields["rank"] for t in (b"t0", b"t1")] == [0, 1]
    before = _routed(s, (b"t0", b"t1"), range(100, 108))
    assert sorted(before[b"t0"] + before[b"t1"]) == list(range(100, 108))
    assert len(before[b"t0"]) == 4 and all((i + 1) not in before[b"t0"] for i in before[b"t0"])  # in turn

    new = Script("workers.trainers=2")
    new.simulator(SIM)
    assert new.ready(b"t1-new", "trainer", rank=1).fields["rank"] == 1  # rank 1 back first
    waiting = _routed(new, (b"t1-new",), range(100, 108))
    assert waiting[b"t1-new"] == before[b"t1"] and len(new.state.trajs.pending) == 4  # rank 0's wait for it
    assert new.ready(b"t0-new", "trainer", rank=0).fields["rank"] == 0
    assert [f.fields["traj_id"] for f in of_type(new.tick(), P.TRAJ, b"t0-new")] == before[b"t0"]
    [refused] = new.send(b"t2", P.READY, {"role": "trainer", "host": "h", "pid": 2, "name": "t2", "rank": 1})
    assert refused.type == P.ERROR and "rank 1" in refused.fields["reason"]


def test_a_grpo_group_completes_on_one_rank():
    """GRPO, two ranks: a group's envs (neighbours with ``group_mode: parallel``, one env with
    ``sequential``) send every fragment to one rank, and the groups take the ranks in turn."""
    for mode, envs_of_group in (("parallel", [[0, 1], [2, 3]]), ("sequential", [[0], [1], [2], [3]])):
        s = Script("workers.trainers=2", "algo.name=grpo", "env.group_size=2", f"env.group_mode={mode}")
        s.simulator(SIM)
        s.trainer(b"t0"), s.trainer(b"t1")
        for i in range(8):
            s.traj(SIM, i, steps=4, env=i % 4)
        out = s.tick()
        rank_of = {f.fields["env"]: f.to for f in of_type(out, P.TRAJ) if f.fields["traj_id"] < 4}
        assert all(rank_of[f.fields["env"]] == f.to for f in of_type(out, P.TRAJ)), mode  # every episode of an env
        assert [len({rank_of[e] for e in group}) for group in envs_of_group] == [1] * len(envs_of_group), mode
        assert len(set(rank_of.values())) == 2, mode


def test_unsent_batches_and_fragments_return_to_their_queues():
    s = Script("batching.max_batch=2")
    s.simulator(SIM)
    s.generator(GEN, credits=1)
    s.trainer(TRAINER)
    s.obs(SIM, 0)
    s.traj(SIM, 7, steps=4)
    outs = [o for o in s.tick(1.0) if o.type != P.HEARTBEAT]
    for o in outs:
        s.state.unsent(o)  # the peers' queues were full
    again = [o for o in s.tick(1.0) if o.type != P.HEARTBEAT]
    assert [o.type for o in again] == [o.type for o in outs] == [P.BATCH, P.TRAJ]
    assert served(again[0]) == served(outs[0]) and again[1].fields["traj_id"] == 7


def test_messages_out_of_order_or_role_are_answered_with_errors():
    s = Script()
    [err] = s.send(SIM, P.OBS, {"slot": 0, "req_id": 1, "n": 1, "instruction": ["x"], "episode_step": [0]})
    assert (err.type, err.fields["code"]) == (P.ERROR, P.E_STATE)
    s.generator(GEN)
    [err] = s.send(GEN, P.TRAJ, {"traj_id": 1, "slot": 0, "steps": 1})
    assert err.fields["code"] == P.E_ROLE
    s.simulator(SIM)
    [err] = s.send(SIM, P.OBS, {"slot": 9, "req_id": 1, "n": 1, "instruction": ["x"], "episode_step": [0]})
    assert err.fields["code"] == P.E_FIELD and "slot 9" in err.fields["reason"]
    assert s.state.status(s.now)["errors"] == 3


def test_a_full_trainer_group_is_refused_and_status_answers_anyone():
    s = Script("workers.trainers=1")
    s.trainer(TRAINER)
    [err] = s.send(b"t2", P.READY, {"role": "trainer", "host": "h", "pid": 2})
    assert err.type == P.ERROR and "trainer group is full" in err.fields["reason"]
    [st] = s.send(b"anyone", P.STATUS)
    assert st.fields["figures"]["workers"] == {"simulator": 0, "generator": 0, "trainer": 1}


def test_a_result_is_taken_only_from_the_generator_its_batch_went_to():
    s, batch = one_batch_out()
    [err] = s.send(GEN2, P.RESULT, {"batch_id": batch.fields["batch_id"], "version": 0},
                   {"action": np.zeros((2, 4), np.float32)})
    assert err.type == P.ERROR and err.fields["code"] == P.E_STATE and "another generator" in err.fields["reason"]
    assert [a.fields["req_id"] for a in s.result(batch)] == [1]  # still out, and served once


def test_a_bug_met_by_one_message_is_answered_and_the_broker_goes_on():
    s = Script("batching.ordering=tests.orderings:explodes")
    s.simulator(SIM)
    [err] = s.send(SIM, P.OBS, {"slot": 0, "req_id": 1, "n": 1, "instruction": ["x"], "episode_step": [0]})
    assert err.type == P.ERROR and err.fields["code"] == "internal" and "RuntimeError" in err.fields["reason"]
    s.generator(GEN)  # still serving
    assert s.state.status(s.now)["errors"] == 1


def test_a_request_whose_shared_memory_cannot_be_read_is_answered_not_raised():
    s = Script("batching.max_batch=6")
    s.simulator(SIM, slots=3, num_envs=6)
    s.send(GEN, P.READY, {"role": "generator", "host": "elsewhere", "pid": 3, "credits": 1})
    fields = {"n": 2, "instruction": ["go"] * 2, "episode_step": [1, 1]}
    gone = P.ShmRef("rlvla3_run_1_9", 0, 4, "uint8", (2, 2), s.state.host)  # the worker's (pid 1), but gone
    s.send(SIM, P.OBS, {"slot": 1, "req_id": 1, **fields}, {"image": gone})
    s.obs(SIM, 2)
    outs = s.tick(1.0)
    [batch] = of_type(outs, P.BATCH)
    assert served(batch) == [(2, 1)]  # the readable one goes
    [(slot, error)] = [(a.fields["slot"], a.fields["error"]) for a in of_type(outs, P.ACT, SIM)]
    assert slot == 1 and "gone" in error


def test_a_batch_past_its_deadline_is_served_elsewhere_and_a_late_result_ignored():
    s, stuck = one_batch_out("batching.batch_timeout_s=5", "broker.heartbeat_s=100")
    assert of_type(s.tick(4.0), P.BATCH) == []  # 4 s out: not yet due
    [again] = of_type(s.tick(1.5), P.BATCH)
    assert again.to == GEN2 and served(again) == served(stuck)  # GEN keeps its credit until it answers
    assert s.result(stuck) == []  # the late answer is dropped
    assert [a.fields["req_id"] for a in s.result(again)] == [1]
    s.obs(SIM, 0)
    assert len(of_type(s.tick(1.0), P.BATCH)) == 1  # GEN answered: its credit is back


def test_weights_are_announcements_the_broker_never_holds_bytes():
    s = Script()
    s.generator(GEN, credits=0)
    s.trainer(TRAINER)
    [empty] = s.send(GEN, P.SNAPSHOT)
    assert empty.type == P.WEIGHTS and empty.fields == {"version": -1}
    [err] = s.send(TRAINER, P.WEIGHTS, {"version": 0}, {"w": np.zeros(2, np.float32)})  # inline bytes
    assert err.type == P.ERROR and err.fields["code"] == P.E_TENSOR and s.state.weights.version == -1
    [pub] = s.weights(TRAINER, 0)
    assert pub.to is None and pub.type == P.WEIGHTS  # on PUB
    assert s.weights(TRAINER, 0) == []  # not newer: ignored
    s.weights(TRAINER, 2)
    [snap] = s.send(GEN, P.SNAPSHOT)
    msg = P.decode(snap.encode())
    assert msg["version"] == 2 and msg["manifest"]["version"] == 2 and msg.tensors == {}
    [bad] = s.send(TRAINER, P.WEIGHTS, {"version": 3, "manifest": {"version": 3, "entries": []}})  # nowhere to fetch
    assert bad.type == P.ERROR and s.state.weights.version == 2


def test_a_resent_request_is_served_once_and_an_answered_one_gets_its_act_again():
    s = Script("batching.max_batch=2")
    s.simulator(SIM)
    s.generator(GEN, credits=1)
    obs = {"slot": 0, "req_id": 1, "n": 2, "instruction": ["go"] * 2, "episode_step": [1, 1], "env_steps": 2}
    image = {"image": np.zeros((2, 2, 2, 3), np.uint8)}
    assert s.send(SIM, P.OBS, obs, image) == []
    assert s.send(SIM, P.OBS, obs, image) == []  # a copy while queued: dropped
    [batch] = of_type(s.tick(1.0), P.BATCH, GEN)
    assert s.send(SIM, P.OBS, obs, image) == []  # a copy while at the generator: dropped
    assert of_type(s.tick(1.0), P.BATCH) == []
    [act] = s.result(batch)
    again = s.send(SIM, P.OBS, obs, image)  # its ACT was lost: the same ACT again, no new batch
    assert again == [act] and of_type(s.tick(1.0), P.BATCH) == []
    assert s.send(SIM, P.OBS, dict(obs, req_id=0), image) == []  # an older request: dropped
    fig = s.state.status(s.now)
    assert fig["duplicates"] == 4 and fig["requests"] == 1 and fig["env_steps"] == 2


def _two_simulators_one_batch(max_batch: int) -> tuple[Script, Out]:
    """Two simulators' first requests, batched for one generator with one credit."""
    s = Script(f"batching.max_batch={max_batch}")
    s.simulator(SIM)
    s.simulator(SIM2)
    s.generator(GEN, credits=1)
    s.obs(SIM, 0)
    s.obs(SIM2, 0)
    [batch] = of_type(s.tick(1.0), P.BATCH, GEN)
    return s, batch


def test_a_stacked_result_is_sliced_into_each_requests_rows():
    # RESULT carries the batch's outputs stacked, the served requests' envs in batch order; a
    # request the generator could not read has no rows. Each ACT gets exactly its own rows.
    s = Script("batching.max_batch=8")
    s.simulator(SIM, slots=4, num_envs=8)
    s.generator(GEN, credits=1)
    for slot, n in enumerate((1, 3, 2, 2)):
        s.obs(SIM, slot, n=n)
    [batch] = of_type(s.tick(1.0), P.BATCH, GEN)
    assert [r["n"] for r in batch.fields["requests"]] == [1, 3, 2, 2]
    rows = np.arange(1 + 2 + 2, dtype=np.float32)  # request 1 (3 envs) dropped: 5 rows
    outs = s.send(GEN, P.RESULT, {"batch_id": batch.fields["batch_id"], "version": 0, "dropped": [1]},
                  {"action": np.stack([rows, -rows], axis=1), "value": rows})
    acts = {a.fields["slot"]: a for a in of_type(outs, P.ACT)}
    assert "error" in acts[1].fields and not acts[1].tensors
    got = {slot: P.inline_array(P.decode(a.encode()).tensors["action"]) for slot, a in acts.items() if slot != 1}
    assert {slot: a.tolist() for slot, a in got.items()} == {
        0: [[0, 0]], 2: [[1, -1], [2, -2]], 3: [[3, -3], [4, -4]]}
    assert P.inline_array(P.decode(acts[3].encode()).tensors["value"]).tolist() == [3, 4]


def test_a_result_without_a_row_per_served_env_is_refused_and_its_batch_served_again():
    s, batch = _two_simulators_one_batch(max_batch=4)
    outs = s.send(GEN, P.RESULT, {"batch_id": batch.fields["batch_id"], "version": 0},
                  {"action": np.zeros((3, 4), np.float32)})  # 4 envs served, 3 rows
    [err] = outs
    assert err.type == P.ERROR and err.to == GEN and err.fields["code"] == P.E_TENSOR and "(4)" in err.fields["reason"]
    again = of_type(s.tick(1.0), P.BATCH, GEN)  # each alone now: a bad one fails alone
    assert [served(b) for b in again] == [served(batch)[:1]]
    assert [a.to for a in s.result(again[0])] == [SIM]
    [last] = of_type(s.tick(1.0), P.BATCH, GEN)
    assert served(last) == served(batch)[1:] and [a.to for a in s.result(last)] == [SIM2]


def test_a_request_the_generator_cannot_read_fails_alone_and_a_gone_simulators_is_never_requeued():
    s, batch = _two_simulators_one_batch(max_batch=4)
    first, second = batch.fields["requests"]
    outs = s.send(GEN, P.RESULT, {"batch_id": batch.fields["batch_id"], "version": 0, "dropped": [0]},
                  {"action": np.zeros((2, 4), np.float32)})
    by_sim = {o.to: o for o in of_type(outs, P.ACT)}
    assert "could not read" in by_sim[SIM].fields["error"] and by_sim[SIM].fields["req_id"] == first["req_id"]
    assert "error" not in by_sim[SIM2].fields and set(by_sim[SIM2].tensors) == {"action"}
    assert s.state.status(s.now)["requests_unreadable"] == 1
    # A batch holding a request of a simulator that left fails: only the live one goes back.
    s.obs(SIM, 0)
    s.obs(SIM2, 0)
    [batch] = of_type(s.tick(1.0), P.BATCH, GEN)
    s.send(SIM, P.DISCONNECT)
    s.result(batch, error="boom")
    assert [r.sim for _, r in s.state.dispatcher.queue.ordered()] == [SIM2]


def test_a_failed_batch_is_retried_request_by_request():
    s, batch = _two_simulators_one_batch(max_batch=8)
    assert len(batch.fields["requests"]) == 2
    s.result(batch, error="nan in the forward pass")
    s.obs(SIM, 1)  # a fresh request never shares a batch with a retried one
    rounds = []
    for _ in range(3):
        [b] = of_type(s.tick(1.0), P.BATCH)
        rounds.append((b.to, served(b)))
        s.result(b)
    assert [r for _, r in rounds] == [[(0, 1)], [(0, 1)], [(1, 1)]]
    assert {to for to, _ in rounds} == {GEN} and s.state.status(s.now)["requeued"] == 2
