"""Benchmark evaluation: each simulator's official protocol, run deterministically, per task.

A protocol is a list of tasks, each with its fixed initial states:

- LIBERO: every task of the suite (or ``task_ids``) from its 50 fixed init states
  (``seed % 50`` picks the state, see ``workers/envs/libero.py``);
- Meta-World: MT1/MT10 from each task's 50 benchmark goals; ML1 from its held-out *test* goals
  (``goal_mode: benchmark``: ``seed`` indexes the goal list);
- ManiSkill: 50 seeded episodes (seeds 0..49) of the task.

``episodes`` shortens every task's list to its first N states; the result says so
(``shortened: true``). The envs of one adapter are spread round-robin over the tasks (as both
the Meta-World and LIBERO adapters assign them), so env ``e`` runs task ``e % n_tasks`` and
takes every ``k``-th of that task's starts. Each env starts its next episode as soon as its last
one ends; the policy acts on whichever envs are live, deterministically.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import torch

from rlvla3.config import JobConfig
from rlvla3.observation import Observation
from workers.envs.base import EnvAdapter, make_env

log = structlog.get_logger()

PROTOCOL_STATES = 50
"""Initial states per task in every official protocol here (LIBERO's init files hold 50; Meta-World
lists 50 goals per task; ManiSkill's evaluation seeds are 0..49)."""

LIBERO_SUITE_TASKS = {"spatial": 10, "object": 10, "goal": 10, "10": 10, "90": 90}


@dataclass
class Protocol:
    """What one benchmark's evaluation runs."""

    name: str
    tasks: int
    """Distinct tasks; env ``e`` of the adapter runs task ``e % tasks``."""
    seeds: list[int]
    """Initial states of every task, in order."""
    options: dict[str, Any]
    """``env.options`` for the evaluation adapter (the protocol's split or goal mode applied)."""
    shortened: bool = False


@dataclass
class Episode:
    task: str
    seed: int
    success: bool
    ret: float
    length: int
    frames: list[np.ndarray] = field(default_factory=list)  # [H, W*cams, 3] per env step, when recorded


def protocol_for(cfg: JobConfig, episodes: int | None = None) -> Protocol:
    """The official protocol of the job's simulator, shortened to ``episodes`` starts per task."""
    name, opts = cfg.env.name, dict(cfg.env.options)
    if name == "libero":
        ids = list(opts.get("task_ids") or range(LIBERO_SUITE_TASKS.get(str(opts.get("suite", "spatial")), 10)))
        opts["task_ids"] = ids
        proto = Protocol(f"LIBERO-{opts.get('suite', 'spatial')}: 50 fixed init states per task", len(ids),
                         list(range(PROTOCOL_STATES)), opts)
    elif name == "metaworld":
        bench = str(opts.get("benchmark", "MT1")).upper()
        opts["goal_mode"] = "benchmark"
        if bench == "ML1":
            opts["split"] = "test"  # meta-test: the goals held out of meta-training
        tasks = 10 if bench == "MT10" else 1
        what = "held-out test goals" if bench == "ML1" else "benchmark goals per task"
        proto = Protocol(f"Meta-World {bench}: {PROTOCOL_STATES} {what}", tasks, list(range(PROTOCOL_STATES)), opts)
    elif name == "maniskill":
        proto = Protocol(f"ManiSkill {opts.get('task', 'PickCube-v1')}: seeds 0..{PROTOCOL_STATES - 1}", 1,
                         list(range(PROTOCOL_STATES)), opts)
    else:  # no official protocol (synthetic, robocasa): the same seeded starts
        proto = Protocol(f"{name}: seeds 0..{PROTOCOL_STATES - 1}", 1, list(range(PROTOCOL_STATES)), opts)
    if episodes is not None and 0 < episodes < len(proto.seeds):
        proto.seeds = proto.seeds[:episodes]
        proto.shortened = True
    return proto


def task_label(adapter: EnvAdapter, env: int) -> str:
    """A readable task name for env ``env`` of an adapter."""
    names = getattr(adapter, "task_names", None)  # Meta-World
    if names:
        return str(names[env])
    ids = getattr(adapter, "task_ids", None)  # LIBERO
    if ids:
        return f"task{ids[env]}: {adapter.instructions[env]}"
    opts = getattr(adapter, "opts", None)
    return str(getattr(opts, "task", None) or "task")


def _frame(obs_images: dict[str, np.ndarray], row: int, cameras: list[str]) -> np.ndarray:
    """One video frame: the chosen cameras side by side (a grid of one row)."""
    return np.concatenate([obs_images[c][row] for c in cameras], axis=1)


@torch.no_grad()
def run_protocol(cfg: JobConfig, policy: torch.nn.Module, proto: Protocol, envs_per_task: int = 1,
                 video_episodes: int = 0, cameras: list[str] | None = None) -> list[Episode]:
    """Every (task, start) of ``proto``, deterministic; the first ``video_episodes`` episodes of
    each task keep their frames (``cameras``: default all)."""
    policy.eval()
    policy.seed_eval(cfg.run.seed)
    k = max(1, min(envs_per_task, len(proto.seeds)))
    n = proto.tasks * k
    env = make_env(cfg.env.name, num_envs=n, seed=cfg.run.seed, options=proto.options, plugins=cfg.env.plugins)
    cams = list(cameras or env.spec.cameras)
    if video_episodes and not cams:
        env.close()
        raise ValueError("videos need camera images: set env.options.cameras (e.g. --set env.options.cameras=[corner])")
    queues = [list(proto.seeds[e // proto.tasks::k]) for e in range(n)]
    labels = [task_label(env, e) for e in range(n)]
    recorded: dict[str, int] = {}
    done: list[Episode] = []
    current: dict[int, Episode] = {}
    latest: dict[int, tuple[Observation, int]] = {}  # env -> (an obs batch, its row there)
    try:
        def start(ids: list[int]) -> None:
            seeds = [queues[e].pop(0) for e in ids]
            obs = env.reset(ids, seeds)
            for row, (e, s) in enumerate(zip(ids, seeds)):
                ep = Episode(labels[e], s, False, 0.0, 0)
                if recorded.get(ep.task, 0) < video_episodes:
                    recorded[ep.task] = recorded.get(ep.task, 0) + 1
                    ep.frames.append(_frame(obs.images, row, cams))
                current[e] = ep
                latest[e] = (obs, row)

        start([e for e in range(n) if queues[e]])
        while current:
            live = sorted(current)
            obs = Observation.concat([o.select(slice(r, r + 1)) for o, r in (latest[e] for e in live)])
            acts = policy.act(obs, deterministic=True).actions.float().cpu().numpy()  # row r <-> live[r]
            rows, stepping = list(range(len(live))), list(live)
            for t in range(acts.shape[1]):
                res = env.step(stepping, acts[rows, t])
                for j, e in enumerate(stepping):
                    ep = current[e]
                    ep.ret += float(res.reward[j])
                    ep.length += 1
                    ep.success |= bool(res.success[j])
                    if ep.frames:
                        ep.frames.append(_frame(res.obs.images, j, cams))
                    latest[e] = (res.obs, j)
                ended = res.terminated | res.truncated
                for j, e in enumerate(stepping):
                    if ended[j]:
                        done.append(current.pop(e))
                rows = [r for r, end in zip(rows, ended) if not end]
                stepping = [e for e, end in zip(stepping, ended) if not end]
                if not stepping:
                    break
            restart = [e for e in live if e not in current and queues[e]]
            if restart:
                start(restart)
    finally:
        env.close()
    log.info("eval_protocol_done", protocol=proto.name, episodes=len(done))
    return done


def success_table(episodes: list[Episode], proto: Protocol, checkpoint: str) -> dict[str, Any]:
    """Per-task success (and mean return / length), plus the overall rate."""
    tasks: dict[str, list[Episode]] = {}
    for ep in episodes:
        tasks.setdefault(ep.task, []).append(ep)
    rows = [{"task": t, "episodes": len(eps), "success": round(float(np.mean([e.success for e in eps])), 4),
             "return": round(float(np.mean([e.ret for e in eps])), 3),
             "length": round(float(np.mean([e.length for e in eps])), 1)} for t, eps in sorted(tasks.items())]
    return {"protocol": proto.name, "checkpoint": checkpoint, "shortened": proto.shortened,
            "starts_per_task": len(proto.seeds), "episodes": len(episodes),
            "max_episode_steps": proto.options.get("max_episode_steps"),
            "success": round(float(np.mean([e.success for e in episodes])), 4) if episodes else None,
            "tasks": rows}


def table_markdown(table: dict[str, Any]) -> str:
    note = [f"**Shortened**: the first {table['starts_per_task']} of {PROTOCOL_STATES} starts per task "
            f"(`--episodes`), not the full protocol.", ""] if table["shortened"] else []
    horizon = f", episodes of at most {table['max_episode_steps']} steps" if table.get("max_episode_steps") else ""
    lines = [f"# Evaluation: {table['protocol']}", "", f"Checkpoint: `{table['checkpoint']}`{horizon}", "", *note,
             "| task | episodes | success | return | length |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['task']} | {r['episodes']} | {r['success']:.3f} | {r['return']:.2f} | {r['length']:.1f} |"
              for r in table["tasks"]]
    lines.append(f"| **all** | {table['episodes']} | {table['success']:.3f} | | |")
    return "\n".join(lines) + "\n"
