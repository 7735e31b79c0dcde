"""Placement: the --gpus mapping per role is checked against the mode (a bad one is a clear
error at load), and colocated offload moves trainer state off and back without changing the
next update by a single bit."""

from __future__ import annotations

import copy
import subprocess
import sys

import numpy as np
import pytest
import torch

from rlvla3.config import ConfigError, load
from rlvla3.harness.bench import random_observation
from rlvla3.scale_config import validate_placement
from workers.algorithms.memory import TrainerOffload, make_offload
from workers.algorithms.ppo import make_optimizer, ppo_update
from workers.model import build_policy, job_spec


def _cfg(*sets: str):
    return load("configs/synthetic.yaml", list(sets))


def _mapped(mode: str, gen: str, tr: str, n_gen: int, n_tr: int, *more: str):
    return _cfg(f"placement.mode={mode}", f"placement.generator_gpus='{gen}'", f"placement.trainer_gpus='{tr}'",
                f"workers.generators={n_gen}", f"workers.trainers={n_tr}", *more)


def test_good_mappings_per_mode() -> None:
    for mode in ("disaggregated", "colocated", "hybrid"):  # CPU: no mapping, every mode accepted
        assert validate_placement(_cfg(f"placement.mode={mode}").placement, 1, 1) == {"generator": [], "trainer": []}
    cfg = _mapped("disaggregated", "0-1", "2,3", 2, 2)
    assert validate_placement(cfg.placement, 2, 2) == {"generator": [0, 1], "trainer": [2, 3]}
    cfg = _mapped("colocated", "0-3", "0-3", 4, 4, "placement.offload=always")
    assert validate_placement(cfg.placement, 4, 4) == {"generator": [0, 1, 2, 3], "trainer": [0, 1, 2, 3]}
    cfg = _mapped("hybrid", "0-2", "2-3", 3, 2)
    assert validate_placement(cfg.placement, 3, 2) == {"generator": [0, 1, 2], "trainer": [2, 3]}


@pytest.mark.parametrize("sets, words", [
    (("disaggregated", "0-1", "1-2", 2, 2), "devices [1] serve and train"),
    (("colocated", "0-1", "0-2", 2, 3), "colocated shares every device"),
    (("hybrid", "0-1", "2-3", 2, 2), "share none"),
    (("hybrid", "0-1", "0-1", 2, 2), "share all"),
    (("colocated", "0-3", "0-3", 2, 4), "generator_gpus names 4 devices but workers.generators is 2"),
    (("colocated", "0-1", "", 2, 1), "map both roles"),
    (("colocated", "0-x", "0", 1, 1), "bad range"),
    (("disaggregated", "", "", 1, 1, "placement.offload=always"), "needs a shared device"),
    (("sideways", "", "", 1, 1), "placement.mode"),
])
def test_bad_mapping_is_a_clear_config_error(sets, words) -> None:
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        _mapped(*sets)


def test_run_refuses_a_bad_gpu_mapping_before_starting_anything(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "rlvla3", "run", "configs/synthetic.yaml", "--run-dir", str(tmp_path / "r"),
                          "--set", "placement.mode=colocated", "--gpus", "generator=0", "--gpus", "trainer=1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "colocated shares every device" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "r").exists()
    out = subprocess.run([sys.executable, "-m", "rlvla3", "run", "configs/synthetic.yaml", "--gpus", "critic=0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "expected generator=DEVICES or trainer=DEVICES" in out.stderr


def _batch(policy, cfg) -> dict:
    spec, rng, n = job_spec(cfg), np.random.default_rng(0), 8
    obs = random_observation(spec, n, rng, "reach")
    torch.manual_seed(0)
    out = policy.act(obs)
    return {"obs": obs, "actions": out.actions, "replay": out.replay, "behav_logprob": out.logprob,
            "advantages": torch.as_tensor(rng.standard_normal(n).astype(np.float32)),
            "returns": torch.as_tensor(rng.standard_normal(n).astype(np.float32)), "values": out.value}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_update_after_onload_is_bit_identical(dtype: str) -> None:
    cfg = load("configs/synthetic_openvla_oft.yaml", ["workers.device=cpu", f"model.dtype={dtype}", "algo.epochs=1",
                                                      "algo.minibatch_size=4", "placement.mode=colocated",
                                                      "placement.offload=always"])
    runs = []
    for offloading in (False, True):
        policy = build_policy(cfg)
        policy.train()
        opt = make_optimizer(policy.parameters(), cfg.algo)
        batch = _batch(policy, cfg)
        ppo_update(policy, opt, copy.copy(batch), cfg.algo)
        if offloading:
            off = make_offload(cfg.placement.mode, cfg.placement.offload, policy, [opt, opt], policy.device)
            assert isinstance(off, TrainerOffload) and off.params
            before = {n: p.data for n, p in policy.named_parameters()}  # held: its storage stays taken
            state_bytes = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                              if isinstance(t, torch.Tensor))
            param_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())
            assert off.offload() == state_bytes + param_bytes and not off.on_device and off.offloads == 1
            assert all(p.grad is None for p in policy.parameters())  # gradients dropped
            assert off.offload() == 0  # already off: nothing moves twice
            assert off.onload() == state_bytes + param_bytes and off.on_device
            for n, p in policy.named_parameters():  # new storage, same bits
                assert p.data_ptr() != before[n].data_ptr() and torch.equal(p, before[n])
        stats = ppo_update(policy, opt, copy.copy(batch), cfg.algo)
        runs.append((stats["loss"], {n: p.detach().clone() for n, p in policy.named_parameters()}))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][n], runs[1][1][n]) for n in runs[0][1])


def test_offload_decision_per_setting() -> None:
    policy = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(policy.parameters())
    assert make_offload("disaggregated", "auto", policy, [opt], torch.device("cpu")) is None
    assert make_offload("colocated", "never", policy, [opt], torch.device("cpu")) is None
    assert make_offload("colocated", "auto", policy, [opt], torch.device("cpu")) is None  # CPU never runs short
    assert make_offload("hybrid", "always", policy, [opt], torch.device("cpu")).params


def test_colocated_always_offloads_around_every_update_in_a_real_job(job_factory) -> None:
    job = job_factory("placement.mode=colocated", "placement.offload=always")
    job.wait(lambda f: f["trainer_version"] >= 2, 180, "two updates with offload: always")
    job.stop()
    log = (job.run_dir / "trainer0.log").read_text()
    assert "trainer_placement" in log and "offloading=True" in log and "mode=colocated" in log
    assert log.count("trainer_state_offloaded") >= 2
