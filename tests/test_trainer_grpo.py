"""GRPO end to end through the fabric: groups of episodes from one seed, zero-variance filtering.

Real broker, simulator, generator and trainer processes on the synthetic task. Success is the
group score (``algo.grpo_reward: success``): a random policy mostly fails, so many groups are
all-fail (no signal: filtered and counted) and some are mixed (trained on).
"""

import json

GRPO = (
    "algo.name=grpo", "env.group_size=2", "algo.max_staleness=1000",
    "algo.batch_steps=48", "algo.minibatch_size=48", "env.options.max_episode_steps=30",
)


def test_grpo_steps_through_fabric_and_keeps_going_in_sync_mode(job_factory):
    """One job in sync mode. The alternating broker pauses after batch_steps delivered; a GRPO
    trainer whose groups are still incomplete asks it to go on (TRAIN starved), as often as
    needed; its batches hold whole groups, and zero-variance groups are filtered. (GRPO in async
    mode: every family in tests/test_vla_fabric.py.)"""
    job = job_factory(*GRPO, "run.mode=sync", "algo.batch_steps=96")
    fig = job.wait(lambda f: f["trainer_version"] >= 3, 180, "three GRPO updates in sync mode")
    assert fig["errors"] == 0
    assert fig["trainer"]["groups_complete"] >= 2
    job.wait(lambda f: (f["trainer"] or {}).get("groups_filtered_zero_variance", 0) >= 1, 120,
             "a zero-variance group filtered")
    job.stop()
    rows = [json.loads(line) for line in (job.run_dir / "trainer_metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows][:3] == [1, 2, 3]
    for r in rows:
        assert r["value_loss"] == 0.0  # no value head in GRPO
        assert r["samples"] > 0 and r["groups"] >= 1
    # every trained batch holds whole groups of group_size complete episodes
    assert all(r["episodes"] == 2 * r["groups"] for r in rows)
