"""A simulator whose request is answered with a bad ACT (actions of the wrong shape) drops that
chunk, restarts the slot's episodes and asks again: the slot never hangs on a bad ACT. (A RESULT
that reports an error is retried by the broker: tests/test_broker_state.py.)"""

from __future__ import annotations

import numpy as np

from rlvla3 import protocol as P
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
