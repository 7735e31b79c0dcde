"""A simulator slot: its adapter, its envs, its two observation blocks, and what one action chunk did.

The simulator worker (``workers/simulator.py``) cycles each slot on its own; these are the
records it keeps per slot, and the seed rule that gives every episode its initial state.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlvla3 import protocol as P
from rlvla3.observation import Observation
from workers.base import JobRunner
from workers.envs.base import EnvAdapter
from workers.envs.subproc import GuardedEnv, SubprocEnv
from workers.trajectory import EnvTrajectory


def episode_seed(run_seed: int, env: int, episode: int, group_size: int = 1, group_mode: str = "parallel") -> int:
    """Initial-state seed of an env's ``episode``-th episode (1-based; ``env`` is the worker's
    global env index). A GRPO group shares one: neighbouring envs' n-th episodes (``parallel``)
    or an env's consecutive episodes (``sequential``)."""
    g = max(1, group_size)
    if group_mode == "parallel":
        key = f"{run_seed}:p:{env // g}:{episode}"
    else:
        key = f"{run_seed}:s:{env}:{(episode - 1) // g}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little") & 0x7FFFFFFF


@dataclass
class ChunkOutcome:
    """What executing one action chunk did to a slot's envs."""

    step_reward: np.ndarray  # [k, T]
    steps: np.ndarray  # [k]
    terminated: np.ndarray  # [k]
    truncated: np.ndarray  # [k]
    success: np.ndarray  # [k]
    next_obs: Observation  # the back block: each env's obs after the chunk (a new episode's for reset envs)
    terminal_obs: Observation | None  # copy of the reset envs' last obs before their reset (rows in done order)
    done_ids: list[int]
    restarts: int = 0


@dataclass
class Slot:
    index: int
    envs: list[int]  # worker-global env indices
    adapter: EnvAdapter
    runner: JobRunner
    trajs: list[EnvTrajectory]
    blocks: tuple[Observation, Observation]  # the slot's two observation blocks (views of shared memory)
    refs: tuple[dict[str, P.ShmRef], ...]  # each block's descriptors, by tensor name
    front: int = 1  # the block the last OBS named; the envs write the other one
    req_id: int = 0
    waiting: bool = False  # an OBS is out, waiting for ACT
    out: dict[str, np.ndarray] | None = None  # the policy outputs being executed
    version: int = -1
    pending_obs: list[Any] | None = None  # last OBS frames, re-sent after a reconnect or env.obs_resend_s
    sent_at: float = 0.0  # when pending_obs last went out (monotonic)
    eval: bool = False  # an evaluation slot: deterministic actions, held-out starts, never trained on
    frozen: np.ndarray | None = None  # eval: envs whose episode of this round is over
    eval_version: int = -1  # eval: the policy version this round evaluates
    decisions: int = 0  # decisions since the slot's fragments were last cut together (every env.fragment_len)

    @property
    def obs(self) -> Observation:
        """The observations the last OBS sent (the policy's view while its ACT is awaited)."""
        return self.blocks[self.front]

    @property
    def back(self) -> Observation:
        """The block the envs write next."""
        return self.blocks[1 - self.front]

    def flip(self) -> None:
        """The back block, written, becomes what the next OBS sends."""
        self.front = 1 - self.front


def slot_adapter(env: Any, k: int, seed: int) -> EnvAdapter:
    """The adapter of one simulator slot of ``k`` envs, as ``env`` (an ``EnvConfig``) asks:
    its own child process (``parallel: process``) or in the caller's process, rebuilt on an
    exception (its envs end truncated, ``info["restarted"]``, as a crashed child reports)."""
    if env.parallel == "process":
        return SubprocEnv(env.name, num_envs=k, seed=seed, options=env.options, step_timeout_s=env.step_timeout_s,
                          plugins=env.plugins)
    return GuardedEnv(env.name, num_envs=k, seed=seed, options=env.options, plugins=env.plugins)
