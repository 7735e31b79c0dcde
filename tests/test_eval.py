"""Evaluation beside training: dedicated slots run held-out starts deterministically every
``eval_every`` versions while the training slots keep stepping; success per version is reported."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlvla3.lifetime import launcher_env

pytestmark = pytest.mark.slow


def test_eval_rounds_run_in_dedicated_slots_without_pausing_training(job_factory):
    """In sync mode, which must not wait for idle eval slots either (async eval rounds: the
    `rlvla3 run` of tests/test_run_outputs.py)."""
    job = job_factory("run.mode=sync", "env.num_envs=6", "env.slots=3", "env.eval_slots=1", "env.eval_every=2",
                      "env.eval_episodes=4", "env.options.max_episode_steps=20")
    fig = job.wait(lambda f: len(f["eval"]) >= 2 and all(e["episodes"] >= 4 for e in list(f["eval"].values())[:2])
                   and f["policy_version"] >= 3, 180, "two evaluation rounds of 4 episodes, sync training on")
    assert fig["errors"] == 0
    versions = sorted(int(v) for v in fig["eval"])
    assert versions[0] == 0 and versions[1] >= versions[0] + 2  # the start, then every 2 versions at most
    for v in versions[:2]:
        e = fig["eval"][str(v)]
        assert e["episodes"] == 4 and e["round"] == 4 and 0.0 <= e["success"] <= 1.0  # a whole round
    # training went on meanwhile: its episodes are counted apart from the evaluation ones
    assert fig["episodes"] > 8 and fig["policy_version"] >= versions[1]
    assert fig["trainer"].get("version", 0) >= versions[1]
    # `rlvla3 status` shows the newest version whose round is whole
    r = subprocess.run([sys.executable, "-m", "rlvla3", "status", "--broker", job.endpoint], capture_output=True,
                       text=True, timeout=60, env={**os.environ, **launcher_env()})
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("latest eval: version"))
    assert int(line.split()[3]) >= versions[1] and "success=" in line
