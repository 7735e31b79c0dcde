"""A synthetic reaching task with a configurable step-time distribution.

A point moves in the unit square towards a goal. The policy sees the state (position and goal)
and a small image (point in green, goal in red); the instruction names the goal's colour. PPO
learns it in a few thousand steps. Each step sleeps for a time drawn from a distribution, so the
asynchronous machinery can be measured on a 2-core machine without burning CPU: the long-tailed
profiles reproduce the physics stalls that RL-VLA^3 is about.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from rlvla3.observation import Observation
from workers.envs.base import EnvSpec, SimEnv, StepResult, register_env


@dataclass
class LatencyConfig:
    kind: str = "constant"
    """``constant``, ``lognormal``, ``bimodal`` or ``replay``."""
    mean_ms: float = 0.0
    """Mean step time (constant and lognormal)."""
    sigma: float = 0.5
    """Lognormal shape."""
    slow_ms: float = 100.0
    """Bimodal: the slow mode's step time."""
    slow_prob: float = 0.05
    """Bimodal: probability of a slow step."""
    replay: str = ""
    """Replay: a latency profile file written by bench/sim_latency.py."""


@dataclass
class SyntheticOptions:
    image_size: int = 16
    """Side of the square camera image."""
    max_episode_steps: int = 40
    """Steps before truncation."""
    goal_radius: float = 0.1
    """Reaching within this distance ends the episode with success."""
    speed: float = 0.1
    """Displacement per unit action per step."""
    latency: dict = field(default_factory=dict)
    """Step-time distribution (see LatencyConfig)."""
    fail_on_step: int = 0
    """Testing: raise in this global step number (0 = never)."""
    hang_on_step: int = 0
    """Testing: sleep for an hour in this global step number (0 = never)."""


class LatencyModel:
    """Draws step times; one draw per env step, a batched step waits for its slowest env."""

    def __init__(self, cfg: LatencyConfig, rng: np.random.Generator) -> None:
        self.cfg = cfg
        self.rng = rng
        self.samples: np.ndarray | None = None
        if cfg.kind == "replay":
            from workers.envs.latency_profile import load_latency_profile

            self.samples = np.asarray(load_latency_profile(cfg.replay), dtype=np.float64)
        elif cfg.kind not in ("constant", "lognormal", "bimodal"):
            raise ValueError(f"env.options.latency.kind {cfg.kind!r} unknown")

    def draw(self, n: int) -> np.ndarray:
        c = self.cfg
        if c.kind == "constant":
            return np.full(n, c.mean_ms / 1000.0)
        if c.kind == "lognormal":
            mu = np.log(max(c.mean_ms, 1e-6) / 1000.0) - c.sigma**2 / 2
            return self.rng.lognormal(mu, c.sigma, n)
        if c.kind == "bimodal":
            slow = self.rng.random(n) < c.slow_prob
            return np.where(slow, c.slow_ms, c.mean_ms) / 1000.0
        return self.rng.choice(self.samples, n)


@register_env("synthetic", options=SyntheticOptions)
class SyntheticReach(SimEnv):
    """Point-reaching envs sharing one latency model."""

    def __init__(self, num_envs: int, seed: int = 0, options: SyntheticOptions | None = None) -> None:
        self.opts = options or SyntheticOptions()
        self.num_envs = num_envs
        self.spec = self.spec_for(self.opts)
        self.rng = np.random.default_rng(seed)
        self.latency = LatencyModel(LatencyConfig(**self.opts.latency), np.random.default_rng(seed + 7919))
        self.pos = np.zeros((num_envs, 2), np.float32)
        self.goal = np.zeros((num_envs, 2), np.float32)
        self.t = np.zeros(num_envs, np.int64)
        self.global_steps = 0

    @staticmethod
    def spec_for(opts: SyntheticOptions | None) -> EnvSpec:
        opts = opts or SyntheticOptions()
        s = opts.image_size
        return EnvSpec(cameras={"top": (s, s)}, state_dim=4, action_dim=2, max_episode_steps=opts.max_episode_steps)

    def _reset(self, ids: list[int], seeds: Sequence[int | None] | None) -> None:
        for j, i in enumerate(ids):
            seed = None if seeds is None else seeds[j]
            rng = np.random.default_rng(seed) if seed is not None else self.rng
            self.pos[i] = rng.uniform(0.1, 0.9, 2)
            goal = rng.uniform(0.1, 0.9, 2)
            while np.linalg.norm(goal - self.pos[i]) < 3 * self.opts.goal_radius:
                goal = rng.uniform(0.1, 0.9, 2)
            self.goal[i] = goal
            self.t[i] = 0

    def _step(self, ids: list[int], actions: np.ndarray) -> StepResult:
        self.global_steps += 1
        if self.opts.fail_on_step and self.global_steps == self.opts.fail_on_step:
            raise RuntimeError("synthetic env: deliberate failure (fail_on_step)")
        if self.opts.hang_on_step and self.global_steps == self.opts.hang_on_step:
            time.sleep(3600)
        delay = float(self.latency.draw(len(ids)).max()) if ids else 0.0
        if delay > 0:
            time.sleep(delay)
        a = np.clip(np.asarray(actions, np.float32).reshape(len(ids), 2), -1.0, 1.0)
        idx = np.asarray(ids)
        before = np.linalg.norm(self.goal[idx] - self.pos[idx], axis=1)
        self.pos[idx] = np.clip(self.pos[idx] + self.opts.speed * a, 0.0, 1.0)
        after = np.linalg.norm(self.goal[idx] - self.pos[idx], axis=1)
        self.t[idx] += 1
        success = after < self.opts.goal_radius
        reward = (before - after) * 10.0 + success.astype(np.float32) * 1.0
        truncated = (self.t[idx] >= self.opts.max_episode_steps) & ~success
        return StepResult(reward=reward.astype(np.float32), terminated=success, truncated=truncated, success=success)

    def observe(self, ids: list[int], into: Observation, rows: Sequence[int]) -> None:
        s = self.opts.image_size
        rows = np.asarray(rows, np.int64)
        img = into.images["top"]
        img[rows] = 0  # the picture is drawn in the caller's rows
        g = np.clip((self.goal[ids] * (s - 1)).round().astype(int), 0, s - 1)
        p = np.clip((self.pos[ids] * (s - 1)).round().astype(int), 0, s - 1)
        img[rows, s - 1 - g[:, 1], g[:, 0], 0] = 255  # image row 0 is the top: y grows upwards
        img[rows, s - 1 - p[:, 1], p[:, 0], 1] = 255
        into.state[rows, :2] = self.pos[ids]
        into.state[rows, 2:] = self.goal[ids]
        for r in rows.tolist():
            into.instruction[r] = "reach the red dot"
