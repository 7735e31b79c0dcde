"""What the benchmarks share: histograms, percentile plots, CPU clocks of a process,
sub-millisecond waits on a ZMQ socket, child processes that announce their endpoint, JSON out.

Benchmarks follow the project's habits: open-loop (a request is due at ``t0 + i/rate``, latency
counts from when it was due), HdrHistogram in microseconds, percentile plots on a log axis, one
JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import zmq
from hdrh.histogram import HdrHistogram

from rlvla3.lifetime import launcher_env

OUT_DIR = "bench/out"
"""Where a benchmark writes unless ``--out`` says otherwise: relative to the current folder, so the
README's commands (run from the repository root) write into the git-ignored ``bench/out/``."""


def new_hist() -> HdrHistogram:
    """1 us .. 60 s at 3 significant digits (values in microseconds)."""
    return HdrHistogram(1, 60_000_000, 3)


def record_us(h: HdrHistogram, ns: int) -> None:
    h.record_value(min(60_000_000, max(1, ns // 1000)))


def summary(h: HdrHistogram) -> dict[str, Any]:
    """count, p50/p90/p99/p999, max and mean of a histogram (us)."""
    if not h.get_total_count():
        return {"count": 0}
    return {"count": h.get_total_count(),
            **{key: h.get_value_at_percentile(p) for key, p in (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p999", 99.9))},
            "max": h.get_max_value(), "mean": round(h.get_mean_value(), 1)}


def merged(hists: Iterable[HdrHistogram]) -> HdrHistogram:
    out = new_hist()
    for h in hists:
        out.add(h)
    return out


def percentile_plot(curves: dict[str, HdrHistogram], path: Path, title: str) -> Path:
    """HdrHistogram-style plot: x = percentile on a log scale of 1/(1-p), 50 .. 99.99; y = us."""
    import numpy as np

    xs = np.linspace(np.log10(2), 4, 200)  # 1/(1-p) from 2 (p50) to 10^4 (p99.99)
    fig, ax = subplots(figsize=(7, 4.2))
    for label, h in curves.items():
        if not h.get_total_count():
            continue
        ys = [h.get_value_at_percentile(100.0 * (1 - 10 ** -x)) for x in xs]
        ax.plot(10 ** xs, ys, label=label)
    ax.set(xscale="log", yscale="log", xlabel="percentile", ylabel="latency (us)")
    ax.set_xticks([2, 10, 100, 1000, 10000], ["50%", "90%", "99%", "99.9%", "99.99%"])
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def subplots(*args: Any, **kw: Any) -> tuple[Any, Any]:
    """``plt.subplots`` on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kw)


def save_figure(fig: Any, path: Path, dpi: int = 110) -> Path:
    """Lay out, write and close a matplotlib figure (its folder made); the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _stat_cpu(stat: Path) -> tuple[str, float]:
    """The command name and user + system CPU seconds in a ``/proc`` ``stat`` file."""
    head, tail = stat.read_text().rsplit(")", 1)
    fields = tail.split()
    return head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far, all its threads (``/proc/PID/stat``)."""
    return _stat_cpu(Path(f"/proc/{pid}/stat"))[1]


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU time of process ``pid`` so far by thread: ``main`` (the thread that runs Python's
    loop), ``zmq_io`` (libzmq's own ``ZMQbg/*`` threads: I/O and reaper) and ``other``."""
    out = {"main": 0.0, "zmq_io": 0.0, "other": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm, seconds = _stat_cpu(task / "stat")
        except OSError:  # the thread ended meanwhile
            continue
        out["main" if task.name == str(pid) else "zmq_io" if comm.startswith("ZMQbg") else "other"] += seconds
    return out


def wait_readable(sock: zmq.Socket, timeout_s: float, spin_s: float = 0.0) -> bool:
    """Wait until ``sock`` has a message, at most ``timeout_s``, to the sub-millisecond (``zmq_poll``
    counts whole milliseconds, too coarse for ~100 us round trips). ZMQ_FD is edge-triggered: ask
    ZMQ_EVENTS first (it also resets the edge), only then sleep in ``select`` on the fd. The last
    ``spin_s`` are spun instead: a VM's timer wake-up from idle overshoots by 100-300 us, which an
    open-loop client would add to every request it sends late."""
    if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        return True
    end = time.perf_counter() + timeout_s
    fd = sock.getsockopt(zmq.FD)
    while (left := end - time.perf_counter()) > spin_s:
        select.select([fd], [], [], left - spin_s)
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            return True
    while time.perf_counter() < end:
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            return True
    return bool(sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)


def parse_bench_args(ap: argparse.ArgumentParser, quick_help: str | None,
                     child: Callable[[argparse.Namespace], None] | None = None,
                     smoke_help: str = "tiny run for CI (no timing value)", out: str = OUT_DIR) -> argparse.Namespace | None:
    """Add the options every benchmark takes (``--out``, ``--quick`` unless ``quick_help`` is None,
    ``--smoke``) and parse the command line. With ``child``, a hidden ``--child`` too: a process started with it (by
    :func:`start_child`) runs ``child(args)`` and gets None: it is the benchmark's helper."""
    ap.add_argument("--out", default=out, help=f"folder for what it writes (default: ./{out})")
    if quick_help is not None:
        ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--smoke", action="store_true", help=smoke_help)
    if child is not None:
        ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if child is None or not args.child:
        return args
    child(args)
    return None


def read_line(proc: subprocess.Popen, timeout_s: float) -> str | None:
    """One line of a child's stdout within ``timeout_s`` (None: it ended or timed out first),
    read a byte at a time so that its later lines stay in the pipe."""
    fd = proc.stdout.fileno()
    buf = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if r:
            chunk = os.read(fd, 1)
            if not chunk:
                return None
            if chunk == b"\n":
                return buf.decode()
            buf += chunk
    return None


def start_child(args: list[str], timeout_s: float = 30.0, talk: bool = False) -> tuple[subprocess.Popen, str]:
    """Start ``python args...``; it must print one line (its endpoint) on stdout at once, and call
    ``rlvla3.lifetime.follow_launcher()`` first so that it ends with this process. ``talk``: its
    stdin is a pipe (commands from this process; its later stdout lines are the answers)."""
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE if talk else subprocess.DEVNULL, env={**os.environ, **launcher_env()})
    line = read_line(proc, timeout_s)
    if line is not None:
        return proc, line.strip()
    stop_child(proc)
    raise RuntimeError(f"child {args} did not announce its endpoint within {timeout_s} s (rc={proc.poll()})")


def stop_child(proc: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """End a child. One that talks first sees the end of its stdin and may leave on its own (a
    simulator frees its shared memory that way); then SIGTERM, then SIGKILL."""
    from rlvla3.app.launch import stop_processes

    if proc.stdin is not None:
        proc.stdin.close()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    stop_processes([proc], timeout_s)
    if proc.stdout is not None:
        proc.stdout.close()


class BenchRun(contextlib.ExitStack):
    """A benchmark's run, as ``with BenchRun(name, curve) as run``: a fresh temporary folder
    (``dir``), with ``curve`` a key folder in it (``keys``: ``rlvla3 keys``, the broker's pair and
    one per role; else None). On the way out, what was pushed on it is undone (last first: the
    children of :meth:`child`, a job's ``stop``, sockets); then the folder goes when ``ok`` was
    set, else stays and a note says where."""

    def __init__(self, name: str, curve: bool = False) -> None:
        import tempfile

        from rlvla3 import auth

        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix=f"rlvla3_bench_{name}_"))
        self.keys = str(self.dir / "keys") if curve else None
        if self.keys:
            auth.make_keys(self.keys)
        self.ok = False

    def child(self, args: list[str], **kw: Any) -> tuple[subprocess.Popen, str]:
        """:func:`start_child`, stopped with the run."""
        proc, line = start_child(args, **kw)
        self.callback(stop_child, proc)
        return proc, line

    def __exit__(self, *exc: Any) -> bool:
        import shutil

        try:
            return super().__exit__(*exc)
        finally:
            if self.ok:
                shutil.rmtree(self.dir, ignore_errors=True)
            else:
                note(f"logs kept in {self.dir}")


def shm_slots(run_id: str, slots: int, n: int, cameras: dict[str, tuple[int, int]],
              state_dim: int) -> tuple[Any, list[Any], list[dict[str, Any]]]:
    """A pool with an observation block of ``n`` envs per slot, as a simulator keeps them: the
    pool, the blocks (views: clear them before closing the pool) and each one's descriptors."""
    from rlvla3.shm import ShmPool, block_refs, observation_block

    pool = ShmPool(run_id, slots * (n * (sum(h * w * 3 for h, w in cameras.values()) + state_dim * 4) + 256) + 4096)
    blocks = [observation_block(pool, cameras, state_dim, n) for _ in range(slots)]
    return pool, blocks, [block_refs(b) for b in blocks]


def load_avg() -> list[float]:
    """The machine's 1, 5 and 15-minute load averages: a shared machine's figures carry them."""
    return [round(x, 2) for x in os.getloadavg()]


def random_observation(spec: Any, n: int, rng: Any, instruction: str = "reach") -> Any:
    """``n`` envs of random camera images and proprio state for an env spec: a policy's input."""
    import numpy as np

    from rlvla3.observation import Observation

    return Observation({c: rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8) for c, (h, w) in spec.cameras.items()},
                       rng.uniform(-1, 1, (n, spec.state_dim)).astype(np.float32), [instruction] * n)


def emit(result: dict[str, Any]) -> None:
    """The benchmark's result: one JSON object, the last line of stdout."""
    sys.stdout.flush()
    print(json.dumps(result, sort_keys=False), flush=True)


def emit_to(out: str | Path, name: str, result: dict[str, Any], **file_only: Any) -> None:
    """Write ``result`` and ``file_only`` to ``out/name`` (the folder made), then :func:`emit` the result."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps({**result, **file_only}, indent=1))
    emit(result)


def note(msg: str) -> None:
    """Progress for humans, on stderr (stdout's last line is the JSON)."""
    print(msg, file=sys.stderr, flush=True)
