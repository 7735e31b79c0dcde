"""Several hosts on one machine: each a network namespace with its own hostname and /dev/shm.

The fabric decides shared memory versus inline frames by host id (``rlvla3.shm.host_id``:
hostname, boot id, /dev/shm device), so a job spread over these hosts takes the cross-host paths
for real: TCP between namespaces (veth pairs on one bridge), inline frames between hosts,
shared memory within one. ``bench/fabric/multihost.py`` and the ``multihost`` test run jobs on them.

    hosts = NetnsHosts()                  # needs root and iproute2; see ``unavailable()``
    broker = hosts.add("broker")          # 10.213.0.1
    sim = hosts.add("sim1")               # 10.213.0.2, ...
    proc = hosts.spawn(sim, ["worker", "--role", "simulator", ...], log_path)
    hosts.cut(sim); hosts.heal(sim)       # its cable out of the switch, and back in
    hosts.kill_host(sim)                  # SIGKILL every process in its namespace, by pid
    hosts.close()                         # kill what is left, delete the namespaces

Every host hangs off one switch (a bridge in a namespace of its own, with no process and no
address), by a veth pair whose switch end :meth:`NetnsHosts.cut` takes down: a network partition
of that host from all the others, as a pulled cable or a failed top-of-rack port (this kernel
has no netem). The host's own end stays up, so its processes see no link change, only silence.

``NetnsJob`` runs a job over them with CURVE keys (broker on the first host, STATUS from there).

Each host keeps one holder process (``sleep``) inside ``unshare --mount --uts`` that owns the
private tmpfs on /dev/shm and the hostname; every process of the host joins the holder's
network, mount and UTS namespaces with ``nsenter``, so processes of one host share /dev/shm and
processes of different hosts do not. Nothing is mounted in, or routed to, the machine's own
namespaces.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import structlog

from rlvla3.app.launch import request_status, spawn
from rlvla3.status_client import DeadlinePassed, rate_over, wait_until

log = structlog.get_logger()

SUBNET = "10.213.0"
"""The hosts' private /24 (it exists only inside the namespaces made here)."""
SHM_SIZE = "512m"
CLONE_NEWNET = 0x40000000


@dataclass
class Host:
    name: str
    netns: str
    addr: str
    holder: subprocess.Popen
    procs: list[subprocess.Popen] = field(default_factory=list)


def unavailable() -> str | None:
    """Why this machine cannot run namespace hosts (``None``: it can)."""
    if os.geteuid() != 0:
        return "needs root (network and mount namespaces)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs {tool!r} (iproute2 / util-linux) on PATH"
    probe = f"rlvprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class NetnsHosts:
    """Namespace hosts on one bridge (held by the first host). Names are unique per process."""

    def __init__(self) -> None:
        self.tag = f"rlv{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.hosts: dict[str, Host] = {}

    def add(self, name: str) -> Host:
        """A new host, reachable from every other at ``host.addr``."""
        i = len(self.hosts)
        if i == 0:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
        netns = f"{self.tag}-{i}"
        _ip("netns", "add", netns)
        addr = f"{SUBNET}.{i + 1}"
        try:
            _ip("-n", netns, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "add", f"port{i}", "type", "veth", "peer", "name", "eth0", "netns", netns)
            _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0", "up")
            _ip("-n", netns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", netns, "link", "set", "eth0", "up")
            holder = subprocess.Popen(
                ["ip", "netns", "exec", netns, "unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c",
                 f"mount -t tmpfs -o size={SHM_SIZE},mode=1777 tmpfs /dev/shm && hostname {name} && exec sleep infinity"],
                start_new_session=True)
        except BaseException:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
            raise
        host = Host(name, netns, addr, holder)
        self.hosts[name] = host
        self._wait_holder(host)
        log.info("netns_host_added", host=name, netns=netns, addr=addr)
        return host

    def _wait_holder(self, host: Host, timeout_s: float = 10.0) -> None:
        """Until the holder runs ``sleep`` with its /dev/shm mounted (its mount namespace is set)."""
        def running() -> bool:
            if host.holder.poll() is not None:
                raise RuntimeError(f"host {host.name}: the namespace holder exited with {host.holder.returncode}")
            try:
                return Path(f"/proc/{host.holder.pid}/comm").read_text().strip() == "sleep"
            except OSError:
                return False

        wait_until(running, timeout_s, f"host {host.name}'s namespace holder to start", interval=0.02)

    def spawn(self, host: Host, args: list[str], log_path: Path | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``rlvla3 ARGS`` on ``host`` (``rlvla3.app.launch.spawn`` inside its namespaces)."""
        enter = ["nsenter", "-t", str(host.holder.pid), "--net", "--mount", "--uts", "--"]
        proc = spawn(args, log_path, env, wrap=enter)
        host.procs.append(proc)
        return proc

    def call_in(self, host: Host, fn: Callable[[], Any], timeout_s: float = 60.0) -> Any:
        """``fn()`` on a thread inside ``host``'s network namespace (sockets it opens, ZeroMQ's
        I/O threads included, live there), e.g. a STATUS round trip from the controller."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                fd = os.open(f"/var/run/netns/{host.netns}", os.O_RDONLY)
                try:
                    if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {host.netns} failed")
                finally:
                    os.close(fd)
                box["value"] = fn()
            except BaseException as exc:  # handed to the caller
                box["error"] = exc

        t = threading.Thread(target=run, name=f"in-{host.name}", daemon=True)
        t.start()
        t.join(timeout_s)
        if t.is_alive():
            raise TimeoutError(f"call in host {host.name} did not return within {timeout_s} s")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _port(self, host: Host) -> str:
        return f"port{list(self.hosts).index(host.name)}"

    def cut(self, host: Host) -> None:
        """Partition ``host`` from every other: its switch port goes down (packets in flight and
        all that follow are dropped; TCP sees nothing until it retransmits in vain)."""
        _ip("-n", self.switch, "link", "set", self._port(host), "down")
        log.info("netns_host_cut", host=host.name)

    def heal(self, host: Host) -> None:
        """Plug ``host`` back in."""
        _ip("-n", self.switch, "link", "set", self._port(host), "up")
        log.info("netns_host_healed", host=host.name)

    def pids(self, host: Host) -> list[int]:
        """Every process in the host's network namespace (its holder included)."""
        r = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True)
        return [int(p) for p in r.stdout.split() if p.isdigit()]

    def kill_host(self, host: Host) -> list[int]:
        """SIGKILL every process of ``host`` (a machine losing power) and reap ours. The
        namespace stays until ``close``."""
        killed = []
        for pid in self.pids(host):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        for p in [host.holder, *host.procs]:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("netns_process_not_reaped", host=host.name, pid=p.pid)
        host.procs = []
        log.info("netns_host_killed", host=host.name, pids=killed)
        return killed

    def close(self) -> None:
        """Kill every process of every host and delete the namespaces."""
        for host in reversed(list(self.hosts.values())):
            try:
                self.kill_host(host)
            finally:
                subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        if self.hosts:
            subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)
        self.hosts = {}


class NetnsJob:
    """A job with CURVE keys across namespace hosts: the broker on the first host (``head``),
    workers started by hand on any host, STATUS asked from the head host."""

    def __init__(self, folder: Path, port: int = 5555, pub_port: int = 5556) -> None:
        self.folder = Path(folder)
        self.hosts = NetnsHosts()
        self.keys = self.folder / "keys"
        self.port, self.pub_port = port, pub_port
        self.url = ""
        self.broker: subprocess.Popen | None = None
        self._broker_args: list[str] = []

    def host(self, name: str) -> Host:
        return self.hosts.hosts.get(name) or self.hosts.add(name)

    def start_broker(self, cfg_path: Path, timeout_s: float = 120.0) -> None:
        from rlvla3.auth import DEFAULT_CLIENTS, make_keys

        make_keys(self.keys, DEFAULT_CLIENTS)  # what `rlvla3 keys DIR` makes
        head = self.host("head")
        self.url = f"tcp://{head.addr}:{self.port}"
        self._broker_args = ["broker", "--config", str(cfg_path), "--bind", self.url, "--pub",
                             f"tcp://{head.addr}:{self.pub_port}", "--keys", str(self.keys)]
        self.restart_broker(timeout_s)

    def restart_broker(self, timeout_s: float = 120.0) -> None:
        """A broker (the first, or a new one after the last was killed) on the same addresses."""
        info = self.folder / "broker.json"
        info.unlink(missing_ok=True)
        self.broker = self.hosts.spawn(self.hosts.hosts["head"], [*self._broker_args, "--info-file", str(info)],
                                       self.folder / "broker.log")
        self._poll(info.exists, timeout_s, "the broker to listen")

    def worker(self, host: str, role: str, name: str, *extra: str) -> subprocess.Popen:
        h = self.host(host)
        args = ["worker", "--role", role, "--broker", self.url, "--keys", str(self.keys), "--key-name", role,
                "--name", name, *extra]
        env = None
        if role == "trainer":  # rank 0's weight stream, reachable from the other hosts
            args += ["--set", f"weights.stream_bind=tcp://{h.addr}:0"]
            # gloo finds its interface by the hostname, which resolves nowhere here (it would
            # fall back to loopback, which other hosts cannot reach): name the host's interface
            env = {"GLOO_SOCKET_IFNAME": "eth0"}
        return self.hosts.spawn(h, args, self.folder / f"{name}.log", env)

    def status(self, timeout_s: float = 10.0) -> dict[str, Any]:
        return self.hosts.call_in(self.hosts.hosts["head"],
                                  lambda: request_status(self.url, timeout_s, keys_dir=str(self.keys), key_name="client"),
                                  timeout_s + 5)

    def rate(self, seconds: float, key: str = "env_steps") -> dict[str, Any]:
        """``key`` per second over a ``seconds`` window of STATUS (``rlvla3.status_client.rate_over``)."""
        return rate_over(self.status, seconds, key)

    def wait(self, pred: Callable[[dict[str, Any]], bool], timeout_s: float, what: str) -> dict[str, Any]:
        """Poll STATUS until ``pred`` holds; fail naming ``what``, with the logs' tails."""
        def check() -> dict[str, Any] | None:
            try:
                fig = self.status()
            except TimeoutError:
                return None
            return fig if pred(fig) else None

        return self._poll(check, timeout_s, what)

    def _poll(self, fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
        try:
            return wait_until(fn, timeout_s, what, interval=0.25)
        except DeadlinePassed as exc:
            raise DeadlinePassed(f"{exc}\n{self.logs()}") from None

    def logs(self, tail: int = 2000) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}" for f in sorted(self.folder.glob("*.log")))

    def close(self) -> None:
        self.hosts.close()
