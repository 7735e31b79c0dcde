"""The ``gymnasium`` env family: any registered id, Box and Discrete actions, truncation kept apart
from termination (and bootstrapped), bad input refused at config load, non-finite envs ending an
episode, and the observation statistics travelling with weight versions and checkpoints.

The unsupported-space, missing-extra and NaN envs are real Gymnasium envs registered here: the
family must judge whatever a user registers, so the test registers what a user might."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gym = pytest.importorskip("gymnasium")

from rlvla3.config import ConfigError, load  # noqa: E402
from rlvla3.lifetime import launcher_env  # noqa: E402
from workers.envs.base import make_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CARTPOLE = ROOT / "configs" / "gym_cartpole_ppo.yaml"
HOPPER = ROOT / "configs" / "gym_hopper_ppo.yaml"
HAVE_MUJOCO = __import__("importlib.util").util.find_spec("mujoco") is not None


class DictObs(gym.Env):
    observation_space = gym.spaces.Dict({"a": gym.spaces.Box(-1, 1, (2,))})
    action_space = gym.spaces.Discrete(2)


class MultiBinaryAct(gym.Env):
    observation_space = gym.spaces.Box(-1, 1, (2,))
    action_space = gym.spaces.MultiBinary(3)


class NeedsExtra(gym.Env):
    def __init__(self) -> None:
        raise gym.error.DependencyNotInstalled("frobnicator is not installed")


class GoesNaN(gym.Env):
    """Returns a NaN observation on its 3rd step of every episode."""

    observation_space = gym.spaces.Box(-10, 10, (3,))
    action_space = gym.spaces.Box(-1, 1, (1,))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(3, np.float32), {}

    def step(self, action):
        self.t += 1
        obs = np.full(3, np.nan if self.t == 3 else 0.5, np.float32)
        return obs, 1.0, False, False, {}


for _cls in (DictObs, MultiBinaryAct, NeedsExtra, GoesNaN):
    gym.register(f"rlvla3test/{_cls.__name__}-v0", entry_point=_cls, max_episode_steps=50)


def gym_cfg(env_id: str, *extra: str):
    return load(CARTPOLE, [f"env.options.id={env_id}", *extra])


@pytest.mark.parametrize("env_id, words", [
    ("NoSuchEnv-v9", "not a registered Gymnasium id"),
    ("rlvla3test/DictObs-v0", "observation space Dict is not supported"),
    ("rlvla3test/MultiBinaryAct-v0", "action space MultiBinary(3) is not supported"),
    ("rlvla3test/NeedsExtra-v0", "needs an extra that is not installed"),
])
def test_bad_envs_are_refused_at_config_load_naming_why(env_id: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        gym_cfg(env_id)
    with pytest.raises(ConfigError, match="unknown key"):
        gym_cfg("CartPole-v1", "env.options.ids=CartPole-v1")


def test_rlvla3_run_refuses_an_unknown_id_before_starting_anything(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "rlvla3", "run", str(CARTPOLE), "--run-dir", str(tmp_path / "run"),
                        "--set", "env.options.id=NoSuchEnv-v9"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**__import__("os").environ, **launcher_env()})
    assert r.returncode != 0 and "not a registered Gymnasium id" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # no folder, no broker, no worker


def test_time_limit_is_a_truncation_and_nan_ends_the_episode_counted() -> None:
    env = make_env("gymnasium", 2, seed=0, options={"id": "CartPole-v1", "max_episode_steps": 5})
    assert env.spec.action_choices == 2 and env.spec.action_dim == 1 and env.spec.state_dim == 4
    env.reset([0, 1], [1, 2])
    for t in range(5):  # pole balanced for 5 steps by alternating pushes: only the limit ends it
        res = env.step([0, 1], np.full((2, 1), t % 2, np.float32))
    assert res.truncated.all() and not res.terminated.any()
    env.close()

    bad = make_env("gymnasium", 1, seed=0, options={"id": "rlvla3test/GoesNaN-v0"})
    bad.reset([0])
    ends = [bad.step([0], np.zeros((1, 1), np.float32)) for _ in range(3)]
    assert [bool(r.terminated[0]) for r in ends] == [False, False, True]
    assert np.isfinite(ends[-1].obs.state).all() and ends[-1].reward[0] == 0.0
    assert bad.nonfinite_episodes == 1
    bad.reset([0])  # the next episode runs on
    assert not bad.step([0], np.zeros((1, 1), np.float32)).terminated[0]
    bad.close()


def _cartpole_batch(cfg, policy):
    """Two 3-step CartPole fragments through adapter -> trajectory fragment -> learner: the first
    ends at the time limit (truncated), the second is ended as a termination."""
    from workers.learner import Fragment, Learner, build_batch
    from workers.trajectory import EnvTrajectory, StepRecord

    env = make_env("gymnasium", 1, seed=0, options=cfg.env.options)
    obs = env.reset([0], [7])
    learner = Learner(cfg)
    for ending in ("truncated", "terminated"):
        tr = EnvTrajectory(env=0)
        tr.begin_episode("", 7)
        for t in range(3):
            with torch.no_grad():
                out = policy.act(obs)
            res = env.step([0], out.actions[:, 0].numpy())
            term = bool(res.terminated[0]) or (ending == "terminated" and t == 2)
            tr.add(StepRecord(obs=obs, actions=out.actions[0].numpy(), logprob=out.logprob[0].numpy(),
                              value=float(out.value[0]), replay={}, version=0, reward=float(res.reward[0]),
                              steps=1, terminated=term,
                              truncated=bool(res.truncated[0]) and not term))
            obs = res.obs
        assert tr.records[-1].truncated == (ending == "truncated")
        header, tensors = tr.fragment(obs, False)
        learner.add(Fragment(header, tensors))
        obs = env.reset([0], [7])
    env.close()
    return build_batch(learner.take(6), 0, cfg)


def test_truncated_fragment_bootstraps_from_the_value_of_its_last_observation() -> None:
    """A time-limit end is bootstrapped with V(final observation), a termination is not."""
    from rlvla3.observation import Observation
    from workers.algorithms.update import TrainState, _gae
    from workers.model import build_policy

    cfg = gym_cfg("CartPole-v1", "env.options.max_episode_steps=3", "algo.lam=1.0")
    policy = build_policy(cfg)
    batch = _cartpole_batch(cfg, policy)
    _adv, ret = _gae(TrainState.build(policy, cfg.algo), batch, batch.samples["values"], cfg.algo)
    with torch.no_grad():
        v_last = float(policy.evaluate(Observation.concat([batch.bootstrap["obs"].select([0])]),
                                       batch.bootstrap["actions"][:1], {}).value[0])
    assert ret[2].item() == pytest.approx(1.0 + cfg.algo.gamma * v_last, abs=1e-4)  # truncated: bootstrapped
    assert ret[5].item() == pytest.approx(1.0, abs=1e-5)  # terminated: nothing after it


def test_an_update_scores_advantages_with_the_critic_it_starts_from_not_the_behaviour_values() -> None:
    """GAE, the value targets and the value clip read the values of the critic the update starts
    from, as the bootstrap does, never the (possibly stale) values the generator sent: an update
    on a batch whose behaviour values are wrong steps exactly as one on the right values."""
    import copy

    from workers.algorithms.update import TrainState, update
    from workers.model import build_policy

    cfg = gym_cfg("CartPole-v1", "env.options.max_episode_steps=3", "algo.minibatch_size=3")
    policy = build_policy(cfg)
    batch = _cartpole_batch(cfg, policy)
    params = []
    for values in (batch.samples["values"], torch.full_like(batch.samples["values"], 1000.0)):
        torch.manual_seed(0)
        mine = copy.deepcopy(policy)
        update(TrainState.build(mine, cfg.algo), dataclasses.replace(batch, samples={**batch.samples, "values": values}),
               cfg.algo)
        params.append(torch.cat([p.detach().flatten() for p in mine.parameters()]))
    assert not torch.equal(params[0], torch.cat([p.detach().flatten() for p in policy.parameters()]))  # it stepped
    assert torch.equal(params[0], params[1])


def test_observation_statistics_travel_with_versions_and_checkpoints(tmp_path: Path) -> None:
    from rlvla3.shm import host_id
    from rlvla3.weights.publisher import WeightPublisher, module_tensors
    from rlvla3.weights.receiver import WeightReceiver
    from workers.checkpoint import save_checkpoint
    from workers.model import build_policy

    cfg = gym_cfg("CartPole-v1", "model.options.norm_obs=true")
    trainer, generator = build_policy(cfg), build_policy(cfg)
    assert {n for n, _, live in module_tensors(trainer) if live and n.startswith("obs_norm.")} == \
        {"obs_norm.mean", "obs_norm.var", "obs_norm.count"}
    env = make_env("gymnasium", 4, seed=0, options=cfg.env.options)
    obs = env.reset(range(4))
    pub = WeightPublisher(trainer, "wt" + __import__("uuid").uuid4().hex[:8], stream_bind="")
    rx = WeightReceiver(generator, host_id(), copy_threads=1)
    try:
        for version in (0, 1):
            if version:
                trainer.update_statistics(obs)  # the trainer folds a batch in after an update
            ann = pub.publish(version)
            assert rx.offer(ann)
            a = rx.next_fetch(0.0)
            rx.fetched(a, rx.fetch(a), None, 0.0)
            assert rx.swap() is not None
        assert torch.equal(generator.obs_norm.mean, trainer.obs_norm.mean) and trainer.obs_norm.count > 1
        assert torch.equal(generator.act(obs, deterministic=True).actions, trainer.act(obs, deterministic=True).actions)
    finally:
        rx.close()
        pub.close()
    save_checkpoint(tmp_path, trainer, None, 1, {}, cfg.to_yaml())
    cfg.model.checkpoint = str(tmp_path)
    loaded = build_policy(cfg)  # what eval and export build
    for name in ("mean", "var", "count"):
        assert torch.equal(getattr(loaded.obs_norm, name), getattr(trainer.obs_norm, name)), name
    env.close()


def run_job(config: Path, tmp_path: Path, mode: str, steps: int, *sets: str) -> dict:
    run = tmp_path / mode
    args = [sys.executable, "-m", "rlvla3", "run", str(config), "--steps", str(steps), "--run-dir", str(run),
            "--set", f"run.mode={mode}", *[a for s in sets for a in ("--set", s)]]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=240,
                       env={**__import__("os").environ, **launcher_env()})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "trainer_metrics.jsonl").read_text().splitlines()]
    return {"summary": summary, "rows": rows, "run": run}


@pytest.mark.slow
def test_cartpole_trains_through_the_fabric_in_async(tmp_path: Path) -> None:
    job = run_job(CARTPOLE, tmp_path, "async", 3000, "algo.batch_steps=256", "env.fragment_len=32")
    s, rows = job["summary"], job["rows"]
    assert s["env_steps"] >= 3000 and s["episodes"] > 0 and s["policy_version"] >= 3
    assert rows[-1]["lr"] < rows[0]["lr"]  # annealed over run.total_env_steps (--steps)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_MUJOCO, reason="gymnasium[mujoco] not installed (pip install -e .[gymnasium-mujoco])")
def test_hopper_trains_through_the_fabric_in_sync_with_its_statistics_in_the_checkpoint(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from workers.algorithms.update import TrainState
    from workers.checkpoint import latest_checkpoint
    from workers.learner import Learner
    from workers.model import build_policy
    from workers.trainer_checkpoints import Checkpoints

    job = run_job(HOPPER, tmp_path, "sync", 1500, "algo.batch_steps=512", "algo.epochs=2", "env.fragment_len=16")
    assert job["summary"]["env_steps"] >= 1500 and job["summary"]["policy_version"] >= 2
    # Sync is on-policy, as CleanRL's PPO is: 16 envs x 16 decisions make a round, two rounds one
    # batch of 512 steps, and every step was acted with the weights the update starts from. GAE
    # runs on from each env's first fragment into its second (only an episode's end cuts it).
    stats = [(r["samples"], r["staleness_counts"]) for r in job["rows"] if "staleness_counts" in r]
    assert stats and all(n == 512 and set(counts) == {"0"} for n, counts in stats), stats
    continued = [r["fragments_continued"] for r in job["rows"] if "fragments_continued" in r]
    assert continued and all(0 < c <= 16 for c in continued), continued
    ckpt = latest_checkpoint(job["run"])
    weights = load_file(str(ckpt / "model.safetensors"))
    assert weights["obs_norm.count"].item() > 1000 and weights["obs_norm.mean"].abs().sum() > 0
    # The reward normaliser's moments too: a resumed trainer divides by the std it had, not by 1.
    saved = json.loads((ckpt / "state.json").read_text())["learner"]["reward_norm"]
    assert saved["count"] > 1000 and saved["var"] != 1.0, saved
    cfg = load(HOPPER, ["run.mode=sync"])
    policy = build_policy(cfg)
    learner = Learner(cfg)
    version, path = Checkpoints(cfg, None, str(job["run"]), 0, 1).resume(TrainState.build(policy, cfg.algo, policy), 0, learner)
    assert path == str(ckpt) and version >= 2
    assert learner.reward_norm.moments() == saved


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_MUJOCO, reason="gymnasium[mujoco] not installed (pip install -e .[gymnasium-mujoco])")
def test_speed_bench_times_a_run_of_ours_beside_the_reference_command(tmp_path: Path) -> None:
    """``bench/jobs/gym_speed.py`` against a stand-in for CleanRL's script (outside the project): a
    command printing CleanRL's progress line with the steps it was given, so the figure shows the
    command was filled in and its last ``SPS:`` line read."""
    env = {**__import__("os").environ, **launcher_env()}
    stand_in = f"{sys.executable} -c \"print('SPS: 1'); print('SPS: {{steps}}')\""
    r = subprocess.run([sys.executable, str(ROOT / "bench/jobs/gym_speed.py"), "--reference", stand_in, "--smoke",
                        "--out", str(tmp_path / "speed")], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["reference"]["per_round"] == [4096.0]
    ours = result["ours"]["async"]
    assert len(ours["per_round"]) == 1 and ours["per_round"][0] > 0
    assert ours["over_reference"] == round(ours["median"] / 4096.0, 3)
    assert (tmp_path / "speed" / "round0" / "async" / "result.json").is_file()
    # A reference that prints no rate is named, not read as zero.
    r = subprocess.run([sys.executable, str(ROOT / "bench/jobs/gym_speed.py"), "--reference", f"{sys.executable} -c pass",
                        "--smoke", "--out", str(tmp_path / "bad")], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0 and "'SPS:' lines" in r.stderr


def test_parity_table_gathers_kept_results_and_sets_the_sync_threshold_from_cleanrl_here(tmp_path: Path) -> None:
    """Results kept from runs on other machines (``result.json`` without its job folder) are
    gathered, not run again, and ``--here`` logs of CleanRL's script set item 4's second sync
    threshold by the same final-return rule (the mean of the last 10% of episodes)."""
    out = tmp_path / "parity"
    curve = {"steps": [2048, 4096], "seconds": [1.0, 2.0], "returns": [10.0, 2500.0], "episodes": [9, 1]}
    for mode, final in (("sync", 2500.0), ("async", 2400.0)):
        folder = out / "hopper" / mode / "seed0"
        folder.mkdir(parents=True)
        (folder / "result.json").write_text(json.dumps({
            "env": "hopper", "mode": mode, "seed": 0, "steps": 4096, "rc": 0, "final_return": final, "episodes": 10,
            "curve": curve, "env_steps": 4096, "steps_per_s": 1000.0, "wall_s": 5.0, "command": "kept"}))
    logs = []
    for k, finals in enumerate(([5.0] * 18 + [1900.0, 1900.0], [7.0] * 9 + [2100.0])):
        log = tmp_path / f"cleanrl_s{k}.log"
        log.write_text("SPS: 880\n" + "".join(f"global_step={100 * (i + 1)}, episodic_return=[{r}]\n"
                                             for i, r in enumerate(finals)))
        logs += ["--here", f"hopper={log}"]
    r = subprocess.run([sys.executable, str(ROOT / "bench/jobs/gym_parity.py"), "--smoke", "--out", str(out), *logs],
                       capture_output=True, text=True, timeout=120, env={**__import__("os").environ, **launcher_env()})
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (out / "hopper" / "sync" / "seed0" / "job").exists()  # gathered, not run again
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["final_return"]["Hopper-v4"]["sync"]["per_seed"] == {"0": 2500.0}
    target = result["sync_target"]["Hopper-v4"]
    assert target["here"]["per_run"] == [1900.0, 2100.0]  # the last 10% of each run's episodes
    assert target["here_lower"] == 1900.0 and target["published_lower"] == 2111.12
    assert target["threshold"] == 1900.0 and target["met"] is True
    assert "| Hopper-v4 | CleanRL here | 2 | 1900.0, 2100.0 |" in (out / "parity.md").read_text()
    bad = subprocess.run([sys.executable, str(ROOT / "bench/jobs/gym_parity.py"), "--smoke", "--out", str(out),
                          "--here", f"hopper={tmp_path / 'parity' / 'parity.md'}"], capture_output=True, text=True,
                         timeout=120, env={**__import__("os").environ, **launcher_env()})
    assert bad.returncode != 0 and "episodic_return" in bad.stderr
    # --gather runs nothing: a declared seed with no kept result is reported missing, not run.
    r = subprocess.run([sys.executable, str(ROOT / "bench/jobs/gym_parity.py"), "--gather", "--envs", "hopper",
                        "--seeds", "0", "1", "--steps", "4096", "--out", str(out)],
                       capture_output=True, text=True, timeout=120, env={**__import__("os").environ, **launcher_env()})
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (out / "hopper" / "sync" / "seed1").exists() and not (out / "hopper" / "async" / "seed1").exists()
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["final_return"]["Hopper-v4"]["async"]["per_seed"] == {"0": 2400.0}
    assert "1: missing" in (out / "parity.md").read_text()


def test_parity_runs_take_config_settings_for_every_run(tmp_path: Path) -> None:
    """``--set KEY=VALUE`` reaches each run's config and is written into its command, so a
    comparison such as ``algo.trust_region=behaviour`` is rerunnable from the table."""
    out = tmp_path / "parity"
    r = subprocess.run([sys.executable, str(ROOT / "bench/jobs/gym_parity.py"), "--smoke", "--modes", "async",
                        "--set", "algo.trust_region=behaviour", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env={**__import__("os").environ, **launcher_env()})
    assert r.returncode == 0, r.stderr[-3000:]
    run = json.loads(r.stdout.strip().splitlines()[-1])["runs"][0]
    assert run["rc"] == 0 and run["command"].endswith("--set algo.trust_region=behaviour")
    job_cfg = (out / "hopper" / "async" / "seed0" / "job" / "config.yaml").read_text()
    assert "trust_region: behaviour" in job_cfg
