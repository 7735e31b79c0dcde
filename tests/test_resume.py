"""``rlvla3 run --resume RUN_DIR`` continues at the checkpoint's version with the same config."""

import json
import signal
import subprocess
import sys


def _run(*args, timeout=180):
    out = subprocess.run([sys.executable, "-m", "rlvla3", "run", *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _versions(run_dir):
    return [json.loads(line)["version"] for line in (run_dir / "trainer_metrics.jsonl").read_text().splitlines()]


def test_resume_refuses_a_run_without_checkpoint(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rlvla3", "run", "--resume", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no checkpoint" in out.stderr


def test_sigterm_leaves_a_checkpoint_that_resume_continues_from(job_factory):
    """Preemption: a trainer of a running job that gets SIGTERM checkpoints its last trained
    version before it exits (checkpoint_every=0: no periodic checkpoint to fall back on), and
    ``rlvla3 run --resume`` continues from exactly that version, with the same config, and
    leaves its own shutdown checkpoint at its last version."""
    job = job_factory("algo.checkpoint_every=0")
    job.wait(lambda f: f["trainer_version"] >= 2, 180, "two updates")
    trainer = job.workers[0]  # start_all starts the trainers first
    assert "trainer0" in " ".join(map(str, trainer.args))
    assert not (job.run_dir / "checkpoints").exists()
    trainer.send_signal(signal.SIGTERM)
    assert trainer.wait(60) == 0
    latest = (job.run_dir / "checkpoints" / "latest").read_text().strip()
    saved = int(latest[1:])
    assert saved >= 2 and saved == _versions(job.run_dir)[-1]  # the version it had trained to
    assert "checkpoint_saved" in (job.run_dir / "trainer0.log").read_text()
    job.stop()
    n_first = len(_versions(job.run_dir))
    config_before = (job.run_dir / "config.yaml").read_text()

    second = _run("--resume", str(job.run_dir), "--steps", "600")
    assert second["reason"] == "steps_reached"
    assert (job.run_dir / "config.yaml").read_text() == config_before
    trainer_log = (job.run_dir / "trainer0.log").read_text()
    assert f"resumed_from={job.run_dir}/checkpoints/{latest}" in trainer_log
    assert f"version={saved}" in trainer_log
    # the resumed trainer published its version first, then counted on from there
    resumed = _versions(job.run_dir)[n_first:]
    assert resumed and resumed == list(range(saved + 1, saved + 1 + len(resumed)))
    broker_runs = (job.run_dir / "broker.log").read_text().split("broker_started")
    published = [int(line.split("version=")[1].split()[0]) for line in broker_runs[-1].splitlines() if "weights_published" in line]
    assert published[0] == saved
    # rlvla3 run's own stop: the shutdown checkpoint is the last version
    assert int((job.run_dir / "checkpoints" / "latest").read_text().strip()[1:]) == resumed[-1]
