"""The embedded default config (what ``rlvla3 run`` runs with no CONFIG): Meta-World reach-v3
with a behaviour-cloning warm start and GRPO on success; without Meta-World it fails before
starting anything, naming how to install it; with it, a tiny default run completes."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlvla3.app.cli import main
from rlvla3.config import DEFAULT_CONFIG, load
from rlvla3.harness.jobs import run_cli
from tests.jobs import last_json

ROOT = Path(__file__).resolve().parents[1]


def test_default_config_is_metaworld_sft_then_grpo():
    cfg = load(None)
    assert DEFAULT_CONFIG == "metaworld_default.yaml"
    assert cfg.env.name == "metaworld" and cfg.env.options["task"] == "reach-v3"
    assert cfg.run.sft_episodes > 0 and cfg.run.sft_epochs > 0 and not cfg.model.checkpoint
    assert cfg.algo.name == "grpo" and cfg.algo.grpo_reward == "success"
    assert cfg.env.group_size == 4
    assert cfg.env.eval_slots >= 1 and cfg.env.eval_every > 0
    # parallel GRPO groups are neighbouring envs: none may straddle into an evaluation slot,
    # or it never completes and its steps hold the admission budget until rollouts stall
    per_slot = cfg.env.num_envs // cfg.env.slots
    assert cfg.env.group_mode != "parallel" or per_slot % cfg.env.group_size == 0
    # the synthetic config stays reachable by its packaged name from any working directory
    cwd = os.getcwd()
    try:
        os.chdir("/")
        assert load("synthetic.yaml").env.name == "synthetic"
        assert load("metaworld_default.yaml").to_dict() == cfg.to_dict()
    finally:
        os.chdir(cwd)


def test_default_run_without_metaworld_fails_early_with_install_hint(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name in ("metaworld", "mujoco") else real(name, *a, **k))
    run_dir = tmp_path / "run"
    r = CliRunner().invoke(main, ["run", "--steps", "10", "--run-dir", str(run_dir)])
    assert r.exit_code != 0
    assert "pip install -e .[metaworld]" in r.output and "scripts/run.sh" in r.output, r.output
    assert not run_dir.exists(), "nothing may start before the check"


@pytest.mark.slow
@pytest.mark.sim
def test_default_run_tiny(tmp_path):
    pytest.importorskip("metaworld")
    run_dir = tmp_path / "run"
    sets = ["run.sft_episodes=8", "run.sft_epochs=2", "run.progress_every_s=0.5",
            "env.options.max_episode_steps=40", "env.num_envs=4", "env.slots=1", "env.parallel=thread",
            "env.eval_slots=0", "workers.simulators=1", "algo.batch_steps=64", "algo.minibatch_size=32"]
    args = ["run", "--steps", "300", "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    r = run_cli(*args, timeout=150, cwd=ROOT, env={"MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "warm start: deterministic success" in r.stdout
    summary = last_json(r.stdout)
    assert summary["reason"] == "steps_reached" and summary["env_steps"] >= 300, summary
    assert summary["shm_leftovers"] == 0
    assert (run_dir / "sft" / "model.safetensors").is_file()
    assert load(str(run_dir / "config.yaml")).model.checkpoint == str((run_dir / "sft").resolve())
    # GRPO groups that teach nothing (all succeed or all fail) are named on the line, not silent
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("no_variance" in row for row in rows)
    assert any(row["no_variance"] for row in rows) == ("groups without variance" in r.stdout)


@pytest.mark.sim
def test_metaworld_success_bonus_paid_once_per_episode():
    pytest.importorskip("metaworld")
    os.environ.setdefault("MUJOCO_GL", "egl")
    from workers.envs.base import make_env
    from workers.envs.metaworld import expert_action

    returns = {}
    for bonus, dense in ((0.0, True), (1000.0, True), (1.0, False)):
        env = make_env("metaworld", 1, options={"task": "reach-v3", "cameras": [], "success_bonus": bonus, "dense_reward": dense,
                                                "terminate_on_success": False, "max_episode_steps": 120})
        try:
            env.reset([0], [3])
            total, successes = 0.0, 0
            for _ in range(120):
                res = env.step([0], expert_action(env, [0]))
                total += float(res.reward[0])
                successes += int(res.success[0])
            returns[bonus] = (total, successes)
            if not dense:  # RLinf's sparse reward: the bonus on the first successful step, nothing else
                assert total == 1.0
        finally:
            env.close()
    assert returns[0.0][1] > 1 and returns[0.0][1] == returns[1000.0][1] == returns[1.0][1]  # the expert succeeds, for several steps
    assert returns[1000.0][0] == pytest.approx(returns[0.0][0] + 1000.0, rel=1e-5)  # the bonus once, not per step
