"""FSDP2 (``train.fsdp``) against DDP: two real gloo ranks on CPU, the same tiny OpenVLA-OFT and the
same per-rank batches through the trainer's update (``workers.algorithms.update``); the losses
of every optimizer step and the weights after agree. Checkpoints move between group sizes: two
FSDP ranks save (sharded and full) and one process resumes; one process saves and two FSDP
ranks resume. And ``train.fsdp: true`` in a real job. A rank lost during the group's checkpoint
stops the other within ``train.collective_timeout_s``."""

import json
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from rlvla3.config import load
from rlvla3.harness.bench import random_observation
from rlvla3.observation import Observation
from workers.algorithms.distributed import destroy_trainer_group, init_trainer_group, wrap_ddp, wrap_fsdp
from workers.algorithms.ppo import make_optimizer
from workers.algorithms.update import TrainBatch, TrainState, update
from workers.checkpoint import load_checkpoint, save_checkpoint
from workers.model import build_policy, job_spec

OVERRIDES = ["workers.device=cpu", "model.dtype=float32", "algo.epochs=1", "algo.minibatch_size=4", "algo.lr=0.001",
             "algo.check_replicas=true"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(policy, cfg, rank: int) -> TrainBatch:
    """Two fragments of 4 steps, acted by ``policy`` (the learner's layout)."""
    spec, rng, n = job_spec(cfg), np.random.default_rng(rank), 8
    obs = random_observation(spec, n, rng, "reach the target")
    torch.manual_seed(rank)
    out = policy.act(obs)
    samples = {"obs": obs, "actions": out.actions, "replay": out.replay, "behav_logprob": out.logprob, "values": out.value}
    ends = [3, 7]
    boot = {"obs": Observation.concat([obs.select(slice(e, e + 1)) for e in ends]), "actions": out.actions[ends],
            "replay": {k: v[ends] for k, v in out.replay.items()}}
    return TrainBatch(samples=samples, keep=np.ones(n, bool), staleness=np.zeros(n, np.int64),
                      rewards=torch.as_tensor(rng.standard_normal(n).astype(np.float32)),
                      terminated=torch.zeros(n, dtype=torch.bool), lengths=[4, 4], bootstrap=boot, advantages=None,
                      env_steps=n)


def _full(policy) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in policy.named_parameters()}


def _rank(rank: int, port: int, out_dir: str) -> None:
    init_trainer_group(rank, 2, "127.0.0.1", port)
    try:
        cfg = load("configs/synthetic_openvla_oft.yaml", OVERRIDES)
        result = {}
        for kind, wrap in (("ddp", wrap_ddp), ("fsdp", wrap_fsdp)):
            policy = build_policy(cfg)  # seeded: the same weights on both ranks, for both runs
            batch = _batch(policy, cfg, rank)
            policy.train()
            state = TrainState.build(policy, cfg.algo, wrap(policy))  # the optimizer steps the shards
            res = update(state, batch, cfg.algo, pad_to=8)
            result[kind] = {"loss": res.diagnostics["loss"], "steps": res.diagnostics["optimizer_steps"],
                            "checksum": res.param_checksum, "sharded": sum(hasattr(p, "full_tensor") for p in policy.parameters())}
            torch.save(_full(policy), f"{out_dir}/{kind}{rank}.pt")
            if kind == "fsdp":  # two ranks save; the test resumes in one process
                for fmt in ("sharded", "full"):
                    save_checkpoint(f"{out_dir}/{fmt}", policy, state.optimizer, 1, {"updates": 1}, "run: {}\n", fmt=fmt)
        # One process saved (the test, below); the two FSDP ranks resume from it.
        for fmt in ("sharded", "full"):
            load_checkpoint(f"{out_dir}/one-{fmt}", state.policy, state.optimizer, restore_rng=False)
            torch.save(_full(policy), f"{out_dir}/resumed-{fmt}{rank}.pt")
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(1.0)  # the next load must overwrite every value
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(result, f)
    finally:
        destroy_trainer_group()


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])][:3]


def test_fsdp2_matches_ddp_and_checkpoints_move_between_group_sizes(tmp_path):
    cfg = load("configs/synthetic_openvla_oft.yaml", OVERRIDES)
    one = build_policy(cfg)
    with torch.no_grad():
        for p in one.parameters():
            p.add_(0.01)  # not the seeded build the ranks start from
    opt = make_optimizer(one.parameters(), cfg.algo)
    for fmt in ("sharded", "full"):
        save_checkpoint(tmp_path / f"one-{fmt}", one, opt, 1, {}, "run: {}\n", fmt=fmt)

    mp.spawn(_rank, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    for r in (0, 1):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        ddp, fsdp = res["ddp"], res["fsdp"]
        assert ddp["steps"] == fsdp["steps"] == 2
        assert ddp["sharded"] == 0 and fsdp["sharded"] > 0  # FSDP really sharded the parameters
        assert abs(ddp["loss"] - fsdp["loss"]) < 1e-5, (ddp["loss"], fsdp["loss"])
        # DDP and FSDP reach the update through different float32 summation orders (FSDP sums
        # the clipping norm shard by shard), so weights may differ by rounding (element-wise
        # below); the checksum once differed by 1.3e-9 relative
        assert ddp["checksum"] == pytest.approx(fsdp["checksum"], rel=1e-7)
        a, b = torch.load(tmp_path / f"ddp{r}.pt"), torch.load(tmp_path / f"fsdp{r}.pt")
        assert a.keys() == b.keys()
        for n in a:
            torch.testing.assert_close(a[n], b[n], rtol=1e-4, atol=1e-6, msg=n)
        for fmt in ("sharded", "full"):  # saved by one process, resumed by two FSDP ranks
            _equal(torch.load(tmp_path / f"resumed-{fmt}{r}.pt"), {n: p.detach() for n, p in one.named_parameters()})
    w0 = torch.load(tmp_path / "fsdp0.pt")
    _equal(w0, torch.load(tmp_path / "fsdp1.pt"))  # one model, gathered the same on every rank
    policy = one
    opt = make_optimizer(policy.parameters(), cfg.algo)
    for fmt in ("sharded", "full"):  # saved by two FSDP ranks, resumed by one process (no group)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(1.0)  # the load must overwrite every value
        load_checkpoint(tmp_path / fmt, policy, opt, restore_rng=False)
        _equal({n: p.detach() for n, p in policy.named_parameters()}, w0)
        assert all(opt.state[p]["step"] == 2 for p in policy.parameters() if p.requires_grad)  # Adam's state came too


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_fsdp_trainer_group_publishes_and_checkpoints_shards(job_factory):
    """``train.fsdp: true`` in a real job: two gloo ranks update together, rank 0 publishes the
    gathered weights and the generator swaps them in; the sharded (DCP) checkpoint both ranks
    wrote loads into one process without a group and holds the weights the ranks reported."""
    from workers.algorithms.distributed import parameter_checksum
    from workers.checkpoint import latest_checkpoint, load_checkpoint

    job = job_factory("workers.trainers=2", "train.fsdp=true", "train.checkpoint_format=sharded",
                      "algo.check_replicas=true", "algo.checkpoint_every=2")
    job.wait(lambda f: f["trainer_version"] >= 3, 240, "three updates by the FSDP trainer group")
    job.stop()
    r0, r1 = _rows(job.run_dir / "trainer_metrics.jsonl"), _rows(job.run_dir / "trainer_metrics.rank1.jsonl")
    both = {r["version"]: r["param_checksum"] for r in r0}
    assert len(r1) >= 2 and all(both.get(r["version"]) == r["param_checksum"] for r in r1)  # one model, gathered alike
    swaps = [line for line in (job.run_dir / "generator0.log").read_text().splitlines() if "weights_swapped" in line]
    assert len(swaps) >= 3, swaps  # version 0 and updates, gathered by the group and published by rank 0
    ck = latest_checkpoint(job.run_dir)
    assert (ck / "dcp" / ".metadata").is_file() and len(list((ck / "dcp").glob("*.distcp"))) == 2  # one file per rank
    policy = build_policy(load(str(job.run_dir / "config.yaml")))
    saved = load_checkpoint(job.run_dir, policy, make_optimizer(policy.parameters(), load(str(job.run_dir / "config.yaml")).algo),
                            restore_rng=False)  # two ranks saved, one process resumes
    assert float(parameter_checksum(policy)) == pytest.approx(both[saved["version"]], rel=1e-6)  # rows keep 8 digits


def _lost_rank(rank: int, port: int, out_dir: str, sig: int) -> None:
    """One rank of two FSDP ranks with ``train.collective_timeout_s=3``: rank 1 goes away (``sig``
    at itself) as the group's checkpoint starts; rank 0 reports how its save ended."""
    import os
    import time
    from pathlib import Path

    from structlog.testing import capture_logs

    from workers.learner import Learner
    from workers.trainer_checkpoints import Checkpoints
    from workers.trainer_rounds import join_group

    cfg = load("synthetic.yaml", ["workers.trainers=2", "train.fsdp=true", "train.collective_timeout_s=3"])
    address = {"addr": "127.0.0.1", "port": port}
    join_group(rank, 2, address, {"dist": address}, "cpu", cfg)
    policy = build_policy(cfg)
    state = TrainState.build(policy, cfg.algo, wrap_fsdp(policy))
    checkpoints = Checkpoints(cfg, Path(out_dir), None, rank, 2)
    torch.distributed.barrier()  # both ranks built: the next collective is the checkpoint's
    if rank == 1:
        os.kill(os.getpid(), sig)
        time.sleep(60)  # never reached with SIGKILL; with SIGSTOP, its sockets stay open and silent
    t0 = time.monotonic()
    with capture_logs() as logs:
        try:
            checkpoints.save(state, 1, Learner(cfg))
            ended = "saved"
        except SystemExit as exc:
            ended = str(exc)
    with open(f"{out_dir}/rank0.json.tmp", "w") as f:
        json.dump({"ended": ended, "waited_s": time.monotonic() - t0, "group_lost": checkpoints.group_lost,
                   "events": [e["event"] for e in logs]}, f)
    os.replace(f"{out_dir}/rank0.json.tmp", f"{out_dir}/rank0.json")  # the test reads it once it exists: whole
    os._exit(0)  # the group is broken: no teardown collective


LOST_RANK_PRELOAD = [__name__, "workers.learner", "workers.trainer_checkpoints", "workers.trainer_rounds",
                     "structlog.testing", "torch.distributed.fsdp", "transformers.modeling_layers"]
"""What a lost-rank case's ranks import (``wrap_fsdp`` imports the last two), imported once by the
forkserver they fork from: a fresh interpreter per rank imports torch, DTensor and transformers
again, for seconds each on two cores."""


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])  # a killed rank, and one whose host went silent
def test_a_rank_lost_during_a_collective_checkpoint_stops_the_other_within_the_timeout(tmp_path, sig):
    """SIGKILL closes the lost rank's connections (gloo fails at once); SIGSTOP keeps them open
    and silent, as a host that went away does, and the survivor waits out the group's timeout."""
    import signal
    import time

    mp.get_context("forkserver").set_forkserver_preload(LOST_RANK_PRELOAD)
    ctx = mp.start_processes(_lost_rank, args=(_free_port(), str(tmp_path), int(getattr(signal, sig))), nprocs=2,
                             join=False, start_method="forkserver")
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "rank0.json").exists() and time.monotonic() < deadline and ctx.processes[0].is_alive():
            time.sleep(0.1)
        out = json.loads((tmp_path / "rank0.json").read_text())
    finally:
        for p in ctx.processes:
            p.kill()
            p.join(10)
    assert out["waited_s"] < 3 + 5, out  # train.collective_timeout_s, and a margin
    assert out["group_lost"] and "lost during the collective checkpoint of version 1" in out["ended"], out
    assert "checkpoint_group_lost" in out["events"], out
    from workers.checkpoint import latest_checkpoint

    assert latest_checkpoint(tmp_path) is None  # the torn save left no checkpoint that looks complete
