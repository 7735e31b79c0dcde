"""The learner and the update without sockets: GRPO groups assemble and score, staleness drops
whole groups and masks samples (one rule), and one update on a real policy reports what it did."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlvla3.config import load
from rlvla3.harness.jobs import SMALL_JOB
from rlvla3.observation import Observation
from workers.algorithms.update import TrainState, _gae, update
from workers.learner import RECENT_FRAGMENTS, Fragment, Learner, Unit, build_batch
from workers.model import build_policy, freeze_prefixes


def _cfg(*overrides: str):
    return load("synthetic.yaml", [*SMALL_JOB, *overrides])


def _fragment(policy, n: int, version: int, *, env: int = 0, episode: int = 0, seed: int = 0,
              done: bool = True, success: bool = False, ret: float = 0.0) -> Fragment:
    """A fragment as a simulator ships it: n decisions of the real policy, n + 1 observations."""
    spec = policy.spec
    rng = np.random.default_rng(env * 1000 + episode)
    obs = {"images": {c: rng.integers(0, 255, (n + 1, h, w, 3), dtype=np.uint8) for c, (h, w) in spec.cameras.items()},
           "state": rng.standard_normal((n + 1, spec.state_dim)).astype(np.float32), "instruction": ["reach"] * (n + 1)}
    with torch.no_grad():
        out = policy.act(Observation({c: v[:n] for c, v in obs["images"].items()}, obs["state"][:n],
                                     obs["instruction"][:n]))
    arrays = {f"obs/images/{c}": v for c, v in obs["images"].items()}
    arrays.update({
        "obs/state": obs["state"], "actions": out.actions.numpy(), "logprob": out.logprob.numpy(),
        "value": out.value.numpy(), "reward": rng.standard_normal(n).astype(np.float32),
        "steps": np.full(n, policy.chunk_size, np.int32), "terminated": np.eye(1, n, n - 1, dtype=bool)[0] & done,
        "truncated": np.zeros(n, bool), "version": np.full(n, version, np.int64),
        **{f"replay/{k}": v.numpy() for k, v in out.replay.items()},
    })
    header = {"instruction": "reach", "env": env, "episode": episode, "seed": seed, "done": done,
              "episode_success": success, "episode_return": ret}
    return Fragment(header, arrays)


def test_grpo_groups_assemble_score_and_drop_whole_when_stale():
    cfg = _cfg("algo.name=grpo", "env.group_size=2", "algo.max_staleness=2")
    policy = build_policy(cfg)
    learner = Learner(cfg)
    counters = learner.counters

    # group (reach, seed 1): one episode in two fragments, then the other episode -> one unit
    learner.add(_fragment(policy, 3, 0, env=0, seed=1, done=False))
    learner.add(_fragment(policy, 2, 0, env=0, seed=1, success=True))
    assert learner.ready_steps == 0 and len(learner.pending_groups) == 1
    learner.add(_fragment(policy, 4, 0, env=1, seed=1, success=False))
    assert learner.ready_steps == 9 and counters.groups_complete == 1
    unit = learner.ready[0]
    assert unit.episodes == 2
    adv = np.concatenate([f.advantages for f in unit.frags])
    assert np.allclose(adv[:5], adv[0]) and np.allclose(adv[5:], adv[5]) and adv[0] > 0 > adv[5]  # success vs failure
    # each episode weighs the same whatever its length (5 steps vs 4): its advantage spread over its steps
    assert np.isclose(adv[:5].sum(), -adv[5:].sum()) and np.isclose(adv[:5].sum() / 4.5, 1 / np.sqrt(2), atol=1e-5)

    # a zero-variance group is discarded and reported, never trained on
    learner.add(_fragment(policy, 2, 0, env=2, seed=2, success=True))
    learner.add(_fragment(policy, 2, 0, env=3, seed=2, success=True))
    assert counters.groups_filtered_zero_variance == 1
    assert learner.take_unreported() == {"dropped_stale": 0, "stale_taken": 0, "discarded": 4, "trained": 0, "unreadable": 0,
                                         "duplicate": 0}

    # version 3 makes version-0 samples stale (max_staleness 2): the ready group and a waiting
    # episode's group go whole; a late episode of the dropped group is dropped on arrival
    learner.add(_fragment(policy, 3, 0, env=4, seed=3))
    learner.add(_fragment(policy, 3, 2, env=6, seed=4))
    learner.prune_stale(3)
    assert learner.ready_steps == 0 and counters.groups_dropped_stale == 2
    assert set(learner.pending_groups) == {("reach", 4)}
    learner.add(_fragment(policy, 5, 3, env=5, seed=3))
    fates = learner.take_unreported()  # dropped before any batch took them
    assert fates["dropped_stale"] == 9 + 3 + 5 and fates["stale_taken"] == 0 and counters.dropped_stale == 17


def test_ppo_batch_masks_stale_samples_and_update_reports_typed_result():
    cfg = _cfg("algo.max_staleness=1", "algo.check_replicas=true")
    policy = build_policy(cfg).train()
    learner = Learner(cfg)
    learner.add(_fragment(policy, 4, 1, env=0, done=False))
    learner.add(_fragment(policy, 3, 3, env=1, ret=2.0, success=True))
    units = learner.take(cfg.algo.batch_steps)
    assert learner.ready_steps == 0 and [u.steps for u in units] == [4, 3]

    batch = build_batch(units, 3, cfg)  # the version-1 fragment is 2 behind: masked, not removed
    assert batch.keep.tolist() == [False] * 4 + [True] * 3 and batch.dropped_stale == 4
    assert batch.staleness.tolist() == [2] * 4 + [0] * 3 and batch.lengths == [4, 3]
    assert batch.bootstrap["obs"].state.shape == (2, policy.spec.state_dim)

    state = TrainState.build(policy, cfg.algo)
    before = [p.detach().clone() for p in policy.parameters()]
    result = update(state, batch, cfg.algo)
    assert result.trained and result.samples == 3 and result.batch_len == 7 and result.dropped_stale == 4
    assert result.episodes == 1 and result.return_mean_batch == 2.0 and result.success_mean_batch == 1.0
    assert result.units == 2 and result.groups is None and result.param_checksum is not None
    assert np.isfinite(result.diagnostics["policy_loss"]) and "explained_variance" in result.diagnostics
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    row = result.figures()
    assert row["samples"] == 3 and row["dropped_stale"] == 4 and "skipped" not in row
    learner.count_update(result)  # the masked steps were taken: the broker must not free them twice
    assert learner.take_unreported() == {"dropped_stale": 4, "stale_taken": 4, "discarded": 0, "trained": 3, "unreadable": 0,
                                         "duplicate": 0}

    # train.min_update_s: the update lasts at least that long, and says how much was compute
    padded = update(state, batch, cfg.algo, min_s=0.3)
    assert padded.trained and padded.update_s >= 0.3 and 0 < padded.compute_s < padded.update_s
    assert padded.figures()["compute_s"] == padded.compute_s

    # every sample stale, one rank: nothing is stepped and the version must not move
    stale = update(state, build_batch(units[:1], 3, cfg), cfg.algo)
    assert not stale.trained and stale.figures()["skipped"] is True and stale.samples == 0


def test_a_batch_trains_on_the_replay_keys_every_fragment_has():
    """A generator batch that mixed evaluation and training envs answers with both acts' replay
    keys (zeros in the other's rows), so one fragment may carry a key the next lacks."""
    cfg = _cfg()
    policy = build_policy(cfg).train()
    plain, mixed = _fragment(policy, 3, 0, env=0), _fragment(policy, 2, 0, env=1)
    mixed.arrays["replay/eval_bins"] = np.zeros((2, 4), np.int64)
    learner = Learner(cfg)
    learner.add(mixed)
    learner.add(plain)
    batch = build_batch(learner.take(cfg.algo.batch_steps), 0, cfg)
    assert set(batch.samples["replay"]) == {k.split("/", 1)[1] for k in plain.arrays if k.startswith("replay/")}
    assert set(batch.bootstrap["replay"]) == set(batch.samples["replay"])
    assert update(TrainState.build(policy, cfg.algo), batch, cfg.algo).trained


def test_a_critic_warmup_runs_every_epoch_whatever_the_kl_target():
    """``algo.target_kl`` reads the KL from the actor. In a critic warm-up the policy stands still,
    so that KL is the staleness alone and must not cut the critic's epochs short."""
    cfg = _cfg("algo.name=ppo", "algo.epochs=3", "algo.target_kl=1e-9")
    policy = build_policy(cfg).train()
    learner = Learner(cfg)
    learner.add(_fragment(policy, 6, 1, env=0, ret=1.0))
    batch = build_batch(learner.take(cfg.algo.batch_steps), 1, cfg)
    with torch.no_grad():  # the trainer has moved on since the actor acted: a staleness gap
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    state = TrainState.build(policy, cfg.algo)
    warm = update(state, batch, cfg.algo, critic_warmup=True)
    assert warm.critic_warmup and warm.diagnostics["approx_kl_behav"] > 1e-9
    assert warm.diagnostics["epochs_run"] == 3
    stepped = update(state, batch, cfg.algo)
    assert stepped.diagnostics["epochs_run"] == 1


def test_frozen_prefixes_stay_put_and_the_critic_steps_at_its_own_rate():
    """``algo.frozen`` (as the trainer applies it before version 0) and ``algo.value_lr``: the
    frozen tower never moves, the actor and the value head each step and anneal from their own rate."""
    cfg = _cfg("algo.frozen=[cnn, trunk.0]", "algo.value_lr=0.01", "algo.anneal_lr=true")
    policy = build_policy(cfg).train()
    with pytest.raises(ValueError, match=r"'vlm' names no parameter .*'cnn', 'log_std', 'mu', 'trunk', 'value_head'"):
        freeze_prefixes(policy, ["vlm"])
    assert freeze_prefixes(policy, cfg.algo.frozen) == len([n for n, _ in policy.named_parameters()
                                                           if n.startswith(("cnn.", "trunk.0."))]) > 0
    learner = Learner(cfg)
    learner.add(_fragment(policy, 6, 0, env=0, ret=1.0, success=True))
    batch = build_batch(learner.take(cfg.algo.batch_steps), 0, cfg)
    state = TrainState.build(policy, cfg.algo)
    assert [g["lr"] for g in state.optimizer.param_groups] == [cfg.algo.lr, 0.01]
    assert [g["lr"] for g in state.critic_optimizer.param_groups] == [0.01]
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    result = update(state, batch, cfg.algo, progress=0.5)
    assert result.trained and result.diagnostics["lr"] == cfg.algo.lr / 2
    assert [g["lr"] for g in state.optimizer.param_groups] == [cfg.algo.lr / 2, 0.005]
    moved = {n for n, p in policy.named_parameters() if not torch.equal(before[n], p)}
    assert not any(n.startswith(("cnn.", "trunk.0.")) for n in moved), moved
    assert {"trunk.2.weight", "mu.weight", "value_head.weight"} <= moved, moved


def _pieces(frag: Fragment, cuts: list[int], writer: dict, first_tid: int) -> list[Fragment]:
    """``frag`` cut where a simulator with a shorter ``env.fragment_len`` would have cut it."""
    out, bounds = [], [0, *cuts, frag.steps]
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        arrays = {n: (v[a:b + 1] if n.startswith("obs/") else v[a:b]).copy() for n, v in frag.arrays.items()}
        header = dict(frag.header, done=frag.header["done"] and b == frag.steps, writer=writer, slot=0,
                      traj_id=first_tid + 3 * k)  # one simulator numbers all its envs' fragments
        piece = Fragment(header, arrays)
        piece.train_rewards = arrays["reward"]
        out.append(piece)
    return out


def test_gae_runs_on_into_the_next_fragment_of_the_episode_in_the_batch():
    """Sync at 4 x 3 steps per env gives the advantages of 12-step fragments; a fragment is
    continued only by its own episode's next one, and only if nothing was lost between."""
    cfg = _cfg()
    policy = build_policy(cfg).train()
    state = TrainState.build(policy, cfg.algo)
    sim = {"host": "h", "pid": 7, "name": "sim-0"}
    whole = [_fragment(policy, 12, 0, env=e, done=False) for e in range(2)]
    for f in whole:
        f.train_rewards = f.arrays["reward"]
    # env 0 and env 1 interleave as a simulator ships them; the batch takes them out of order
    pieces = [p for e in range(2) for p in _pieces(whole[e], [3, 6, 9], sim, first_tid=10 + e)]
    order = [5, 0, 7, 2, 1, 4, 3, 6]
    cut = build_batch([Unit([pieces[i]], pieces[i].steps) for i in order], 0, cfg)
    assert cut.successors == [order.index(i + 1) if i % 4 != 3 else -1 for i in order]

    def advantages(batch):
        values = batch.samples["values"].float()
        return _gae(state, batch, values, cfg.algo)[0]

    ref = advantages(build_batch([Unit([f], f.steps) for f in whole], 0, cfg))
    got = advantages(cut)
    starts = np.cumsum([0] + [pieces[i].steps for i in order])
    for pos, i in enumerate(order):
        e, k = divmod(i, 4)
        want = ref[e * 12 + 3 * k: e * 12 + 3 * k + 3]
        assert torch.allclose(got[starts[pos]:starts[pos + 1]], want, atol=1e-5), (i, got, ref)

    # a lost piece breaks the chain there (its successor's first observation is not the
    # bootstrap observation), another simulator's or another episode's piece never joins it
    gap = build_batch([Unit([pieces[i]], 3) for i in (0, 2, 3)], 0, cfg)
    assert gap.successors == [-1, 2, -1]
    other = _pieces(whole[0], [3, 6, 9], dict(sim, pid=8), first_tid=11)
    assert build_batch([Unit([pieces[0]], 3), Unit([other[1]], 3)], 0, cfg).successors == [-1, -1]
    later = _pieces(whole[0], [3, 6, 9], sim, first_tid=10)
    later[1].header["episode"] = 1
    assert build_batch([Unit([later[0]], 3), Unit([later[1]], 3)], 0, cfg).successors == [-1, -1]
    assert build_batch([Unit([pieces[0]], 3), Unit([pieces[1]], 3)], 0, cfg).successors == [1, -1]


def test_a_fragment_is_known_again_by_its_simulator_and_traj_id_within_a_bounded_window():
    learner = Learner(_cfg())

    def header(traj_id: int, pid: int = 7, evaluation: bool = False) -> dict:
        return {"traj_id": traj_id, "steps": 8, "eval": evaluation, "writer": {"host": "h", "pid": pid, "name": "sim"}}

    assert not learner.resent(header(1)) and not learner.resent(header(1, pid=8))  # another simulator's 1
    assert learner.resent(header(1)) and learner.resent(header(1, pid=8, evaluation=True))
    assert learner.counters.duplicates == 2 and learner.take_unreported()["duplicate"] == 8  # evaluation steps: not reported
    assert not learner.resent({"traj_id": 1, "steps": 8})  # no writer (a broker that does not say): never a copy
    for traj_id in range(2, RECENT_FRAGMENTS + 1):
        learner.resent(header(traj_id))
    assert len(learner.recent) == RECENT_FRAGMENTS
    assert not learner.resent(header(1))  # the oldest went out of the window
