"""The generator worker: batched inference for the policy, with weight versions swapped in
between batches, never during one.

Weights follow the ZeroMQ Guide's Clone pattern: subscribe to the broker's PUB first, then ask
the broker for its snapshot (SNAPSHOT), then apply only updates newer than what we hold. Until
the snapshot's version is in, the generator announces no credits, so it takes no batches with
weights older than the job's; when the broker has no version yet (-1), it waits for version 0
from trainer rank 0: the weights it built itself are never served, so generators do not rely on
identical seeded builds. The one exception is a job with no trainer (``workers.trainers=0``:
evaluation, benchmarks), where nothing would ever publish: there it serves its build.

A WEIGHTS announcement (version + manifest + where the bytes are) goes to a
:class:`~rlvla3.weights.receiver.WeightReceiver`: a "weights" thread copies and verifies the
version beside the served weights (from the trainer's shared-memory store on this host, or its
stream), and the loop swaps it in at the next gap between batches. A torn or corrupt version is
fetched again; one that cannot be loaded leaves the served weights as they are.

In sync mode a BATCH names the version it must be served with (``min_version``: the newest the
broker announced), so the rollout after an update is on-policy: a batch that arrives before that
version is fetched waits for it, at most half of ``batching.batch_timeout_s``, after which it is
served with what is in (``batch_served_behind``).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any
from urllib.parse import urlparse

import numpy as np
import structlog
import torch
import zmq

from rlvla3 import auth
from rlvla3 import names
from rlvla3 import protocol as P
from rlvla3.observation import Observation
from rlvla3.shm import ShmAttachments
from rlvla3.weights.manifest import ManifestError
from rlvla3.weights.receiver import WeightReceiver
from workers.base import WorkerBase
from workers.model import build_policy

log = structlog.get_logger()

INLINE_FORWARD_S = 0.005
"""Forward passes shorter than this run on the socket thread instead of a JobRunner."""


def gather(msg: P.Message, attach: ShmAttachments, pinned: bool = False
           ) -> tuple[Observation | None, np.ndarray, dict[int, str]]:
    """A BATCH's readable requests as one observation, their envs' deterministic flags, and the
    requests left out with why (``None``: none was readable).

    A request that cannot be read (its shared memory is gone with its simulator, tensors that
    disagree with ``n``) is left out alone: the rest of the batch is served.
    Each request is first wrapped without a copy (views into shared memory, where the
    simulator's envs wrote them, or the received frames). One request stays that view: safe,
    since a slot rewrites its observation block only after its ACT, which is sent after this
    batch's forward pass. Several requests cost one copy, one new array per field, as batching
    must. ``pinned`` (a CUDA policy): that one copy goes into pinned host memory, also for one
    request, and the policy's host-to-device copy is the only other.
    """
    parts, det, dropped = [], [], {}
    per_request = names.by_request(msg.tensors)
    for i, req in enumerate(msg["requests"]):
        n = int(req["n"])
        try:
            views = {name: attach.materialize(t) for name, t in per_request.get(i, {}).items()}
            obs = Observation.from_tensors(views, req["instruction"])
            if len(obs) != n:
                raise ValueError(f"request {i}: {len(obs)} observation(s), n={n}")
        except (KeyError, ValueError) as err:  # ProtocolError is a ValueError
            dropped[i] = str(err)[:300]
            continue
        parts.append(obs)
        flags = list(req.get("deterministic") or [])
        det.extend(bool(flags[j]) if j < len(flags) else False for j in range(n))
    return (Observation.concat(parts, pinned=pinned) if parts else None), np.asarray(det, dtype=bool), dropped


def pub_address(pub: str, broker_url: str) -> str:
    """Turn the broker's bound PUB endpoint into one this host can connect to."""
    u = urlparse(pub)
    if u.scheme == "tcp" and u.hostname in ("0.0.0.0", "*", "::"):
        host = urlparse(broker_url).hostname or "127.0.0.1"
        return f"tcp://{host}:{u.port}"
    return pub


class GeneratorWorker(WorkerBase):
    role = "generator"

    def __init__(self, broker: str, **kw: Any) -> None:
        super().__init__(broker, **kw)
        self.sub: zmq.Socket | None = None
        self.sub_addr = ""  # the PUB endpoint subscribed to (a restarted broker's READY may move it)
        self.policy = None
        self.version = 0
        self.serving = False
        self.receiver: WeightReceiver | None = None
        self.serve_from: int | None = None  # serving starts once this version is in (set by the snapshot)
        self.batches: deque[tuple] = deque()
        self.busy = False
        self.served = 0
        self.forward_ema_s = 1.0  # starts on the runner thread until forward times are known

    def ready_fields(self) -> dict[str, Any]:
        return {"credits": 0}

    def setup(self) -> None:
        cfg = self.cfg
        torch.set_num_threads(max(1, cfg.workers.torch_threads))
        self.policy = build_policy(cfg, device=self.device)
        self.policy.eval()
        self.receiver = WeightReceiver(self.policy, self.host, shm=cfg.weights.shm, bucket_mb=cfg.weights.bucket_mb,
                                       copy_threads=cfg.weights.copy_threads,
                                       cuda_ipc=cfg.weights.cuda_ipc)

    def start(self) -> None:
        cfg = self.cfg
        self.runner = self.new_runner("forward")
        self.weights_runner = self.new_runner("weights")
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"W")
        self.sub.setsockopt(zmq.RCVHWM, 4)
        self.sub.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
        auth.configure_client(self.sub, self.keys_dir, self.key_name)
        self.sub_addr = pub_address(self.welcome["pub"], self.broker_url)
        self.sub.connect(self.sub_addr)
        self.send(P.SNAPSHOT, {})
        log.info("generator_ready", family=cfg.model.family, device=str(self.policy.device),
                 params=sum(p.numel() for p in self.policy.parameters()))

    def on_reconnected(self) -> None:
        """A restarted broker may publish on another address (its READY reply says where):
        subscribe there, then ask for its snapshot again (the Clone pattern, as at start)."""
        if self.sub is None:
            return
        addr = pub_address(self.welcome["pub"], self.broker_url)
        if addr != self.sub_addr:
            log.info("weights_sub_moved", old=self.sub_addr, new=addr)
            self.sub.disconnect(self.sub_addr)
            self.sub.connect(addr)
            self.sub_addr = addr
        self.send(P.SNAPSHOT, {})

    def extra_sockets(self) -> list[zmq.Socket]:
        return [self.sub] if self.sub is not None else []

    def heartbeat_fields(self) -> dict[str, Any]:
        return {"credits": self.cfg.batching.credits if (self.serving and self.cfg) else 0, "version": self.version,
                "served": self.served}

    # -- weights ------------------------------------------------------------------------------

    def on_socket(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.DONTWAIT, copy=False)
            except zmq.Again:
                return
            try:
                msg = P.decode(frames[1:])
            except P.ProtocolError as err:
                log.warning("bad_weights_message", code=err.code, reason=err.reason)
                continue
            if msg.type == P.WEIGHTS:
                self._on_weights(msg)

    def _on_weights(self, msg: P.Message) -> None:
        """A version from PUB or the snapshot reply."""
        try:
            self.receiver.offer(msg.header)
        except ManifestError as err:
            log.warning("bad_weights_announcement", version=msg.get("version"), error=str(err)[:300])
            return
        self._fetch_next()

    def _fetch_next(self) -> None:
        ann = self.receiver.next_fetch(time.monotonic())
        if ann is not None:
            self.weights_runner.submit(lambda: self.receiver.fetch(ann), ("weights", ann))

    def _weights_waiting(self) -> bool:
        return self.receiver is not None and self.receiver.staged is not None

    def tick(self, now: float) -> None:
        self._fetch_next()  # a retry whose back-off has passed
        self._next_batch()  # a batch held for a version that is late

    def teardown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()

    def _swap_weights(self) -> None:
        t0 = time.perf_counter()
        staged = self.receiver.swap()
        if staged is not None:
            self.version = staged.policy_version  # what results are tagged with (weights.in_flight: older than the publication)
            log.info("weights_swapped", version=self.version, publication=staged.version, source=staged.source, mb=round(staged.nbytes / 1e6, 2),
                     fetch_ms=round(staged.fetch_ms, 2), swap_ms=round((time.perf_counter() - t0) * 1000, 3))
            self.weights_runner.submit(self.receiver.release, ("weights_released", None))
            self._fetch_next()
        self._maybe_serve()

    def _maybe_serve(self) -> None:
        """Announce credits once the snapshot's version (at least version 0) is swapped in."""
        if not self.serving and self.serve_from is not None and self.receiver.version >= self.serve_from:
            self.serving = True
            self.send(P.HEARTBEAT, self.heartbeat_fields())
            log.info("generator_serving", version=self.version)

    # -- batches ------------------------------------------------------------------------------

    def on_message(self, msg: P.Message) -> None:
        if msg.type == P.WEIGHTS:  # snapshot reply
            version = msg["version"]
            if version < 0 and self.cfg.workers.trainers == 0 and not self.serving:
                # No trainer in this job (evaluation, benchmarks): nothing will publish, so serve
                # the build (and swap to any version a trainer started by hand announces later).
                self.serving = True
                self.send(P.HEARTBEAT, self.heartbeat_fields())
                log.info("generator_serving", version=self.version, own_build=True)
                return
            if version >= 0:
                self._on_weights(msg)
            # Serve once the snapshot's version is in; with none yet, once rank 0's version 0 is.
            self.serve_from = version if 0 <= version <= self.receiver.newest() else 0
            self._maybe_serve()
        elif msg.type == P.BATCH:
            # Gather now, even while a forward pass runs: the next batch is ready the moment
            # the current one finishes (its slots do not rewrite their observations before ACT).
            try:
                obs, det, dropped = gather(msg, self.attach, pinned=self.policy.device.type == "cuda")
            except (KeyError, ValueError) as err:  # requests that cannot be batched together
                log.error("batch_unreadable", batch_id=msg["batch_id"], error=str(err))
                self.send(P.RESULT, {"batch_id": msg["batch_id"], "version": self.version, "error": str(err)})
                return
            for i, why in dropped.items():  # answered by the broker with an error ACT, alone
                log.warning("request_unreadable", batch_id=msg["batch_id"], request=i, error=why)
            if obs is None:
                self.send(P.RESULT, {"batch_id": msg["batch_id"], "version": self.version, "dropped": sorted(dropped)})
                return
            self.batches.append((msg["batch_id"], obs, det, msg.get("queue_us"), sorted(dropped),
                                 msg.get("min_version", -1), time.monotonic()))
            self._next_batch()

    def _next_batch(self) -> None:
        if self.busy or not self.batches:
            return
        if self._weights_waiting():
            self._swap_weights()
        batch_id, obs, det, queue_us, dropped, min_version, arrived = self.batches[0]
        if self.version < min_version:
            waited = time.monotonic() - arrived
            if waited < self.cfg.batching.batch_timeout_s / 2:
                return  # the version is on its way: a fetch that ends calls this again, and so does tick
            log.warning("batch_served_behind", batch_id=batch_id, version=self.version, min_version=min_version,
                        waited_s=round(waited, 1))
        self.batches.popleft()
        self.busy = True
        version = self.version
        tag = (batch_id, version, queue_us, dropped)
        if self.forward_ema_s < INLINE_FORWARD_S:
            # A short forward pass costs less than two thread hand-offs: run it right here
            # (heartbeats only need to go out once a second).
            try:
                result, error = self._forward(obs, det), None
            except Exception as exc:
                result, error = None, exc
            self.on_job_done(tag, result, error)
        else:
            self.runner.submit(lambda: self._forward(obs, det), tag)

    def _forward(self, obs: Observation, deterministic: np.ndarray) -> tuple[dict[str, np.ndarray], float]:
        """One batch; evaluation envs (deterministic) and training envs are run as two groups."""
        t0 = time.perf_counter()
        groups = [g for g in (np.flatnonzero(~deterministic), np.flatnonzero(deterministic)) if len(g)]
        res: dict[str, np.ndarray] = {}
        with torch.inference_mode():
            for g, det in zip(groups, [bool(deterministic[g[0]]) for g in groups]):
                sub = obs if len(groups) == 1 else obs.select(g)
                out = self.policy.act(sub, deterministic=det)
                part = {"actions": out.actions, "logprob": out.logprob, "value": out.value,
                        **names.with_prefix(names.REPLAY, out.replay)}
                for name, v in part.items():
                    arr = v.float().cpu().numpy() if v.dtype == torch.bfloat16 or name in ("actions", "logprob", "value") else v.cpu().numpy()
                    if len(groups) == 1:
                        res[name] = arr
                        continue
                    if name not in res:
                        res[name] = np.zeros((len(deterministic), *arr.shape[1:]), dtype=arr.dtype)
                    res[name][g] = arr
        return res, time.perf_counter() - t0

    def on_job_done(self, tag: Any, result: Any, error: BaseException | None) -> None:
        if tag[0] == "weights_released":
            return
        if tag[0] == "weights":
            self.receiver.fetched(tag[1], result, error, time.monotonic())
            if self.receiver.staged is not None and not self.busy:
                self._swap_weights()
                self._next_batch()  # one held for this version
            if self.serve_from is not None and self.receiver.newest() < self.serve_from:
                self.serve_from = 0  # the snapshot's version was dropped: serve any version we get
                self._maybe_serve()
            self._fetch_next()
            return
        batch_id, version, queue_us, dropped = tag
        self.busy = False
        if self._weights_waiting():
            self._swap_weights()  # between batches, never during one
        threaded = self.forward_ema_s >= INLINE_FORWARD_S
        if threaded:
            self._next_batch()  # start the next forward pass before sending this one's results
        if error is not None:
            log.error("forward_failed", batch_id=batch_id, error=repr(error)[:500])
            self.send(P.RESULT, {"batch_id": batch_id, "version": version, "error": repr(error)[:500]})
        else:
            res, secs = result
            self.forward_ema_s = secs if self.served == 0 else 0.8 * self.forward_ema_s + 0.2 * secs
            # Stacked as the forward pass left them: the served requests' envs in batch order
            # (the broker slices each request's rows).
            fields = {"batch_id": batch_id, "version": version, "forward_us": int(secs * 1e6), "queue_us": queue_us}
            self.send(P.RESULT, dict(fields, dropped=dropped) if dropped else fields, res)
            self.served += 1
        if not threaded:
            self._next_batch()
