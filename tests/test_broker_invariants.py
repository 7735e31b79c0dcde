"""Invariants of the broker's state under random message sequences (hypothesis): no request is
lost or served twice, admission never grants past its bound, every live training slot is served
(through generator failures and deaths, simulator deaths and the sync barrier)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from brokers.outgoing import Out
from rlvla3 import protocol as P
from tests.brokerscript import Script, of_type, served

SIMS = (b"sim0", b"sim1")
GENS = (b"gen0", b"gen1")
TRAINER = b"trainer"
SLOTS = 2
MAX_BATCH = 4

# (kind, which worker, a number, a flag); frequent kinds appear more often in the list.
KINDS = (["obs"] * 4 + ["answer"] * 4 + ["traj"] * 3 + ["tick"] * 3
         + ["train", "gen_dies", "gen_joins", "sim_dies", "sim_joins"])
action = st.tuples(st.sampled_from(KINDS), st.integers(0, 1), st.integers(0, 7), st.booleans())
TICKS = (0.0, 0.001, 0.01, 0.5)


class Fabric:
    """Simulators, generators and a trainer that behave as the real workers do, around a Script.
    A simulator has at most one request per slot out; it asks again only after its ACT."""

    def __init__(self, mode: str, staleness: int) -> None:
        self.s = Script(f"run.mode={mode}", f"algo.max_staleness={staleness}", "algo.batch_steps=4",
                        f"batching.max_batch={MAX_BATCH}", "batching.max_wait_ms=5", f"env.slots={SLOTS}",
                        "broker.heartbeat_s=1000")  # liveness by DISCONNECT here, not by silence
        self.mode = mode
        self.alive_sims: set[bytes] = set()
        self.alive_gens: set[bytes] = set()
        self.asked: dict[tuple[bytes, int], int] = {}  # slot -> its open req_id
        self.must_answer: set[tuple[bytes, int, int]] = set()
        self.acts: Counter = Counter()
        self.out: dict[int, tuple[bytes, Out, set]] = {}  # batch_id -> (generator, BATCH, requests)
        self.version = 0
        self.s.trainer(TRAINER)
        for i in range(2):
            self.do(("sim_joins", i, 0, True))
            self.do(("gen_joins", i, 0, True))

    def take(self, outs: list) -> None:
        for o in outs:
            if o.type == P.ACT:
                assert o.to in self.alive_sims, "an ACT for a simulator that left"
                key = (o.to, o.fields["slot"], o.fields["req_id"])
                self.acts[key] += 1
                assert self.acts[key] == 1, f"request {key} answered twice"
                if self.asked.get(key[:2]) == key[2]:
                    del self.asked[key[:2]]
                self.must_answer.discard(key)
            elif o.type == P.BATCH:
                assert o.to in self.alive_gens, "a batch for a generator that left"
                reqs = self.s.state.dispatcher.batches[o.fields["batch_id"]].requests
                assert [(r.slot, r.req_id) for r in reqs] == served(o)
                keys = {(r.sim, r.slot, r.req_id) for r in reqs}
                assert not keys & {k for _, _, ks in self.out.values() for k in ks}, "a request in two batches at once"
                self.out[o.fields["batch_id"]] = (o.to, o, keys)

    def tick(self, dt: float) -> None:
        adm = self.s.state.admission
        # The capacity rule written out, and the no-deadlock floor while less than a batch is in.
        bound = (adm.lag + adm.version + 1) * adm.batch_size - adm.admitted
        if adm.finished < adm.batch_size:
            bound = max(bound, MAX_BATCH)
        before = adm.in_flight
        self.take(self.s.tick(dt))
        if adm.enabled:
            assert adm.in_flight - before <= max(bound, 0), "admission granted past its bound"
        if self.mode == "sync" and self.barrier_reached() and not self.s.state.training_pause and any(
                g.free > 0 for g in self.s.state.dispatcher.generators.values()):
            assert self.s.state.dispatcher.batches, "the sync barrier was reached and nothing went out"

    def barrier_reached(self) -> bool:
        return bool(self.asked) and all((sim, slot) in self.asked for sim in self.alive_sims for slot in range(SLOTS))

    def do(self, act: tuple[str, int, int, bool]) -> None:
        kind, i, k, ok = act
        s = self.s
        sim, gen = SIMS[i], GENS[i]
        if kind == "obs":  # the simulator asks for every slot it has no request out for
            for slot in range(SLOTS):
                if sim in self.alive_sims and (sim, slot) not in self.asked:
                    req_id = s.obs(sim, slot)
                    self.asked[(sim, slot)] = req_id
                    self.must_answer.add((sim, slot, req_id))
        elif kind == "answer" and self.out:
            batch_id = sorted(self.out)[k % len(self.out)]
            ok = ok or k % 2 == 0  # most answers are actions
            gen, batch, _ = self.out.pop(batch_id)
            if gen in self.alive_gens:
                self.take(s.result(batch, version=self.version, error=None if ok else "failed"))
        elif kind == "gen_dies" and gen in self.alive_gens:
            s.send(gen, P.DISCONNECT)
            self.alive_gens.discard(gen)
            self.out = {b: entry for b, entry in self.out.items() if entry[0] != gen}
        elif kind == "gen_joins" and gen not in self.alive_gens:
            s.generator(gen, credits=2)
            self.alive_gens.add(gen)
        elif kind == "sim_dies" and sim in self.alive_sims:
            s.send(sim, P.DISCONNECT)
            self.alive_sims.discard(sim)
            self.must_answer = {r for r in self.must_answer if r[0] != sim}
            self.asked = {r: v for r, v in self.asked.items() if r[0] != sim}
        elif kind == "sim_joins" and sim not in self.alive_sims:
            s.simulator(sim, slots=SLOTS, num_envs=2 * SLOTS)
            self.alive_sims.add(sim)
        elif kind == "traj" and sim in self.alive_sims:
            self.take(s.traj(sim, traj_id=len(s.sent), steps=k + 1))
        elif kind == "train":
            steps = s.state.pacing.waiting  # the trainer takes every training step it received
            s.send(TRAINER, P.TRAIN, {"phase": "begin", "version": self.version, "steps": steps})
            self.version += 1
            s.weights(TRAINER, self.version)
            s.send(TRAINER, P.TRAIN, {"phase": "end", "version": self.version})
        elif kind == "tick":
            self.tick(TICKS[k % len(TICKS)])

    def drain(self) -> None:
        """Generators come back and answer everything; simulators keep asking (sync needs every
        slot); the trainer keeps training. Every request asked before must get its one ACT."""
        for i in range(len(GENS)):
            self.do(("gen_joins", i, 0, True))
        for _ in range(200):
            if not self.must_answer:
                return
            for sim in sorted(self.alive_sims):
                for slot in range(SLOTS):
                    if (sim, slot) not in self.asked:
                        self.asked[(sim, slot)] = self.s.obs(sim, slot)
            self.do(("train", 0, 0, True))
            self.tick(0.01)
            while self.out:
                self.do(("answer", 0, 0, True))
        raise AssertionError(f"requests never answered: {sorted(self.must_answer)[:5]}")


@settings(max_examples=150, deadline=None)
@given(mode=st.sampled_from(["async", "async_rollout", "sync"]), staleness=st.integers(0, 2),
       actions=st.lists(action, min_size=20, max_size=100))
def test_no_request_lost_or_served_twice_and_admission_within_bound(mode, staleness, actions):
    fabric = Fabric(mode, staleness)
    for act in actions:
        fabric.do(act)
    fabric.drain()
    assert all(n == 1 for n in fabric.acts.values())
    assert of_type(fabric.s.sent, P.ERROR) == [] and fabric.s.state.stats.errors == 0
