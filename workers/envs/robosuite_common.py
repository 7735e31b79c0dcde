"""What the robosuite-based adapters (LIBERO on robosuite 1.4, RoboCasa on 1.5) share."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Sequence

import numpy as np

from rlvla3.observation import Observation
from workers.envs.base import EnvAdapter, StepResult, episode_ends


class RobosuiteAdapter(EnvAdapter):
    """One robosuite env per index in ``_envs``: stepping is the same for all of them.

    A subclass sets ``opts`` (with ``terminate_on_success`` and ``max_episode_steps``), ``_envs``
    and the step counters ``_t``, and says how its envs report success and build observations.
    """

    opts: Any
    _envs: list[Any]
    _t: np.ndarray

    @staticmethod
    @abstractmethod
    def _success(env: Any) -> bool:
        """Whether ``env``'s task is solved in its current state."""

    @abstractmethod
    def _obs(self, ids: list[int], raws: list[dict[str, Any]]) -> Observation:
        """The batch for ``ids`` from robosuite's raw observation dicts."""

    def _scale_action(self, a: np.ndarray) -> np.ndarray:
        """Map clipped [-1, 1] actions to what the env takes (the same, unless overridden)."""
        return a

    def step(self, ids: Sequence[int], actions: np.ndarray) -> StepResult:
        ids = [int(i) for i in ids]
        a = self._scale_action(np.clip(np.asarray(actions, np.float32), -1.0, 1.0))
        n = len(ids)
        reward, success, raws = np.zeros(n, np.float32), np.zeros(n, bool), []
        for k, i in enumerate(ids):
            raw, r, _, _ = self._envs[i].step(a[k])
            reward[k] = r
            success[k] = bool(self._success(self._envs[i]))
            raws.append(raw)
        self._t[ids] += 1
        terminated, truncated = episode_ends(self._t[ids], success, self.opts.terminate_on_success,
                                             self.opts.max_episode_steps)
        return StepResult(self._obs(ids, raws), reward, terminated, truncated, success)
