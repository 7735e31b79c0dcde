"""Checkpoint round trip: weights, optimizer, counters, config and RNG continue identically."""

import random

import numpy as np
import pytest
import torch
from torch import nn

from workers.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

CONFIG = "run:\n  name: test\nalgo: ppo\n"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)
        self.head2 = self.head  # a shared (tied) module: safetensors must cope
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def train_steps(net: nn.Module, opt: torch.optim.Optimizer, n: int) -> list[float]:
    """Steps that draw from every RNG, so a resumed run must continue each stream."""
    trace = []
    for _ in range(n):
        x = torch.randn(16, 4) + float(np.random.rand()) + random.random()
        loss = net(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        net.steps += 1
        trace.append(float(loss.detach()))
    return trace


def snapshot(net: nn.Module) -> dict:
    return {k: v.clone() for k, v in net.state_dict().items()}


def test_round_trip_continues_identically(tmp_path):
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    train_steps(net, opt, 3)

    path = save_checkpoint(tmp_path, net, opt, version=3, step_counters={"env_steps": 1200, "updates": 3}, config_yaml=CONFIG)
    assert path.name == "v00000003" and latest_checkpoint(tmp_path) == path
    assert {p.name for p in path.iterdir()} == {"model.safetensors", "optimizer.pt", "state.json", "rng.json", "config.yaml"}
    expected_trace = train_steps(net, opt, 4)
    expected_weights = snapshot(net)

    # A fresh process would start with other weights and other RNG states.
    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    net2 = Net()
    opt2 = torch.optim.Adam(net2.parameters(), lr=1e-2)
    info = load_checkpoint(tmp_path, net2, opt2)

    assert info["version"] == 3
    assert info["counters"] == {"env_steps": 1200, "updates": 3}
    assert info["config_yaml"] == CONFIG
    assert float(net2.steps) == 3
    assert train_steps(net2, opt2, 4) == expected_trace
    for k, v in snapshot(net2).items():
        assert torch.equal(v, expected_weights[k]), k


def test_latest_moves_and_old_checkpoints_are_pruned(tmp_path):
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for v in (1, 2, 3):
        save_checkpoint(tmp_path, net, opt, v, {"updates": v}, CONFIG, keep_last=2)
    save_checkpoint(tmp_path, net, opt, 3, {"updates": 33}, CONFIG, keep_last=2)  # same version again
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "v00000002", "v00000003"]  # no temporary leftovers either
    assert load_checkpoint(tmp_path, Net(), restore_rng=False)["counters"] == {"updates": 33}
    # A checkpoint folder itself can be named as well as the run folder.
    assert load_checkpoint(tmp_path / "checkpoints" / "v00000002", Net(), restore_rng=False)["version"] == 2


def test_unfinished_write_is_invisible(tmp_path):
    net = Net()
    save_checkpoint(tmp_path, net, None, 1, {}, CONFIG)
    # A crash mid-save leaves only a hidden temporary folder behind.
    (tmp_path / "checkpoints" / ".tmp-v00000002-1-1").mkdir()
    assert latest_checkpoint(tmp_path).name == "v00000001"
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path, net, torch.optim.SGD(net.parameters(), lr=0.1))  # saved without optimizer


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path, Net())
