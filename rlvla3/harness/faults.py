"""Faults between namespace hosts, each made and measured the same way for the test
(``tests/test_partition.py``, short cuts) and the bench (``bench/faults/partition.py``, 30 s cuts).

    head   (10.213.0.1)  broker, trainer, simulator sim-head, generator gen-head
    simh   (10.213.0.2)  simulator sim-far       (the one-rank job)
    genh   (10.213.0.3)  generator gen-far       (the one-rank job)
    trh    (10.213.0.2)  trainer rank 1          (the two-rank job: ``start_job(folder, ranks=2)``)

    job = start_job(folder)                  # the workers joined and training
    out = run_fault(job, "simulator_host_cut", cut_s=6.0)
    out.problems                             # [] when every rule held

The faults (``FAULTS``), and the event each is logged as:

    simulator_host_cut   simh's switch port down for ``cut_s``    broker: ``simulator_gone reason=expired``
    generator_host_cut   genh's switch port down                  broker: ``generator_gone reason=expired``
    broker_host_cut      head's switch port down (the broker, cut off from simh and genh)
                                                                  workers: ``broker_silent_reconnecting``
    broker_restart       the broker SIGKILLed, a new one on the same address ``cut_s`` later
                                                                  workers: ``broker_restarted``
    trainer_rank_cut     trh (rank 1 of 2) cut off                broker: ``trainer_gone reason=expired``,
                                                                  ``trainer_group_broken_disconnecting``

A torch.distributed group cannot shrink, so a lost rank ends the group: the broker disconnects the
other ranks, every rank stops (rank 1, back after the heal, finds rank 0 gone), and a supervisor
restarts them all from the run folder's latest checkpoint (``--run-dir``; here every 2 versions).
The steps the ranks held are ``lost_with_trainer`` by the ledger's rule: at most the admission
window, ``(algo.admission_lag + 1) * algo.batch_steps`` plus one batch.

Per fault: the time to detect (the broker declares the cut worker gone; for the broker's faults
the first far worker logs the silence), the time to recover (from the heal, or the new broker's
start, until every worker is registered and the far simulator steps again), env steps/s before
and over the fault until recovery (the dip), and the ledger: ``lost`` (acknowledged steps lost with
a trainer) and ``duplicated`` (steps acknowledged beyond the decision steps served: a step
counted twice). A cut longer than the liveness window (``LIVENESS``: 2 s) is a real partition.
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from brokers.admission import admission_lag
from brokers.ledger import ACKED_PARTS
from rlvla3.config import load
from rlvla3.harness.jobs import SMALL_JOB, per_worker
from rlvla3.harness.netns import NetnsJob
from rlvla3 import protocol as P
from rlvla3.status_client import DeadlinePassed, built_after, wait_until

LIVENESS = ("broker.heartbeat_s=0.5", "broker.liveness=4")
"""A peer silent for 2 s is gone: a cut of a few seconds is a real partition, not a hiccup."""
FAULTS = ("simulator_host_cut", "generator_host_cut", "broker_host_cut", "broker_restart")
"""The faults of the one-rank job."""
RANK_FAULTS = ("trainer_rank_cut",)
"""The faults of the two-rank job."""
REJOIN_BOUND_S = P.RECONNECT_MAX_S + 5.0
"""Every host rejoins within its back-off cap plus 5 s of the heal."""
RATE_WINDOW_S = 3.0
"""Env steps/s before a fault: over this window (the bench's; its smoke and the tests use less)."""


@dataclass
class Outcome:
    """One fault, measured."""

    fault: str
    cut_s: float
    detect_s: float | None = None
    recover_s: float | None = None
    steps_per_s_before: float = 0.0
    steps_per_s_during: float = 0.0
    lost: int = 0
    duplicated: int = 0
    resent_recognised: int = 0
    """Re-sent fragments and requests the broker knew and neither routed nor served again."""
    version_before: int = 0
    version_after: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def dip(self) -> float:
        """The fraction of env steps/s lost over the fault until recovery."""
        return 0.0 if self.steps_per_s_before <= 0 else max(0.0, 1.0 - self.steps_per_s_during / self.steps_per_s_before)

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "dip": round(self.dip, 3)}


def counted_twice(fig: dict[str, Any], old: dict[str, Any] | None = None) -> int:
    """Steps acknowledged beyond the decision steps served, over this broker and ``old``, the
    figures of a killed one taken just before the kill (the new broker acknowledges the fragments
    the old one served and had not acknowledged: they are re-sent to it). A copy the trainer
    already held is acknowledged with the fate ``duplicate``: not a second acknowledgement."""
    def once(f: dict[str, Any]) -> int:
        return f["acked_steps"]["acked"] - f["acked_steps"].get("duplicate", 0)

    acked = once(fig) + (once(old) if old else 0)
    served = fig["decision_steps"] + (old["decision_steps"] if old else 0)
    return max(0, acked - served)


def ledger_problems(fig: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """What breaks the ledger's rules in one broker's figures (empty: exact); ``old`` as in
    :func:`counted_twice`."""
    a = fig["acked_steps"]
    out = []
    if a["acked"] != sum(a[k] for k in ACKED_PARTS):
        out.append(f"fates do not add up to the acknowledged steps: {a}")
    if twice := counted_twice(fig, old):
        out.append(f"{twice} steps acknowledged twice")
    return out


class FaultJob(NetnsJob):
    """The module's layout over namespace hosts, with ``ranks`` trainer ranks."""

    def __init__(self, folder: Path, ranks: int) -> None:
        super().__init__(folder)
        self.ranks = ranks
        far = 1 if ranks == 1 else 0  # the two-rank job needs no far simulator or generator
        self.all = {"simulator": 1 + far, "generator": 1 + far, "trainer": ranks}
        """The workers STATUS shows when the job is whole."""
        self.trainers: dict[str, subprocess.Popen] = {}
        self.simulators: list[subprocess.Popen] = []
        """Held still (SIGSTOP) while a broker about to be killed gives its last figures."""
        self.lost_allowed = 0
        """Acknowledged steps a fault may lose: none, but what a lost trainer group held."""

    def start_trainer(self, name: str) -> None:
        self.trainers[name] = self.worker("head" if name == "trainer" else "trh", "trainer", name,
                                          "--run-dir", str(self.folder / "run"))


def start_job(folder: Path, ranks: int = 1, overrides: tuple[str, ...] = ()) -> FaultJob:
    """The module's layout joined, stepping and trained once."""
    group = ("workers.trainers=2", "algo.checkpoint_every=2") if ranks == 2 else ()
    cfg = load("synthetic.yaml", [*SMALL_JOB, *LIVENESS, *group, *overrides])
    cfg_path = folder / "config.yaml"
    cfg_path.write_text(cfg.to_yaml())
    job = FaultJob(folder, ranks)
    if ranks == 2:  # what the ranks can hold at most: the admission window (brokers/admission.py)
        job.lost_allowed = (admission_lag(cfg.algo) + 1) * cfg.algo.batch_steps + cfg.batching.max_batch
    try:
        job.start_broker(cfg_path)
        job.start_trainer("trainer")
        if ranks == 2:
            job.start_trainer("trainer-far")
        job.simulators.append(job.worker("head", "simulator", "sim-head"))
        job.worker("head", "generator", "gen-head")
        sims = ["sim-head"]
        if job.all["simulator"] == 2:
            job.simulators.append(job.worker("simh", "simulator", "sim-far"))
            job.worker("genh", "generator", "gen-far")
            sims.append("sim-far")
        job.wait(lambda f: f["workers"] == job.all and f["trainer_version"] >= 1
                 and all((per_worker(f, n).get("env_steps") or 0) > 0 for n in sims), 600,
                 "all the workers to join and train")
    except BaseException:
        job.close()
        raise
    return job


def run_fault(job: FaultJob, fault: str, cut_s: float, rate_window_s: float) -> Outcome:
    """Make ``fault`` last ``cut_s`` and measure it (env steps/s before it over ``rate_window_s``);
    the job is whole again when this returns."""
    if fault not in (RANK_FAULTS if job.ranks == 2 else FAULTS):
        raise ValueError(f"fault {fault!r} is not one of a {job.ranks}-rank job's: {FAULTS} (one rank), {RANK_FAULTS} (two)")
    out = Outcome(fault, cut_s)
    before = job.rate(rate_window_s)
    out.steps_per_s_before = before["rate"]
    first = before["last"]
    out.version_before = first["trainer_version"]
    old = None
    if fault in ("simulator_host_cut", "generator_host_cut"):
        last = _cut_worker_host(job, out, "simh" if fault == "simulator_host_cut" else "genh")
    elif fault == "broker_host_cut":
        last = _cut_broker_host(job, out)
    elif fault == "trainer_rank_cut":
        last = _cut_trainer_rank(job, out)
    else:
        old, last = _restart_broker(job, out)
        first = {**first, "acked_steps": dict.fromkeys(first["acked_steps"], 0)}  # the new broker's ledger
    # recovered: training goes on after the fault (the version continues from the trainer's)
    last = job.wait(lambda f: f["trainer_version"] >= max(out.version_before, last["trainer_version"]) + 1, 120,
                    f"training to go on after {fault}")
    out.version_after = last["trainer_version"]
    if out.version_after < out.version_before:
        out.problems.append(f"the version went back from {out.version_before} to {out.version_after}")
    a, b = first["acked_steps"], last["acked_steps"]
    out.lost = b["lost_with_trainer"] - a["lost_with_trainer"]
    out.duplicated = counted_twice(last, old)
    out.resent_recognised = (last["traj"]["duplicates"] + last["duplicates"]
                             - (0 if old else first["traj"]["duplicates"] + first["duplicates"]))
    out.problems += ledger_problems(last, old)
    if out.lost > job.lost_allowed:
        out.problems.append(f"{out.lost} acknowledged steps lost (at most {job.lost_allowed} may be)")
    return out


def _during(out: Outcome, t0: float, steps0: int, fig: dict[str, Any]) -> None:
    out.steps_per_s_during = (fig["env_steps"] - steps0) / max(1e-6, time.monotonic() - t0)


def _cut_worker_host(job: FaultJob, out: Outcome, host: str) -> dict[str, Any]:
    """A worker host cut off: the broker declares its worker gone, the rest goes on, it rejoins."""
    gone = dict(job.all, **{"simulator" if host == "simh" else "generator": 1})
    start = job.status()
    h = job.hosts.hosts[host]
    job.hosts.cut(h)
    t_cut = time.monotonic()
    job.wait(lambda f: f["workers"] == gone, 30, f"the broker to see {host}'s worker gone")
    out.detect_s = time.monotonic() - t_cut
    # the rest of the job keeps stepping and training while the host is away
    job.wait(lambda f: f["env_steps"] > start["env_steps"] + 50 and f["trainer_version"] > start["trainer_version"],
             max(60.0, out.cut_s), f"the job to go on without {host}")
    time.sleep(max(0.0, out.cut_s - (time.monotonic() - t_cut)))  # the cut lasts cut_s
    job.hosts.heal(h)
    t_heal = time.monotonic()
    fig = job.wait(lambda f: f["workers"] == job.all, REJOIN_BOUND_S, f"{host} to rejoin after the heal")
    out.recover_s = time.monotonic() - t_heal
    _during(out, t_cut, start["env_steps"], fig)
    return fig


def _far_logs_show(job: FaultJob, event: str, sizes: dict[Path, int]) -> bool:
    """Whether a far worker's log (simh's, genh's) has logged ``event`` since ``sizes`` were taken."""
    for path, size in sizes.items():
        with path.open("rb") as f:
            f.seek(size)
            if event.encode() in f.read():
                return True
    return False


def _far_sizes(job: FaultJob) -> dict[Path, int]:
    return {p: p.stat().st_size for p in (job.folder / "sim-far.log", job.folder / "gen-far.log")}


def _back(job: FaultJob, out: Outcome, t_back: float, far_steps: int) -> dict[str, Any]:
    fig = job.wait(lambda f: f["workers"] == job.all and (per_worker(f, "sim-far").get("env_steps") or 0) > far_steps + 20,
                   REJOIN_BOUND_S, "the far hosts to rejoin the broker and step again")
    out.recover_s = time.monotonic() - t_back
    return fig


def _cut_broker_host(job: FaultJob, out: Outcome) -> dict[str, Any]:
    """The broker's host cut off from all the others; the far workers keep their state and
    unacknowledged data and rejoin after the heal (the workers on the head host stay)."""
    start = job.status()
    far_steps = per_worker(start, "sim-far")["env_steps"]
    sizes = _far_sizes(job)
    head = job.hosts.hosts["head"]
    job.hosts.cut(head)
    t_cut = time.monotonic()
    wait_until(lambda: _far_logs_show(job, "broker_silent_reconnecting", sizes), max(30.0, out.cut_s),
               "a far worker to notice the silence", interval=0.05)
    out.detect_s = time.monotonic() - t_cut
    time.sleep(max(0.0, out.cut_s - (time.monotonic() - t_cut)))  # the cut lasts cut_s
    job.hosts.heal(head)
    fig = _back(job, out, time.monotonic(), far_steps)
    _during(out, t_cut, start["env_steps"], fig)
    return fig


def _restart_broker(job: FaultJob, out: Outcome) -> tuple[dict[str, Any], dict[str, Any]]:
    """The broker SIGKILLed (its host lost) and a new one started on the same address ``cut_s``
    later: the workers rejoin it, the simulators re-send what has no ack, the trainer re-announces
    its version. Returns the old broker's last figures and the new one's once the job is back."""
    sizes = _far_sizes(job)
    for p in job.simulators:
        p.send_signal(signal.SIGSTOP)
    try:
        start = _still_figures(job)
        job.broker.send_signal(signal.SIGKILL)
        job.broker.wait(10)
    finally:
        for p in job.simulators:
            p.send_signal(signal.SIGCONT)
    t_kill = time.monotonic()
    far_steps = per_worker(start, "sim-far")["env_steps"]
    wait_until(lambda: _far_logs_show(job, "broker_silent_reconnecting", sizes), max(30.0, out.cut_s),
               "a far worker to notice the broker gone", interval=0.05)
    out.detect_s = time.monotonic() - t_kill
    time.sleep(max(0.0, out.cut_s - (time.monotonic() - t_kill)))  # the broker stays away cut_s
    job.restart_broker()
    t_back = time.monotonic()
    fig = _back(job, out, t_back, far_steps)
    if not _far_logs_show(job, "broker_restarted", sizes):
        out.problems.append("no far worker logged broker_restarted")
    # the new broker counts every simulator's total from READY: env steps stay comparable
    _during(out, t_kill, start["env_steps"], fig)
    return start, fig


def _still_figures(job: FaultJob, settle_s: float = 5.0) -> dict[str, Any]:
    """The broker's figures once nothing more reaches its ledger (the simulators held still by
    the caller): STATUS builds read until two in a row show the same served and acknowledged
    steps. Figures read while steps still arrive miss the decision steps counted between the read
    and the kill, whose fragments the new broker then acknowledges: steps that look acknowledged
    twice."""
    ledger = lambda f: (f["decision_steps"], f["acked_steps"])  # noqa: E731
    deadline = time.monotonic() + settle_s
    last = job.status()
    while time.monotonic() < deadline:
        fig = job.wait(built_after(last), settle_s, "a later STATUS build")
        if ledger(fig) == ledger(last):
            return fig
        last = fig
    return last  # the figures as they are: the ledger check then says what moved


def _cut_trainer_rank(job: FaultJob, out: Outcome) -> dict[str, Any]:
    """Rank 1's host cut off: the broker lets the group go, every rank stops, and the supervisor
    (this function) restarts both from the latest checkpoint once the host is back."""
    start = job.status()
    h = job.hosts.hosts["trh"]
    job.hosts.cut(h)
    t_cut = time.monotonic()
    job.wait(lambda f: f["workers"]["trainer"] == 0, 30, "the broker to let the trainer group go")
    out.detect_s = time.monotonic() - t_cut
    time.sleep(max(0.0, out.cut_s - (time.monotonic() - t_cut)))  # the cut lasts cut_s
    job.hosts.heal(h)
    t_heal = time.monotonic()
    try:  # rank 0 stops on the broker's word, rank 1 when it finds rank 0 gone
        wait_until(lambda: all(p.poll() is not None for p in job.trainers.values()), 60,
                   "every trainer rank to stop", interval=0.1)
    except DeadlinePassed:
        stuck = [n for n, p in job.trainers.items() if p.poll() is None]
        out.problems.append(f"trainer ranks {stuck} did not stop within 60 s of the heal (SIGKILLed)")
        for n in stuck:
            job.trainers[n].send_signal(signal.SIGKILL)
            job.trainers[n].wait(10)
    for name in job.trainers:
        job.start_trainer(name)
    fig = job.wait(lambda f: f["workers"] == job.all and f["trainer_version"] > start["trainer_version"], 300,
                   "both ranks to rejoin and train again")
    out.recover_s = time.monotonic() - t_heal
    _during(out, t_cut, start["env_steps"], fig)
    return fig
