"""A generator keeps the weights it has when a published version cannot be loaded (wrong
shapes, missing tensors, inf/NaN), and loads the next good one: a real generator process, a real
broker, and a hand-driven trainer peer publishing WEIGHTS."""

from __future__ import annotations

import numpy as np
import torch
import zmq

from rlvla3 import protocol as P
from tests.jobs import wait_until
from workers.model import build_policy, state_tensors


def test_generator_keeps_weights_when_a_version_fails_to_load(job_factory, zctx):
    job = job_factory(start=False)
    trainer = zctx.socket(zmq.DEALER)
    trainer.setsockopt(zmq.LINGER, 0)
    trainer.connect(job.endpoint)
    try:
        trainer.send_multipart(P.encode(P.READY, {"role": "trainer", "host": "t", "pid": 1, "name": "hand-trainer"}))
        assert trainer.poll(5000) and P.decode(trainer.recv_multipart()).type == P.READY
        good = state_tensors(build_policy(job.cfg))
        trainer.send_multipart(P.encode(P.WEIGHTS, {"version": 1}, good))
        job.start_worker("generator", "generator0")

        def gen_version():
            job.assert_alive()
            trainer.send_multipart(P.encode(P.HEARTBEAT, {}))  # stay alive in the broker's eyes
            w = job.worker(job.fig(), "generator0")
            return w["version"] if w and w["version"] is not None else None

        wait_until(lambda: gen_version() == 1, 180, "the generator to load version 1", interval=0.2)

        name = next(iter(good))
        wrong_shape = dict(good, **{name: torch.zeros(3, 1, 7)})
        missing = {k: v for k, v in good.items() if k != name}
        floats = [k for k, v in good.items() if v.is_floating_point()]
        nan = dict(good, **{floats[-1]: torch.full_like(good[floats[-1]], float("nan"))})
        for version, tensors in ((2, wrong_shape), (3, missing), (4, nan)):
            trainer.send_multipart(P.encode(P.WEIGHTS, {"version": version}, tensors))
        def rejected() -> bool:
            job.assert_alive()  # before the fix the generator died on version 2
            return (job.run_dir / "generator0.log").read_text().count("weights_rejected") >= 3

        wait_until(rejected, 60, "three rejected versions")
        assert gen_version() == 1, "the generator dropped its weights for a version it could not load"

        trainer.send_multipart(P.encode(P.WEIGHTS, {"version": 5}, {k: v + 1 for k, v in good.items()}))
        wait_until(lambda: gen_version() == 5, 60, "the generator to load the next good version")
        assert all(p.poll() is None for p in job.workers)
        assert np.isfinite(job.fig()["policy_version"])
    finally:
        trainer.close()
