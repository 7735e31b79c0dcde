"""The simulator worker: one batch of envs split into slots that never wait for each other.

Each slot cycles on its own: send OBS -> receive ACT -> execute the action chunk (in the slot's
own thread, or in a child process with ``env.parallel: process``) -> record the decision step
-> send the next OBS at once. Finished episodes and long-episode fragments go out as TRAJ; their
buffers are freed when the broker forwards the trainer's TRAJ_ACK.

Each slot owns two observation blocks in shared memory, and its envs render and write their
observations straight into them (``into``): the block the generator reads is the one the
simulator wrote, with no copy in between. The blocks alternate: an OBS names the *front* block,
and the chunk that ACT starts writes the *back* one, so the front block stays as the policy saw
it (its trajectory record is taken from it) and a block is rewritten only after the ACT of the
request that last named it. On the same host as the broker, the OBS carries the block's
descriptor; elsewhere the block's bytes go inline. Trajectories travel the same two ways.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import structlog

from rlvla3 import names
from rlvla3 import protocol as P
from rlvla3.observation import Observation
from rlvla3.shm import ShmPool, block_refs, observation_block, sweep_leftovers
from workers.base import WorkerBase
from workers.recorder import EpisodeRecorder
from workers.slots import ChunkOutcome, Slot, episode_seed, slot_adapter
from workers.trajectory import EnvTrajectory, StepRecord

log = structlog.get_logger()


class SimulatorWorker(WorkerBase):
    role = "simulator"

    def __init__(self, broker: str, num_envs: int | None = None, slots: int | None = None, index: int = 0, **kw: Any) -> None:
        super().__init__(broker, **kw)
        self.num_envs_override = num_envs
        self.slots_override = slots
        self.index = index
        self.slots: list[Slot] = []
        self.obs_pool: ShmPool | None = None
        self.traj_pool: ShmPool | None = None
        # Fragment ids start at the clock in microseconds: a simulator restarted under the same host,
        # pid and name (a container's pid 1) starts past every id its predecessor used, so neither
        # the broker nor a trainer takes its fragments for re-sent ones (``Worker.same``, ``traj_id``).
        self.next_traj = time.time_ns() // 1000
        self.unacked: dict[int, tuple[dict[str, Any], dict[str, Any], list[int]]] = {}
        self.env_steps = 0
        self.restarts_unreported = 0
        self.eval_seeds: list[int] = []  # held-out starts left in the current evaluation round
        self.next_eval_version = 0
        self.eval_round_version = -1
        self.eval_round_size = 0  # episodes in the current evaluation round (the broker knows a round is whole)
        self.recorder: EpisodeRecorder | None = None  # run.record_dir: stages chosen slots' episodes
        self.blocks_sent: set[int] = set()  # slot blocks whose descriptors went to the broker on this connection

    # -- set-up -------------------------------------------------------------------------------

    def _layout(self) -> tuple[int, int]:
        num_envs = self.num_envs_override or self.cfg.env.num_envs
        slots = self.slots_override or self.cfg.env.slots
        if num_envs % slots:
            raise SystemExit(f"simulator: num_envs {num_envs} is not a multiple of slots {slots}")
        return num_envs, slots

    def ready_fields(self) -> dict[str, Any]:
        if self.cfg is None:  # first READY: announce what we will have (overrides or defaults later)
            return {"slots": self.slots_override or 0, "num_envs": self.num_envs_override or 0}
        n, s = self._layout()
        # Our total: a restarted broker rebuilds its env-step count from it.
        return {"slots": s, "num_envs": n, "info": {"env_steps": self.env_steps}}

    def setup(self) -> None:
        cfg = self.cfg
        num_envs, n_slots = self._layout()
        k = num_envs // n_slots
        self.use_shm = self.welcome.get("broker_host") == self.host
        if cfg.run.record_dir:
            self.recorder = EpisodeRecorder(cfg.run.record_dir, self.name, cfg.run.record_slots)
        run_id = self.welcome.get("run_id", "run")
        seed0 = cfg.run.seed * 1_000_003 + self.index * 10_007
        sweep_leftovers()
        adapters = [slot_adapter(cfg.env, k, seed0 + s) for s in range(n_slots)]
        spec = adapters[0].spec
        per_env = sum(h * w * 3 for h, w in spec.cameras.values()) + spec.state_dim * 4 + 64 * (len(spec.cameras) + 1)
        # The envs write here in every layout (a child process too); only the wire differs.
        self.obs_pool = ShmPool(run_id, 2 * per_env * num_envs + 64 * 2 * n_slots * (len(spec.cameras) + 1) + 4096)
        for s, adapter in enumerate(adapters):
            envs = list(range(s * k, (s + 1) * k))
            blocks = (observation_block(self.obs_pool, spec.cameras, spec.state_dim, k),
                      observation_block(self.obs_pool, spec.cameras, spec.state_dim, k))
            slot = Slot(index=s, envs=envs, adapter=adapter, runner=self.new_runner(f"slot{s}"),
                        trajs=[EnvTrajectory(env=self.index * 100_000 + e) for e in envs], blocks=blocks,
                        refs=tuple(block_refs(b) for b in blocks),
                        eval=s >= n_slots - cfg.env.eval_slots)
            self.slots.append(slot)
        if self.use_shm:
            steps = cfg.env.fragment_len + 1
            self.traj_pool = ShmPool(run_id, max(per_env * steps * num_envs * 4, 1 << 20))
        log.info("simulator_ready", env=cfg.env.name, num_envs=num_envs, slots=n_slots, shm=self.use_shm, parallel=cfg.env.parallel)

    def start(self) -> None:
        # The first round evaluates the starting policy (version 0: a warm start's baseline).
        self.next_eval_version = 0 if self.cfg.env.eval_every > 0 else -1
        for slot in self.slots:
            if slot.eval:
                continue  # idle until the first evaluation round
            slot.runner.submit(lambda slot=slot: self._reset_all(slot), ("reset", slot.index))

    def _seed_for(self, env: int, episode: int) -> int:
        return episode_seed(self.cfg.run.seed, env, episode, self.cfg.env.group_size, self.cfg.env.group_mode)

    # -- evaluation rounds --------------------------------------------------------------------

    def _eval_seed_list(self) -> list[int]:
        """The held-out initial states: the same every round, disjoint from training seeds."""
        k = len(self.slots[0].envs)
        n = self.cfg.env.eval_episodes or k * sum(1 for s in self.slots if s.eval)
        base = 1_500_000_000 + self.index * 100_003
        return [(base + i) % (2**31) for i in range(n)]

    def _maybe_start_eval(self, version: int) -> None:
        if self.next_eval_version < 0 or version < self.next_eval_version:
            return
        if any(s.eval and (s.waiting or s.out is not None or s.frozen is not None) for s in self.slots):
            return  # the previous round is still running
        every = self.cfg.env.eval_every
        self.next_eval_version = (version // every + 1) * every
        self.eval_seeds = self._eval_seed_list()
        self.eval_round_version = version
        self.eval_round_size = len(self.eval_seeds)
        log.info("eval_round_started", version=version, episodes=len(self.eval_seeds))
        for slot in self.slots:
            if slot.eval:
                self._next_eval_episodes(slot, version)

    def _next_eval_episodes(self, slot: Slot, version: int) -> None:
        k = len(slot.envs)
        if not self.eval_seeds:
            slot.frozen = None
            return
        seeds = [self.eval_seeds.pop(0) if self.eval_seeds else None for _ in range(k)]
        slot.frozen = np.asarray([sd is None for sd in seeds])  # no start left for these envs
        slot.eval_version = version
        ids = list(range(k))
        used = [sd if sd is not None else 0 for sd in seeds]
        for tr, sd in zip(slot.trajs, used):
            tr.records = []
        slot.decisions = 0
        slot.runner.submit(lambda: (slot.adapter.reset(ids, used, into=slot.back), used), ("eval_reset", slot.index))

    # -- slot work (runs on the slot's thread) ------------------------------------------------

    def _reset_all(self, slot: Slot) -> Observation:
        ids = list(range(len(slot.envs)))
        seeds = [self._seed_for(slot.trajs[i].env, slot.trajs[i].episode + 1) for i in ids]
        return slot.adapter.reset(ids, seeds, into=slot.back)

    def _run_chunk(self, slot: Slot, actions: np.ndarray) -> ChunkOutcome:
        k, T = actions.shape[0], actions.shape[1]
        step_reward = np.zeros((k, T), np.float32)
        steps = np.zeros(k, np.int32)
        term = np.zeros(k, bool)
        trunc = np.zeros(k, bool)
        success = np.zeros(k, bool)
        active = np.ones(k, bool) if slot.frozen is None else ~slot.frozen
        back = slot.back  # the envs write here; the front block stays as the policy saw it
        if not active.all():  # envs that do not step (a finished evaluation episode) keep their obs
            back.assign(np.flatnonzero(~active), slot.obs.select(~active))
        restarts = 0
        for t in range(T):
            ids = np.flatnonzero(active)
            if not len(ids):
                break
            # Guarded/SubprocEnv: crashes come back as restarts
            res = slot.adapter.step(ids.tolist(), actions[ids, t], into=back)
            step_reward[ids, t] = res.reward
            steps[ids] += 1
            term[ids] |= res.terminated
            trunc[ids] |= res.truncated & ~res.terminated
            success[ids] |= res.success
            restarted = res.info.get("restarted") if isinstance(res.info, dict) else None
            if restarted:
                restarts += len(restarted)
                trunc[np.asarray(restarted, dtype=np.int64)] = True
            active[ids] = ~(term[ids] | trunc[ids])
        done_ids = np.flatnonzero(term | trunc).tolist()
        if done_ids and slot.eval:  # evaluation envs wait for the rest of their round
            return ChunkOutcome(step_reward, steps, term, trunc, success, back, None, done_ids, restarts)
        terminal = None
        if done_ids:  # their last obs goes into their trajectories; the reset overwrites it in place
            terminal = back.select(done_ids)
            seeds = [self._seed_for(slot.trajs[i].env, slot.trajs[i].episode + 1) for i in done_ids]
            slot.adapter.reset(done_ids, seeds, into=back)
        return ChunkOutcome(step_reward, steps, term, trunc, success, back, terminal, done_ids, restarts)

    # -- loop-side handling -------------------------------------------------------------------

    def on_job_done(self, tag: Any, result: Any, error: BaseException | None) -> None:
        kind, s = tag
        slot = self.slots[s]
        if error is not None:
            log.error("slot_failed", slot=s, kind=kind, error=repr(error)[:500])
            raise error
        if kind == "reset":
            slot.flip()
            for i, tr in enumerate(slot.trajs):
                tr.begin_episode(slot.obs.instruction[i], self._seed_for(tr.env, tr.episode + 1))
            self._send_obs(slot, env_steps=0)
        elif kind == "eval_reset":
            _, seeds = result
            slot.flip()
            for i, tr in enumerate(slot.trajs):
                tr.begin_episode(slot.obs.instruction[i], seeds[i])
            self._send_obs(slot, env_steps=0)
        elif kind == "chunk":
            self._finish_chunk(slot, result)

    def on_message(self, msg: P.Message) -> None:
        if msg.type == P.ACT:
            self._on_act(msg)
        elif msg.type == P.TRAJ_ACK:
            for tid in msg["traj_ids"]:
                entry = self.unacked.pop(tid, None)
                if entry is not None and self.traj_pool is not None:
                    for off in entry[2]:
                        self.traj_pool.free(off)

    def _on_act(self, msg: P.Message) -> None:
        s = msg["slot"]
        if not (0 <= s < len(self.slots)):
            log.warning("act_bad_slot", slot=s)
            return
        slot = self.slots[s]
        if not slot.waiting or msg["req_id"] != slot.req_id:
            log.warning("act_unexpected", slot=s, req_id=msg["req_id"], expected=slot.req_id)
            return
        k = len(slot.envs)
        error = msg.get("error")
        out: dict[str, Any] = {}
        if not error:
            try:
                out = {name: self.attach.materialize(t, copy=True) for name, t in msg.tensors.items()}
            except (P.ProtocolError, OSError, ValueError) as err:
                error = f"unreadable ACT: {err}"
        actions = out.get("actions")
        if not error and (actions is None or actions.ndim != 3 or actions.shape[0] != k):
            error = f"ACT actions of shape {None if actions is None else actions.shape}, slot has {k} envs"
        if error:  # the policy could not serve this request: restart the slot's episodes, ask again
            log.error("act_failed_resetting_slot", slot=s, error=error)
            slot.waiting = False
            for tr in slot.trajs:
                tr.records = []
            slot.decisions = 0
            slot.runner.submit(lambda: self._reset_all(slot), ("reset", s))
            return
        slot.waiting = False
        slot.pending_obs = None
        slot.out = out
        slot.version = msg["version"]
        if not slot.eval:
            self._maybe_start_eval(slot.version)
        slot.runner.submit(lambda: self._run_chunk(slot, actions.astype(np.float32)), ("chunk", s))

    def _finish_chunk(self, slot: Slot, outcome: ChunkOutcome) -> None:
        out = slot.out
        slot.out = None
        replay = names.under_prefix(names.REPLAY, out)
        frag_len = self.cfg.env.fragment_len
        self.env_steps += int(outcome.steps.sum())
        self.restarts_unreported += outcome.restarts
        reset_row = {i: j for j, i in enumerate(outcome.done_ids)}
        # Every env of the slot cuts its fragment at the same decision, every fragment_len: a sync
        # round of fragment_len decisions is then exactly the slot's envs x fragment_len steps,
        # whatever episodes ended inside it (an episode's end also cuts that env's fragment).
        slot.decisions += 1
        cut_all = slot.decisions >= frag_len
        if cut_all:
            slot.decisions = 0
        for i, tr in enumerate(slot.trajs):
            if slot.frozen is not None and slot.frozen[i]:
                continue
            tr.add(StepRecord(
                obs=slot.obs.select([i]), actions=out["actions"][i], logprob=out["logprob"][i],
                value=float(out["value"][i]), replay={k: v[i] for k, v in replay.items()}, version=slot.version,
                reward=float(outcome.step_reward[i].sum()), steps=int(outcome.steps[i]),
                terminated=bool(outcome.terminated[i]), truncated=bool(outcome.truncated[i]),
            ))
            done = i in reset_row
            if done or cut_all:
                last = (outcome.terminal_obs.select([reset_row[i]]) if done and outcome.terminal_obs is not None
                        else outcome.next_obs.select([i]))
                try:
                    header, tensors = tr.fragment(last, bool(outcome.success[i]))
                except ValueError as err:  # a generator changed its tensors' shapes inside one fragment
                    log.error("fragment_unstackable", slot=slot.index, env=tr.env, error=str(err)[:300])
                    header = None
                tr.records = []
                if header is not None:
                    if slot.eval:
                        header.update({"eval": True, "eval_version": slot.eval_version, "eval_round": self.eval_round_size})
                    self._ship(slot, header, tensors)
            if done and not slot.eval:
                tr.begin_episode(outcome.next_obs.instruction[i], self._seed_for(tr.env, tr.episode + 1))
        slot.flip()  # the back block, written by the chunk, is what the next OBS sends
        if slot.eval:
            slot.frozen = slot.frozen | np.isin(np.arange(len(slot.envs)), outcome.done_ids)
            if slot.frozen.all():  # this slot's episodes of the round are over
                self._next_eval_episodes(slot, self.eval_round_version)
            else:
                self._send_obs(slot, env_steps=int(outcome.steps.sum()))
            return
        self._send_obs(slot, env_steps=int(outcome.steps.sum()))

    # -- sending ------------------------------------------------------------------------------

    def _send_obs(self, slot: Slot, env_steps: int) -> None:
        slot.req_id += 1
        k = len(slot.envs)
        fields: dict[str, Any] = {
            "slot": slot.index, "req_id": slot.req_id, "n": k, "instruction": list(slot.obs.instruction),
            "episode_step": [tr.episode_step for tr in slot.trajs],
            "version": min((tr.oldest_version() for tr in slot.trajs), default=-1),
            "env_steps": env_steps, "decision_steps": k if env_steps else 0,
            "env_restarts": self.restarts_unreported,
        }
        if slot.eval:
            fields["eval"] = True
            fields["deterministic"] = [True] * k
        tensors: dict[str, Any] = slot.obs.to_tensors()  # written in place by the envs: nothing to copy
        sent = tensors
        if self.use_shm:  # the block's descriptors (it is rewritten only after this request's ACT) ...
            block = fields["block"] = 2 * slot.index + slot.front
            tensors = sent = dict(slot.refs[slot.front])
            if block in self.blocks_sent:
                sent = {}  # ... or, once the broker has them, the block's number alone
            self.blocks_sent.add(block)
        self.restarts_unreported = 0
        slot.waiting = True
        slot.pending_obs = [fields, tensors]  # a re-send carries the tensors (the broker may have lost the block)
        slot.sent_at = time.monotonic()
        self.send(P.OBS, fields, sent)

    def _ship(self, slot: Slot, header: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
        self.next_traj += 1
        tid = self.next_traj
        fields = dict(header, traj_id=tid, slot=slot.index)
        if header.get("done"):
            fields["episode_returns"] = [header["episode_return"]]
            fields["episode_successes"] = [header["episode_success"]]
        if self.recorder is not None and self.recorder.wants(slot.index):
            self.recorder.add(header, tensors)
        offsets: list[int] = []
        send_tensors: dict[str, Any] = tensors
        if self.traj_pool is not None:
            placed = self.traj_pool.put_many(tensors)
            if placed is not None:
                send_tensors, offsets = placed
            else:
                log.warning("traj_pool_full_sending_inline", traj_id=tid)
        self.unacked[tid] = (fields, send_tensors, offsets)
        self.send(P.TRAJ, fields, send_tensors)

    def tick(self, now: float) -> None:
        """A request whose ACT is late goes again (the broker serves it once whatever happens)."""
        every = self.cfg.env.obs_resend_s
        for slot in self.slots:
            if every > 0 and slot.waiting and slot.pending_obs is not None and now - slot.sent_at >= every:
                log.warning("obs_resent", slot=slot.index, req_id=slot.req_id, waited_s=round(now - slot.sent_at, 3))
                slot.sent_at = now
                self.send(P.OBS, *slot.pending_obs)

    def on_reconnected(self) -> None:
        """The broker restarted: re-send what it may have lost (requests and unacked TRAJ)."""
        self.blocks_sent.clear()  # a new connection: the broker knows none of its blocks
        for slot in self.slots:
            if slot.waiting and slot.pending_obs is not None:  # its steps are in READY's total
                slot.pending_obs[0] = dict(slot.pending_obs[0], env_steps=0)
                slot.sent_at = time.monotonic()
                self.send(P.OBS, *slot.pending_obs)
        for fields, tensors, _ in self.unacked.values():
            self.send(P.TRAJ, fields, tensors)

    def heartbeat_fields(self) -> dict[str, Any]:
        return {"env_steps": self.env_steps}

    def teardown(self) -> None:
        for slot in self.slots:
            slot.runner.join(timeout=5)
            try:
                slot.adapter.close()
            except Exception as exc:
                log.warning("env_close_failed", error=repr(exc))
        for pool in (self.obs_pool, self.traj_pool):
            if pool is not None:
                pool.close()
