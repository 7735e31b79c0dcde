"""Who may talk to the broker: CURVE encryption and a ZAP allowlist of client public keys.

Anyone who reaches the broker's port could otherwise read the config, answer batches or publish
weights. With a key folder (made by ``rlvla3 keys DIR``) the broker's ROUTER and PUB sockets are
CURVE servers, and a ZAP handler (pyzmq's ThreadAuthenticator) admits only clients whose public
key is in ``DIR/clients/``. A peer without an allowed key never completes the handshake: it
gets no reply at all.

Key folder layout (the ``.key_secret`` files are owner-only; hand each host only what it needs):

    DIR/broker.key              broker public key (every client needs it)
    DIR/broker.key_secret       broker secret key (the broker's host only)
    DIR/clients/NAME.key        a client's public key: the allowlist
    DIR/clients/NAME.key_secret a client's secret key (that client's host only)

Rule: CURVE is on exactly when a key folder is given. A broker bound to a non-loopback address
refuses to start without one unless ``--insecure`` is given (:func:`check_bind`).
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from urllib.parse import urlsplit

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

ZAP_DOMAIN = "rlvla3"
DEFAULT_CLIENTS = ("simulator", "generator", "trainer", "client")
"""One key pair per role by default (``rlvla3 keys DIR --client NAME`` adds per-worker ones)."""


class AuthError(RuntimeError):
    """Keys missing or unreadable, or a bind that would expose the job without them."""


# ---------------------------------------------------------------------------------------------
# Key files
# ---------------------------------------------------------------------------------------------


def make_keys(keys_dir: str | Path, clients: tuple[str, ...] = DEFAULT_CLIENTS) -> list[Path]:
    """Create the broker's key pair (unless present) and one pair per client name. Existing
    pairs are kept, so the command can add clients to a folder; a broker reads the allowlist
    when it starts (restart it to admit a new client)."""
    root = Path(keys_dir)
    (root / "clients").mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    made = []
    for folder, name in [(root, "broker"), *((root / "clients", c) for c in clients)]:
        if not name or "/" in name or name.startswith("."):
            raise AuthError(f"bad key name {name!r}")
        if not (folder / f"{name}.key_secret").is_file():
            public, secret = zmq.auth.create_certificates(str(folder), name)
            os.chmod(secret, 0o600)
            made.append(Path(public))
    return made


def _load_secret(path: Path) -> tuple[bytes, bytes]:
    if not path.is_file():
        raise AuthError(f"no key file {path} (make the key pairs with `rlvla3 keys {path.parent}`)")
    public, secret = zmq.auth.load_certificate(str(path))
    if secret is None:
        raise AuthError(f"{path} holds no secret key")
    return public, secret


def _load_public(path: Path) -> bytes:
    if not path.is_file():
        raise AuthError(f"no key file {path} (make the key pairs with `rlvla3 keys {path.parent}`)")
    return zmq.auth.load_certificate(str(path))[0]


# ---------------------------------------------------------------------------------------------
# Sockets
# ---------------------------------------------------------------------------------------------


def start_authenticator(ctx: zmq.Context, keys_dir: str | Path) -> ThreadAuthenticator:
    """The ZAP handler for ``ctx``: CURVE clients whose public key is in ``keys_dir/clients``.
    Start it before binding; stop it when the sockets are closed."""
    clients = Path(keys_dir) / "clients"
    if not any(clients.glob("*.key")):
        raise AuthError(f"no client public keys in {clients}: nobody could join")
    auth = NamedKeyAuthenticator(ctx, clients)
    auth.start()
    auth.configure_curve(domain=ZAP_DOMAIN, location=str(clients))
    return auth


class NamedKeyAuthenticator(ThreadAuthenticator):
    """The allowlist's ZAP handler, naming each admitted peer by its key file: the User-Id of
    its messages (``frame.get("User-Id")``) is ``NAME`` of ``clients/NAME.key``. The broker binds
    roles to these names (``brokers.access.role_allowed``)."""

    def __init__(self, ctx: zmq.Context, clients: Path) -> None:
        super().__init__(ctx)
        self.names = {_load_public(p): p.name[:-len(".key")] for p in sorted(clients.glob("*.key"))}

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.names.get(zmq.utils.z85.encode(client_public_key), "")


def configure_server(sock: zmq.Socket, keys_dir: str | Path) -> None:
    """Make ``sock`` a CURVE server with the broker's key pair (before bind)."""
    public, secret = _load_secret(Path(keys_dir) / "broker.key_secret")
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())


def configure_client(sock: zmq.Socket, keys_dir: str | Path | None, name: str) -> None:
    """Make ``sock`` a CURVE client with client ``name``'s key pair (before connect). A no-op
    without a key folder, so callers need no branch."""
    if not keys_dir:
        return
    root = Path(keys_dir)
    public, secret = _load_secret(root / "clients" / f"{name}.key_secret")
    sock.setsockopt(zmq.CURVE_SERVERKEY, _load_public(root / "broker.key"))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


def bind_private(sock: zmq.Socket, endpoint: str) -> None:
    """Bind; an ipc:// socket file is created owner-only (umask while binding, then chmod),
    so other users of a shared machine cannot connect to it."""
    if not endpoint.startswith("ipc://"):
        sock.bind(endpoint)
        return
    old = os.umask(0o077)
    try:
        sock.bind(endpoint)
    finally:
        os.umask(old)
    path = sock.getsockopt(zmq.LAST_ENDPOINT).decode()[len("ipc://"):]
    if path and not path.startswith("@"):  # "@...": Linux abstract namespace, no file
        os.chmod(path, 0o600)


# ---------------------------------------------------------------------------------------------
# Policy
# ---------------------------------------------------------------------------------------------


def is_loopback(endpoint: str) -> bool:
    """ipc://, inproc:// and tcp:// on 127.0.0.0/8, ::1 or localhost stay on this machine."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = urlsplit(endpoint.replace("tcp://", "//", 1)).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a host name: reachable from elsewhere
        return False


def check_bind(endpoints: list[str], keys_dir: str | None, require_auth: bool, insecure: bool) -> None:
    """Refuse a configuration that would let anyone who reaches the port own the job."""
    if keys_dir:
        root = Path(keys_dir)
        _load_secret(root / "broker.key_secret")
        if not any((root / "clients").glob("*.key")):
            raise AuthError(f"no client public keys in {root / 'clients'}: nobody could join")
        return
    if require_auth:
        raise AuthError("--auth needs a key folder (--keys DIR or broker.keys_dir; make one with `rlvla3 keys DIR`)")
    exposed = [e for e in endpoints if not is_loopback(e)]
    if exposed and not insecure:
        raise AuthError(
            f"refusing to bind {', '.join(exposed)} without keys: anyone who can reach it could read the job's "
            "config, answer batches and publish weights. Make keys with `rlvla3 keys DIR` and pass --keys DIR "
            "(workers too), or pass --insecure on a trusted network.")
