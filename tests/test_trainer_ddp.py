"""Two CPU trainer ranks (gloo) through the real broker: the broker spreads trajectories over
both, they update together, and their weights are identical after every update."""

import json


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_two_trainer_ranks_stay_identical(job_factory):
    job = job_factory("workers.trainers=2", "algo.check_replicas=true")
    job.wait(lambda f: f["workers"]["trainer"] == 2, 60, "two trainers joined")
    job.wait(lambda f: f["trainer_version"] >= 3, 180, "three updates by the trainer group")
    job.stop()  # metrics are flushed at shutdown
    r0 = _rows(job.run_dir / "trainer_metrics.jsonl")
    r1 = _rows(job.run_dir / "trainer_metrics.rank1.jsonl")
    assert {r["rank"] for r in r0} == {0} and {r["rank"] for r in r1} == {1}
    by_version = {}
    for r in r0 + r1:
        by_version.setdefault(r["version"], []).append(r)
    both = {v: rs for v, rs in by_version.items() if len(rs) == 2}
    assert len(both) >= 3, by_version.keys()
    for v, (a, b) in both.items():
        assert a["param_checksum"] == b["param_checksum"], f"replicas differ after version {v}"
        assert a["batch_len"] == b["batch_len"]  # same number of minibatches on every rank
        assert a["samples"] > 0 and b["samples"] > 0  # each rank trained on its own trajectories
    # rank 0 wrote the checkpoint at shutdown
    assert (job.run_dir / "checkpoints" / "latest").is_file()
