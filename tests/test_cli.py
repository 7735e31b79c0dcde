"""The command line as a user runs it: config errors that name the key, --gpus parsing,
`rlvla3 run` with a tiny budget (CleanRL-style smoke test), `rlvla3 status --json`,
`rlvla3 worker --count` supervising several workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlvla3.app.run import RunRefused, require_model_options
from rlvla3.config import ConfigError, load
from rlvla3.config_rules import RENAMED
from rlvla3.harness.jobs import run_cli
from rlvla3.lifetime import launcher_env
from rlvla3.scale_config import parse_gpus
from tests.jobs import last_json


def test_every_shipped_config_loads():
    # A recipe whose keys drifted from the schema fails here, not when a user first runs it.
    paths = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert len(paths) >= 20
    for path in paths:
        load(path)


def test_parse_gpus():
    assert parse_gpus("0-3") == [0, 1, 2, 3]
    assert parse_gpus("0,2") == [0, 2]
    assert parse_gpus("1") == [1]
    assert parse_gpus("0-1,4") == [0, 1, 4]
    assert parse_gpus(None) == []
    for bad in ("3-1", "a", "0,0"):
        with pytest.raises(ValueError):
            parse_gpus(bad)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="batching.max_bach"):
        load("synthetic.yaml", ["batching.max_bach=3"])
    with pytest.raises(ConfigError, match="batching.max_batch"):
        load("synthetic.yaml", ["batching.max_batch=lots"])
    with pytest.raises(ConfigError, match="run.mode"):
        load("synthetic.yaml", ["run.mode=fast"])
    with pytest.raises(ConfigError, match="env.num_envs"):
        load("synthetic.yaml", ["env.num_envs=5", "env.slots=2"])
    cfg = load("synthetic.yaml", ["batching.max_batch=16", "env.options.latency={kind: constant, mean_ms: 3}"])
    assert cfg.batching.max_batch == 16 and cfg.env.options["latency"]["mean_ms"] == 3
    assert load("synthetic.yaml", ["algo.lr=1e-4"]).algo.lr == 1e-4  # YAML 1.1 reads 1e-4 as a string
    with pytest.raises(ConfigError, match="algo.lr"):
        load("synthetic.yaml", ["algo.lr=1e-4x"])
    with pytest.raises(ConfigError, match="broker.max_peer_msgs_per_s"):
        load("synthetic.yaml", ["broker.max_peer_msgs_per_s=0"])
    with pytest.raises(ConfigError, match="train.collective_timeout_s"):
        load("synthetic.yaml", ["train.collective_timeout_s=0"])
    with pytest.raises(ConfigError, match="algo.admission_lag"):  # ahead of the filter: made only to be dropped
        load("synthetic.yaml", ["algo.admission_lag=5", "algo.max_staleness=4"])
    assert load("synthetic.yaml", ["algo.admission_lag=null"]).algo.admission_lag is None
    with pytest.raises(ConfigError, match="weights.in_flight"):  # in-flight weights are published within every update
        load("synthetic.yaml", ["weights.in_flight=true", "algo.publish_every=2"])
    assert load("synthetic.yaml", ["weights.in_flight=true"]).weights.in_flight


def test_a_tilde_override_removes_a_key_so_its_default_applies():
    # pi0 under the pi0.5 recipe: the file's pi0.5-only option goes, the rest of model.options stays.
    cfg = load("metaworld_pi05_rgb.yaml", ["model.family=pi0", "~model.options.critic"])
    assert cfg.model.family == "pi0" and cfg.model.options == {"size": "tiny", "sampler": "sde", "num_steps": 4,
                                                                "noise_level": 0.5}
    require_model_options(cfg)  # the check `rlvla3 run` makes before it starts anything
    with pytest.raises(RunRefused, match=r"unknown option\(s\) \['critic'\]"):  # without the removal
        require_model_options(load("metaworld_pi05_rgb.yaml", ["model.family=pi0"]))
    assert load("synthetic.yaml", ["~algo.lr"]).algo.lr == load("synthetic.yaml", ["~algo"]).algo.lr
    for bad, says in (("~algo.lrr", "not set"), ("~model.options.size.x", "not set"), ("~algo.lr=1", "no value"),
                      ("algo.lr", "key=value or ~key")):
        with pytest.raises(ConfigError, match=says):
            load("synthetic.yaml", [bad])


def test_removed_keys_name_their_replacement():
    for old, new in RENAMED.items():
        with pytest.raises(ConfigError, match=f"{old} was removed: set {new} instead"):
            load("synthetic.yaml", [f"{old}=2"])
    with pytest.raises(ConfigError, match="env.group_size"):  # GRPO's groups are env.group_size
        load("synthetic.yaml", ["algo.name=grpo"])


def test_cli_rejects_unknown_key_before_starting_anything(tmp_path: Path):
    r = run_cli("run", "configs/synthetic.yaml", "--set", "algo.lrr=1", "--run-dir", str(tmp_path / "r"), timeout=60)
    assert r.returncode != 0 and "algo.lrr" in r.stderr


def test_a_worker_that_fails_its_setup_ends_the_run_with_its_error(tmp_path: Path):
    # algo.frozen names parameters, which only a built policy knows: the trainer refuses at setup
    r = run_cli("run", "configs/synthetic.yaml", "--steps", "600", "--run-dir", str(tmp_path / "r"),
                "--set", "algo.frozen=[nope]", "--set", "workers.simulators=1", timeout=120)
    assert r.returncode != 0
    assert last_json(r.stdout)["reason"].startswith("process_exited")
    assert "trainer0.log" in r.stderr and "nope" in r.stderr and "names no parameter of this policy" in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
def test_run_smoke_and_status(tmp_path: Path):
    run_dir = tmp_path / "run"
    r = run_cli("run", "configs/synthetic.yaml", "--steps", "600", "--run-dir", str(run_dir),
               "--set", "env.num_envs=4", "--set", "env.slots=2", "--set", "algo.batch_steps=64",
               "--set", "run.progress_every_s=0.5", "--set", "workers.simulators=1")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = last_json(r.stdout)
    assert summary["reason"] == "steps_reached" and summary["env_steps"] >= 600
    assert summary["shm_leftovers"] == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows and rows[-1]["env_steps"] >= 600
    assert (run_dir / "config.yaml").is_file() and (run_dir / "broker.log").is_file()


@pytest.mark.slow
def test_status_json_worker_count_and_a_trainer_beyond_the_group(job_factory):
    """One job: ``rlvla3 status --json``; ``rlvla3 worker --count 2`` supervising two simulators;
    a trainer beyond the group size (workers.trainers=1, one already joined) refused."""
    job = job_factory("workers.simulators=0")
    sims = job.start_worker("simulator", "pair", ["--count", "2", "--num-envs", "2", "--slots", "1"])
    job.wait(lambda f: f["workers"]["simulator"] == 2 and f["slots"] == 2 and f["workers"]["trainer"] == 1, 60,
             "two simulators from one --count 2, and the trainer")
    r = run_cli("status", "--broker", job.endpoint, "--json", timeout=30)
    fig = json.loads(r.stdout)
    for key in ("workers", "env_steps", "queue_depth", "policy_version"):
        assert key in fig
    assert fig["workers"]["simulator"] == 2
    sims.terminate()
    sims.wait(20)
    job.wait(lambda f: f["workers"]["simulator"] == 0, 30, "the supervisor stopping both children")
    extra = job.start_worker("trainer", "extra")  # it exits: the last step, after the job's last wait
    assert extra.wait(60) != 0
    assert "trainer group is full" in (job.run_dir / "extra.log").read_text()


@pytest.mark.slow
def test_ctrl_c_stops_every_process(tmp_path: Path):
    import signal
    import time

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "rlvla3", "run", "synthetic.yaml", "--steps", "10000000",
                             "--run-dir", str(run_dir), "--set", "run.progress_every_s=0.5",
                             "--set", "workers.simulators=1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **launcher_env()})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # poll the metrics file for progress
            rows = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
            if rows and json.loads(rows[-1])["env_steps"] > 100:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("no progress before Ctrl-C")
        pids = [json.loads((run_dir / "broker.json").read_text())["pid"]]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = last_json(out)
    assert summary["reason"] == "interrupted" and summary["shm_leftovers"] == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_run_controller_refuses_before_it_starts_anything(tmp_path):
    """``rlvla3 run``'s controller (rlvla3/app/run.py) names what cannot start a run, before any
    process starts or any folder is made."""
    from rlvla3.app.run import RunController, RunOptions, RunRefused

    with pytest.raises(RunRefused, match="drop CONFIG"):
        RunController.prepare(RunOptions(config="synthetic.yaml", resume=str(tmp_path)))
    with pytest.raises(RunRefused, match="no checkpoint"):
        RunController.prepare(RunOptions(resume=str(tmp_path)))
    with pytest.raises(RunRefused, match="batching.max_bach"):
        RunController.prepare(RunOptions(config="synthetic.yaml", overrides=("batching.max_bach=3",), run_dir=str(tmp_path / "r")))
    # The model's options are its family's: a key or value it does not take is named here, not by
    # each worker once started.
    with pytest.raises(RunRefused, match=r"unknown option\(s\) \['hiden'\]"):
        RunController.prepare(RunOptions(config="synthetic.yaml", overrides=("model.options.hiden=3",), run_dir=str(tmp_path / "r")))
    with pytest.raises(RunRefused, match="readout 'mode' not in"):
        RunController.prepare(RunOptions(config="synthetic_openvla_oft.yaml", overrides=("model.options.readout=mode",),
                                         run_dir=str(tmp_path / "r")))
    assert not (tmp_path / "r").exists()


def test_a_sync_batch_that_is_not_whole_rounds_is_named_before_the_run(tmp_path):
    """Sync trains every step at the version that acted it only when a batch is whole rounds
    (2 simulators x 8 envs x 16 decisions = 256 in synthetic.yaml); otherwise ``rlvla3 run``
    says so before it starts."""
    from rlvla3.app.run import RunController, RunOptions

    for batch_steps, noted in ((100, True), (512, False)):
        lines: list[str] = []
        RunController.prepare(RunOptions(config="synthetic.yaml", overrides=("run.mode=sync", f"algo.batch_steps={batch_steps}"),
                                         run_dir=str(tmp_path / str(batch_steps))), echo=lines.append)
        assert any("not a whole number of sync rounds of 256" in line for line in lines) == noted, lines
