"""A trainer checks every fragment against the shapes its own policy acts in: a training
fragment from a simulator (buggy or hostile) whose tensors would not stack with a batch is
unreadable, counted and acknowledged, and the trainer trains on with the rest; an evaluation
fragment's frames are checked before the metrics thread films them."""

from __future__ import annotations

import numpy as np
import torch

from rlvla3 import protocol as P
from rlvla3.config import load
from rlvla3.harness.jobs import SMALL_JOB
from rlvla3.harness.peer import Peer
from rlvla3.observation import Observation
from rlvla3.status_client import wait_until
from workers.model import build_policy

OVERRIDES = ("workers.generators=0", "workers.simulators=0", "algo.batch_steps=16", "algo.minibatch_size=8")


def _fragment(policy, n: int, seed: int) -> dict[str, np.ndarray]:
    """n decisions of the job's own policy, as a simulator ships them (n + 1 observations)."""
    spec, rng = policy.spec, np.random.default_rng(seed)
    images = {c: rng.integers(0, 255, (n + 1, h, w, 3), dtype=np.uint8) for c, (h, w) in spec.cameras.items()}
    state = rng.standard_normal((n + 1, spec.state_dim)).astype(np.float32)
    with torch.no_grad():
        out = policy.act(Observation({c: v[:n] for c, v in images.items()}, state[:n], ["reach"] * n))
    return {**{f"obs/images/{c}": v for c, v in images.items()}, "obs/state": state,
            "actions": out.actions.numpy(), "logprob": out.logprob.numpy(), "value": out.value.numpy(),
            "reward": rng.standard_normal(n).astype(np.float32), "steps": np.full(n, policy.chunk_size, np.int32),
            "terminated": np.zeros(n, bool), "truncated": np.zeros(n, bool), "version": np.zeros(n, np.int64),
            **{f"replay/{k}": v.numpy() for k, v in out.replay.items()}}


def test_a_fragment_that_would_not_stack_is_unreadable_and_the_trainer_trains_on(job_factory, zctx):
    job = job_factory(*OVERRIDES)
    job.wait(lambda f: f["workers"]["trainer"] == 1, 120, "the trainer")
    policy = build_policy(load("synthetic.yaml", [*SMALL_JOB, *OVERRIDES]))
    sim = Peer(zctx, job.endpoint, "simulator", "hand-sim", host="elsewhere", pid=1, slots=1, num_envs=1)
    try:
        sim.expect(P.READY)
        header = {"instruction": "reach", "env": 0, "seed": 0, "done": False, "slot": 0}
        bad = _fragment(policy, 8, 0)
        bad["actions"] = np.concatenate([bad["actions"], bad["actions"]], axis=1)  # twice the chunk
        sim.send(P.TRAJ, {**header, "episode": 0, "steps": 8, "traj_id": 1}, bad)
        job.wait(lambda f: f["acked_steps"]["unreadable"] == 8, 60, "the bad fragment counted unreadable")
        assert "traj_unreadable" in (job.run_dir / "trainer0.log").read_text()
        for i in range(2):  # a batch of 16 good steps: the trainer is alive and trains on them
            sim.send(P.TRAJ, {**header, "episode": 1 + i, "steps": 8, "traj_id": 2 + i}, _fragment(policy, 8, 1 + i))
        fig = job.wait(lambda f: f["policy_version"] >= 1, 120, "an update on the good fragments")
        assert fig["acked_steps"]["trained"] == 16 and fig["acked_steps"]["unreadable"] == 8
        job.assert_alive()
    finally:
        sim.sock.close()


def test_an_evaluation_fragment_is_checked_before_it_is_filmed(job_factory, zctx):
    """Evaluation fragments are tallied and filmed on the trainer's metrics thread, where a frame
    that is not uint8 would fail the GIF encoder, and a camera of another height the join of the
    cameras: the thread would end, and with it every later metrics row and film. The trainer
    films the spec's cameras only, and a fragment whose frames differ from the spec is unreadable."""
    job = job_factory(*OVERRIDES)
    job.wait(lambda f: f["workers"]["trainer"] == 1, 120, "the trainer")
    policy = build_policy(load("synthetic.yaml", [*SMALL_JOB, *OVERRIDES]))
    sim = Peer(zctx, job.endpoint, "simulator", "hand-sim", host="elsewhere", pid=1, slots=1, num_envs=1)
    videos, log = job.run_dir / "videos", job.run_dir / "trainer0.log"
    try:
        sim.expect(P.READY)
        header = {"instruction": "reach", "env": 0, "seed": 0, "done": True, "slot": 0, "eval": True,
                  "episode_success": True}
        floats = _fragment(policy, 8, 0)
        floats["obs/images/top"] = floats["obs/images/top"].astype(np.float32)
        sim.send(P.TRAJ, {**header, "episode": 0, "steps": 8, "traj_id": 1, "eval_version": 0}, floats)
        wait_until(lambda: "dtype float32" in log.read_text(), 60, "the float frames counted unreadable")
        extra = _fragment(policy, 8, 1)
        extra["obs/images/zz"] = np.zeros((9, 5, 8, 3), np.uint8)  # a camera the spec lacks, of another height
        sim.send(P.TRAJ, {**header, "episode": 1, "steps": 8, "traj_id": 2, "eval_version": 1}, extra)
        wait_until(lambda: (videos / "eval_v00001_env0_success.gif").is_file(), 60, "the film of the spec's camera")
        header = {**header, "eval": False, "done": False}
        for i in range(2):  # the metrics thread still writes: an update's row reaches the JSONL
            sim.send(P.TRAJ, {**header, "episode": 2 + i, "steps": 8, "traj_id": 3 + i}, _fragment(policy, 8, 2 + i))
        job.wait(lambda f: f["policy_version"] >= 1, 120, "an update on the training fragments")
        metrics = job.run_dir / "trainer_metrics.jsonl"
        wait_until(lambda: metrics.is_file() and '"version": 1' in metrics.read_text(), 60, "the update's metrics row")
        assert not (videos / "eval_v00000_env0_success.gif").exists()
        job.assert_alive()
    finally:
        sim.sock.close()
