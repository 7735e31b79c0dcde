"""Weights to another host: a bucketed stream served by trainer rank 0 over its own ZMQ socket.

Why a ZMQ stream and not a torch.distributed broadcast group: generators come and go, and a
broadcast group has to be rebuilt (a collective every member, rank 0 included, blocks in)
each time one joins or leaves; a late or slow generator would hold up the others and the
trainer. With a stream each generator pulls the version it was told about, at its own pace,
from rank 0's ROUTER socket (``weights.stream_bind``); it needs no rendezvous, a late joiner is
just one more reader, and a generator that dies mid-fetch costs nothing. The price is that
bytes go through host memory and TCP instead of NCCL over NVLink/InfiniBand, which matters for
multi-GB models across GPU hosts; a broadcast group can be added beside this later without
changing the announcement (it is one more "where").

The server reads the same shared-memory store that same-host generators map, so rank 0 keeps
one copy of each version whatever the number of readers. A FETCH asks for one byte range
(``region``, ``offset``, ``nbytes`` <= :data:`MAX_BUCKET_BYTES`) of one version; the server
copies the range out under the region's seqlock and answers BUCKET with the bytes, or BUCKET
with ``error: "gone"`` when the region no longer holds that version (the reader then waits
for the newer announcement). The reader keeps two FETCHes in flight (credit-based flow, as the
ZeroMQ Guide's file transfer) and checks every tensor's checksum against the manifest.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import structlog
import zmq

from rlvla3 import protocol as P
from rlvla3.weights.manifest import ALIGN, REGIONS, Entry, checksum
from rlvla3.weights.store import TornRead, WeightStore

log = structlog.get_logger()

MAX_BUCKET_BYTES = 256 * 2**20
"""A FETCH asks for at most this many bytes (one BUCKET frame)."""
IN_FLIGHT = 2
"""FETCHes a reader keeps outstanding."""
BUCKET_TIMEOUT_S = 30.0
"""A reader gives up a fetch when a bucket takes longer than this (the stream may be gone)."""


class StreamServer:
    """Trainer rank 0's weight stream: a thread with its own context and ROUTER socket."""

    def __init__(self, store: WeightStore, bind: str, advertise_host: str = "") -> None:
        self.store = store
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 64 * 1024)
        self.sock.setsockopt(zmq.SNDHWM, 4 * IN_FLIGHT)
        self.sock.bind(bind)
        self.endpoint = advertised(self.sock.getsockopt_string(zmq.LAST_ENDPOINT), advertise_host)
        self._stop = threading.Event()
        self.buckets_sent = 0
        self._thread = threading.Thread(target=self._loop, name="weight-stream", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.sock.poll(100, zmq.POLLIN):
                    continue
                frames = self.sock.recv_multipart(copy=False)
                reply = self._answer(frames[1:])
                try:
                    self.sock.send_multipart([frames[0], *reply], zmq.DONTWAIT, copy=False)
                except (zmq.Again, zmq.ZMQError) as exc:  # the reader left or is not draining
                    log.warning("weight_bucket_undelivered", error=str(exc))
        finally:
            self.sock.close(linger=0)
            self.ctx.term()

    def _answer(self, frames: list[Any]) -> list[Any]:
        try:
            msg = P.decode(frames)
            if msg.type != P.FETCH:
                raise P.ProtocolError(P.E_TYPE, f"the weight stream answers FETCH, not {msg.type}")
            version, region, offset, nbytes = msg["version"], msg["region"], msg["offset"], msg["nbytes"]
            start = self.store.region_offset(region) if region in REGIONS else -1
            if start < 0 or not 0 < nbytes <= MAX_BUCKET_BYTES or offset < start \
                    or offset + nbytes > start + self.store.region_size(region):
                raise P.ProtocolError(P.E_FIELD, f"range {offset}+{nbytes} is not inside region {region}")
        except P.ProtocolError as err:
            return P.error_frames(err.code, err.reason, P.FETCH)
        head = {"version": version, "region": region, "offset": offset}
        try:
            seq = self.store.read_begin(region, version)
            out = np.empty(nbytes, dtype=np.uint8)
            np.copyto(out, self.store.view(offset, nbytes))
            self.store.read_end(region, seq)
        except TornRead as exc:
            return P.encode(P.BUCKET, {**head, "error": "gone", "reason": str(exc)})
        self.buckets_sent += 1
        return P.encode(P.BUCKET, head, {"bytes": out})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def advertised(endpoint: str, host: str) -> str:
    """The endpoint readers connect to: a wildcard bind is advertised under ``host``."""
    scheme, _, rest = endpoint.partition("://")
    addr, _, port = rest.rpartition(":")
    if scheme == "tcp" and addr in ("0.0.0.0", "*", "[::]", "::"):
        import socket

        return f"tcp://{host or socket.gethostname()}:{port}"
    return endpoint


def plan_buckets(entries: list[Entry], bucket_bytes: int) -> list[tuple[int, int, int]]:
    """(region, offset, nbytes) ranges covering ``entries``: neighbours in one region merge until
    a bucket is full; a tensor larger than a bucket is split."""
    bucket_bytes = max(ALIGN, min(int(bucket_bytes), MAX_BUCKET_BYTES))
    out: list[tuple[int, int, int]] = []
    for e in sorted(entries, key=lambda e: (e.region, e.offset)):
        if e.nbytes == 0:
            continue
        a, end = e.offset, e.offset + e.nbytes
        if out:
            r, o, n = out[-1]
            if r == e.region and a - (o + n) < ALIGN and end - o <= bucket_bytes:
                out[-1] = (r, o, end - o)
                continue
        while a < end:
            n = min(bucket_bytes, end - a)
            out.append((e.region, a, n))
            a += n
    return out


def stream_read(ctx: zmq.Context, endpoint: str, entries: list[Entry], dst: dict[str, np.ndarray],
                bucket_bytes: int) -> dict[str, int]:
    """Fetch ``entries`` (all of one version per region) into ``dst`` (name -> flat uint8 array);
    return each entry's checksum as received. Raises TornRead when the stream cannot deliver."""
    versions = {e.region: e.since for e in entries}
    buckets = plan_buckets(entries, bucket_bytes)
    by_start = sorted(entries, key=lambda e: (e.region, e.offset))
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_BUCKET_BYTES + 64 * 1024)
    sock.connect(endpoint)
    try:
        sent = 0
        pending = 0
        for _ in range(len(buckets)):
            while sent < len(buckets) and pending < IN_FLIGHT:
                r, o, n = buckets[sent]
                sock.send_multipart(P.encode(P.FETCH, {"version": versions[r], "region": r, "offset": o, "nbytes": n}))
                sent += 1
                pending += 1
            if not sock.poll(int(BUCKET_TIMEOUT_S * 1000), zmq.POLLIN):
                raise TornRead(f"weight stream {endpoint}: no bucket within {BUCKET_TIMEOUT_S:.0f} s")
            try:
                msg = P.decode(sock.recv_multipart(copy=False))
            except P.ProtocolError as err:
                raise TornRead(f"weight stream {endpoint}: bad reply ({err})") from None
            pending -= 1
            if msg.type == P.ERROR:
                raise TornRead(f"weight stream {endpoint} refused: {msg['reason']}")
            if msg.type != P.BUCKET or msg.get("error"):
                raise TornRead(f"weight stream {endpoint}: {msg.get('reason') or msg.type}")
            data = msg.tensors.get("bytes")
            if data is None:
                raise TornRead(f"weight stream {endpoint}: BUCKET without bytes")
            _scatter(msg["region"], msg["offset"], P.inline_array(data), by_start, dst)
    finally:
        sock.close(linger=0)
    return {e.name: checksum(dst[e.name]) for e in entries}


def _scatter(region: int, offset: int, data: np.ndarray, entries: list[Entry], dst: dict[str, np.ndarray]) -> None:
    """Copy the parts of a bucket that belong to each entry into that entry's buffer."""
    end = offset + data.nbytes
    for e in entries:
        if e.region != region or e.offset >= end or e.offset + e.nbytes <= offset:
            continue
        a, b = max(offset, e.offset), min(end, e.offset + e.nbytes)
        dst[e.name][a - e.offset:b - e.offset] = data[a - offset:b - offset]
