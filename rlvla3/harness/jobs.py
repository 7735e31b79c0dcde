"""A job on this machine through the real launcher (``rlvla3.app.launch.LocalJob``), watched from
outside: poll its STATUS until a condition or a deadline, env steps/s over a window, the RSS of
its processes; an ``rlvla3`` command run to its end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from rlvla3.app.launch import LocalJob
from rlvla3.lifetime import launcher_env
from rlvla3.status_client import DeadlinePassed, rate_over, wait_until

SMALL_JOB = (
    "env.num_envs=4", "env.slots=2", "env.fragment_len=8",
    "env.options.latency={kind: constant, mean_ms: 1.0}", "env.options.image_size=8",
    "algo.batch_steps=64", "algo.minibatch_size=32", "algo.epochs=1",
    "batching.max_batch=8", "batching.max_wait_ms=2", "model.options.hidden=32",
    "workers.simulators=1", "workers.generators=1", "workers.trainers=1",
)
"""Overrides for a small, quick synthetic job (few envs, short fragments, tiny updates), one worker
per role: quick on a 2-core machine."""


def run_command(argv: list[str], timeout: float | None = 240, env: dict[str, str] | None = None,
                **popen: Any) -> subprocess.CompletedProcess:
    """``argv`` run to its end as a user runs it, but ending with this process
    (``rlvla3/lifetime.py``); stdout and stderr captured as text. ``env`` adds to this one's."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {}), **launcher_env()}, **popen)


def run_cli(*args: str, timeout: float | None = 240, **popen: Any) -> subprocess.CompletedProcess:
    """``python -m rlvla3 ARGS`` through :func:`run_command`: the real entry point."""
    return run_command([sys.executable, "-m", "rlvla3", *args], timeout, **popen)


def start_cli(*args: str, **popen: Any) -> subprocess.Popen:
    """``python -m rlvla3 ARGS`` started, not waited for; it ends with this process, also when this one is killed."""
    return subprocess.Popen([sys.executable, "-m", "rlvla3", *args], env={**os.environ, **launcher_env()}, **popen)


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a file written a line at a time (``metrics.jsonl``, a JSON log); other
    lines, the one being written included, are skipped."""
    rows = []
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def rss_mb(pid: int) -> float | None:
    """Resident memory of process ``pid`` in MiB (None: it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def per_worker(fig: dict[str, Any], name: str) -> dict[str, Any]:
    """One worker's row of a STATUS answer (empty when it is not registered)."""
    return next((w for w in fig.get("per_worker", []) if w["name"] == name), {})


def generator_serving(fig: dict[str, Any]) -> bool:
    """Whether a generator has told the broker it has credits (it takes batches)."""
    return any(w["role"] == "generator" and (w.get("credits") or 0) > 0 for w in fig.get("per_worker", []))


_SHOWN = ("uptime_s", "trainer_version", "workers", "env_steps", "acked_steps", "traj", "trajs_pending", "trainer")
"""The figures a failed wait shows."""


class Job(LocalJob):
    """A LocalJob watched from outside; any process that dies with an error fails a wait at once."""

    def wait(self, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        """STATUS until ``pred(figures)`` holds (those figures), or fail naming ``what`` with the
        last figures seen and the logs' tails (a failure on a loaded CI machine is then readable)."""
        seen: list[dict[str, Any]] = []

        def check() -> dict[str, Any] | None:
            self.assert_alive()
            f = self.status()
            seen[:] = [f]
            return f if pred(f) else None

        try:
            return wait_until(check, timeout, what, interval=0.1)
        except DeadlinePassed as err:
            last = {k: seen[0].get(k) for k in _SHOWN} if seen else None
            raise DeadlinePassed(f"{err}\nlast figures: {last}\n{self.logs(1500)}") from None

    def assert_alive(self) -> None:
        for p in [self.broker_proc, *self.workers]:
            if p is not None and p.poll() is not None and p.returncode not in (0, -9, -15):
                raise AssertionError(f"a process exited with {p.returncode}\n{self.logs(3000)}")

    def rate(self, seconds: float, key: str = "env_steps") -> dict[str, Any]:
        """``key`` per second over a ``seconds`` window of STATUS (``rlvla3.status_client.rate_over``)."""
        return rate_over(self.status, seconds, key)

    def logs(self, tail: int = 2500) -> str:
        """The tail of every log in the run folder (for failure messages)."""
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}" for f in sorted(self.run_dir.glob("*.log")))


def start_job(cfg: Any, run_dir: Path, workers: bool = True, bind: str = "tcp://127.0.0.1:0",
              pub: str = "tcp://127.0.0.1:0", log_json: bool = False) -> Job:
    """``cfg`` written into ``run_dir`` (made), its broker up on ``bind``/``pub`` (by default free
    loopback ports) and, with ``workers``, the config's workers started. Stopped again if any of
    that fails; otherwise the caller stops it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    job = Job(cfg, run_dir, run_dir / "config.yaml", log_json=log_json)
    try:
        job.start_broker(bind, pub)
        if workers:
            job.start_all()
    except BaseException:
        job.stop()
        raise
    return job
