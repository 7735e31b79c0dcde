"""A simulator re-sends an OBS whose ACT is late (``env.obs_resend_s``), and the broker serves each
request once: a request the broker refused (here: over its per-peer cap) is asked again and
served; a copy of a request that is out at a generator is dropped, not batched a second time.
(A copy of an answered request gets the same ACT again: tests/test_broker_state.py.)"""

from __future__ import annotations


import numpy as np
import zmq

from rlvla3 import protocol as P
from rlvla3.status_client import wait_until
from tests.jobs import join_as_generator, next_batch



def _answer(sock: zmq.Socket, batch: P.Message) -> None:
    n = sum(req["n"] for req in batch["requests"])
    outputs = {"actions": np.zeros((n, 1, 2), np.float32), "logprob": np.zeros((n, 1), np.float32),
               "value": np.zeros(n, np.float32)}
    sock.send_multipart(P.encode(P.RESULT, {"batch_id": batch["batch_id"], "version": 0}, outputs))


def test_a_late_act_makes_the_simulator_ask_again_and_no_request_is_served_twice(job_factory, zctx):
    job = job_factory("workers.generators=0", "workers.trainers=0", "env.slots=2", "env.num_envs=2", "env.eval_slots=0",
                      "broker.max_peer_requests=1", "env.obs_resend_s=1", start=False)
    job.start_worker("simulator", "simulator0")
    # One slot's OBS is queued; the other's is refused (over the cap): that slot now waits for an ACT.
    job.wait(lambda f: f["queue_depth"] == 1 and f["errors"] >= 1, 60, "one request queued, one refused")
    gen = join_as_generator(zctx, job.endpoint, "gen")
    try:
        held = next_batch(gen, 60.0)
        served = [(r["slot"], r["req_id"]) for r in held["requests"]]
        # Held past obs_resend_s: the held request's copy is dropped, the refused one is queued again.
        def copies_settled() -> bool:
            gen.send_multipart(P.encode(P.HEARTBEAT, {"credits": 1}))
            f = job.status()
            return f["duplicates"] >= 1 and f["queue_depth"] == 1

        wait_until(copies_settled, 30, "a copy of the held request dropped and the refused one queued again", 0.2)
        _answer(gen, held)
        while len({slot for slot, _ in served}) < 2 or len(served) < 4:
            batch = next_batch(gen, 30.0)
            served += [(r["slot"], r["req_id"]) for r in batch["requests"]]
            _answer(gen, batch)
        assert len(served) == len(set(served)), served  # nothing served twice
        fig = job.status()
        assert fig["duplicates"] >= 1 and job.broker_proc.poll() is None
        assert "obs_resent" in (job.run_dir / "simulator0.log").read_text()
    finally:
        gen.close()
