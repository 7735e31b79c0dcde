"""A bounded load on this machine: busy processes and an fsync'd writer, as a stop must survive.

Each load process ends by itself after its deadline, and the context manager kills whatever is
left, so a failing test never leaves the machine loaded.

A test that loads the machine on purpose has it to itself (:func:`machine_alone`): every other
test holds the machine shared while it runs (:func:`machine_shared`, the test suite's autouse
fixture), so the load never starves a test beside it on another pytest worker into missing its
heartbeats. Two ``flock`` files make a writer-first lock: the gate stops new tests from starting
while the loader waits for the running ones to end."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

_BUSY = "import time\nend = time.time() + {s}\nwhile time.time() < end:\n    pass\n"
_WRITER = (
    "import os, time\nend = time.time() + {s}\nbuf = os.urandom(1 << 20)\n"
    "while time.time() < end:\n"
    "    with open({path!r}, 'wb') as f:\n"
    "        for _ in range({mb}):\n"
    "            f.write(buf)\n"
    "            if time.time() > end:\n"
    "                break\n"
    "        f.flush()\n"
    "        os.fsync(f.fileno())\n"
    "os.unlink({path!r})\n"
)


@contextlib.contextmanager
def machine_load(seconds: float, busy_per_core: int = 4, write_mb: int = 256) -> Iterator[None]:
    """``busy_per_core`` × cores busy loops plus one writer of fsync'd ``write_mb`` MB files, for
    at most ``seconds``."""
    fd, path = tempfile.mkstemp(prefix="rlvla3-load-")
    os.close(fd)
    procs = [subprocess.Popen([sys.executable, "-c", _BUSY.format(s=seconds)])
             for _ in range(busy_per_core * (os.cpu_count() or 1))]
    procs.append(subprocess.Popen([sys.executable, "-c", _WRITER.format(s=seconds, path=path, mb=write_mb)]))
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def machine_folder(tmp_path_factory) -> Path:
    """A folder every pytest worker of one test run shares: each worker's base temp is one below it."""
    return Path(tmp_path_factory.getbasetemp()).parent


@contextlib.contextmanager
def _locked(path: Path, how: int) -> Iterator[None]:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases its lock


@contextlib.contextmanager
def machine_shared(folder: Path) -> Iterator[None]:
    """Held while a test runs: the gate is passed, then the lock held shared."""
    fd = os.open(folder / "machine.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        with _locked(folder / "machine.gate", fcntl.LOCK_EX):
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def machine_alone(folder: Path) -> Iterator[None]:
    """The machine to this process alone: waits for the running tests to end, and no new one
    starts until it is let go."""
    with _locked(folder / "machine.gate", fcntl.LOCK_EX), _locked(folder / "machine.lock", fcntl.LOCK_EX):
        yield
