"""Any registered Gymnasium env as a batch of envs: ``env.name: gymnasium``, ``env.options.id``.

Each env of the batch is its own ``gymnasium.make`` (its time limit included, so a time-limit end
comes back as a truncation and the trainer bootstraps its value). The observation is flattened
into the state row (no cameras); a Box action is clipped to the space's bounds before the step
(the policy's log-prob is of the unclipped sample, as CleanRL's ClipAction does); a Discrete
action arrives as one float and is rounded to an index.

An env that returns NaN or inf (observation or reward) has that episode ended there: the step
counts as terminated with reward 0 and a zeroed observation, so nothing non-finite reaches the
trainer, and ``nonfinite_episodes`` counts it (logged each time).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import structlog

from rlvla3.gym_config import GymnasiumOptions, gym_spaces, make_gymnasium_env
from rlvla3.observation import Observation
from workers.envs.base import EnvSpec, SimEnv, StepResult, register_env, reset_seeds

log = structlog.get_logger()


@register_env("gymnasium", options=GymnasiumOptions)
class GymnasiumEnv(SimEnv):
    """``num_envs`` copies of one Gymnasium id, stepped one after the other in this process."""

    def __init__(self, num_envs: int, seed: int = 0, options: GymnasiumOptions | None = None) -> None:
        self.opts = options or GymnasiumOptions()
        self.num_envs = num_envs
        self._envs = [make_gymnasium_env(self.opts) for _ in range(num_envs)]
        self.spaces = gym_spaces(self._envs[0], self.opts)
        self.spec = self._spec(self.spaces)
        self.low = np.asarray(self.spaces.low, np.float32)
        self.high = np.asarray(self.spaces.high, np.float32)
        self.rng = np.random.default_rng(seed)
        self.obs = np.zeros((num_envs, self.spaces.obs_dim), np.float32)
        self.task_names = [self.opts.id] * num_envs  # what evaluation tables call the task
        self.nonfinite_episodes = 0

    @staticmethod
    def _spec(s: Any) -> EnvSpec:
        return EnvSpec(cameras={}, state_dim=s.obs_dim, action_dim=s.action_dim, max_episode_steps=s.max_episode_steps,
                       action_low=min(s.low), action_high=max(s.high), action_choices=s.choices)

    @classmethod
    def spec_for(cls, opts: GymnasiumOptions | None) -> EnvSpec:
        opts = opts or GymnasiumOptions()
        env = make_gymnasium_env(opts)
        try:
            return cls._spec(gym_spaces(env, opts))
        finally:
            env.close()

    def _flat(self, obs: Any) -> np.ndarray:
        from gymnasium import spaces

        return np.asarray(spaces.flatten(self._envs[0].observation_space, obs), np.float32)

    def _reset(self, ids: list[int], seeds: Sequence[int | None] | None) -> None:
        for i, seed in zip(ids, reset_seeds(ids, seeds, self.rng)):
            obs, _info = self._envs[i].reset(seed=seed)
            self.obs[i] = self._flat(obs)

    def _step(self, ids: list[int], actions: np.ndarray) -> StepResult:
        n = len(ids)
        reward = np.zeros(n, np.float32)
        terminated = np.zeros(n, bool)
        truncated = np.zeros(n, bool)
        success = np.zeros(n, bool)
        for j, i in enumerate(ids):
            a = actions[j].reshape(-1)
            if self.spaces.choices:
                act: Any = int(np.clip(np.rint(a[0]) if np.isfinite(a[0]) else 0, 0, self.spaces.choices - 1))
            else:
                act = np.clip(np.nan_to_num(a), self.low, self.high)
            obs, r, term, trunc, info = self._envs[i].step(act)
            flat = self._flat(obs)
            if not (np.isfinite(flat).all() and np.isfinite(r)):
                self.nonfinite_episodes += 1
                log.warning("env_nonfinite_episode_ended", id=self.opts.id, env=i, count=self.nonfinite_episodes)
                flat[:] = 0.0
                r, term, trunc = 0.0, True, False
            self.obs[i] = flat
            reward[j] = r
            terminated[j] = term
            truncated[j] = trunc and not term
            success[j] = bool(info.get("is_success", info.get("success", False)))
        return StepResult(reward=reward, terminated=terminated, truncated=truncated, success=success)

    def observe(self, ids: list[int], into: Observation, rows: Sequence[int]) -> None:
        into.state[np.asarray(rows, np.int64)] = self.obs[ids]
        for r in rows:
            into.instruction[r] = self.opts.id
