"""The WEIGHTS announcement (a version, its manifest and where its bytes are; never the bytes)
and the broker's one rule about it.

Header fields of WEIGHTS (besides ``v`` and ``type``):

    version       int    the publication's number: the store, manifest and receivers' order
    policy_version int   optional: the policy version the weights act as (default ``version``);
                         weights published while an update runs (``weights.in_flight``) carry
                         the version that update started from, under a newer ``version``
    manifest      map    :class:`rlvla3.weights.manifest.Manifest` on the wire
    store         map    {"host": host id, "seg": segment name, "size": bytes} of the trainer's
                         shared-memory store, or nil when same-host reads are off
    stream        str    rank 0's weight stream endpoint (FETCH/BUCKET), or nil
    published_at  int    trainer's wall clock (ns) when the version was published
    ipc           map    optional: the CUDA IPC handle of rank 0's device copy of the trainable
                         slot (``rlvla3.weights.cuda_ipc``; same-GPU generators; CUDA only)

The broker keeps the newest announcement as its snapshot (the ZeroMQ Guide's Clone pattern),
accepts only increasing versions and refuses a WEIGHTS that carries tensors: its memory no
longer depends on the model's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlvla3 import protocol as P
from rlvla3.weights.manifest import SLOTS, Manifest, ManifestError


def parse_ipc(ipc: Any) -> dict[str, Any] | None:
    """Validate an announcement's ``ipc`` field (None when absent); raises ValueError."""
    if ipc is None:
        return None
    ints = ("slot", "base", "device", "size", "offset", "ref_offset")
    if not isinstance(ipc, dict) or not isinstance(ipc.get("uuid"), str) or ipc.get("slot") not in SLOTS \
            or not all(isinstance(ipc.get(k), int) and ipc[k] >= 0 for k in ints) \
            or not all(isinstance(ipc.get(k), bytes) for k in ("handle", "ref_handle")):
        raise ValueError("announcement ipc must be {uuid, slot, base, device, handle, size, offset, ref_handle, ref_offset, ...}")
    return ipc


@dataclass(frozen=True)
class Announcement:
    version: int
    manifest: Manifest
    store: dict[str, Any] | None
    stream: str | None
    published_at: int | None
    ipc: dict[str, Any] | None = None
    policy_version: int | None = None
    """The policy version these weights act as; None: ``version``."""

    @property
    def acts_as(self) -> int:
        return self.version if self.policy_version is None else self.policy_version

    def fields(self) -> dict[str, Any]:
        """The WEIGHTS header fields that announce this version."""
        return {"version": self.version, "manifest": self.manifest.to_wire(), "store": self.store,
                "stream": self.stream, "published_at": self.published_at, **({"ipc": self.ipc} if self.ipc else {}),
                **({"policy_version": self.policy_version} if self.policy_version is not None else {})}


def parse_announcement(header: dict[str, Any]) -> Announcement:
    """Validate a WEIGHTS header as an announcement; raises ManifestError naming the problem."""
    version = header.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ManifestError(f"announcement version {version!r} is not a non-negative integer")
    policy = header.get("policy_version")
    if policy is not None and (not isinstance(policy, int) or isinstance(policy, bool) or not 0 <= policy <= version):
        raise ManifestError(f"announcement policy_version {policy!r} is not an integer in [0, version {version}]")
    store, stream, at = header.get("store"), header.get("stream"), header.get("published_at")
    size = None
    if store is not None:
        if not isinstance(store, dict) or not isinstance(store.get("host"), str) \
                or not isinstance(store.get("seg"), str) or not str(store.get("seg")).startswith(P.SHM_PREFIX) \
                or "/" in store["seg"] or not isinstance(store.get("size"), int):
            raise ManifestError("announcement store must be {host: str, seg: rlvla3_..., size: int}")
        size = store["size"]
    if stream is not None and (not isinstance(stream, str) or "://" not in stream or len(stream) > 1000):
        raise ManifestError(f"announcement stream {stream!r} is not an endpoint")
    if store is None and stream is None:
        raise ManifestError("announcement says neither store nor stream: nowhere to fetch from")
    if at is not None and not isinstance(at, int):
        raise ManifestError("published_at must be an integer")
    manifest = Manifest.from_wire(header.get("manifest"), store_size=size)
    if manifest.version != version:
        raise ManifestError(f"manifest is for version {manifest.version}, announcement for {version}")
    try:
        ipc = parse_ipc(header.get("ipc"))
    except ValueError as err:
        raise ManifestError(str(err)) from None
    if ipc is not None and store is None:
        raise ManifestError("announcement ipc needs the store (its seqlock guards the device copy)")
    return Announcement(version, manifest, store, stream, at, ipc, policy)


def publications_per_version(cfg: Any) -> int:
    """How many publication numbers each policy version spans: publication ``v * S + k`` is
    policy version ``v`` after ``k`` of its update's epochs (``weights.in_flight``: S is
    ``algo.epochs``; otherwise 1, and publication and policy version are the same number).
    The trainer numbers by it and the broker checks announcements against it."""
    return max(1, int(cfg.algo.epochs)) if cfg.weights.in_flight else 1


class LatestWeights:
    """The broker's weight rule: keep the newest announcement, accept only increasing versions,
    never hold tensor bytes. Pure logic (no sockets): the broker calls :meth:`offer` on WEIGHTS
    from a trainer and publishes what it returns, and answers SNAPSHOT with the same frames
    (``brokers/weights.py``)."""

    def __init__(self) -> None:
        self.version = -1
        self.policy_version = -1
        """The policy version the newest announcement acts as (what versions elsewhere count)."""

    def offer(self, msg: P.Message) -> dict[str, Any] | None:
        """The fields to publish on PUB, or None when the version is not newer. A bad
        announcement raises ProtocolError (the broker answers ERROR and drops it)."""
        if msg.tensors:
            raise P.ProtocolError(P.E_TENSOR, "WEIGHTS announces a version; its bytes go through the weight store or stream, never the broker")
        try:
            ann = parse_announcement(msg.header)
        except ManifestError as err:
            raise P.ProtocolError(P.E_FIELD, str(err)) from None
        if ann.version <= self.version:
            return None
        if ann.acts_as < self.policy_version:
            raise P.ProtocolError(P.E_FIELD, f"WEIGHTS version {ann.version} acts as policy version {ann.acts_as}, "
                                             f"older than the {self.policy_version} already announced")
        self.version, self.policy_version = ann.version, ann.acts_as
        return ann.fields()
