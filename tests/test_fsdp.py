"""FSDP2 (``train.fsdp``) against DDP: two real gloo ranks on CPU, the same tiny OpenVLA-OFT and the
same per-rank batches; the losses of every optimizer step and the weights after agree."""

import json
import socket

import numpy as np
import torch
import torch.multiprocessing as mp

from rlvla3.config import load
from tests.jobs import random_observation
from workers.algorithms.distributed import destroy_trainer_group, init_trainer_group, wrap_ddp, wrap_fsdp
from workers.algorithms.ppo import make_optimizer, ppo_update
from workers.model import build_policy, job_spec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(policy, cfg, rank: int) -> dict:
    spec, rng, n = job_spec(cfg), np.random.default_rng(rank), 8
    obs = random_observation(spec, n, rng, "reach the target")
    torch.manual_seed(rank)
    out = policy.act(obs)
    return {"obs": obs, "actions": out.actions, "replay": out.replay, "behav_logprob": out.logprob,
            "advantages": torch.as_tensor(rng.standard_normal(n).astype(np.float32)),
            "returns": torch.as_tensor(rng.standard_normal(n).astype(np.float32)), "values": out.value}


def _rank(rank: int, port: int, out_dir: str) -> None:
    init_trainer_group(rank, 2, "127.0.0.1", port)
    try:
        cfg = load("configs/synthetic_openvla_oft.yaml", ["workers.device=cpu", "model.dtype=float32",
                                                          "algo.epochs=1", "algo.minibatch_size=4", "algo.lr=0.001"])
        result = {}
        for kind, wrap in (("ddp", wrap_ddp), ("fsdp", wrap_fsdp)):
            policy = build_policy(cfg)  # seeded: the same weights on both ranks, for both runs
            batch = _batch(policy, cfg, rank)
            policy.train()
            model = wrap(policy)
            stats = ppo_update(model, make_optimizer(model.parameters(), cfg.algo), batch, cfg.algo)
            full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in policy.named_parameters()}
            result[kind] = {"loss": stats["loss"], "steps": stats["optimizer_steps"],
                            "sharded": sum(hasattr(p, "full_tensor") for p in policy.parameters())}
            torch.save(full, f"{out_dir}/{kind}{rank}.pt")
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(result, f)
    finally:
        destroy_trainer_group()


def test_fsdp2_matches_ddp_on_two_gloo_ranks(tmp_path):
    mp.spawn(_rank, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    for r in (0, 1):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        ddp, fsdp = res["ddp"], res["fsdp"]
        assert ddp["steps"] == fsdp["steps"] == 2
        assert ddp["sharded"] == 0 and fsdp["sharded"] > 0  # FSDP really sharded the parameters
        assert abs(ddp["loss"] - fsdp["loss"]) < 1e-5, (ddp["loss"], fsdp["loss"])
        a, b = torch.load(tmp_path / f"ddp{r}.pt"), torch.load(tmp_path / f"fsdp{r}.pt")
        assert a.keys() == b.keys()
        for n in a:
            torch.testing.assert_close(a[n], b[n], rtol=1e-4, atol=1e-6, msg=n)
    w0, w1 = (torch.load(tmp_path / f"fsdp{r}.pt") for r in (0, 1))
    assert all(torch.equal(w0[n], w1[n]) for n in w0)  # one model, gathered the same on every rank
