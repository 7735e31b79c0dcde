"""Two CPU trainer ranks (gloo) through the real broker: the broker spreads trajectories over
both, they update together, and their weights are identical after every update (one job, with
two generators, that also learns)."""

import json


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def replicas_identical(run_dir) -> None:
    """Both ranks' metric rows: each rank's own, and the same weights after every version both
    logged (``algo.check_replicas`` also checks this inside the group, after every update)."""
    r0 = _rows(run_dir / "trainer_metrics.jsonl")
    r1 = _rows(run_dir / "trainer_metrics.rank1.jsonl")
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
    assert (run_dir / "checkpoints" / "latest").is_file()


def _version(log_line):
    return int(log_line.split(" version=")[1].split()[0])


LEARN = ("env.num_envs=8", "env.slots=4", "env.fragment_len=16", "algo.batch_steps=256",
         "algo.minibatch_size=64", "algo.epochs=4", "model.options.hidden=64", "env.options.image_size=16")


def test_two_generators_two_trainers_learn_through_the_weight_store(job_factory):
    """Weights go from rank 0's shared-memory store to both generators (the broker passes only
    announcements), each generator swaps versions in between the batches it serves, and the job
    still learns the synthetic task. Async: every rank tells the broker the steps it took, or
    admission would stop after max_staleness + 1 batches."""
    job = job_factory(*LEARN, "workers.trainers=2", "workers.generators=2", "run.mode=async", "algo.check_replicas=true")
    fig = job.wait(lambda f: f["env_steps"] >= 6000 and f["return_recent"] is not None, 240, "6000 steps")
    assert fig["return_recent"] > 1.5, fig["return_recent"]  # a random policy's return is about 0
    assert fig["errors"] == 0 and fig["workers"]["generator"] == 2 and fig["workers"]["trainer"] == 2
    job.stop()  # metrics are flushed at shutdown
    replicas_identical(job.run_dir)
    broker = (job.run_dir / "broker.log").read_text()
    published = [line for line in broker.splitlines() if "weights_published" in line]
    assert _version(published[0]) == 0 and len(published) >= 3  # version 0 from rank 0, then updates
    # the broker sent announcements (a manifest), a few KB whatever the model's bytes
    assert all(int(line.split("announcement_bytes=")[1].split()[0]) < 16_000 for line in published)
    for gen in ("generator0", "generator1"):
        events = (job.run_dir / f"{gen}.log").read_text().splitlines()
        serving = next(i for i, line in enumerate(events) if "generator_serving" in line)
        swaps = [line for line in events[serving:] if "weights_swapped" in line]
        assert len(swaps) >= 2 and all("source=shm" in line for line in swaps), gen  # swapped while serving
        assert _version(next(line for line in events if "weights_swapped" in line)) == 0  # rank 0's v0 first
