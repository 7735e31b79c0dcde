"""A generator keeps the weights it has when an announced version cannot be loaded (inf/NaN),
and loads the next good one; the broker refuses a WEIGHTS that carries tensors, and one whose
manifest lists other tensors than the model's first (another shape, a missing tensor). A real generator process and a real broker; the test plays trainer
rank 0 with the production publisher (a shared-memory weight store per model) over a DEALER."""

from __future__ import annotations

import re
import uuid

import numpy as np
import torch
import zmq

from rlvla3 import protocol as P
from rlvla3.harness.jobs import per_worker
from rlvla3.harness.peer import Peer
from rlvla3.status_client import wait_until
from rlvla3.weights.publisher import WeightPublisher
from workers.model import build_policy


def _set(model: torch.nn.Module, name: str, value: torch.nn.Parameter | None) -> torch.nn.Module:
    prefix, _, leaf = name.rpartition(".")
    (model.get_submodule(prefix) if prefix else model).register_parameter(leaf, value)
    return model


def _reply(sock: zmq.Socket) -> P.Message:
    """The broker's next message that is not a heartbeat."""
    while True:
        assert sock.poll(5000), "no reply from the broker"
        msg = P.decode(sock.recv_multipart())
        if msg.type != P.HEARTBEAT:
            return msg


def test_generator_keeps_weights_when_a_version_fails_to_load(job_factory, zctx):
    job = job_factory(start=False)
    # This process is rank 0: the stores it announces are its own (host, pid), as the broker checks.
    hand = Peer(zctx, job.endpoint, "trainer", "hand-trainer")
    trainer = hand.sock
    publishers: list[WeightPublisher] = []

    def publisher(model: torch.nn.Module) -> WeightPublisher:
        publishers.append(WeightPublisher(model, uuid.uuid4().hex[:8], stream_bind=""))
        return publishers[-1]

    try:
        hand.expect(P.READY, 5)
        # The broker takes announcements only: a WEIGHTS with the bytes inline is an ERROR.
        good_model = build_policy(job.cfg)
        trainer.send_multipart(P.encode(P.WEIGHTS, {"version": 1}, {k: v.detach() for k, v in good_model.state_dict().items()}))
        assert trainer.poll(5000)
        err = P.decode(trainer.recv_multipart())
        assert err.type == P.ERROR and err["code"] == P.E_TENSOR and err["ref_type"] == P.WEIGHTS

        good = publisher(good_model)
        trainer.send_multipart(P.encode(P.WEIGHTS, good.publish(1)))
        job.start_worker("generator", "generator0")

        def gen_version():
            job.assert_alive()
            trainer.send_multipart(P.encode(P.HEARTBEAT, {}))  # stay alive in the broker's eyes
            w = per_worker(job.status(), "generator0")
            return w["version"] if w and w["version"] is not None else None

        wait_until(lambda: gen_version() == 1, 180, "the generator to load version 1", interval=0.2)

        name, param = next((n, p) for n, p in good_model.named_parameters() if p.dim() >= 1)
        wrong_shape = _set(build_policy(job.cfg), name, torch.nn.Parameter(torch.zeros(3, 1, 7)))
        missing = _set(build_policy(job.cfg), name, None)
        nan = build_policy(job.cfg)
        with torch.no_grad():
            list(nan.parameters())[-1].fill_(float("nan"))
        for version, model in ((2, wrong_shape), (3, missing)):  # not this model: the broker refuses
            trainer.send_multipart(P.encode(P.WEIGHTS, publisher(model).publish(version)))
            err = _reply(trainer)
            assert err.type == P.ERROR and err["code"] == P.E_FIELD and err["ref_type"] == P.WEIGHTS, err.header
        trainer.send_multipart(P.encode(P.WEIGHTS, publisher(nan).publish(4)))  # fits, but NaN: the generator refuses

        def rejected() -> bool:
            job.assert_alive()  # a version that cannot be loaded must not kill the generator
            return "weights_rejected" in (job.run_dir / "generator0.log").read_text()

        wait_until(rejected, 60, "the NaN version rejected")
        assert "inf or NaN" in (job.run_dir / "generator0.log").read_text()
        assert gen_version() == 1, "the generator dropped its weights for a version it could not load"

        with torch.no_grad():
            for p in good_model.parameters():
                p.add_(1)
        trainer.send_multipart(P.encode(P.WEIGHTS, good.publish(5)))
        wait_until(lambda: gen_version() == 5, 60, "the generator to load the next good version")
        assert all(p.poll() is None for p in job.workers)
        assert np.isfinite(job.status()["policy_version"])
    finally:
        trainer.close()
        for pub in publishers:
            pub.close()


def test_in_flight_weights_are_served_between_versions_and_act_as_the_version_they_left(job_factory):
    """``weights.in_flight`` in a real async job (4 epochs): trainer rank 0 also publishes between
    epochs, as publication 4v + k acting as version v. The generator swaps such weights in (the
    update's 0.4 s pad keeps the last of them newest for a while) and tags its results with v,
    so the trainer takes every fragment they acted (none is 'ahead' of it) and keeps training."""
    job = job_factory("weights.in_flight=true", "algo.epochs=4", "train.min_update_s=0.4")
    job.wait(lambda f: f["trainer_version"] >= 5, 180, "five updates with weights published in flight")
    job.stop()
    lines = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in (job.run_dir / "generator0.log").read_text().splitlines()
             if "weights_swapped" in line]
    swaps = [(int(d["version"]), int(d["publication"])) for d in lines]
    assert swaps and all(version == publication // 4 for version, publication in swaps), swaps
    assert any(publication % 4 for _, publication in swaps), swaps  # weights from inside an update were served
    trainer_log = (job.run_dir / "trainer0.log").read_text()
    assert "traj_unreadable" not in trainer_log and "update_failed" not in trainer_log
    assert "message_rejected" not in (job.run_dir / "broker.log").read_text()


def test_a_late_start_waits_for_an_updates_epochs_and_training_goes_on(job_factory):
    """``weights.collect_after_epochs: 3`` of 4 in a real async job: rollouts wait while each
    update runs its first 3 epochs (the broker counts the updates they waited in), the real
    trainer's TRAIN begin and in-flight publications (4v + k) lift the wait, and the job keeps
    training. The generator acts with weights from inside the updates."""
    job = job_factory("weights.in_flight=true", "algo.epochs=4", "weights.collect_after_epochs=3")
    fig = job.wait(lambda f: f["trainer_version"] >= 6 and (f["pacing"] or {}).get("late_waits", 0) >= 3, 180,
                   "six updates, rollouts held in three of them")
    job.stop()
    assert fig["pacing"]["late_epochs"] == 3 and fig["pacing"]["late_whole"] == 0, fig["pacing"]
    swaps = [int(p) for p in re.findall(r"weights_swapped .*?publication=(\d+)", (job.run_dir / "generator0.log").read_text())]
    assert any(p % 4 == 3 for p in swaps), swaps
    assert "update_failed" not in (job.run_dir / "trainer0.log").read_text()
    assert "message_rejected" not in (job.run_dir / "broker.log").read_text()
