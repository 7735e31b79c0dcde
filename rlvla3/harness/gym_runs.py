"""One ``rlvla3 run`` of a Gymnasium PPO recipe (``configs/gym_<env>_ppo.yaml``) and its figures:
what the PPO parity and speed benches (``bench/jobs/gym_parity.py``, ``gym_speed.py``) both run.

A run's curve is its trainer's per-update lines (``trainer_metrics.jsonl``): env steps consumed,
the wall-clock second and the raw, unscaled returns of the episodes that ended in that batch; its
speed is the launcher's progress lines (``metrics.jsonl``) from the first env step on.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from rlvla3.harness.jobs import json_lines, start_cli

ENVS = {"hopper": "Hopper-v4", "halfcheetah": "HalfCheetah-v4", "cartpole": "CartPole-v1"}
MODES = ("sync", "async")

LAST_SHARE = 0.10
"""``final_return`` is the mean return of this share of a run's episodes, the last ones."""


def run_one(root: Path, env: str, mode: str, seed: int, steps: int, folder: Path, timeout_s: float, fresh: bool,
            overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """One job run from ``root`` (the repository), or the result a previous invocation left in
    ``folder`` (resumable per seed). ``overrides`` are ``--set KEY=VALUE`` settings of the
    config, the same for every mode."""
    result_path = folder / "result.json"
    job = folder / "job"
    if not fresh and (done := kept_result(folder, steps)) is not None:
        return done
    args = ["run", f"configs/gym_{env}_ppo.yaml", "--steps", str(steps),
            "--run-dir", str(job), "--set", f"run.mode={mode}", "--set", f"run.seed={seed}"]
    for kv in overrides:
        args += ["--set", kv]
    folder.mkdir(parents=True, exist_ok=True)
    if job.exists():
        shutil.rmtree(job)  # an unfinished attempt's metrics must not count
    t0 = time.monotonic()
    with open(folder / "run.log", "w") as log:
        proc = start_cli(*args, cwd=root, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()  # a clean stop: the run writes its summary
            rc = proc.wait(120)
    out = summarise(job, steps)
    out.update(env=env, mode=mode, seed=seed, steps=steps, rc=rc, wall_s=round(time.monotonic() - t0, 1),
               command=shlex.join(["python", "-m", "rlvla3", *args]))
    if rc == 0 and out["episodes"] > 0 and (out["env_steps"] or 0) >= steps:  # a run stopped early reruns
        result_path.write_text(json.dumps(out))
    return out


def kept_result(folder: Path, steps: int) -> dict[str, Any] | None:
    """The result a finished run of ``steps`` env steps left in ``folder``, or None. Its figures
    are read again from the run's own files where they are here (results gathered from other
    machines keep only ``result.json``)."""
    result_path, job = folder / "result.json", folder / "job"
    if not result_path.is_file():
        return None
    done = json.loads(result_path.read_text())
    if done.get("steps") != steps:
        return None
    return {**done, **summarise(job, steps)} if (job / "trainer_metrics.jsonl").is_file() else done


def summarise(job: Path, steps: int) -> dict[str, Any]:
    """Curve points and figures from the trainer's per-update lines."""
    rows = [r for r in json_lines(job / "trainer_metrics.jsonl")
            if r.get("episodes", 0) > 0 and np.isfinite(r.get("return_mean_batch", np.nan))]
    t0 = rows[0]["elapsed_s"] if rows else 0.0
    curve = {"steps": [int(r["env_steps_consumed"]) for r in rows],
             "seconds": [round(r["elapsed_s"] - t0, 2) for r in rows],
             "returns": [round(float(r["return_mean_batch"]), 2) for r in rows],
             "episodes": [int(r["episodes"]) for r in rows]}
    return {"final_return": final_return(curve), "episodes": int(sum(curve["episodes"])), "curve": curve,
            **throughput(job / "metrics.jsonl")}


def throughput(path: Path) -> dict[str, Any]:
    """Env steps and env steps per second over the whole run, from its first env step (the
    launcher's progress lines; process start-up is not charged)."""
    stepped = [r for r in json_lines(path) if r.get("env_steps", 0) > 0]
    if len(stepped) < 2:  # a run over before its second progress line (the smoke): the launcher's own rate
        last = stepped[-1] if stepped else {}
        return {"env_steps": last.get("env_steps", 0), "steps_per_s": last.get("env_steps_per_s")}
    a, b = stepped[0], stepped[-1]
    rate = (b["env_steps"] - a["env_steps"]) / max(1e-9, b["elapsed_s"] - a["elapsed_s"])
    return {"env_steps": b["env_steps"], "steps_per_s": round(rate, 1)}


def final_return(curve: dict[str, list]) -> float | None:
    """Mean raw return of the last ``LAST_SHARE`` of the episodes (whole batches from the end,
    each weighted by its episodes, until they hold that many)."""
    eps = np.asarray(curve["episodes"], float)
    if not len(eps):
        return None
    want = max(1.0, LAST_SHARE * eps.sum())
    rets = np.asarray(curve["returns"], float)
    take = int(np.searchsorted(np.cumsum(eps[::-1]), want)) + 1
    e, r = eps[::-1][:take], rets[::-1][:take]
    return round(float((e * r).sum() / e.sum()), 2)

