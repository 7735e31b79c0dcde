"""A job across several hosts for real: every host is a network namespace with its own hostname
and /dev/shm (``rlvla3/netns.py``), joined by veth pairs on one bridge, and the job runs with
CURVE on, as it would across machines.

    head   (10.213.0.1)  broker, simulator sim-head, generator gen-head
    train  (10.213.0.2)  trainer
    far    (10.213.0.3)  simulator sim-far, generator gen-far     (killed mid-run)
    late   (10.213.0.4)  simulator sim-late                        (added mid-run)

Checked from the broker's STATUS: each host has its own host id; frames travel as shared memory
within the head host and inline across hosts; a simulator host added mid-run gets work; killing
every process of one host loses no acknowledged step (``acked_steps``: every step acknowledged
by the trainer is trained, stale, discarded or still held by it) and the job goes on.

Skipped, with the reason, only where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlvla3.cli import _ask_status
from rlvla3.config import load
from rlvla3.netns import NetnsHosts, unavailable
from tests.jobs import FAST, wait_until

REASON = unavailable()
pytestmark = [pytest.mark.multihost, pytest.mark.timeout(900),
              pytest.mark.skipif(REASON is not None, reason=f"multihost: {REASON}")]

PORT, PUB = 5555, 5556


def _fates_add_up(a: dict[str, int]) -> bool:
    parts = ("evaluation", "trained", "stale", "discarded", "unreadable", "lost_with_trainer", "held_by_trainers")
    return a["acked"] == sum(a[k] for k in parts)


class Cluster:
    """The job's hosts, its processes and STATUS as seen from the head host."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.hosts = NetnsHosts()
        self.keys = tmp / "keys"
        self.url = ""

    def start_broker(self, cfg_path: Path) -> None:
        from rlvla3.launch import python_cmd
        import subprocess

        subprocess.run(python_cmd("keys", str(self.keys)), check=True, capture_output=True)
        head = self.hosts.add("head")
        self.url = f"tcp://{head.addr}:{PORT}"
        info = self.tmp / "broker.json"
        self.hosts.spawn(head, ["broker", "--config", str(cfg_path), "--bind", self.url, "--pub", f"tcp://{head.addr}:{PUB}",
                                "--keys", str(self.keys), "--info-file", str(info)], self.tmp / "broker.log")
        wait_until(info.exists, 120, "the broker to listen")

    def worker(self, host_name: str, role: str, name: str) -> None:
        host = self.hosts.hosts.get(host_name) or self.hosts.add(host_name)
        args = ["worker", "--role", role, "--broker", self.url, "--keys", str(self.keys), "--key-name", role, "--name", name]
        if role == "trainer":
            args += ["--run-dir", str(self.tmp / "run")]
        self.hosts.spawn(host, args, self.tmp / f"{name}.log")

    def fig(self) -> dict[str, Any]:
        return self.hosts.call_in(self.hosts.hosts["head"], lambda: _ask_status(self.url, 10.0, str(self.keys), "client"))

    def wait(self, pred, timeout: float, what: str) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            try:
                f = self.fig()
            except TimeoutError:
                return None
            return f if pred(f) else None

        try:
            return wait_until(check, timeout, what, interval=0.5)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{self.logs()}") from None

    def logs(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-2000:]}" for f in sorted(self.tmp.glob("*.log")))


def per(fig: dict[str, Any], name: str) -> dict[str, Any]:
    return next((w for w in fig["per_worker"] if w["name"] == name), {})


def test_job_across_namespace_hosts_with_curve(tmp_path: Path):
    cfg = load("synthetic.yaml", FAST)
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(cfg.to_yaml())
    c = Cluster(tmp_path)
    try:
        c.start_broker(cfg_path)
        c.worker("head", "simulator", "sim-head")
        c.worker("head", "generator", "gen-head")
        c.worker("train", "trainer", "trainer")
        c.worker("far", "simulator", "sim-far")
        c.worker("far", "generator", "gen-far")

        # ---- every host has its own host id; frames: shm within the head, inline across ----
        fig = c.wait(lambda f: f["workers"] == {"simulator": 2, "generator": 2, "trainer": 1}
                     and f["trainer_version"] >= 1 and all(per(f, n).get("frames", {}).get("inline", 0) > 0
                                                            for n in ("sim-far", "gen-far", "trainer")),
                     600, "all five workers to join over CURVE, frames to flow and one update")
        hosts = {w["name"]: w["host"] for w in fig["per_worker"]}
        assert hosts["sim-head"] == hosts["gen-head"]
        assert len({hosts["sim-head"], hosts["trainer"], hosts["sim-far"]}) == 3, hosts
        assert hosts["sim-far"] == hosts["gen-far"]
        assert per(fig, "sim-head")["frames"]["shm"] > 0 and per(fig, "sim-head")["frames"]["inline"] == 0
        assert per(fig, "sim-far")["frames"]["shm"] == 0  # another host than the broker's: inline only
        assert per(fig, "gen-far")["frames"]["shm"] == 0  # the broker inlines head-host shm for it
        assert per(fig, "trainer")["frames"]["shm"] == 0
        c.wait(lambda f: per(f, "gen-head").get("frames", {}).get("shm", 0) > 0, 120,
               "the head host's generator to read the head simulator's shared memory")

        # ---- a simulator host added mid-run gets work -------------------------------------------
        c.worker("late", "simulator", "sim-late")
        fig = c.wait(lambda f: (per(f, "sim-late").get("env_steps") or 0) > 0, 300, "sim-late (a new host) to get work")
        assert per(fig, "sim-late")["host"] not in set(hosts.values())

        # ---- kill every process of one host: nothing acknowledged is lost ----------------------
        before = c.fig()
        killed = c.hosts.kill_host(c.hosts.hosts["far"])
        assert len(killed) >= 3  # holder, sim-far, gen-far
        fig = c.wait(lambda f: f["workers"] == {"simulator": 2, "generator": 1, "trainer": 1}, 120,
                     "the broker to see the far host's workers gone")
        fig = c.wait(lambda f: f["trainer_version"] >= before["trainer_version"] + 2
                     and f["env_steps"] > before["env_steps"], 300, "the job to go on after the host died")
        acked = fig["acked_steps"]
        assert acked["acked"] > 0 and acked["trained"] > 0, acked
        assert acked["lost_with_trainer"] == 0 and acked["trainers_lost"] == 0, acked
        assert _fates_add_up(acked), acked
        assert per(fig, "sim-late")["frames"]["inline"] > 0 and per(fig, "sim-late")["frames"]["shm"] == 0
        (tmp_path / "status.json").write_text(json.dumps(fig))
    finally:
        c.hosts.close()
    assert not c.hosts.hosts
