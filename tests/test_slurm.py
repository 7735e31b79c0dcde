"""The Slurm recipe on a real Slurm: munged, slurmctld and slurmd for one CPU-only node, started
here from a config in a temporary folder, and ``deploy/slurm/rlvla3.sbatch`` submitted the way
deploy/README.md shows. Three jobs: one stopped by ``STEPS``, then one that resumes it and is
stopped by ``scancel --batch --signal=USR1`` (what ``--signal=B:USR1@120`` sends before a time
limit), then one that resumes that and is ended by a plain ``scancel``. Each must leave a
checkpoint, no process of the run (by the pids its logs name) and no shared-memory segment.

Needs Debian's ``slurm-wlm`` and ``munge`` and root (slurmd starts jobs as their user); CI
installs them (``scripts/bootstrap.sh``). Elsewhere the test is skipped with the reason; under
``CI=true`` that is a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from rlvla3.shm import segments_of_run

ROOT = Path(__file__).resolve().parents[1]
NODE = "localhost"
"""The node's name: it is also the broker's host in the workers' address, so it must resolve."""
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")


def _which(name: str) -> str | None:
    """Daemons live in /usr/sbin, which a user's PATH may lack."""
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")


def _unavailable() -> str | None:
    missing = [d for d in DAEMONS if _which(d) is None]
    if missing:
        return f"no {', '.join(missing)}: install slurm-wlm and munge (apt, as scripts/bootstrap.sh does as root)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs"
    return None


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true, but the Slurm test cannot run: {reason}")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(pred, timeout_s: float, what: str, every_s: float = 0.2, diag=lambda: ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every_s)  # polling with a deadline
    raise AssertionError(f"{what} did not happen within {timeout_s:.0f} s\n{diag()}")


class Cluster:
    """munged + slurmctld + slurmd for one node, ended by their pids."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        # munged wants a socket folder every user can reach, and a socket path under 108 bytes
        self.munge = Path(tempfile.mkdtemp(prefix="rlvla3-mg-", dir="/tmp"))
        os.chmod(self.munge, 0o755)
        self.conf = tmp / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def _start(self, argv: list[str], name: str) -> None:
        out = open(self.tmp / f"{name}.out", "wb")
        self.procs.append(subprocess.Popen([_which(argv[0]), *argv[1:]], stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                           start_new_session=True))
        out.close()

    def start(self) -> None:
        key = self.munge / "munge.key"
        key.write_bytes(os.urandom(128))
        os.chmod(key, 0o400)
        sock = self.munge / "sock"
        self._start(["munged", "-F", "--force", f"--socket={sock}", f"--key-file={key}",
                     f"--pid-file={self.munge / 'pid'}", f"--seed-file={self.munge / 'seed'}",
                     f"--log-file={self.munge / 'log'}"], "munged")
        _wait(sock.exists, 10, "munged's socket", diag=lambda: self.logs())
        for d in ("state", "spool"):
            (self.tmp / d).mkdir()
        host = socket.gethostname().split(".")[0]
        self.conf.write_text("\n".join([
            "ClusterName=rlvla3ci", f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", f"AuthInfo=socket={sock}", "CredType=cred/munge",
            f"StateSaveLocation={self.tmp / 'state'}", f"SlurmdSpoolDir={self.tmp / 'spool'}",
            f"SlurmctldPidFile={self.tmp / 'slurmctld.pid'}", f"SlurmdPidFile={self.tmp / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.tmp / 'slurmctld.log'}", f"SlurmdLogFile={self.tmp / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "SchedulerType=sched/builtin",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "ReturnToService=2", "SlurmdParameters=config_overrides", "KillWait=5", "MessageTimeout=10",
            # no GPUs; more CPUs than the machine has (config_overrides), so steps are never short of them
            f"NodeName={NODE} NodeAddr=127.0.0.1 CPUs=8 RealMemory=4000 State=UNKNOWN",
            "PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))
        self._start(["slurmctld", "-D", "-f", str(self.conf)], "slurmctld")
        self._start(["slurmd", "-D", "-f", str(self.conf), "-N", NODE], "slurmd")
        _wait(lambda: self.run(["sinfo", "-h", "-o", "%T"]).stdout.strip() == "idle", 30, "the node idle",
              diag=self.logs)

    def run(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env={**self.env, **kw.pop("env", {})}, capture_output=True, text=True,
                              timeout=30, **kw)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.tmp.glob("*.out")) + sorted(self.tmp.glob("*.log")))

    def stop(self) -> None:
        self.run(["scancel", "--user=root"])
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        shutil.rmtree(self.munge, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = _unavailable()
    if reason:
        _skip_or_fail(reason)
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
    except AssertionError as exc:
        c.stop()
        _skip_or_fail(f"the Slurm daemons did not start: {exc}")
    yield c
    c.stop()


# ---------------------------------------------------------------------------------------------
# One job at a time, as a user submits it
# ---------------------------------------------------------------------------------------------


class Job:
    def __init__(self, cluster: Cluster, run_dir: Path, **settings: str) -> None:
        """``SETTING=... sbatch --nodes=1 deploy/slurm/rlvla3.sbatch`` from the repository root."""
        self.cluster, self.run_dir = cluster, run_dir
        env = {"RLVLA3_VENV": os.environ.get("RLVLA3_VENV", sys.prefix), "RUN_DIR": str(run_dir),
               "SIMS_PER_NODE": "1", "PORT": str(_free_port()), "PUB_PORT": str(_free_port()), **settings}
        proc = cluster.run(["sbatch", "--nodes=1", "deploy/slurm/rlvla3.sbatch"], cwd=ROOT, env=env)
        assert proc.returncode == 0, proc.stderr
        self.id = re.search(r"Submitted batch job (\d+)", proc.stdout).group(1)
        self.out = ROOT / f"rlvla3-{self.id}.out"

    def output(self) -> str:
        text = self.out.read_text(errors="replace") if self.out.is_file() else "(no job output yet)"
        logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(self.run_dir.glob("*.log")))
        return f"--- job {self.id}\n{text[-4000:]}\n{logs}"

    def running(self) -> bool:
        return bool(self.cluster.run(["squeue", "-h", "-j", self.id]).stdout.strip())

    def rows(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []

    def pids(self) -> set[int]:
        """Every process the run wrote down: the broker's info file and each log line's pid."""
        pids = {json.loads((self.run_dir / "broker.json").read_text())["pid"]}
        for log in self.run_dir.glob("*.log"):
            pids |= {int(p) for p in re.findall(r"\bpid=(\d+)", log.read_text(errors="replace"))}
        return pids

    def finish(self, timeout_s: float) -> dict:
        """Wait for the job to end; then none of its processes and no segment may be left."""
        _wait(lambda: not self.running(), timeout_s, f"job {self.id} ending", every_s=0.5, diag=self.output)
        run_id = json.loads((self.run_dir / "broker.json").read_text())["run_id"]
        alive = [p for p in self.pids() if _is_rlvla3(p)]
        assert not alive, f"processes of the run left: {alive}\n{self.output()}"
        assert segments_of_run(run_id) == [], self.output()
        summary = json.loads((self.run_dir / "summary.json").read_text())
        assert summary["shm_leftovers"] == 0
        self.out.replace(self.run_dir / self.out.name)  # keep the repository root clean
        return summary


def _is_rlvla3(pid: int) -> bool:
    try:
        return b"rlvla3" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _latest_version(run_dir: Path) -> int:
    return int((run_dir / "checkpoints" / "latest").read_text().strip().lstrip("v"))


@pytest.mark.timeout(300)
def test_the_recipe_trains_stops_and_resumes_on_slurm(cluster: Cluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"

    # -- a job stopped by STEPS: trained, checkpointed, nothing left ------------------------------
    job = Job(cluster, run_dir, STEPS="600")
    summary = job.finish(150)
    assert summary["reason"] == "steps_reached" and summary["env_steps"] >= 600, job.output()
    rows = job.rows()
    assert rows[-1]["policy_version"] >= 1 and rows[-1]["env_steps"] > rows[0]["env_steps"], rows
    assert (run_dir / "curves.png").is_file() and (run_dir / "config.yaml").is_file()
    first = _latest_version(run_dir)
    assert first >= rows[-1]["policy_version"]

    # -- resumed in a new job, which continues the version; a --signal stop checkpoints it ------
    job = Job(cluster, run_dir, RESUME=str(run_dir))
    resumed = _wait(lambda: [r for r in job.rows()[len(rows):] if r["policy_version"] > first], 120,
                    "the resumed job's next version", diag=job.output)
    # Rows before the resumed trainer's first WEIGHTS say -1 (no version yet); every version seen is the checkpoint's or later.
    assert all(r["policy_version"] >= first for r in job.rows()[len(rows):] if r["policy_version"] >= 0), \
        "the resumed job started below the checkpoint"
    proc = cluster.run(["scancel", "--batch", "--signal=USR1", job.id])
    assert proc.returncode == 0, proc.stderr
    summary = job.finish(90)
    assert summary["reason"] == "interrupted", job.output()
    second = _latest_version(run_dir)
    assert second >= resumed[0]["policy_version"] > first
    assert "stopping the workers" in (run_dir / job.out.name).read_text()

    # -- resumed again and ended by a plain scancel: every process signalled at once, each still
    # stops cleanly (the trainer's checkpoint) within KillWait -----------------------------------
    seen = len(job.rows())
    job = Job(cluster, run_dir, RESUME=str(run_dir))
    resumed = _wait(lambda: [r for r in job.rows()[seen:] if r["policy_version"] > second], 120,
                    "the second resumed job's next version", diag=job.output)
    proc = cluster.run(["scancel", job.id])
    assert proc.returncode == 0, proc.stderr
    job.finish(60)
    assert _latest_version(run_dir) >= resumed[0]["policy_version"] > second, job.output()
