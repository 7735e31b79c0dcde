"""What the robosuite-based adapters (LIBERO on robosuite 1.4, RoboCasa on 1.5) share."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Sequence

import numpy as np

from rlvla3.observation import Observation
from workers.envs.base import SimEnv, StepResult, episode_ends


class RobosuiteAdapter(SimEnv):
    """One robosuite env per index in ``_envs``: stepping is the same for all of them.

    A subclass sets ``opts`` (with ``terminate_on_success``, ``max_episode_steps`` and
    ``cameras``), ``_envs``, the step counters ``_t`` and each env's last raw observation dict
    ``_last``, and says how its envs report success, name their state and instruction.
    """

    opts: Any
    _envs: list[Any]
    _t: np.ndarray
    _last: list[dict[str, Any]]

    @staticmethod
    @abstractmethod
    def _success(env: Any) -> bool:
        """Whether ``env``'s task is solved in its current state."""

    @abstractmethod
    def _state(self, raw: dict[str, Any]) -> np.ndarray:
        """The flat state of one env from its raw observation dict."""

    @abstractmethod
    def _instruction(self, i: int) -> str:
        """Env ``i``'s task instruction."""

    @abstractmethod
    def _image_key(self, camera: str) -> str:
        """The raw observation key of a camera's image."""

    def observe(self, ids: list[int], into: Observation, rows: Sequence[int]) -> None:
        for i, row in zip(ids, rows):
            raw = self._last[i]
            into.state[row] = self._state(raw)
            for c in self.opts.cameras:
                # robosuite hands over a fresh image in OpenGL row order (bottom row first):
                # one copy, written upright straight into the caller's row
                np.copyto(into.images[c][row], raw[self._image_key(c)][::-1])
            into.instruction[row] = self._instruction(i)

    def _scale_action(self, a: np.ndarray) -> np.ndarray:
        """Map clipped [-1, 1] actions to what the env takes (the same, unless overridden)."""
        return a

    def _step(self, ids: list[int], actions: np.ndarray) -> StepResult:
        a = self._scale_action(np.clip(actions, -1.0, 1.0))
        n = len(ids)
        reward, success = np.zeros(n, np.float32), np.zeros(n, bool)
        for k, i in enumerate(ids):
            self._last[i], r, _, _ = self._envs[i].step(a[k])
            reward[k] = r
            success[k] = bool(self._success(self._envs[i]))
        self._t[ids] += 1
        terminated, truncated = episode_ends(self._t[ids], success, self.opts.terminate_on_success,
                                             self.opts.max_episode_steps)
        return StepResult(reward, terminated, truncated, success)
