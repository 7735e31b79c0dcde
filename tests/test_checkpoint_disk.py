"""A full disk under a running job: each refused checkpoint is one error line, training goes on,
the older checkpoints stay whole, and checkpoints resume once there is room again.

The run folder's ``checkpoints/`` is a small tmpfs of its own (root), so the logs and metrics
beside it still have room: the test is about the checkpoint writes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import errno

import pytest
import torch
from safetensors.torch import load_file

from rlvla3.harness.jobs import Job
from workers.checkpoint import CHECKPOINTS, latest_checkpoint, save_checkpoint

pytestmark = pytest.mark.slow


def _fill(folder: Path) -> Path:
    """Write a file into ``folder`` until the disk refuses; returns it."""
    filler = folder / ".filler"
    chunk = b"\0" * 65536
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError:
            pass
    return filler


def _need_root() -> None:
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs as root: mounting a small tmpfs must work there")
        pytest.skip("needs root to mount a small tmpfs")


def _lines(job: Job, event: str) -> list[str]:
    return [line for line in (job.run_dir / "trainer0.log").read_text().splitlines() if event in line]


def test_a_disk_that_fills_inside_the_optimizer_state_is_an_os_error(tmp_path: Path):
    """The weights fit and the optimizer state does not: torch.save's own writer would raise a
    RuntimeError with no errno, which a trainer does not take for a full disk."""
    _need_root()
    ckpts = tmp_path / CHECKPOINTS
    ckpts.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(ckpts)], check=True)
    try:
        model = torch.nn.Linear(256, 512)  # 0.5 MB of weights, 1 MB of Adam state
        opt = torch.optim.Adam(model.parameters())
        model(torch.zeros(1, 256)).sum().backward()
        opt.step()
        with pytest.raises(OSError) as exc:
            save_checkpoint(tmp_path, model, opt, 1, {}, "run: {}\n")
        assert exc.value.errno == errno.ENOSPC and "optimizer.pt" in str(exc.value), exc.value
        assert list(ckpts.iterdir()) == []  # the refused save left nothing
    finally:
        subprocess.run(["umount", "-l", str(ckpts)], check=False)


def test_a_full_disk_fails_checkpoints_loudly_and_training_goes_on(job_factory):
    _need_root()
    # Every checkpoint is kept: pruning frees a checkpoint's room, and a save that finished its
    # writes just before the disk filled would then free room for the next and the next.
    job = job_factory("algo.checkpoint_every=1", "algo.keep_checkpoints=0", start=False)
    ckpts = job.run_dir / "checkpoints"
    ckpts.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(ckpts)], check=True)
    try:
        job.start_all()
        job.wait(lambda f: latest_checkpoint(job.run_dir) is not None and f["trainer_version"] >= 2, 180, "a first checkpoint")
        filler = _fill(ckpts)
        # A save the trainer began before the disk filled may still be renamed into place, so
        # the checkpoint kept is read once a save has been refused (saves run one at a time).
        job.wait(lambda f: len(_lines(job, "checkpoint_failed")) >= 1, 180, "a first refused checkpoint")
        kept = latest_checkpoint(job.run_dir)
        full_at = job.status()["trainer_version"]
        job.wait(lambda f: f["trainer_version"] >= full_at + 3 and len(_lines(job, "checkpoint_failed")) >= 3, 180,
                 "training on past two more refused checkpoints")
        failed = _lines(job, "checkpoint_failed")
        assert all("No space left on device" in line and "errno=28" in line for line in failed), failed
        log = (job.run_dir / "trainer0.log").read_text()
        assert "Traceback" not in log and "update_failed" not in log
        # The checkpoint from before the disk filled is still the newest complete one, and whole.
        assert latest_checkpoint(job.run_dir) == kept
        assert load_file(str(kept / "model.safetensors"))
        filler.unlink()
        saved = len(_lines(job, "checkpoint_saved"))
        job.wait(lambda f: len(_lines(job, "checkpoint_saved")) > saved, 120, "a checkpoint once there is room")
        newest = latest_checkpoint(job.run_dir)
        assert newest is not None and newest.name > kept.name
        # What the refused saves started is gone; a save of a newer version may be under way.
        left = [p.name for p in ckpts.iterdir() if p.name.startswith(".tmp-")]
        assert all(name.split("-")[1] > newest.name for name in left), (newest.name, left)
    finally:
        job.stop()
        subprocess.run(["umount", "-l", str(ckpts)], check=False)
