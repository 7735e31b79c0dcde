"""The rewards PPO trains on, decided in one place: raw env rewards, optionally divided by a
running std of each env's discounted return (``algo.reward_norm``), times ``algo.reward_scale``,
clipped to ``+-algo.reward_clip``.

The normaliser follows Gymnasium's NormalizeReward (what CleanRL's continuous-control PPO
uses): per env a discounted return ``G = gamma * G + r``, reset when an episode ends; every
``G`` goes into a running variance, and each reward is divided by the std as it stands when that
reward arrives. Fragments of one env reach the trainer in order, so the trainer can keep ``G``
per env exactly as an env wrapper would. Episode returns reported anywhere stay raw.

The running moments are checkpointed (:meth:`ReturnNormalizer.moments`), so a resumed trainer
divides by the std it had, not by 1. The per-env ``G`` is not: after a resume each env's ``G``
starts again at 0, as it does at an episode's start.
"""

from __future__ import annotations

import numpy as np

from rlvla3.config import AlgoConfig

EPS = 1e-8


class ReturnNormalizer:
    """Per-env discounted returns and the running variance of all of them."""

    def __init__(self, gamma: float) -> None:
        self.gamma = float(gamma)
        self.returns: dict[object, float] = {}
        self.mean, self.var, self.count = 0.0, 1.0, 1e-4

    def moments(self) -> dict[str, float]:
        """What a checkpoint keeps (``state.json``'s ``reward_norm``)."""
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def restore(self, saved: dict[str, float]) -> None:
        self.mean, self.var, self.count = float(saved["mean"]), float(saved["var"]), float(saved["count"])

    def _fold(self, g: float) -> None:
        self.count += 1.0
        delta = g - self.mean
        self.mean += delta / self.count
        # Welford's update of the population variance with one sample.
        self.var += (delta * (g - self.mean) - self.var) / self.count

    def __call__(self, env: object, rewards: np.ndarray, ended: bool) -> np.ndarray:
        """``rewards`` of one env's consecutive decisions, divided as they arrive; ``ended``:
        the fragment's last decision ends the episode."""
        g = self.returns.get(env, 0.0)
        out = np.empty(len(rewards), np.float64)
        for t, r in enumerate(rewards.astype(np.float64)):
            g = g * self.gamma + r
            self._fold(g)
            out[t] = r / np.sqrt(self.var + EPS)
        if ended:
            self.returns.pop(env, None)
        else:
            self.returns[env] = g
        return out.astype(np.float32)


def training_rewards(algo: AlgoConfig, normalizer: ReturnNormalizer | None, env: object, rewards: np.ndarray,
                     ended: bool) -> np.ndarray:
    """The rewards GAE sees for one fragment of ``env`` (see the module docstring)."""
    r = normalizer(env, rewards, ended) if normalizer is not None else rewards.astype(np.float32)
    r = r * np.float32(algo.reward_scale)
    if algo.reward_clip > 0:
        r = np.clip(r, -algo.reward_clip, algo.reward_clip)
    return r.astype(np.float32)
