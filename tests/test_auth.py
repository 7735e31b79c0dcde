"""CURVE and the ZAP allowlist on real sockets: a stranger gets nothing, an allowlisted job runs
end to end, an exposed bind without keys is refused, ipc:// socket files are owner-only."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
import zmq.auth
from click.testing import CliRunner

from rlvla3 import auth
from rlvla3 import protocol as P
from rlvla3.app.cli import main
from rlvla3.app.launch import request_status
from rlvla3.config import load
from rlvla3.harness.jobs import SMALL_JOB, Job, start_job
from rlvla3.status_client import wait_until

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    out = tmp_path / "keys"
    result = CliRunner().invoke(main, ["keys", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_keys_command_makes_owner_only_secrets(keys: Path):
    assert (keys / "broker.key").is_file() and (keys / "broker.key_secret").is_file()
    for role in auth.DEFAULT_CLIENTS:
        secret = keys / "clients" / f"{role}.key_secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
        assert (keys / "clients" / f"{role}.key").is_file()
    before = (keys / "broker.key_secret").read_bytes()
    result = CliRunner().invoke(main, ["keys", str(keys), "--client", "gen7"])
    assert result.exit_code == 0 and (keys / "clients" / "gen7.key_secret").is_file()
    assert (keys / "broker.key_secret").read_bytes() == before  # existing pairs are kept


def _job(tmp_path: Path, bind: str = "tcp://127.0.0.1:0", pub: str = "tcp://127.0.0.1:0", start: bool = True) -> Job:
    return start_job(load("synthetic.yaml", list(SMALL_JOB)), tmp_path / "job", start, bind, pub)


def _silent(ctx: zmq.Context, endpoint: str, setup) -> bool:
    """True when a DEALER set up by ``setup`` gets no answer at all to STATUS and READY."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        setup(sock)
        sock.connect(endpoint)
        sock.send_multipart(P.encode(P.STATUS, {}))
        sock.send_multipart(P.encode(P.READY, {"role": "trainer", "host": "x", "pid": 1}))
        return sock.poll(1500) == 0
    finally:
        sock.close()


def test_curve_broker_admits_only_allowlisted_keys(tmp_path: Path, keys: Path, zctx, monkeypatch):
    monkeypatch.setenv("RLVLA3_KEYS", str(keys))
    job = _job(tmp_path, start=False)
    try:
        assert _silent(zctx, job.endpoint, lambda s: None), "a plain peer got an answer from a CURVE broker"
        stranger_pub, stranger_secret = zmq.curve_keypair()
        broker_pub = zmq.auth.load_certificate(str(keys / "broker.key"))[0]

        def unlisted(s: zmq.Socket) -> None:  # a well-formed CURVE client whose key is not allowed
            s.setsockopt(zmq.CURVE_SERVERKEY, broker_pub)
            s.setsockopt(zmq.CURVE_PUBLICKEY, stranger_pub)
            s.setsockopt(zmq.CURVE_SECRETKEY, stranger_secret)

        assert _silent(zctx, job.endpoint, unlisted), "a key outside the allowlist got an answer"
        fig = request_status(job.endpoint, 5.0, keys_dir=str(keys))
        assert fig["workers"] == {"simulator": 0, "generator": 0, "trainer": 0}
        assert job.broker_proc.poll() is None
    finally:
        job.stop()


def test_job_runs_end_to_end_with_curve(tmp_path: Path, keys: Path, monkeypatch):
    """Broker, simulator, generator and trainer as real processes, every socket CURVE (the
    generator's SUB included: it loads versions published after its snapshot)."""
    monkeypatch.setenv("RLVLA3_KEYS", str(keys))
    job = _job(tmp_path)
    try:
        def advanced():
            dead = [p.returncode for p in [job.broker_proc, *job.workers] if p.poll() is not None]
            assert not dead, f"a process exited: {dead}\n" + "\n".join(f.read_text()[-2000:] for f in job.run_dir.glob("*.log"))
            fig = request_status(job.endpoint, 5.0, keys_dir=str(keys))
            gen = next((w for w in fig["per_worker"] if w["role"] == "generator"), None)
            return fig["env_steps"] >= 200 and fig["policy_version"] >= 2 and gen and (gen["version"] or -1) >= 2

        wait_until(advanced, 240, "a CURVE job to train and the generator to load published versions", interval=0.5)
        assert "curve=True" in (job.run_dir / "broker.log").read_text()
    finally:
        job.stop()


def _ask(ctx: zmq.Context, endpoint: str, keys: Path, key_name: str, msg: list) -> P.Message:
    """One message from an allowlisted CURVE client ``key_name``, and the broker's answer."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        auth.configure_client(sock, str(keys), key_name)
        sock.connect(endpoint)
        sock.send_multipart(msg)
        assert sock.poll(10_000), f"no answer to {key_name}"
        return P.decode(sock.recv_multipart())
    finally:
        sock.close()


def test_curve_roles_are_bound_to_key_names(tmp_path: Path, keys: Path, zctx, monkeypatch):
    """The shell hands the ZAP User-Id (the key file's name) to the state: the ``client`` key
    may ask STATUS but not join, a ``simulator`` key may join only as a simulator."""
    monkeypatch.setenv("RLVLA3_KEYS", str(keys))
    job = _job(tmp_path, start=False)
    try:
        def ready(role: str) -> list:
            return P.encode(P.READY, {"role": role, "host": "h", "pid": 1, "name": "x"})

        for key_name, role in (("client", "trainer"), ("simulator", "trainer"), ("generator", "simulator")):
            reply = _ask(zctx, job.endpoint, keys, key_name, ready(role))
            assert reply.type == P.ERROR and reply["code"] == P.E_AUTH, (key_name, role, reply.header)
        assert _ask(zctx, job.endpoint, keys, "simulator", ready("simulator")).type == P.READY
        assert _ask(zctx, job.endpoint, keys, "client", P.encode(P.STATUS, {})).type == P.STATUS
        assert job.broker_proc.poll() is None
    finally:
        job.stop()


@pytest.mark.slow
def test_rlvla3_run_with_keys(tmp_path: Path, keys: Path):
    """``rlvla3 run --keys``: every process a CURVE peer with its role's key, STATUS polls too."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "RLVLA3_KEYS"}
    sets = [x for kv in SMALL_JOB for x in ("--set", kv)]
    r = subprocess.run([sys.executable, "-m", "rlvla3", "run", "synthetic.yaml", "--steps", "300", "--keys", str(keys),
                        "--run-dir", str(run_dir), *sets], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert '"reason": "steps_reached"' in r.stdout.strip().splitlines()[-1], r.stdout[-2000:]
    assert "curve=True" in (run_dir / "broker.log").read_text()


def _broker_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RLVLA3_KEYS"}
    return subprocess.run([sys.executable, "-m", "rlvla3", "broker", "--info-file", str(tmp_path / "b.json"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_exposed_bind_without_keys_is_refused(tmp_path: Path):
    r = _broker_cli(tmp_path, "--bind", "tcp://0.0.0.0:0", "--pub", "tcp://127.0.0.1:0")
    assert r.returncode != 0
    assert "refusing to bind tcp://0.0.0.0:0 without keys" in r.stderr and "--insecure" in r.stderr, r.stderr
    assert not (tmp_path / "b.json").exists()
    r = _broker_cli(tmp_path, "--auth", "--bind", "tcp://127.0.0.1:0", "--pub", "tcp://127.0.0.1:0")
    assert r.returncode != 0 and "--auth needs a key folder" in r.stderr, r.stderr


def test_exposed_bind_with_insecure_starts(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k != "RLVLA3_KEYS"}
    info = tmp_path / "b.json"
    proc = subprocess.Popen([sys.executable, "-m", "rlvla3", "broker", "--insecure", "--bind", "tcp://0.0.0.0:0",
                             "--pub", "tcp://127.0.0.1:0", "--info-file", str(info)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: info.is_file() or proc.poll() is not None, 30, "the broker to listen")
        assert proc.poll() is None and info.is_file()
    finally:
        proc.terminate()
        proc.wait(10)


def test_ipc_endpoints_are_owner_only(tmp_path: Path):
    job = _job(tmp_path, f"ipc://{tmp_path}/router.sock", f"ipc://{tmp_path}/pub.sock", start=False)
    try:
        for name in ("router.sock", "pub.sock"):
            mode = stat.S_IMODE((tmp_path / name).stat().st_mode)
            assert mode & 0o077 == 0, f"{name} is {oct(mode)}"
        assert request_status(job.endpoint, 5.0)["run_id"]
    finally:
        job.stop()


@pytest.mark.parametrize("endpoint, loopback", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.3.0.1:1", True), ("tcp://localhost:1", True), ("tcp://[::1]:1", True),
    ("ipc:///tmp/x", True), ("tcp://*:5555", False), ("tcp://0.0.0.0:1", False), ("tcp://10.0.0.2:1", False),
    ("tcp://eth0:1", False),
])
def test_is_loopback(endpoint: str, loopback: bool):
    assert auth.is_loopback(endpoint) is loopback
