"""Trained checkpoints out: ``rlvla3 export RUN_DIR --format F --out DIR`` (a real process) writes a
run's policy in its family's format; loading it back - with rlvla3's loader, and for pi0 also with
transformers' own ``PI0ForConditionalGeneration`` - gives the same actions, bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from typing import Any

import numpy as np
import pytest
import torch
import yaml

from rlvla3.observation import Observation
from tests.jobs import ProcessPool, child_env
from workers.envs.base import env_spec
from workers.policies.base import make_policy

ROOT = Path(__file__).resolve().parents[1]
ENV = {"name": "synthetic", "options": {"image_size": 32, "max_episode_steps": 16}}

CASES = [  # (id, family, format, options)
    ("pi0-transformers", "pi0", "transformers", {"size": "tiny"}),
    ("pi0-lerobot", "pi0", "lerobot", {"size": "tiny_release"}),
    ("pi05-lerobot", "pi05", "lerobot", {"size": "tiny_release"}),
    ("gr00t-release", "gr00t_n15", "release", {"size": "tiny"}),
    ("openvla_oft-release", "openvla_oft", "release", {"size": "tiny"}),
]


def obs_for(spec, batch: int = 3, seed: int = 0) -> Observation:
    rng = np.random.default_rng(seed)
    return Observation({c: rng.integers(0, 256, (batch, h, w, 3), dtype=np.uint8) for c, (h, w) in spec.cameras.items()},
                       rng.uniform(-1, 1, (batch, spec.state_dim)).astype(np.float32),
                       ["reach the red target", "push", "reach"][:batch])


def make_run(run_dir: Path, family: str, options: dict, lora: dict | None = None):
    """A run folder as the trainer leaves it: weights moved off their init, statistics set
    (``lora``: with trained adapters, as a ``model.lora`` run leaves it)."""
    from workers.checkpoint import save_checkpoint

    spec = env_spec(ENV["name"], ENV["options"])
    opts = {**options, "device": "cpu", "dtype": "float32"}
    if family != "openvla_oft":
        opts["num_steps"] = 4  # flow families: a power of two, so upstream's time grid is exact too
    policy = make_policy(family, {**opts, "chunk_size": 4}, spec)
    if lora is not None:
        from rlvla3.scale_config import LoraConfig
        from workers.policies.lora import add_lora

        add_lora(policy, LoraConfig(**lora))
    torch.manual_seed(5)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            p.add_(torch.randn_like(p) * (3e-2 if ".lora_B." in n else 1e-3))  # trained adapters that matter
    # Exactly representable statistics (powers of two), so every file format stores them exactly.
    policy.norm.set(state=(torch.full((spec.state_dim,), 0.25), torch.full((spec.state_dim,), 2.0)),
                    action=(torch.full((spec.action_dim,), -0.5), torch.full((spec.action_dim,), 0.5)))
    cfg = {"env": ENV, "model": {"family": family, "chunk_size": 4, "dtype": "float32",
                                 "options": {k: v for k, v in opts.items() if k not in ("device", "dtype")},
                                 **({"lora": lora} if lora is not None else {})}}
    save_checkpoint(run_dir, policy, None, version=7, step_counters={"env_steps": 100}, config_yaml=yaml.safe_dump(cfg))
    return policy, spec


def export_argv(run_dir: Path, fmt: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "rlvla3.app.cli", "export", str(run_dir), "--format", fmt, "--out", str(out)]


class Exports:
    """Every export this module checks, as real processes in the background two at a time (each
    is single-threaded start-up and CPU work), from run folders made here first. The pi0 tiny run
    serves the transformers round trip, the upstream load and both refusals."""

    def __init__(self, root: Path, cases: list[tuple[str, str, str, dict]]) -> None:
        self.root = root
        self.pool = ProcessPool(2)
        self.runs: dict[str, tuple[Any, Any]] = {}
        self.done: dict[str, tuple[int, str, str]] = {}
        env = child_env()
        for case_id, family, fmt, options in cases:
            self.runs[case_id] = make_run(root / case_id, family, options)
            self.pool.add(case_id, export_argv(root / case_id, fmt, root / f"{case_id}-out"), env=env, cwd=ROOT)
        self.runs["lora"] = make_run(root / "lora", "openvla_oft", {"size": "tiny"}, lora={"enabled": True, "rank": 4})
        self.pool.add("lora", export_argv(root / "lora", "release", root / "lora-out"), env=env, cwd=ROOT)
        pi0 = root / "pi0-transformers"  # tiny: 2 heads, which LeRobot's variants cannot name
        for key, run, fmt in (("refuse-lerobot", pi0, "lerobot"), ("refuse-release", pi0, "release"),
                              ("refuse-nothing", root / "nothing", "lerobot")):
            self.pool.add(key, export_argv(run, fmt, root / f"{key}-out"), env=env, cwd=ROOT)

    def result(self, key: str) -> tuple[int, str, str]:
        """The export's exit code, stdout and stderr (several tests read the pi0 tiny one)."""
        if key not in self.done:
            self.done[key] = self.pool.result(key)
        return self.done[key]

    def out(self, key: str) -> Path:
        return self.root / f"{key}-out"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    e = Exports(tmp_path_factory.mktemp("exports"), CASES)
    yield e
    e.pool.close()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_export_round_trip_gives_identical_actions(case, exports):
    from workers.release.layouts import load_release

    case_id, family, fmt, options = case
    policy, spec = exports.runs[case_id]
    returncode, stdout, stderr = exports.result(case_id)
    assert returncode == 0, stderr[-3000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["family"] == family and summary["checkpoint"].endswith("v00000007")
    loaded = load_release(str(exports.out(case_id)), family, spec, {"device": "cpu", "dtype": "float32"})
    obs = obs_for(spec)
    for p in (policy, loaded):
        p.seed_eval(0)  # the flow families' ODE starts: the same draws for both
    a, b = policy.act(obs, deterministic=True), loaded.act(obs, deterministic=True)
    assert torch.equal(a.actions, b.actions)
    assert torch.equal(a.value, b.value)  # the critic travels in the rlvla3 side file
    assert not torch.equal(policy.norm.action_out(torch.zeros(1)), torch.zeros(1))


def test_lora_run_exports_merged_base_weights(exports):
    """A LoRA run's export holds base weights only (adapters folded in) and acts as the run did."""
    from safetensors import safe_open

    from workers.release.layouts import load_release

    policy, spec = exports.runs["lora"]
    assert any(".lora_B." in n for n, _ in policy.named_parameters())
    returncode, _, stderr = exports.result("lora")
    assert returncode == 0, stderr[-3000:]
    for f in exports.out("lora").rglob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            assert not [k for k in st.keys() if "lora_" in k], f
    loaded = load_release(str(exports.out("lora")), "openvla_oft", spec, {"device": "cpu", "dtype": "float32"})
    assert not any("lora_" in n for n, _ in loaded.named_parameters())
    obs = obs_for(spec)
    a, b = policy.act(obs, deterministic=True), loaded.act(obs, deterministic=True)
    torch.testing.assert_close(b.actions, a.actions, rtol=1e-5, atol=1e-5)  # W x + s B A x vs (W + s B A) x: rounding
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if ".lora_B." in n:
                p.zero_()
    assert not torch.allclose(policy.act(obs, deterministic=True).actions, a.actions, atol=1e-3)  # adapters mattered


def test_pi0_export_loads_in_upstream_transformers(exports):
    from transformers import PI0ForConditionalGeneration

    policy, spec = exports.runs["pi0-transformers"]  # pi0 tiny, exported --format transformers
    assert exports.result("pi0-transformers")[0] == 0
    upstream = PI0ForConditionalGeneration.from_pretrained(str(exports.out("pi0-transformers"))).eval()
    obs = obs_for(spec, seed=4)
    with torch.no_grad():
        noise = torch.randn(3, 4, policy.model_action_dim)
        raw = upstream.sample_actions(noise=noise, **policy.model_inputs(policy.norm.state_in(obs)))
    assert torch.equal(policy.act(obs, deterministic=True, noise=noise).actions, policy.norm.action_out(raw[..., : spec.action_dim]))


def test_export_refuses_what_the_format_cannot_hold(exports):
    returncode, _, stderr = exports.result("refuse-lerobot")  # the pi0 tiny run: 2 heads
    assert returncode != 0 and "8 heads" in stderr
    returncode, _, stderr = exports.result("refuse-release")
    assert returncode != 0 and "pi0 exports as ['transformers', 'lerobot']" in stderr
    assert exports.result("refuse-nothing")[0] != 0
