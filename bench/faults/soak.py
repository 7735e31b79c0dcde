"""A soak run: a job over two network-namespace hosts, faults at random intervals for
``--minutes``, every killed process restarted (``rlvla3 worker``, as a supervisor would).

    head  broker, trainer, simulator sim0, generator gen0 (sim0 and gen0: never killed or cut)
    far   simulator sim1, generator gen1

One fault at a time: a generator, simulator or trainer SIGKILLed; the far host cut off for
``--cut-s`` (``rlvla3/harness/netns.py``); the broker SIGKILLed and a new one started on the same
address ``--cut-s`` later (``NetnsJob.restart_broker``).

Reports every process's RSS over time, the env steps done, and the fate of every acknowledged
trajectory step (``brokers/ledger.py``), summed over the broker's incarnations. Targets
(``targets`` in the JSON): each broker's fates add up to its acknowledged steps exactly; a trainer
kill loses at most one update (whole fragments until ``batch_steps``: ``batch_steps +
env.fragment_len - 1`` steps); the kept processes grow their RSS by at most
``RSS_SLOPE_MB_PER_10MIN`` (least squares, one sample a minute after their first ``--warmup``
seconds). The one trainer and one broker have no process to keep: their RSS is per incarnation.

    python bench/faults/soak.py --minutes 3      # --smoke: seconds of faults after start-up, no soak
Needs root and iproute2; prints one JSON object last and writes soak.json and soak_rss.png under --out.
"""

from __future__ import annotations

import argparse
import random
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from brokers.ledger import ACKED_PARTS
from rlvla3.app.launch import stop_processes
from rlvla3.config import load
from rlvla3.harness.bench import emit_to, parse_bench_args, save_figure, subplots
from rlvla3.harness.jobs import rss_mb
from rlvla3.harness.netns import NetnsJob, unavailable
from rlvla3.status_client import DeadlinePassed, wait_until

RSS_SLOPE_MB_PER_10MIN = 1.0
CONFIG = ("env.num_envs=6", "env.slots=3", "env.eval_slots=1", "env.eval_every=4", "env.fragment_len=8",
          "env.options.latency={kind: constant, mean_ms: 2.0}", "env.options.image_size=8",
          "algo.batch_steps=128", "algo.minibatch_size=64", "algo.epochs=1", "algo.checkpoint_every=2",
          "batching.max_batch=8", "batching.max_wait_ms=2", "model.options.hidden=32",
          "broker.heartbeat_s=0.5", "broker.liveness=4")
WORKERS = (("head", "trainer", "trainer"), ("head", "generator", "gen0"), ("head", "simulator", "sim0"),
           ("far", "generator", "gen1"), ("far", "simulator", "sim1"))
KEPT = ("gen0", "sim0")
"""One process per worker role with several processes, never killed or cut: their RSS slope is judged."""
FAULTS = ("generator", "simulator", "trainer", "partition", "broker_restart")


@dataclass
class Proc:
    """One process incarnation and its RSS samples (seconds since start, MiB)."""

    name: str
    role: str
    popen: subprocess.Popen
    started: float
    rss: list[tuple[float, float]] = field(default_factory=list)


def slope(p: Proc, warm_s: float, every_s: float) -> dict[str, Any] | None:
    """RSS growth in MB per 10 minutes: a least-squares line through one sample per ``every_s``
    (each window's mean) after the process's first ``warm_s`` seconds (None: too few windows)."""
    bins: dict[int, list[tuple[float, float]]] = {}
    for t, r in p.rss:
        if t - p.started >= warm_s:
            bins.setdefault(int((t - p.started - warm_s) // every_s), []).append((t, r))
    points = [(sum(t for t, _ in b) / len(b), sum(r for _, r in b) / len(b)) for b in bins.values()]
    if len(points) < 2:
        return None
    k = np.polyfit(*np.array(points).T, 1)[0]
    return {"mb_per_10min": round(float(k) * 600, 3), "samples": len(points), "rss_mb": round(points[-1][1], 1),
            "lived_s": round(p.rss[-1][0] - p.started, 1)}


class Soak:
    """The job's processes, each incarnation tracked, started by hand as a supervisor would."""

    def __init__(self, job: NetnsJob, cfg_path: Path, t0: float) -> None:
        self.job, self.cfg_path, self.t0 = job, cfg_path, t0
        self.procs: list[Proc] = []
        self.incarnation: dict[str, int] = {}
        self.host_of = {name: host for host, _, name in WORKERS}

    def start_broker(self, restart: bool = False) -> Proc:
        if restart:
            self.job.restart_broker()
        else:
            self.job.start_broker(self.cfg_path)
        return self._track("broker", "broker", self.job.broker)

    def start_worker(self, role: str, name: str) -> Proc:
        extra = ["--run-dir", str(self.job.folder / "run")] if role == "trainer" else []  # resumes from its checkpoint
        return self._track(name, role, self.job.worker(self.host_of[name], role, name, *extra))

    def _track(self, name: str, role: str, p: subprocess.Popen) -> Proc:
        self.incarnation[name] = self.incarnation.get(name, 0) + 1
        proc = Proc(f"{name}#{self.incarnation[name]}", role, p, time.monotonic())
        self.procs.append(proc)
        return proc

    def live(self, name: str | None = None, role: str | None = None) -> list[Proc]:
        return [p for p in self.procs if p.popen.poll() is None and (name is None or p.name.split("#")[0] == name)
                and (role is None or p.role == role)]

    def sample_rss(self) -> None:
        now = time.monotonic()
        for p in self.live():
            r = rss_mb(p.popen.pid)
            if r is not None:
                p.rss.append((now, r))

    def status(self) -> dict[str, Any] | None:
        try:
            return self.job.status(timeout_s=3.0)
        except TimeoutError:
            return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="how long to run")
    ap.add_argument("--kill-every", type=float, default=None, help="mean seconds between faults (default: 20; smoke: 2)")
    ap.add_argument("--cut-s", type=float, default=None, help="how long a cut or a broker's absence lasts (default: 10; smoke: 3)")
    ap.add_argument("--warmup", type=float, default=None, help="seconds of a process's life before its RSS slope counts "
                                                               "(default: 300, or a third of a shorter run; smoke: 2)")
    ap.add_argument("--seed", type=int, default=0)
    args = parse_bench_args(ap, None, smoke_help="a few seconds of frequent faults after start-up (the README test)")
    minutes = 0.1 if args.smoke else args.minutes
    kill_every = args.kill_every or (2.0 if args.smoke else 20.0)
    cut_s = args.cut_s or (3.0 if args.smoke else 10.0)
    warm_s = args.warmup if args.warmup is not None else (2.0 if args.smoke else min(300.0, minutes * 20))
    slope_every = 1.0 if args.smoke else 60.0  # one RSS point a minute for the slope
    sample_every = 0.5 if args.smoke else 2.0
    out = Path(args.out)
    reason = unavailable()
    if reason is not None:
        return emit_to(out, "soak.json", {"skipped": reason, "mode": "smoke" if args.smoke else "soak"})
    rng = random.Random(args.seed)

    folder = Path(tempfile.mkdtemp(prefix="rlvla3-soak-"))
    cfg = load("synthetic.yaml", CONFIG)
    cfg_path = folder / "config.yaml"
    cfg_path.write_text(cfg.to_yaml())
    t0 = time.monotonic()
    soak = Soak(NetnsJob(folder), cfg_path, t0)
    faults: list[dict[str, Any]] = []
    timeline: list[dict[str, Any]] = []
    ledgers: list[dict[str, Any]] = []  # each killed broker's last figures
    restart_trainer_after: float | None = None
    last: dict[str, Any] | None = None
    try:
        soak.start_broker()
        for _, role, name in WORKERS:
            soak.start_worker(role, name)
        # ---- warm: the job runs end to end before the first fault ------------------------------
        wait_until(lambda: soak.sample_rss() or ((f := soak.status()) and f["trainer_version"] >= 1), 300,
                   "the job's first update", interval=0.5)
        t_run = time.monotonic()
        end = t_run + minutes * 60
        next_kill = t_run + rng.uniform(0.5, 1.5) * kill_every
        next_sample = 0.0
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_sample:
                next_sample = now + sample_every
                soak.sample_rss()
                f = soak.status()
                if f:
                    last = f
                    timeline.append({"t": round(now - t0, 1), "env_steps": f["env_steps"], "version": f["trainer_version"],
                                     "workers": f["workers"], "acked_steps": f["acked_steps"]})
            for p in soak.procs:  # a worker that exits on its own is restarted too (a supervisor's job)
                base = p.name.split("#")[0]
                if p.role != "broker" and p.popen.poll() is not None and p.popen.returncode != -signal.SIGKILL \
                        and not soak.live(base) and base != "trainer":
                    soak.start_worker(p.role, base)
            if restart_trainer_after is None and not soak.live(role="trainer"):
                restart_trainer_after = now  # it exited on its own (e.g. refused): rejoin like a supervisor
            if restart_trainer_after is not None and now >= restart_trainer_after:
                f = soak.status()
                if f and f["workers"]["trainer"] == 0:  # the broker let go of the dead rank: rejoin
                    soak.start_worker("trainer", "trainer")
                    restart_trainer_after = None
            if now >= next_kill and restart_trainer_after is None:
                next_kill = now + rng.uniform(0.5, 1.5) * kill_every
                before = soak.status() or last or {}
                kind = rng.choice(FAULTS)
                record: dict[str, Any] = {"t": round(now - t0, 1), "fault": kind, "broker": soak.incarnation["broker"],
                                          "acked_steps_before": before.get("acked_steps") or {}}
                if kind == "partition":
                    far = soak.job.hosts.hosts["far"]
                    soak.job.hosts.cut(far)
                    time.sleep(cut_s)  # the cut itself
                    soak.job.hosts.heal(far)
                elif kind == "broker_restart":
                    soak.job.broker.send_signal(signal.SIGKILL)
                    soak.job.broker.wait(10)
                    ledgers.append(before)
                    time.sleep(cut_s)  # the broker's host is away
                    soak.start_broker(restart=True)
                else:
                    victims = [p for p in soak.live(role=kind) if p.name.split("#")[0] not in KEPT]
                    if not victims:  # that role's process exited on its own a moment ago: no kill this time
                        continue
                    victim = rng.choice(victims)
                    victim.popen.send_signal(signal.SIGKILL)
                    victim.popen.wait(10)
                    record["process"] = victim.name
                    if kind == "trainer":
                        restart_trainer_after = time.monotonic()
                    else:
                        soak.start_worker(kind, victim.name.split("#")[0])
                faults.append(record)
            time.sleep(0.1)  # the supervisor's loop: polling, not synchronising
        # ---- end: simulators stop first, so what is in flight settles -------------------------
        sims = soak.live(role="simulator")
        for p in sims:
            p.popen.send_signal(signal.SIGTERM)
        for p in sims:
            p.popen.wait(30)
        try:
            wait_until(lambda: (f := soak.status()) and f["trajs_pending"] == 0 and f["trajs_inflight"] == 0
                       and f["workers"]["trainer"] >= 1, 10, "what is in flight to settle", interval=0.25)
        except DeadlinePassed:
            pass  # the figures as they are then
        last = soak.status() or last
    finally:
        stop_processes([p.popen for p in soak.procs if p.popen.poll() is None], timeout_s=20)
        soak.job.close()
    result = report(soak, [*ledgers, last or {}], faults, timeline, cfg.algo.batch_steps, cfg.env.fragment_len,
                    warm_s, slope_every, minutes, args.smoke)
    plot_rss(soak, out / "soak_rss.png")
    emit_to(out, "soak.json", result, timeline=timeline)


def report(soak: Soak, brokers: list[dict[str, Any]], faults: list[dict[str, Any]], timeline: list[dict[str, Any]],
           batch_steps: int, fragment_len: int, warm_s: float, slope_every: float, minutes: float,
           smoke: bool) -> dict[str, Any]:
    ledgers = [dict(b.get("acked_steps") or {}) for b in brokers]
    acked = {k: sum(a.get(k, 0) for a in ledgers) for k in ("acked", *ACKED_PARTS, "over_reported")}
    # What each trainer kill lost: lost_with_trainer moves when the broker lets go of the trainer,
    # measured until the next trainer kill or the end of that broker's life.
    losses = []
    kills = [k for k in faults if k["fault"] == "trainer"]
    for i, k in enumerate(kills):
        after = next((n for n in kills[i + 1:] if n["broker"] == k["broker"]), None)
        end = after["acked_steps_before"] if after else ledgers[k["broker"] - 1]
        losses.append(end.get("lost_with_trainer", 0) - k["acked_steps_before"].get("lost_with_trainer", 0))
    rss = {p.name: slope(p, warm_s, slope_every) for p in soak.procs}
    kept = {k: v for k, v in rss.items() if k.split("#")[0] in KEPT}
    update_max = batch_steps + fragment_len - 1  # whole fragments until batch_steps: the largest batch
    return {
        "minutes": minutes,
        "mode": "smoke" if smoke else "soak",
        "env_steps": (brokers[-1] or {}).get("env_steps"),
        "policy_version": (brokers[-1] or {}).get("trainer_version"),
        "kills": {r: sum(1 for k in faults if k["fault"] == r) for r in FAULTS},
        "acked_steps": acked,
        "brokers": len(brokers),
        "broker_ledgers": ledgers,
        "lost_per_trainer_kill": losses,
        "batch_steps": batch_steps,
        "update_batch_max_steps": update_max,
        "rss_mb": rss,
        "rss_slope_target_mb_per_10min": RSS_SLOPE_MB_PER_10MIN,
        "rss_warmup_s": warm_s,
        "kept": list(KEPT),
        "broker_errors": (brokers[-1] or {}).get("errors"),
        "traj": (brokers[-1] or {}).get("traj"),
        "targets": {
            "kept_rss_slope_within_target": bool(kept) and all(v is not None and v["mb_per_10min"] <= RSS_SLOPE_MB_PER_10MIN
                                                               for v in kept.values()),
            "fates_add_up": bool(ledgers) and all(a and a.get("acked") == sum(a.get(k, 0) for k in ACKED_PARTS) for a in ledgers),
            "lost_per_trainer_kill_within_one_update": all(x <= update_max for x in losses),
        },
        "samples": len(timeline),
    }


def plot_rss(soak: Soak, path: Path) -> None:
    fig, ax = subplots(figsize=(9, 4.5))
    for p in soak.procs:
        if p.rss:
            ax.plot([t - soak.t0 for t, _ in p.rss], [r for _, r in p.rss], label=p.name, lw=1)
    ax.set(xlabel="seconds", ylabel="RSS (MiB)", title="RSS of every process (a new line per restart)")
    ax.legend(fontsize=6, ncol=4)
    save_figure(fig, path, 100)


if __name__ == "__main__":
    main()
