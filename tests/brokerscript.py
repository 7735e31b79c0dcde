"""Drive a ``BrokerState`` with scripted messages, without sockets: each message goes through the
real codec (encode, decode) and what the state answers is kept for the test to read."""

from __future__ import annotations

from typing import Any

import numpy as np

from brokers.outgoing import Out
from brokers.state import BrokerState
from rlvla3 import protocol as P
from rlvla3.config import load
from rlvla3.harness.jobs import SMALL_JOB
from rlvla3.weights.manifest import Entry, Manifest

HOST = "testhost"


def announcement(version: int, shape: tuple[int, ...] = (2, 2)) -> dict[str, Any]:
    """WEIGHTS fields announcing ``version`` of a one-tensor model (the broker never sees bytes)."""
    e = Entry("w", "float32", shape, 1, 4096, 4 * int(np.prod(shape)), 7, version, True)
    return {"version": version, "manifest": Manifest(version, (e,)).to_wire(), "store": None,
            "stream": "tcp://127.0.0.1:1", "published_at": 0}


class Script:
    """A broker state at a scripted clock. ``now`` only moves when a test moves it."""

    def __init__(self, *overrides: str) -> None:
        self.cfg = load("synthetic.yaml", [*SMALL_JOB, *overrides])
        self.now = 0.0
        self.state = BrokerState(self.cfg, self.now, run_id="script", host=HOST)
        self.sent: list[Out] = []
        self._req_ids: dict[tuple[bytes, int], int] = {}

    # ---- driving -------------------------------------------------------------------------------

    def send(self, who: bytes, msg_type: str, fields: dict[str, Any] | None = None,
             tensors: dict[str, Any] | None = None, key: str | None = None) -> list[Out]:
        """``key``: the CURVE key name the shell would pass (the ZAP User-Id)."""
        msg = P.decode(P.encode(msg_type, fields, tensors))
        outs = self.state.handle(who, msg, self.now, key)
        self.sent += outs
        return outs

    def weights(self, who: bytes, version: int) -> list[Out]:
        """A trainer announces ``version``."""
        return self.send(who, P.WEIGHTS, announcement(version))

    def tick(self, dt: float = 0.0) -> list[Out]:
        self.now += dt
        outs = self.state.tick(self.now)
        self.sent += outs
        return outs

    # ---- workers -------------------------------------------------------------------------------

    def ready(self, who: bytes, role: str, **fields: Any) -> Out:
        outs = self.send(who, P.READY, {"role": role, "host": HOST, "pid": 1, "name": who.decode(), **fields})
        assert outs[-1].type == P.READY, outs
        return outs[-1]

    def simulator(self, who: bytes, slots: int = 2, num_envs: int = 4) -> Out:
        return self.ready(who, "simulator", slots=slots, num_envs=num_envs)

    def generator(self, who: bytes, credits: int = 2) -> Out:
        return self.ready(who, "generator", credits=credits)

    def trainer(self, who: bytes, credits: int = 64) -> Out:
        return self.ready(who, "trainer", credits=credits)

    def obs(self, sim: bytes, slot: int, n: int = 2, steps: list[int] | None = None, **fields: Any) -> int:
        """One OBS request for ``slot``; returns its req_id."""
        req_id = self._req_ids.get((sim, slot), 0) + 1
        self._req_ids[(sim, slot)] = req_id
        image = np.full((n, 2, 2, 3), req_id % 256, dtype=np.uint8)
        outs = self.send(sim, P.OBS, {"slot": slot, "req_id": req_id, "n": n, "instruction": ["go"] * n,
                                      "episode_step": steps or [1] * n, "decision_steps": n, **fields},
                         {"image": image})
        assert not outs, outs
        return req_id

    def result(self, batch: Out, version: int = 0, error: str | None = None) -> list[Out]:
        """The generator answers ``batch`` (an Out of type BATCH) with one action per env, stacked
        (each row holds its request's ``req_id``)."""
        fields: dict[str, Any] = {"batch_id": batch.fields["batch_id"], "version": version}
        tensors = {}
        if error is not None:
            fields["error"] = error
        else:
            ids = [r["req_id"] for r in batch.fields["requests"] for _ in range(r["n"])]
            tensors["action"] = np.repeat(np.asarray(ids, np.float32)[:, None], 4, axis=1)
        return self.send(batch.to, P.RESULT, fields, tensors)

    def traj(self, sim: bytes, traj_id: int, steps: int, slot: int = 0, **fields: Any) -> list[Out]:
        return self.send(sim, P.TRAJ, {"traj_id": traj_id, "slot": slot, "steps": steps, **fields},
                         {"reward": np.zeros(steps, dtype=np.float32)})


def of_type(outs: list[Out], msg_type: str, to: bytes | None = None) -> list[Out]:
    return [o for o in outs if o.type == msg_type and (to is None or o.to == to)]


def served(batch: Out) -> list[tuple[int, int]]:
    """(slot, req_id) of each request in a BATCH."""
    return [(r["slot"], r["req_id"]) for r in batch.fields["requests"]]
