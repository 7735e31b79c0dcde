"""The observation batch: wire names, zero-copy wrapping, and the one copy a batch costs.

The gather tests run the generator's real ``gather`` on a BATCH encoded and decoded by the
protocol codec, over a real shared-memory segment written by its owner.
"""

from __future__ import annotations

import os
import tracemalloc
from collections import Counter

import numpy as np
import pytest

from rlvla3 import names
from rlvla3 import protocol as P
from rlvla3.observation import IMAGES, STATE, Observation
from rlvla3.shm import POISON, ShmAttachments, ShmPool, host_id
from workers.generator import gather
from tests.jobs import join_as_generator, next_batch
from workers.trajectory import EnvTrajectory, StepRecord, fragment_observation

CAMERAS = {"front": (64, 96), "wrist": (48, 48)}
STATE_DIM = 9


def make_obs(n: int, seed: int) -> Observation:
    rng = np.random.default_rng(seed)
    return Observation(
        {c: rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8) for c, (h, w) in CAMERAS.items()},
        rng.standard_normal((n, STATE_DIM)).astype(np.float32),
        [f"task {seed} env {i}" for i in range(n)],
    )


def shm_request(pool: ShmPool, obs: Observation) -> dict[str, P.ShmRef]:
    """What a simulator slot sends: its observation written into blocks it owns."""
    refs = {}
    for name, arr in obs.to_tensors().items():
        off = pool.alloc(arr.nbytes)
        pool.view(off, P.dtype_name(arr), arr.shape)[...] = arr
        refs[name] = pool.ref(off, P.dtype_name(arr), arr.shape)
    return refs


def batch_message(requests: list[tuple[Observation, dict[str, object]]]) -> P.Message:
    """Encode and decode a BATCH as the broker forms it: request i's tensors under r<i>/."""
    tensors: dict[str, object] = {}
    meta = []
    for i, (obs, refs) in enumerate(requests):
        tensors.update(names.with_prefix(names.request_prefix(i), refs))
        meta.append({"req_id": i, "slot": i, "n": len(obs), "instruction": obs.instruction,
                     "episode_step": [0] * len(obs), "deterministic": [i == 1] * len(obs)})
    frames = P.encode(P.BATCH, {"batch_id": 1, "requests": meta}, tensors)
    return P.decode([bytes(f) if not isinstance(f, bytes) else f for f in frames])


@pytest.fixture()
def pool():
    p = ShmPool(f"obstest{os.getpid()}", 4 << 20)
    yield p
    p.close()


def test_one_request_stays_a_view_of_shared_memory(pool):
    obs = make_obs(3, seed=1)
    refs = shm_request(pool, obs)
    att = ShmAttachments()
    try:
        got, det, _ = gather(batch_message([(obs, refs)]), att)
        assert len(got) == 3 and det.tolist() == [False] * 3 and got.instruction == obs.instruction
        for name, arr in got.to_tensors().items():
            assert np.shares_memory(arr, att.array(refs[name])), f"{name} was copied"
        # The owner rewrites its block: a view sees the new bytes.
        pool.view(refs[STATE].offset, "float32", (3, STATE_DIM))[...] = 7.0
        assert (got.state == 7.0).all()
    finally:
        att.close()


def test_gathering_several_requests_costs_exactly_one_copy(pool):
    parts = [make_obs(4, seed=s) for s in (1, 2, 3)]
    reqs = [(o, shm_request(pool, o)) for o in parts]
    msg = batch_message(reqs)
    att = ShmAttachments()
    try:
        views = [{name: att.array(ref) for name, ref in refs.items()} for _, refs in reqs]
        field_bytes = {name: sum(v[name].nbytes for v in views) for name in views[0]}
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            tracemalloc.reset_peak()
            base, _ = tracemalloc.get_traced_memory()
            got, det, _ = gather(msg, att)
            _, peak = tracemalloc.get_traced_memory()
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        # One new array per field and nothing else of that size: no intermediate copy.
        numpy_only = [tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)]

        def large(snap: tracemalloc.Snapshot) -> Counter:
            return Counter(t.size for t in snap.filter_traces(numpy_only).traces if t.size >= min(field_bytes.values()))

        assert large(after) - large(before) == Counter(field_bytes.values())
        assert peak - base < sum(field_bytes.values()) * 1.1, (peak - base, field_bytes)

        assert len(got) == 12 and det.tolist() == [False] * 4 + [True] * 4 + [False] * 4
        assert got.instruction == [s for o in parts for s in o.instruction]
        tensors = got.to_tensors()
        assert set(tensors) == set(field_bytes)
        for name, arr in tensors.items():
            assert arr.flags.owndata and arr.nbytes == field_bytes[name]
            assert not any(np.shares_memory(arr, v[name]) for v in views), f"{name} aliases shared memory"
            np.testing.assert_array_equal(arr, np.concatenate([o.to_tensors()[name] for o in parts]))
        # The owner rewrites a block: the gathered copy keeps what was sent.
        pool.view(reqs[0][1][STATE].offset, "float32", (4, STATE_DIM))[...] = 7.0
        np.testing.assert_array_equal(got.state[:4], parts[0].state)
    finally:
        att.close()


def test_inline_request_wraps_the_received_frames():
    obs = make_obs(2, seed=5)
    got, _, _ = gather(batch_message([(obs, obs.to_tensors())]), ShmAttachments())
    for name, arr in got.to_tensors().items():
        assert not arr.flags.owndata and not arr.flags.writeable, f"{name} was copied out of its frame"
        np.testing.assert_array_equal(arr, obs.to_tensors()[name])


def test_gather_leaves_out_a_request_it_cannot_read_and_serves_the_rest(pool):
    obs = make_obs(3, seed=1)
    bad = shm_request(pool, obs.select(slice(0, 2)))  # two rows sent for three instructions
    gone_pool = ShmPool(f"obsgone{os.getpid()}", 1 << 20)
    gone = shm_request(gone_pool, obs)
    gone_pool.close()  # its owner left: the segment is unlinked before the generator ever mapped it
    good = make_obs(2, seed=2)
    past_end = dict(shm_request(pool, obs))  # a block that would run past the segment's end
    past_end[STATE] = P.ShmRef(pool.name, pool.shm.size - 8, 3 * STATE_DIM * 4, "float32", (3, STATE_DIM), pool.host)
    att = ShmAttachments()
    try:
        got, det, dropped = gather(batch_message([(obs, bad), (obs, gone), (good, shm_request(pool, good)),
                                                         (obs, {}), (obs, past_end)]), att)
        assert len(got) == 2 and sorted(dropped) == [0, 1, 3, 4] and len(det) == 2
        assert "state of shape" in dropped[0] and "is gone" in dropped[1] and "no tensor 'state'" in dropped[3]
        assert "beyond segment size" in dropped[4]
        np.testing.assert_array_equal(got.state, good.state)
        none, _, dropped = gather(batch_message([(obs, gone)]), att)
        assert none is None and list(dropped) == [0]
    finally:
        att.close()
    with pytest.raises(ValueError, match="not a list of strings"):
        Observation.from_tensors(obs.to_tensors(), 3)


def test_wire_names_are_one_scheme():
    obs = make_obs(2, seed=0)
    assert set(obs.to_tensors()) == {"images/front", "images/wrist", "state"}
    assert set(obs.to_tensors(names.FRAGMENT_OBS)) == {"obs/images/front", "obs/images/wrist", "obs/state"}
    named = names.with_prefix(names.request_prefix(3), obs.to_tensors())
    assert set(named) == {"r3/images/front", "r3/images/wrist", "r3/state"}
    assert set(names.by_request(named)[3]) == set(obs.to_tensors())
    assert names.under_prefix(IMAGES, obs.to_tensors()).keys() == CAMERAS.keys()
    with pytest.raises(P.ProtocolError):
        names.by_request({"images/front": obs.images["front"]})
    back = Observation.from_tensors(obs.to_tensors("obs"), obs.instruction, prefix="obs")
    assert back.images["front"] is obs.images["front"] and back.state is obs.state


def test_select_concat_assign():
    obs = make_obs(4, seed=0)
    assert Observation.concat([obs]) is obs
    view = obs.select(slice(1, 3))
    assert np.shares_memory(view.state, obs.state) and view.instruction == obs.instruction[1:3]
    rows = obs.select([3, 0])
    assert not np.shares_memory(rows.state, obs.state) and rows.instruction == [obs.instruction[3], obs.instruction[0]]
    masked = obs.select(np.array([True, False, False, True]))
    np.testing.assert_array_equal(masked.state, rows.state[::-1])
    cur = obs.copy()
    cur.assign([2], make_obs(1, seed=9))
    np.testing.assert_array_equal(cur.images["wrist"][2], make_obs(1, seed=9).images["wrist"][0])
    assert cur.instruction[2] == "task 9 env 0" and obs.instruction[2] == "task 0 env 2"
    with pytest.raises(ValueError, match="cameras"):
        Observation.concat([obs, Observation({}, obs.state, obs.instruction)])
    torch = pytest.importorskip("torch")
    t = obs.to_torch("cpu", cameras=["wrist"])
    assert list(t.images) == ["wrist"] and t.state.dtype == torch.float32
    assert np.shares_memory(t.state.numpy(), obs.state)  # on the CPU: no copy


def test_fragment_observations_round_trip():
    obs = [make_obs(1, seed=s) for s in range(4)]
    tr = EnvTrajectory(env=0)
    tr.begin_episode("task", seed=1)
    for o in obs[:3]:
        tr.add(StepRecord(obs=o, actions=np.zeros((2, 3), np.float32), logprob=np.zeros(2, np.float32), value=0.0,
                          replay={"noise": np.ones(5, np.float32)}, version=1))
    header, tensors = tr.fragment(obs[3], success=False)
    assert names.under_prefix(names.REPLAY, tensors)["noise"].shape == (3, 5)
    got = fragment_observation(tensors, header["instruction"])
    assert len(got) == 4 and got.instruction == ["task"] * 4
    np.testing.assert_array_equal(got.select(slice(0, -1)).state, np.concatenate([o.state for o in obs[:3]]))
    np.testing.assert_array_equal(got.select(slice(-1, None)).images["front"], obs[3].images["front"])



def test_simulator_writes_in_place_but_never_the_block_a_reader_holds(job_factory, zctx):
    """A real simulator's envs write their observations straight into the block that a generator
    on the same host reads (no copy on the way), and the block an OBS named is not rewritten
    while the chunk its ACT started runs: the next OBS names the slot's other block, and the
    held one still reads as it did. Every row the reader sees was written (never the pool's
    poison)."""
    job = job_factory("workers.generators=0", "workers.trainers=0", "env.slots=1", "env.num_envs=2",
                      "env.eval_slots=0", start=False)
    job.start_worker("simulator", "simulator0")
    gen = join_as_generator(zctx, job.endpoint, "reader", host=host_id(), pid=os.getpid())
    att = ShmAttachments()
    try:
        held: list[tuple[P.ShmRef, np.ndarray]] = []  # (state block, what it read when it arrived)
        for _ in range(4):
            batch = next_batch(gen)
            ref = batch.tensors[names.tensor_name(names.request_prefix(0), STATE)]
            assert isinstance(ref, P.ShmRef), "same host: the OBS names the slot's block"
            state = att.array(ref)
            assert not (state == POISON).any(), f"the reader got unwritten rows: {state}"
            if held:  # the chunk wrote the other block; the one the last OBS named is intact
                assert ref.offset != held[-1][0].offset
                np.testing.assert_array_equal(att.array(held[-1][0]), held[-1][1])
            if len(held) >= 2:  # ... and two requests on, that block was written again in place
                assert ref.offset == held[-2][0].offset and not np.array_equal(state, held[-2][1])
            held.append((ref, state.copy()))
            n = batch["requests"][0]["n"]
            outputs = {"actions": np.ones((n, 1, 2), np.float32), "logprob": np.zeros((n, 1), np.float32),
                       "value": np.zeros(n, np.float32)}
            gen.send_multipart(P.encode(P.RESULT, {"batch_id": batch["batch_id"], "version": 0}, outputs))
    finally:
        att.close()
        gen.close()


def test_a_cuda_batch_is_one_copy_into_pinned_memory_then_one_transfer(pool):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    obs = make_obs(3, seed=1)
    refs = shm_request(pool, obs)
    att = ShmAttachments()
    try:
        got, _, _ = gather(batch_message([(obs, refs)]), att, pinned=True)
        for name, arr in got.to_tensors().items():
            assert torch.from_numpy(arr).is_pinned() and not np.shares_memory(arr, att.array(refs[name]))
        on_gpu = got.to_torch("cuda")
        np.testing.assert_array_equal(on_gpu.images["front"].cpu().numpy(), obs.images["front"])
    finally:
        att.close()


def test_a_simulator_that_names_another_host_id_sends_its_observations_inline(job_factory, monkeypatch):
    """``RLVLA3_HOST_ID`` replaces the host id a worker announces (containers that share /dev/shm
    under different hostnames name one id). A simulator naming another id is elsewhere to the
    broker: its observations travel inline, while the job's own simulator's travel as shm."""
    from rlvla3.harness.jobs import per_worker

    job = job_factory()
    monkeypatch.setenv("RLVLA3_HOST_ID", "another-host")
    job.start_worker("simulator", "sim-away")
    monkeypatch.delenv("RLVLA3_HOST_ID")
    fig = job.wait(lambda f: per_worker(f, "sim-away").get("frames", {}).get("inline", 0) > 0
                   and per_worker(f, "simulator0").get("frames", {}).get("shm", 0) > 0, 120,
                   "both simulators' observations to reach the broker")
    away, home = per_worker(fig, "sim-away"), per_worker(fig, "simulator0")
    assert away["host"] == "another-host" and home["host"] == host_id(), (away["host"], home["host"])
    assert away["frames"]["shm"] == 0 and home["frames"]["inline"] == 0, (away["frames"], home["frames"])
