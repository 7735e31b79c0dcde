"""Dispatch and batching: OBS requests in, BATCHes out to generators, RESULTs back as ACTs.

Owns the request queue, the generators' credits, the batches out at generators and the sticky
slot map. A batch lost with its generator, or failed on it, goes back into the queue with its
arrival time (served first again); a request that failed ``MAX_ATTEMPTS`` times is answered
with an error ACT instead. Admission (``brokers.admission``) is told what goes out and settles.

Requests are idempotent by (simulator, slot, req_id): a simulator re-sends an OBS whose ACT is
late (``env.obs_resend_s``); a copy of a request that is queued or out at a generator is
dropped, and a copy of one already answered gets the same ACT again. Nothing is served twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from brokers.adaptive import AdaptiveBatching, Bounds
from brokers.admission import AdmissionController
from brokers.holdings import PeerHoldings
from brokers.ordering import get_ordering
from brokers.outgoing import Out, ShmBridge, error
from brokers.queue import BatchRule, GeneratorState, PendingRequest, RequestQueue, form_batches
from brokers.registry import Registry, Worker
from brokers.stats import BrokerStats
from rlvla3 import names
from rlvla3 import protocol as P
from rlvla3.config import JobConfig

log = structlog.get_logger()

MAX_ATTEMPTS = 3  # a request whose batch failed this many times is answered with an error


@dataclass
class Batch:
    generator: bytes
    requests: list[PendingRequest]
    sent_at: float


class Dispatcher:
    def __init__(self, cfg: JobConfig, registry: Registry, admission: AdmissionController, bridge: ShmBridge,
                 stats: BrokerStats, holdings: PeerHoldings | None = None) -> None:
        self.registry = registry
        self.admission = admission
        self.bridge = bridge
        self.stats = stats
        self.queue = RequestQueue(get_ordering(cfg.batching.ordering), holdings)
        self.timeout_s = cfg.batching.batch_timeout_s
        self.rule = BatchRule(cfg.batching.max_batch, cfg.batching.max_wait_ms / 1000.0, cfg.batching.assignment == "sticky")
        self.batching = cfg.batching
        self.adaptive: AdaptiveBatching | None = self._controller() if cfg.batching.adaptive else None
        self.generators: dict[bytes, GeneratorState] = {}
        self.sticky: dict[tuple[bytes, int], bytes] = {}  # (simulator, slot) -> generator
        self.batches: dict[int, Batch] = {}
        self._next_batch = 0
        self.last_req: dict[tuple[bytes, int], int] = {}  # (simulator, slot) -> newest req_id taken
        self.answers: dict[tuple[bytes, int], Out] = {}  # (simulator, slot) -> its last ACT

    # ---- requests in -------------------------------------------------------------------------

    def duplicate(self, w: Worker, header: dict[str, Any]) -> list[Out] | None:
        """``None`` for a new request (an OBS's ``header``); for a copy of one already taken (a
        re-send), what to send back: its ACT again when it was answered, nothing while it is
        queued or at a generator."""
        key = (w.identity, header["slot"])
        last = self.last_req.get(key)
        if last is None or header["req_id"] > last:
            return None
        self.stats.duplicates += 1
        answer = self.answers.get(key)
        return [answer] if answer is not None and answer.fields["req_id"] == header["req_id"] else []

    def _answered(self, req: PendingRequest, act: Out) -> Out:
        self.answers[req.slot_key] = act
        return act

    def on_obs(self, w: Worker, msg: P.Message, now: float, nbytes: int, tensors: dict[str, Any]) -> None:
        """Queue a new request (``tensors``: its own or its block's; ``nbytes``: its inline
        tensors' bytes). Fields are validated already (``protocol.decode``): ints are ints, in range."""
        h = msg.header  # read as a dict: this runs for every request
        n, steps_of = h["n"], h["episode_step"]
        if n < 1 or len(h["instruction"]) != n or len(steps_of) != n:
            raise P.ProtocolError(P.E_FIELD, "OBS: n, instruction and episode_step disagree")
        slot = h["slot"]
        if not (0 <= slot < max(w.slots, 1)):
            raise P.ProtocolError(P.E_FIELD, f"OBS: slot {slot} out of range (worker has {w.slots})")
        self.queue.push(PendingRequest(w.identity, slot, h["req_id"], n, now, list(steps_of), h.get("version", -1), h,
                                       tensors, w.host, steps_of.count(0), nbytes=nbytes))
        self.last_req[(w.identity, slot)] = h["req_id"]
        stats = self.stats
        stats.requests += 1
        w.count_frames(tensors)
        if self.adaptive is not None:
            self.adaptive.on_arrival(n, self.queue.envs)
        steps = h.get("env_steps", 0)
        if steps:
            stats.env_steps += steps
            w.info["env_steps"] = (w.info.get("env_steps") or 0) + steps
        stats.decision_steps += h.get("decision_steps", 0)
        stats.env_restarts += h.get("env_restarts", 0)

    # ---- batches out -------------------------------------------------------------------------

    def dispatch(self, now: float, force: bool, budget: int | None, min_version: int | None) -> list[Out]:
        """Form the batches that are due and address them to generators. A request that cannot
        go out (its shared memory is unreadable from the generator, or anything else raises) is
        answered with an error ACT; the rest of its batch goes. ``min_version``: the weights
        version each batch must be served with (sync mode), or None."""
        formed = form_batches(self.queue, list(self.generators.values()), self.rule, now, self.sticky,
                              force=force, budget=budget, cost=self.admission.cost)
        out = []
        for gen, reqs in formed:
            self.admission.on_dispatched(reqs)
            gen_worker = self.registry.workers[gen.identity]
            gen_host = gen_worker.host
            ready: list[tuple[PendingRequest, dict[str, Any]]] = []
            for r in reqs:
                if r.host == gen_host:  # its references are readable there as they are (brokers.access)
                    ready.append((r, r.tensors))
                    continue
                try:
                    ready.append((r, {name: self.bridge.for_host(t, gen_host) for name, t in r.tensors.items()}))
                except Exception as err:  # noqa: BLE001 - one bad request never stops the broker
                    log.warning("request_dropped_unreadable", slot=r.slot, req_id=r.req_id, error=repr(err)[:300])
                    out += self._give_up([r], f"request not deliverable to a generator: {err}")
            if ready:
                for _, tensors in ready:
                    gen_worker.count_frames(tensors)
                out.append(self._batch(gen, ready, now, min_version))
        return out

    def _batch(self, gen: GeneratorState, ready: list[tuple[PendingRequest, dict[str, Any]]], now: float,
               min_version: int | None) -> Out:
        self._next_batch += 1
        batch_id = self._next_batch
        reqs = [r for r, _ in ready]
        tensors: dict[str, Any] = {}
        meta = []
        for i, (r, req_tensors) in enumerate(ready):
            head = names.request_prefix(i) + names.NAME_SEP  # names.with_prefix written out: per request of every batch
            for name, t in req_tensors.items():
                tensors[head + name] = t
            header = r.header
            meta.append({
                "req_id": r.req_id, "slot": r.slot, "n": r.n, "instruction": header["instruction"],
                "episode_step": r.episode_step,
                "deterministic": header["deterministic"] if "deterministic" in header else [False] * r.n,
            })
        waits = [int((now - r.arrival) * 1e6) for r in reqs]
        self.stats.record("queue_wait_us", waits)
        gen.inflight.add(batch_id)
        self.batches[batch_id] = Batch(gen.identity, reqs, now)
        self.stats.batches += 1
        envs = sum(r.n for r in reqs)
        self.stats.record("batch_size", [envs])
        if self.adaptive is not None:
            self.adaptive.on_batch(envs, sum(waits) / 1e6 / len(reqs))
        fields = {"batch_id": batch_id, "requests": meta, "queue_us": waits}
        if min_version is not None:
            fields["min_version"] = min_version
        return Out(gen.identity, P.BATCH, fields, tensors)

    def unsent(self, batch_id: int) -> None:
        """The shell could not send a batch (its generator is gone or full): queue it again."""
        batch = self.batches.pop(batch_id, None)
        if batch is None:
            return
        gen = self.generators.get(batch.generator)
        if gen is not None:
            gen.inflight.discard(batch_id)
        self.stats.batches -= 1
        for r in batch.requests:
            self.queue.push(r)

    # ---- the batching rule: adaptive, or set live by a client -------------------------------

    def _controller(self) -> AdaptiveBatching:
        b = self.batching
        bounds = Bounds(b.adaptive_min_batch, b.adaptive_max_batch, b.adaptive_min_wait_ms / 1000.0,
                        b.adaptive_max_wait_ms / 1000.0)
        return AdaptiveBatching(bounds, self.rule.max_batch, self.rule.max_wait_s, window_s=b.adaptive_window_s)

    def adapt(self, now: float) -> list[Out]:
        """Apply the adaptive controller's move, if it made one (a timer step of ``tick``)."""
        moved = self.adaptive.step(now) if self.adaptive is not None else None
        if moved is not None:
            self.rule.max_batch, self.rule.max_wait_s = moved
            log.info("batching_tuned", max_batch=moved[0], max_wait_ms=round(moved[1] * 1e3, 3),
                     **{k: v for k, v in self.adaptive.last.items() if k != "generate_ms_fit"})
        return []

    def on_tune(self, w: Worker, msg: P.Message, now: float) -> list[Out]:
        """A client sets the rule live (``max_batch``, ``max_wait_ms``) and turns the controller
        on or off (``adaptive``); turned on, it starts from the rule as it then is. Bounds of
        the adaptive controller come from the config, not from the client."""
        if "max_batch" in msg.header:
            self.rule.max_batch = int(msg["max_batch"])
        if "max_wait_ms" in msg.header:
            self.rule.max_wait_s = float(msg["max_wait_ms"]) / 1000.0
        if "adaptive" in msg.header:
            self.adaptive = self._controller() if msg["adaptive"] else None
        log.info("batching_set", by=w.name, max_batch=self.rule.max_batch, max_wait_ms=self.rule.max_wait_s * 1e3,
                 adaptive=self.adaptive is not None)
        return [Out(w.identity, P.TUNE, {"batching": self.figures()})]

    def figures(self) -> dict[str, Any]:
        """The rule in force (STATUS ``batching``), and the controller's view when adaptive."""
        fig: dict[str, Any] = {"max_batch": self.rule.max_batch, "max_wait_ms": round(self.rule.max_wait_s * 1e3, 4),
                               "adaptive": self.adaptive is not None}
        if self.adaptive is not None:
            fig["controller"] = self.adaptive.figures()
        return fig

    # ---- results back ------------------------------------------------------------------------

    def on_result(self, w: Worker, msg: P.Message, now: float) -> list[Out]:
        batch_id = msg["batch_id"]
        if batch_id in self.batches and self.batches[batch_id].generator != w.identity:
            raise P.ProtocolError(P.E_STATE, f"RESULT for batch {batch_id}, which went to another generator")
        batch = self.batches.pop(batch_id, None)
        gen = self.generators.get(w.identity)
        if gen is not None:
            gen.inflight.discard(batch_id)
        if batch is None:
            log.warning("result_unknown_batch", batch_id=batch_id, generator=w.name)
            return []
        w.info["served"] = int(w.info.get("served") or 0) + 1
        w.info["version"] = msg["version"]
        if msg.get("error"):
            return self._failed(batch_id, batch, w.name, str(msg["error"])[:300])
        h = msg.header  # validated: ints are ints
        dropped = set(h.get("dropped") or ())  # requests the generator could not read
        served = sum(r.n for i, r in enumerate(batch.requests) if i not in dropped)
        wrong = [f"{name} {list(t.shape)}" for name, t in msg.tensors.items() if not t.shape or t.shape[0] != served]
        if wrong:  # not this batch's outputs: served again, as after a failed forward pass
            self.stats.errors += 1
            reason = f"RESULT tensors must have one row per served env ({served}): {', '.join(wrong)[:200]}"
            return self._failed(batch_id, batch, w.name, reason) + [error(w.identity, P.E_TENSOR, reason, P.RESULT)]
        self.stats.record("generate_us", [int((now - batch.sent_at) * 1e6)])
        if self.adaptive is not None:
            self.adaptive.on_result(sum(r.n for r in batch.requests), now - batch.sent_at)
        self.admission.on_settled(batch.requests)
        queue_us = h.get("queue_us") or []
        out = []
        version, forward_us, live, answers = h["version"], h.get("forward_us", 0), self.registry.workers, self.answers
        slicers, start = [(name, P.row_slicer(t)) for name, t in msg.tensors.items()], 0
        for i, req in enumerate(batch.requests):
            if i in dropped:
                self.stats.requests_unreadable += 1
                if req.sim in live:  # alone: the slot restarts its episodes and asks again
                    out.append(self._answered(req, Out(req.sim, P.ACT, {
                        "slot": req.slot, "req_id": req.req_id, "version": -1,
                        "error": "the generator could not read this request's observation (its shared memory is gone?)"})))
                continue
            first, start = start, start + req.n
            if req.sim not in live:
                continue  # its simulator left; nothing to deliver
            fields = {"slot": req.slot, "req_id": req.req_id, "version": version,
                      "queue_us": queue_us[i] if i < len(queue_us) else 0, "forward_us": forward_us}
            act = answers[(req.sim, req.slot)] = Out(req.sim, P.ACT, fields,
                                                     {name: rows(first, req.n) for name, rows in slicers})
            out.append(act)  # what self._answered does, written out: per request of every RESULT
        return out

    def _failed(self, batch_id: int, batch: Batch, generator: str, error: str) -> list[Out]:
        log.warning("batch_failed", batch_id=batch_id, generator=generator, error=error)
        out = []
        for r in batch.requests:
            r.attempts += 1
            if r.attempts < MAX_ATTEMPTS and r.sim in self.registry:  # a gone simulator's: never again
                self.queue.push(r)
                self.stats.requeued += 1
            else:
                out += self._give_up([r], error)
        return out

    def _give_up(self, reqs: list[PendingRequest], error: str) -> list[Out]:
        """Answer requests that will not be served with an error ACT (the slot restarts)."""
        self.admission.on_settled(reqs)
        return [self._answered(r, Out(r.sim, P.ACT, {"slot": r.slot, "req_id": r.req_id, "version": -1,
                                                      "error": error[:300]}))
                for r in reqs if r.sim in self.registry]

    def expire(self, now: float) -> list[Out]:
        """Batches past their deadline are treated as failed: re-queued (or, after
        ``MAX_ATTEMPTS``, answered with an error). A late RESULT for one is ignored."""
        out: list[Out] = []
        for batch_id, batch in list(self.batches.items()):
            if now - batch.sent_at > self.timeout_s:
                del self.batches[batch_id]
                w = self.registry.get(batch.generator)
                out += self._failed(batch_id, batch, batch.generator.hex()[:16] if w is None else w.name,
                                    f"no RESULT within batching.batch_timeout_s={self.timeout_s}")
        return out

    def overlook(self, gap_s: float) -> None:
        """The broker did not look for ``gap_s`` (its loop paused or starved): batches out then
        keep that much more time, as their RESULTs may wait unread in the broker's socket."""
        for batch in self.batches.values():
            batch.sent_at += gap_s

    # ---- workers joining and leaving ---------------------------------------------------------

    def add_generator(self, identity: bytes, credits: int) -> None:
        self.generators[identity] = GeneratorState(identity, credits=credits)

    def set_credits(self, identity: bytes, credits: int) -> None:
        self.generators[identity].credits = max(0, credits)

    def generator_gone(self, identity: bytes) -> None:
        """Its batches go back into the queue, keeping their arrival times: served first again."""
        gen = self.generators.pop(identity, None)
        for batch_id in sorted(gen.inflight if gen else []):
            batch = self.batches.pop(batch_id, None)
            if batch is None:
                continue
            for r in batch.requests:
                if r.sim not in self.registry:  # its simulator left too (its memory may be gone)
                    self.admission.on_settled([r])
                    continue
                self.queue.push(r)
                self.stats.requeued += 1
            log.warning("batch_requeued", batch_id=batch_id, requests=len(batch.requests))
        for key in [k for k, g in self.sticky.items() if g == identity]:
            del self.sticky[key]

    def simulator_gone(self, identity: bytes) -> None:
        self.queue.remove_where(lambda r: r.sim == identity)
        for table in (self.sticky, self.last_req, self.answers):
            for key in [k for k in table if k[0] == identity]:
                del table[key]

    def wait_s(self, now: float) -> float | None:
        """Seconds until the oldest request is due for an idle generator (``None``: no such
        deadline). A busy generator takes only full batches, which only a new request makes."""
        if not len(self.queue) or not any(g.free > 0 and not g.inflight for g in self.generators.values()):
            return None
        oldest = self.queue.oldest_arrival()
        if oldest is None:
            return None
        return max(0.0, oldest + self.rule.max_wait_s - now)
