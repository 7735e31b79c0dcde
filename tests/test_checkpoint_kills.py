"""Checkpoints that cannot be torn: SIGKILLs timed to land inside writes, full and sharded (DCP).

After every kill, the run's newest complete checkpoint is the newest write that finished, it
loads, and the next save tidies what the killed one left. Every fourth round writes a version
that already has a checkpoint, so kills also land while one is being replaced."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from workers.checkpoint import CHECKPOINTS, latest_checkpoint, load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
KILLS = 20
MODEL_MB = 16
"""With Adam state, about 50 MB a write: long enough to aim a kill inside it."""


class Writer:
    """The ``tests.checkpoint_writer`` process, driven line by line; one serves every case."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.checkpoint_writer", str(MODEL_MB)],
                                     cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        assert self.expect("ready", 120) == ["ready"]

    def expect(self, word: str, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"the writer exited ({self.proc.poll()}) before {word!r}")
            if line.split()[0] == word:
                return line.split()
        raise AssertionError(f"no {word!r} within {timeout_s} s")

    def save(self, run_dir: Path, fmt: str, version: int, kill_after_s: float | None) -> bool:
        """Write ``version`` in ``fmt`` into ``run_dir``; SIGKILL the writing child ``kill_after_s``
        into it. True when the write finished (the kill came too late)."""
        assert self.proc.poll() is None, f"the writer exited ({self.proc.returncode})"
        self.proc.stdin.write(f"save {version} {fmt} {run_dir}\n")
        _, _, pid = self.expect("start", 60)
        if kill_after_s is not None:
            time.sleep(kill_after_s)  # aiming a kill inside the write
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.expect("exit", 120)[2] == "0"

    def close(self) -> None:
        self.proc.kill()  # nothing left to write; torch's interpreter teardown takes seconds under load
        self.proc.wait(30)
        self.proc.stdin.close()
        self.proc.stdout.close()


def model_like_the_writers() -> nn.Module:
    width = 1024
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(max(1, int(MODEL_MB * 2**20 / 4 / width / width)))])


@pytest.fixture(scope="module")
def writer():
    """One writer for both formats: its torch import and model build are most of a case's time."""
    w = Writer()
    yield w
    w.close()


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_kills_inside_writes_never_tear_a_checkpoint(tmp_path: Path, fmt: str, writer: Writer):
    rng = random.Random(0)
    model = model_like_the_writers()  # loaded into after every kill
    assert writer.save(tmp_path, fmt, 1, None)
    t0 = time.monotonic()
    assert writer.save(tmp_path, fmt, 2, None)  # the second clean write is the one timed: the first warms up
    write_s = time.monotonic() - t0
    newest, version, torn = 2, 2, 0
    for i in range(KILLS):
        version = newest if i % 4 == 3 else version + 1  # every fourth: replace the newest
        finished = writer.save(tmp_path, fmt, version, rng.uniform(0.0, 0.5) * write_s)
        torn += not finished
        found = latest_checkpoint(tmp_path)
        listing = (i, version, finished, sorted(os.listdir(tmp_path / CHECKPOINTS)))
        # A killed write counts once its rename published it (the kill hit the pointer or
        # the pruning); otherwise the newest before it is still the newest.
        assert found is not None and found.name in {f"v{newest:08d}", f"v{version:08d}"}, listing
        assert finished <= (found.name == f"v{max(newest, version):08d}"), listing
        newest = int(found.name[1:])
        assert load_checkpoint(tmp_path, model, restore_rng=False)["version"] == newest
    assert torn >= KILLS // 4, f"only {torn} of {KILLS} kills landed inside a write ({write_s:.2f} s each)"
    assert writer.save(tmp_path, fmt, version + 1, None)  # a clean save tidies every leftover
    left = sorted(p.name for p in (tmp_path / CHECKPOINTS).iterdir() if p.name.startswith("."))
    assert left == [], left
    assert latest_checkpoint(tmp_path).name == f"v{version + 1:08d}"
