"""Every tiny VLA family takes a PPO and a GRPO step end to end through the fabric: real broker,
simulator, generator and trainer processes on the synthetic task (small images, short episodes).
"""

import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {"openvla_oft": "openvla_oft_tiny.yaml", "pi0": "pi0_tiny.yaml", "pi05": "pi05_tiny.yaml",
            "gr00t_n15": "gr00t_n15_tiny.yaml"}
MODULES = {"openvla_oft": "openvla_oft", "pi0": "pi0", "pi05": "pi05", "gr00t_n15": "gr00t"}
ALGOS = {
    "ppo": ("algo.name=ppo",),
    # returns, not success: a random tiny VLA never succeeds, and all-fail groups are filtered
    "grpo": ("algo.name=grpo", "algo.group_size=2", "env.group_size=2", "algo.grpo_reward=return", "algo.max_staleness=1000"),
}


def model_overrides(family: str) -> list[str]:
    model = yaml.safe_load((ROOT / "configs" / "models" / FAMILIES[family]).read_text())["model"]
    return [f"model.family={model['family']}", f"model.chunk_size={model['chunk_size']}",
            f"model.options={json.dumps(model.get('options', {}))}"]


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(ALGOS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_step_through_fabric(job_factory, family, algo):
    pytest.importorskip(f"workers.policies.{MODULES[family]}")
    job = job_factory(
        *model_overrides(family), *ALGOS[algo],
        "env.num_envs=2", "env.slots=1", "env.options.image_size=16", "env.options.max_episode_steps=6",
        "algo.batch_steps=8", "algo.minibatch_size=8", "algo.epochs=1",
    )
    fig = job.wait(lambda f: f["trainer_version"] >= 1 and f["policy_version"] >= 1, 240, f"{family} {algo}: one update published")
    assert fig["trainer"]["samples"] > 0
    assert fig["trainer"]["value_loss"] == 0.0 if algo == "grpo" else True
