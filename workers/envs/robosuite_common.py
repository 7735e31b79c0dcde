"""What the robosuite-based adapters (LIBERO on robosuite 1.4, RoboCasa on 1.5) share."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np


def step_envs(envs: Sequence[Any], ids: Sequence[int], actions: np.ndarray,
              success_of: Callable[[Any], bool]) -> tuple[np.ndarray, np.ndarray, list[dict[str, Any]]]:
    """One robosuite step in each env of ``ids``: rewards [n], successes [n] and raw observations."""
    n = len(ids)
    reward, success, raws = np.zeros(n, np.float32), np.zeros(n, bool), []
    for k, i in enumerate(ids):
        raw, r, _, _ = envs[i].step(actions[k])
        reward[k] = r
        success[k] = bool(success_of(envs[i]))
        raws.append(raw)
    return reward, success, raws


def episode_ends(t: np.ndarray, success: np.ndarray, terminate_on_success: bool,
                 max_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(terminated, truncated): success ends an episode if asked; the time limit truncates the rest."""
    terminated = success.copy() if terminate_on_success else np.zeros(len(success), bool)
    return terminated, (t >= max_steps) & ~terminated
