"""A soak run: a job whose generators, simulators and trainer are SIGKILLed at random intervals
and restarted (``rlvla3 worker``, as a supervisor would), for ``--minutes``.

Reports the RSS of every process over time and whether it is flat after warm-up, the env steps
done, and the fate of every acknowledged trajectory step (the broker's ``acked_steps``,
``brokers/ledger.py``): each is exactly one of evaluation, trained, stale, discarded, unreadable,
lost with a killed trainer (acknowledged on receipt, never updated), or held by the live trainer
when the run ends (a partial batch that waits for more steps).

Targets (``targets`` in the JSON): RSS flat after warm-up (the broker, which is never killed, and
every process that lived past warm-up: growth over its life after warm-up at most
``RSS_SLACK_MB``); the categories add up to the acknowledged steps exactly; each trainer kill
loses at most one update's worth of steps: an update takes whole fragments until it holds
``algo.batch_steps``, so its batch is at most ``batch_steps + env.fragment_len - 1`` steps.

    python bench/faults/soak.py --minutes 3      # --smoke: ~12 s, no value as a soak
Prints one JSON object last and writes soak.json and soak_rss.png under --out.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from rlvla3.app.launch import spawn, stop_processes
from rlvla3.config import load
from rlvla3.harness.bench import OUT_DIR, save_figure, subplots
from rlvla3.harness.jobs import Job, rss_mb
from rlvla3.status_client import DeadlinePassed, wait_until

RSS_SLACK_MB = 32.0
FATES = ("evaluation", "trained", "stale", "discarded", "unreadable", "lost_with_trainer", "held_by_trainers")
CONFIG = ("env.num_envs=6", "env.slots=3", "env.eval_slots=1", "env.eval_every=4", "env.fragment_len=8",
          "env.options.latency={kind: constant, mean_ms: 2.0}", "env.options.image_size=8",
          "algo.batch_steps=128", "algo.minibatch_size=64", "algo.epochs=1", "algo.checkpoint_every=2",
          "batching.max_batch=8", "batching.max_wait_ms=2", "model.options.hidden=32",
          "broker.heartbeat_s=0.5", "broker.liveness=4")


@dataclass
class Proc:
    """One process incarnation and its RSS samples (seconds since start, MiB)."""

    name: str
    role: str
    popen: subprocess.Popen
    started: float
    rss: list[tuple[float, float]] = field(default_factory=list)


def flatness(p: Proc, warm_s: float) -> dict[str, Any] | None:
    """RSS at the end of warm-up against the most seen afterwards (None: did not outlive warm-up)."""
    after = [(t, r) for t, r in p.rss if t - p.started >= warm_s]
    if len(after) < 3:
        return None
    start = after[0][1]
    peak = max(r for _, r in after)
    return {"rss_after_warmup_mb": round(start, 1), "rss_peak_mb": round(peak, 1), "growth_mb": round(peak - start, 1),
            "lived_s": round(after[-1][0] - p.started, 1)}


class Soak:
    """The job's processes, each incarnation tracked, started by hand as a supervisor would."""

    def __init__(self, job: Job, t0: float) -> None:
        self.job, self.t0 = job, t0
        self.procs: list[Proc] = []
        self.incarnation: dict[str, int] = {}

    def start_broker(self) -> Proc:
        self.job.start_broker("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
        return self._track("broker", "broker", self.job.broker_proc)

    def start_worker(self, role: str, name: str) -> Proc:
        args = ["worker", "--role", role, "--broker", self.job.endpoint, "--name", name]
        if role == "trainer":  # a restarted trainer resumes from the run folder's latest checkpoint
            args += ["--run-dir", str(self.job.run_dir / "run")]
        return self._track(name, role, spawn(args, self.job.run_dir / f"{name}.log"))

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
            return self.job.status()
        except TimeoutError:
            return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="how long to run")
    ap.add_argument("--smoke", action="store_true", help="3 s of frequent kills after start-up (the README test)")
    ap.add_argument("--kill-every", type=float, default=None, help="mean seconds between kills (default: 20; smoke: 1.5)")
    ap.add_argument("--warmup", type=float, default=None, help="seconds before RSS counts as warm (default: 60; smoke: 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=OUT_DIR, help="folder for soak.json and soak_rss.png")
    args = ap.parse_args()
    minutes = 0.05 if args.smoke else args.minutes
    kill_every = args.kill_every or (1.5 if args.smoke else 20.0)  # smoke: the first kill within 2.25 s of 3
    warm_s = args.warmup if args.warmup is not None else (2.0 if args.smoke else 60.0)
    sample_every = 0.5 if args.smoke else 2.0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)

    folder = Path(tempfile.mkdtemp(prefix="rlvla3-soak-"))
    cfg = load("synthetic.yaml", CONFIG)
    cfg_path = folder / "config.yaml"
    cfg_path.write_text(cfg.to_yaml())
    t0 = time.monotonic()
    soak = Soak(Job(cfg, folder, cfg_path), t0)
    kills: list[dict[str, Any]] = []
    timeline: list[dict[str, Any]] = []
    restart_trainer_after: float | None = None
    last = None
    try:
        soak.start_broker()
        for role, name in (("trainer", "trainer"), ("generator", "gen0"), ("simulator", "sim0"), ("simulator", "sim1")):
            soak.start_worker(role, name)
        # ---- warm: the job runs end to end before the first kill -------------------------------
        wait_until(lambda: soak.sample_rss() or ((f := soak.status()) and f["trainer_version"] >= 1), 180,
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
                if p.role != "broker" and p.popen.poll() is not None and not p.popen.returncode == -signal.SIGKILL \
                        and not soak.live(p.name.split("#")[0]) and p.name.split("#")[0] != "trainer":
                    soak.start_worker(p.role, p.name.split("#")[0])
            if restart_trainer_after is None and not soak.live(role="trainer"):
                restart_trainer_after = now  # it exited on its own (e.g. refused): rejoin like a supervisor
            if restart_trainer_after is not None and now >= restart_trainer_after:
                f = soak.status()
                if f and f["workers"]["trainer"] == 0:  # the broker let go of the dead rank: rejoin
                    soak.start_worker("trainer", "trainer")
                    restart_trainer_after = None
            if now >= next_kill and restart_trainer_after is None:
                next_kill = now + rng.uniform(0.5, 1.5) * kill_every
                role = rng.choice(("generator", "simulator", "trainer"))
                victims = soak.live(role=role)
                if not victims:  # that role's only process exited on its own a moment ago: no kill this time
                    continue
                victim = rng.choice(victims)
                before = soak.status() or last or {}
                victim.popen.send_signal(signal.SIGKILL)
                victim.popen.wait(10)
                kills.append({"t": round(now - t0, 1), "role": role, "process": victim.name,
                              "acked_steps_before": (before.get("acked_steps") or {})})
                if role == "trainer":
                    restart_trainer_after = time.monotonic()
                else:
                    soak.start_worker(role, victim.name.split("#")[0])
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
    result = report(soak, last or {}, kills, timeline, cfg.algo.batch_steps, cfg.env.fragment_len, warm_s, minutes,
                    args.smoke)
    (out / "soak.json").write_text(json.dumps({**result, "timeline": timeline}, indent=1))
    plot_rss(soak, out / "soak_rss.png")
    print(json.dumps(result))


def report(soak: Soak, last: dict[str, Any], kills: list[dict[str, Any]], timeline: list[dict[str, Any]],
           batch_steps: int, fragment_len: int, warm_s: float, minutes: float, smoke: bool) -> dict[str, Any]:
    acked = dict(last.get("acked_steps") or {})
    trainer_kills = [k for k in kills if k["role"] == "trainer"]
    # What each trainer kill lost: the ledger's lost_with_trainer moves when the broker lets go of it.
    losses = []
    marks = [k["acked_steps_before"].get("lost_with_trainer", 0) for k in trainer_kills] + [acked.get("lost_with_trainer", 0)]
    for a, b in zip(marks, marks[1:]):
        losses.append(b - a)
    rss = {p.name: flatness(p, warm_s) for p in soak.procs}
    judged = {k: v for k, v in rss.items() if v is not None}
    flat = bool(judged) and all(v["growth_mb"] <= RSS_SLACK_MB for v in judged.values())
    total = sum(acked.get(k, 0) for k in FATES)
    update_max = batch_steps + fragment_len - 1  # whole fragments until batch_steps: the largest batch
    return {
        "minutes": minutes,
        "mode": "smoke" if smoke else "soak",
        "env_steps": last.get("env_steps"),
        "policy_version": last.get("trainer_version"),
        "kills": {r: sum(1 for k in kills if k["role"] == r) for r in ("generator", "simulator", "trainer")},
        "acked_steps": acked,
        "fates_sum": total,
        "lost_per_trainer_kill": losses,
        "batch_steps": batch_steps,
        "update_batch_max_steps": update_max,
        "rss_mb": rss,
        "rss_slack_mb": RSS_SLACK_MB,
        "broker_errors": last.get("errors"),
        "traj": last.get("traj"),
        "targets": {
            "rss_flat_after_warmup": flat,
            "fates_add_up": bool(acked) and total == acked.get("acked"),
            "lost_per_trainer_kill_within_one_update": all(x <= update_max for x in losses),
        },
        "samples": len(timeline),
    }


def plot_rss(soak: Soak, path: Path) -> None:

    fig, ax = subplots(figsize=(9, 4.5))
    for p in soak.procs:
        if p.rss:
            ax.plot([t - soak.t0 for t, _ in p.rss], [r for _, r in p.rss], label=p.name, lw=1)
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("RSS of every process (a new line per restart)")
    ax.legend(fontsize=6, ncol=4)
    save_figure(fig, path, 100)


if __name__ == "__main__":
    main()
