"""Every tiny VLA family served by a generator worker through the broker and trained by a
trainer worker, on the synthetic task, from the ``configs/synthetic_<family>.yaml``
recipes.

One job per family does both algorithms: a PPO trainer takes a step and publishes it; then it
leaves, and a GRPO trainer (``--set algo.name=grpo``) joins the running job, resumes from the
checkpoint its predecessor left in the run folder, and takes a GRPO step on groups of episodes
that the simulator started from one seed (``env.group_size: 2`` from the start).

And ``rlvla3 run`` end to end as a user runs it, for one tiny family.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlvla3.app.launch import stop_processes
from rlvla3.config import load
from rlvla3.harness.jobs import Job
from tests.jobs import start_job

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MODULES = {"openvla_oft": "openvla_oft", "pi0": "pi0", "pi05": "pi05", "gr00t_n15": "gr00t"}
FAMILIES = sorted(MODULES)

SMALL = (
    "env.num_envs=2", "env.slots=1", "env.fragment_len=4", "env.group_size=2",
    "env.options.max_episode_steps=8", "env.options.image_size=32",
    "algo.batch_steps=16", "algo.minibatch_size=8", "algo.epochs=1", "algo.max_staleness=1000",
    "batching.max_batch=4", "batching.max_wait_ms=5",
)
GRPO = ("algo.name=grpo", "algo.grpo_reward=return")  # a random tiny VLA never succeeds


def recipe(family: str) -> str:
    return f"configs/synthetic_{family}.yaml"


@pytest.fixture
def recipe_job(tmp_path: Path):
    jobs: list[Job] = []

    def make(config: str, *overrides: str) -> Job:
        return start_job(load(str(ROOT / config), list(overrides)), tmp_path, jobs)

    yield make
    for j in jobs:
        j.stop()


@pytest.mark.parametrize("family", FAMILIES)
def test_recipe_model_is_the_tiny_model_config(family: str) -> None:
    tiny = yaml.safe_load((ROOT / "configs" / "models" / f"{family}_tiny.yaml").read_text())["model"]
    cfg = load(str(ROOT / recipe(family)))
    assert cfg.model.family == tiny["family"] and cfg.model.chunk_size == tiny["chunk_size"]
    assert cfg.model.options == tiny["options"]
    assert cfg.env.name == "synthetic" and cfg.algo.name == "ppo"


@pytest.mark.parametrize("family", FAMILIES)
def test_family_ppo_then_grpo_step_through_fabric(recipe_job, family: str) -> None:
    pytest.importorskip(f"workers.policies.{MODULES[family]}")
    job = recipe_job(recipe(family), *SMALL)

    def served(f: dict[str, Any]) -> int:
        return sum(w["served"] or 0 for w in f["per_worker"] if w["role"] == "generator")

    # PPO: the generator serves the family's action chunks, the trainer publishes a version (its
    # figures come after the announcement, once a due checkpoint is written: wait for both).
    fig = job.wait(lambda f: f["policy_version"] >= 1 and served(f) > 0 and "samples" in f["trainer"], 300,
                   f"{family}: one PPO version published")
    assert fig["errors"] == 0, job.logs()
    tr = fig["trainer"]
    assert tr["samples"] > 0 and "groups_complete" not in tr, tr
    assert tr["value_loss"] > 0.0  # PPO trains the value head
    v_ppo = fig["policy_version"]
    gen = next(w for w in fig["per_worker"] if w["role"] == "generator")
    assert gen["version"] is not None

    # GRPO: the PPO trainer leaves (checkpointing), a GRPO trainer joins and continues the versions.
    trainer0 = job.workers[0]  # start_all starts the trainers first
    stop_processes([trainer0], timeout_s=60)
    job.workers.remove(trainer0)
    job.start_worker("trainer", "trainer_grpo", [a for o in GRPO for a in ("--set", o)])
    fig = job.wait(lambda f: f["policy_version"] > v_ppo and "groups_complete" in f["trainer"]
                   and f["trainer"].get("version", 0) > v_ppo, 300, f"{family}: one GRPO version published")
    tr = fig["trainer"]
    assert tr["groups_complete"] >= 1 and tr["samples"] > 0, tr
    assert tr["value_loss"] == 0.0, tr  # GRPO has no critic
    assert fig["errors"] == 0 and fig["traj"]["dropped"] == 0, job.logs()
    log = (job.run_dir / "trainer_grpo.log").read_text()
    assert "algo=grpo" in log or '"algo": "grpo"' in log, log[-2000:]


def test_rlvla3_run_end_to_end_tiny_vla(tmp_path: Path) -> None:
    """``rlvla3 run CONFIG --steps N --run-dir DIR`` as a user runs it (CleanRL style)."""
    family = "pi0"
    pytest.importorskip(f"workers.policies.{MODULES[family]}")
    run_dir = tmp_path / "run"
    steps = 160
    proc = subprocess.run(
        [sys.executable, "-m", "rlvla3", "run", recipe(family), "--steps", str(steps), "--run-dir", str(run_dir),
         "--set", "run.progress_every_s=1.0", "--set", "algo.batch_steps=16", "--set", "algo.minibatch_size=8"],
        capture_output=True, text=True, timeout=420, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    summary = json.loads(lines[-1])
    assert summary["reason"] == "steps_reached", summary
    assert summary["env_steps"] >= steps and summary["run_dir"] == str(run_dir)
    assert summary["shm_leftovers"] == 0
    assert summary["workers"] == {"simulator": 1, "generator": 1, "trainer": 1}
    assert json.loads((run_dir / "summary.json").read_text())["env_steps"] == summary["env_steps"]
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert rows and rows[-1]["env_steps"] == summary["env_steps"]
    assert all(b["elapsed_s"] >= a["elapsed_s"] for a, b in zip(rows, rows[1:]))
    assert (run_dir / "config.yaml").is_file()
    assert load(str(run_dir / "config.yaml")).model.family == family
    assert any(line.startswith("[") and "steps=" in line for line in lines), proc.stdout[-2000:]
