"""STATUS at the broker: the live figures of the whole job, and the cache that answers STATUS.

Figures are built and encoded at most every ``STATUS_REFRESH_S``: between refreshes an answer
costs the loop one send, whatever the job's size or the number of clients asking
(``bench/status_flood.py`` measures a flood of them).
"""

from __future__ import annotations

from typing import Any, Callable

from brokers.outgoing import Out
from rlvla3 import protocol as P

STATUS_REFRESH_S = 0.25
"""STATUS figures are built at most this often (percentiles at most once a second: ``brokers.stats``)."""


class StatusCache:
    """The last STATUS built: ``(built at, figures, encoded frames)``."""

    def __init__(self) -> None:
        self._built: tuple[float, dict[str, Any], list[Any]] | None = None

    def reply(self, identity: bytes, now: float, build: Callable[[float], dict[str, Any]]) -> Out:
        """STATUS for ``identity``: the cached figures, or ``build(now)`` once they are older than
        ``STATUS_REFRESH_S``."""
        if self._built is None or now - self._built[0] >= STATUS_REFRESH_S:
            fig = build(now)
            self._built = (now, fig, P.encode(P.STATUS, {"figures": fig}))
        return Out(identity, P.STATUS, {"figures": self._built[1]}, frames=self._built[2])

    def clear(self) -> None:
        """The next STATUS is built afresh (a client that changed the batching rule sees it)."""
        self._built = None


def job_figures(state: Any, now: float) -> dict[str, Any]:
    """Every figure STATUS shows, from a ``brokers.state.BrokerState``: the counters and
    percentiles of ``brokers.stats``, the workers, queues, pacing, admission and step fates."""
    gens = state.dispatcher.generators
    fig = state.stats.snapshot(now)
    fig.update({
        "run_id": state.run_id,
        "mode": state.mode,
        "workers": state.registry.counts(),
        "slots": sum(w.slots for w in state.registry.of_role("simulator")),
        "queue_depth": len(state.dispatcher.queue),
        "queued_envs": state.dispatcher.queue.envs,
        "batches_inflight": len(state.dispatcher.batches),
        "trajs_pending": len(state.trajs.pending),
        "trajs_inflight": len(state.trajs.out),
        "policy_version": state.weights.version,
        "trainer_version": state.trainer_version,
        "training_pause": state.training_pause,
        "pacing": state.pacing.figures(),
        "admission_waits": state.admission.waits,
        "admission": state.admission.figures(),
        "acked_steps": state.trajs.ledger.figures(),
        "dropped_stale": state.trajs.ledger.reported["stale"],
        "discarded": state.trajs.ledger.reported["discarded"],
        "batching": state.dispatcher.figures(),
        "peer_rate": state.peer_rates.figures(),
        "per_worker": [
            {"name": w.name, "role": w.role, "worker_id": w.worker_id, "host": w.host, "pid": w.pid,
             "version": w.info.get("version"), "served": w.info.get("served"), "env_steps": w.info.get("env_steps"),
             "credits": gens[w.identity].credits if w.identity in gens else None,
             "inflight": len(gens[w.identity].inflight) if w.identity in gens else len(w.trajs_inflight),
             "frames": dict(w.frames)}
            for w in state.registry
        ],
    })
    return fig
