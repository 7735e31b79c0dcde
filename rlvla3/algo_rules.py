"""The algorithm settings' validation rules, kept out of ``rlvla3.config`` so it stays small."""

from __future__ import annotations

from typing import Any

from rlvla3.scale_config import ConfigError

RATIO_LEVELS = ("unit", "chunk")


def validate_algo(cfg: Any) -> None:
    """The algorithm's rules (``config.validate`` calls it), each error naming its key."""
    a = cfg.algo
    if a.name not in ("ppo", "grpo"):
        raise ConfigError(f"algo.name: {a.name!r} not in ('ppo', 'grpo')")
    if a.minibatch_size < 1 or a.batch_steps < 1 or a.epochs < 1:
        raise ConfigError("algo.batch_steps, algo.minibatch_size and algo.epochs must be >= 1")
    if a.clip_eps <= 0:
        raise ConfigError(f"algo.clip_eps must be > 0, got {a.clip_eps}")
    if a.ratio_level not in RATIO_LEVELS:
        raise ConfigError(f"algo.ratio_level: {a.ratio_level!r} not in {RATIO_LEVELS}")
    if a.dual_clip != 0 and a.dual_clip <= 1.0:
        raise ConfigError(f"algo.dual_clip must be > 1 (or 0: off), got {a.dual_clip}")
    if a.behav_weight_cap != 0 and a.behav_weight_cap < 1.0:
        # Below 1 it would down-weight even fresh samples, and PPO would no longer be PPO.
        raise ConfigError(f"algo.behav_weight_cap must be >= 1 (or 0: uncapped), got {a.behav_weight_cap}")
    if a.value_clip_eps < 0 or a.max_grad_norm <= 0:
        raise ConfigError("algo.value_clip_eps must be >= 0 and algo.max_grad_norm > 0")
    if a.max_staleness < 0:
        raise ConfigError(f"algo.max_staleness must be >= 0, got {a.max_staleness}")
    if a.grpo_reward not in ("success", "return"):
        raise ConfigError(f"algo.grpo_reward: {a.grpo_reward!r} not in ('success', 'return')")
    if a.name == "grpo" and cfg.env.group_size < 2:
        # A group of one has no variance: nothing would ever be trained on.
        raise ConfigError(f"algo.name=grpo needs env.group_size >= 2 (episodes compared within a group), "
                          f"got {cfg.env.group_size}")
