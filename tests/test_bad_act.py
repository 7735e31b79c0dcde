"""A simulator whose request is answered with a bad ACT (actions of the wrong shape) drops that
chunk, restarts the slot's episodes and asks again: the slot never hangs on a bad ACT. (A RESULT
that reports an error is retried by the broker: tests/test_broker_state.py.)"""

from __future__ import annotations

import numpy as np

from rlvla3 import protocol as P
from rlvla3.status_client import wait_until
from tests.jobs import join_as_generator, next_batch


def test_a_bad_act_restarts_the_slot_which_asks_again(job_factory, zctx):
    job = job_factory("workers.generators=0", "workers.trainers=0", "env.slots=1", "env.num_envs=2",
                      "env.eval_slots=0", start=False)
    job.start_worker("simulator", "simulator0")
    gen = join_as_generator(zctx, job.endpoint, "bad-gen")
    try:
        seen = []
        for _ in range(2):
            batch = next_batch(gen)
            [req] = batch["requests"]
            seen.append(req["req_id"])
            n = req["n"]
            outputs = {"actions": np.zeros((n, 3), np.float32),  # 2-D: no chunk axis
                       "logprob": np.zeros((n, 1), np.float32), "value": np.zeros(n, np.float32)}
            gen.send_multipart(P.encode(P.RESULT, {"batch_id": batch["batch_id"], "version": 0}, outputs))
        again = next_batch(gen)  # the slot recovered each time and asks once more
        seen.append(again["requests"][0]["req_id"])
        assert again["requests"][0]["slot"] == req["slot"] and len(set(seen)) == 3, seen
        log = (job.run_dir / "simulator0.log").read_text()
        assert log.count("act_failed_resetting_slot") == 2, log[-2000:]
        assert job.broker_proc.poll() is None
    finally:
        gen.close()


def _answer(gen, batch, replay: dict) -> None:
    [req] = batch["requests"]
    n = req["n"]
    outputs = {"actions": np.zeros((n, 1, 2), np.float32), "logprob": np.zeros((n, 1), np.float32),
               "value": np.zeros(n, np.float32), **{f"replay/{k}": v(n) for k, v in replay.items()}}
    gen.send_multipart(P.encode(P.RESULT, {"batch_id": batch["batch_id"], "version": 0}, outputs))


def test_replies_whose_tensors_change_mid_fragment_never_kill_the_simulator(job_factory, zctx):
    """A generator batch that mixed evaluation and training envs answers with both acts' replay
    keys, so one fragment's records can differ in keys: the fragment keeps those every record has.
    A reply whose replay changes shape inside a fragment loses that fragment, with an error, and
    the simulator serves on. (A RESULT without a row per env the broker refuses: brokers/dispatch.py.)"""
    job = job_factory("workers.generators=0", "workers.trainers=0", "env.slots=1", "env.num_envs=2",
                      "env.eval_slots=0", "env.fragment_len=2", start=False)
    job.start_worker("simulator", "simulator0")
    gen = join_as_generator(zctx, job.endpoint, "mixing-gen")
    one = lambda n: np.ones((n, 3), np.float32)  # noqa: E731
    try:
        _answer(gen, next_batch(gen), {"chain": one, "eval_bins": lambda n: np.zeros((n, 2), np.int64)})
        _answer(gen, next_batch(gen), {"chain": one})  # fragment_len 2: both envs ship here
        job.wait(lambda f: f["traj"]["received"] >= 2, 30, "two fragments with the keys both records have")
        _answer(gen, next_batch(gen), {"chain": one})
        _answer(gen, next_batch(gen), {"chain": lambda n: np.ones((n, 5), np.float32)})  # 3 -> 5 wide
        log = lambda: (job.run_dir / "simulator0.log").read_text()  # noqa: E731
        wait_until(lambda: log().count("fragment_unstackable") == 2, 30, "both envs' second fragment refused")
        assert job.status()["traj"]["received"] == 2
        for _ in range(2):  # it still asks, and ships the next fragments
            _answer(gen, next_batch(gen), {"chain": one})
        job.wait(lambda f: f["traj"]["received"] == 4, 30, "the third fragment of each env")
        job.assert_alive()
    finally:
        gen.close()
