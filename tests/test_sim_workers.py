"""Real simulators behind the real simulator worker and broker.

* Each installed simulator (Meta-World, ManiSkill, LIBERO), from its repo config, state-based and
  with short episodes: the simulator worker resets, steps and ends episodes served by a generator
  worker (mlp policy) and consumed by a trainer; the broker's STATUS reports the episodes with
  their return and success.
* The images a generator receives through the broker (bytes inlined by the broker, as for a
  generator on another host) have the configured size and are the upright images the adapter
  renders for the same initial-state seed.
* A slot whose env crashes or hangs (synthetic env in a child process) is restarted while the
  other slots keep stepping (one job: a healthy simulator, a crashing one and a hanging one).
* RoboCasa without its package: ``rlvla3 worker --role simulator`` exits non-zero and says how
  to install it.

Rendered steps are kept few: offscreen rendering is slow on CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

os.environ.setdefault("MUJOCO_GL", "egl")  # headless GL, inherited by every worker process
os.environ.setdefault("PYOPENGL_PLATFORM", "egl")

from rlvla3 import names
from rlvla3 import protocol as P  # noqa: E402
from rlvla3.config import load  # noqa: E402
from rlvla3.harness.jobs import Job, per_worker
from rlvla3.harness.peer import Peer
from rlvla3.observation import IMAGES  # noqa: E402
from rlvla3.status_client import wait_until
from tests.jobs import robocasa_available, start_job

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

# One small job: 1 simulator, 1 generator, 1 trainer; tiny PPO batches.
SMALL = (
    "workers.simulators=1", "workers.generators=1", "workers.trainers=1",
    "algo.batch_steps=16", "algo.minibatch_size=8", "algo.epochs=1",
    "batching.max_batch=8", "batching.max_wait_ms=2", "model.options={hidden: 32}",
)

# Per simulator: its import name, repo config, and state-only options with short episodes.
SIMS: dict[str, dict[str, Any]] = {
    "metaworld": {
        "module": "metaworld", "config": "configs/metaworld_reach_mlp.yaml",
        "state": {"benchmark": "MT1", "task": "reach-v3", "cameras": [], "max_episode_steps": 12},
        "rgb": {"benchmark": "MT1", "task": "reach-v3", "cameras": ["corner"], "image_size": [32, 40],
                "max_episode_steps": 4},
        "camera": "corner", "timeout": 180,
    },
    "maniskill": {
        "module": "mani_skill", "config": "configs/maniskill_pushcube_state.yaml",
        "state": {"task": "PushCube-v1", "obs_mode": "state", "max_episode_steps": 8},
        "rgb": {"task": "PickCube-v1", "obs_mode": "rgb", "image_size": [32, 40], "max_episode_steps": 4},
        "camera": "base_camera", "timeout": 300,
    },
    "libero": {
        "module": "libero", "config": "configs/libero_spatial_rgb.yaml",
        "state": {"suite": "spatial", "task_ids": [0], "cameras": [], "settle_steps": 1, "max_episode_steps": 8},
        "rgb": {"suite": "spatial", "task_ids": [0], "cameras": ["agentview"], "image_size": [32, 40],
                "settle_steps": 1, "max_episode_steps": 4},
        "camera": "agentview", "timeout": 300,
    },
}


def _opts(d: dict[str, Any]) -> str:
    import json

    return json.dumps(d)


@pytest.fixture
def repo_job(tmp_path: Path):
    """Like conftest's job_factory, but from one of the repo's configs (plus overrides)."""
    jobs: list[Job] = []

    def make(config: str | None, *overrides: str, start: bool = True) -> Job:
        return start_job(load(str(ROOT / config) if config else None, list(overrides)), tmp_path, jobs, start)

    yield make
    for j in jobs:
        j.stop()


# ---------------------------------------------------------------------------------------------
# Episodes through the fabric, per simulator
# ---------------------------------------------------------------------------------------------


@pytest.mark.sim
@pytest.mark.parametrize("sim", sorted(SIMS))
def test_episodes_through_fabric(repo_job, sim: str) -> None:
    s = SIMS[sim]
    pytest.importorskip(s["module"])
    job = repo_job(s["config"], *SMALL, "env.num_envs=2", "env.slots=2", "env.parallel=process",
                   f"env.options={_opts(s['state'])}")
    fig = job.wait(lambda f: f["episodes"] >= 4 and f["traj"]["acked"] >= 1, s["timeout"],
                   f"{sim}: four episodes through broker, simulator, generator and trainer")
    assert fig["workers"] == {"simulator": 1, "generator": 1, "trainer": 1}, fig["workers"]
    assert fig["slots"] == 2
    assert fig["errors"] == 0 and fig["env_restarts"] == 0, job.logs()
    # An episode of max_episode_steps env steps (chunks of 4) ends within a few decisions.
    assert fig["env_steps"] >= 4 * 4, fig["env_steps"]
    assert isinstance(fig["return_recent"], float) and np.isfinite(fig["return_recent"])
    assert fig["success_rate_recent"] is not None and 0.0 <= fig["success_rate_recent"] <= 1.0
    gen = next(w for w in fig["per_worker"] if w["role"] == "generator")
    assert (gen["served"] or 0) > 0
    sim_fig = next(w for w in fig["per_worker"] if w["role"] == "simulator")
    assert (sim_fig["env_steps"] or 0) == fig["env_steps"]


# ---------------------------------------------------------------------------------------------
# Images through the broker, per simulator
# ---------------------------------------------------------------------------------------------


class ProbeGenerator:
    """A generator on a pretend other host: the broker inlines the observation bytes to it.

    It announces one credit, heartbeats, and keeps the first BATCH it is given (it never
    answers, so the slot waits; the job is torn down afterwards)."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.peer = Peer(ctx, endpoint, "generator", "probe", host="probe-other-host", credits=1)

    def next_batch(self, timeout: float, alive: Any) -> P.Message:
        return wait_until(lambda: alive() or self._batch(), timeout, "a BATCH at the probe generator", interval=0)

    def _batch(self) -> P.Message | None:
        try:
            return self.peer.expect(P.BATCH, 0.2, credits=1)
        except TimeoutError:
            return None

    def close(self) -> None:
        self.peer.sock.close(linger=0)


@pytest.mark.sim
@pytest.mark.parametrize("sim", sorted(SIMS))
def test_images_through_broker_upright_and_sized(repo_job, sim: str) -> None:
    s = SIMS[sim]
    pytest.importorskip(s["module"])
    from workers.envs.base import make_env

    opts = s["rgb"]
    cam = s["camera"]
    h, w = opts["image_size"]
    job = repo_job(s["config"], *SMALL, "env.num_envs=1", "env.slots=1", "env.parallel=process", "run.seed=0",
                   f"env.options={_opts(opts)}", start=False)
    job.start_worker("simulator", "sim0", ["--index", "0"])
    ctx = zmq.Context()
    probe = ProbeGenerator(ctx, job.endpoint)
    try:
        batch = probe.next_batch(s["timeout"], job.assert_alive)
    finally:
        probe.close()
        ctx.term()
    req = batch["requests"][0]
    assert req["n"] == 1 and req["episode_step"] == [0]
    t = names.by_request(batch.tensors)[0][names.tensor_name(IMAGES, cam)]
    assert isinstance(t, P.InlineTensor), "the broker should inline shared-memory bytes for another host"
    img = P.inline_array(t)
    assert img.shape == (1, h, w, 3) and img.dtype == np.uint8, (img.shape, img.dtype)
    assert img.std() > 5, "a blank image came through"

    # The same first episode rendered here: env 0's first initial-state seed with run.seed 0.
    from workers.slots import episode_seed

    seed = episode_seed(0, 0, 1, job.cfg.env.group_size, job.cfg.env.group_mode)
    env = make_env(sim, 1, seed=0, options=opts)
    try:
        ref = env.reset([0], [seed]).images[cam]
    finally:
        env.close()
    assert ref.shape == img.shape
    diff = np.abs(ref.astype(np.int16) - img.astype(np.int16)).mean()
    flipped = np.abs(ref[:, ::-1].astype(np.int16) - img.astype(np.int16)).mean()
    assert diff < 2.0 and diff < flipped, (diff, flipped)
    # The adapter's own image is upright: (the per-simulator tests check this on scene
    # content at larger sizes); a coarse check that survives 32 px:
    if sim == "libero":  # the bright table fills the bottom, the darker wall the top
        g = img[0].astype(float).mean(-1)
        assert g[-6:].mean() > g[:6].mean(), (g[:6].mean(), g[-6:].mean())


# ---------------------------------------------------------------------------------------------
# Faulty envs: restarted on their own, the rest keep stepping
# ---------------------------------------------------------------------------------------------


FAULTS = {"crash": "env.options.fail_on_step=6", "hang": "env.options.hang_on_step=6"}


def test_faulty_envs_restarted_while_others_keep_stepping(repo_job) -> None:
    """One job: a healthy simulator, one whose envs crash and one whose envs hang."""
    job = repo_job(
        "configs/synthetic.yaml", *SMALL, "env.num_envs=2", "env.slots=2", "env.parallel=process", "env.step_timeout_s=3",
        "env.fragment_len=8", "env.options={image_size: 8, max_episode_steps: 10, latency: {kind: constant, mean_ms: 5.0}}",
        "model.chunk_size=1", start=False,
    )
    job.start_all()  # trainer, generator and a healthy simulator ...
    for i, (fault, bad) in enumerate(FAULTS.items()):  # ... and one per fault whose envs fault
        job.start_worker("simulator", f"sim_{fault}", ["--index", str(i + 1), "--set", bad])

    def restarted() -> bool:
        job.assert_alive()
        return all("env_restart" in (job.run_dir / f"sim_{fault}.log").read_text() for fault in FAULTS)

    wait_until(restarted, 240, "a restart after the crash and one after the hang", interval=0.1)
    # The broker counts a restart when the simulator next reports it, which may be after its log line.
    fig = job.wait(lambda f: f["env_restarts"] >= 2, 60, "the broker to count both restarts")

    def steps(f: dict[str, Any], name: str) -> int:
        return int(per_worker(f, name).get("env_steps") or 0)

    base = {n: steps(fig, n) for n in ("simulator0", *(f"sim_{fault}" for fault in FAULTS))}
    # The healthy simulator's slots keep stepping, and the restarted slots step again.
    fig2 = job.wait(lambda f: steps(f, "simulator0") > base["simulator0"] + 20
                    and all(steps(f, f"sim_{fault}") > base[f"sim_{fault}"] + 4 for fault in FAULTS),
                    180, "every simulator stepping after the restarts")
    assert fig2["workers"]["simulator"] == 3 and fig2["errors"] == 0
    assert fig2["episodes"] >= 1 and fig2["traj"]["dropped"] == 0
    for fault, says in (("hang", "hung"), ("crash", "deliberate failure")):
        log = (job.run_dir / f"sim_{fault}.log").read_text()
        assert "env_restart" in log and says in log, log[-3000:]
    ok_log = (job.run_dir / "simulator0.log").read_text()
    assert "env_restart" not in ok_log


# ---------------------------------------------------------------------------------------------
# RoboCasa without its package
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(robocasa_available(), reason="robocasa is installed here")
@pytest.mark.parametrize("parallel", ["process", "thread"])
def test_robocasa_worker_without_package_exits_with_install_steps(repo_job, tmp_path: Path, parallel: str) -> None:
    config = tmp_path / "robocasa.yaml"  # the repo ships no RoboCasa config: no kitchen builds here (docs/robocasa.md)
    config.write_text("env: {name: robocasa, num_envs: 1, slots: 1, options: {task: OpenDrawer}}\nmodel: {family: mlp}\n")
    job = repo_job(str(config), "workers.simulators=1", f"env.parallel={parallel}", start=False)
    proc = subprocess.run(
        [sys.executable, "-m", "rlvla3", "worker", "--role", "simulator", "--broker", job.endpoint, "--name", "robocasa"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "robocasa is not installed" in out, out[-3000:]
    assert "own virtualenv" in out and "robosuite>=1.5" in out and "download_kitchen_assets" in out, out[-3000:]
    # It said so once and left: the broker saw it come and go, nothing else broke.
    fig = wait_until(lambda: next((f for f in [job.status()] if f["workers"]["simulator"] == 0), None), 30,
                     "the broker to see the worker gone")
    assert fig["errors"] == 0
