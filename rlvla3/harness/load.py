"""A bounded load on this machine: busy processes and an fsync'd writer, as a stop must survive.

Each load process ends by itself after its deadline, and the context manager kills whatever is
left, so a failing test never leaves the machine loaded."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
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
