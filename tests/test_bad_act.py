"""A simulator whose request is answered with a bad ACT (actions of the wrong shape) drops that
chunk, restarts the slot's episodes and asks again: the slot never hangs on a bad ACT. (A RESULT
that reports an error is retried by the broker: tests/test_broker_state.py.)"""

from __future__ import annotations

import time

import numpy as np
import zmq

from rlvla3 import names
from rlvla3 import protocol as P


def _next_batch(sock: zmq.Socket, timeout_s: float) -> P.Message:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(200):
            msg = P.decode(sock.recv_multipart())
            if msg.type == P.BATCH:
                return msg
        sock.send_multipart(P.encode(P.HEARTBEAT, {"credits": 1}))  # stay alive while waiting
    raise AssertionError(f"no BATCH within {timeout_s} s: the slot stopped asking")


def test_a_bad_act_restarts_the_slot_which_asks_again(job_factory, zctx):
    job = job_factory("workers.generators=0", "workers.trainers=0", "env.slots=1", "env.num_envs=2",
                      "env.eval_slots=0", start=False)
    job.start_worker("simulator", "simulator0")
    gen = zctx.socket(zmq.DEALER)
    gen.setsockopt(zmq.LINGER, 0)
    gen.connect(job.endpoint)
    try:
        gen.send_multipart(P.encode(P.READY, {"role": "generator", "host": "elsewhere", "pid": 1, "name": "bad-gen",
                                              "credits": 1}))
        seen = []
        for _ in range(2):
            batch = _next_batch(gen, 60.0)
            [req] = batch["requests"]
            seen.append(req["req_id"])
            n = req["n"]
            outputs = {"actions": np.zeros((n, 3), np.float32),  # 2-D: no chunk axis
                       "logprob": np.zeros((n, 1), np.float32), "value": np.zeros(n, np.float32)}
            gen.send_multipart(P.encode(P.RESULT, {"batch_id": batch["batch_id"], "version": 0},
                                        names.with_prefix(names.request_prefix(0), outputs)))
        again = _next_batch(gen, 60.0)  # the slot recovered each time and asks once more
        seen.append(again["requests"][0]["req_id"])
        assert again["requests"][0]["slot"] == req["slot"] and len(set(seen)) == 3, seen
        log = (job.run_dir / "simulator0.log").read_text()
        assert log.count("act_failed_resetting_slot") == 2, log[-2000:]
        assert job.broker_proc.poll() is None
    finally:
        gen.close()
