"""GRPO: group-relative advantages over episodes that share a task and an initial state.

A *group* is ``group_size`` episodes the simulators started from the same task and seed /
init state. Each episode's advantage is its return standardized within its group, so the
critic is replaced by the group's own average:

    A_e = (R_e - mean_g(R)) / (std_g(R) + eps)

``std`` is the sample standard deviation (Bessel-corrected, as in DeepSeekMath / verl). A group
whose returns are all equal (all succeed or all fail) carries no learning signal: its episodes
are masked out and counted in ``groups_filtered_zero_variance``.

Incomplete groups are the caller's business: the trainer should hold an episode until the other
``group_size - 1`` episodes of its group have arrived (or drop the group when a member is
dropped for staleness) and pass only complete groups here. A group that still arrives here with
a single episode has no variance and is filtered.

The loss is the PPO clipped surrogate without a value term: :func:`grpo_loss` calls
``ppo_loss`` with ``vf_coef = 0``, after :func:`broadcast_episode_advantages` gives every
decision step of an episode that episode's advantage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from workers.algorithms.ppo import PPOConfig, ppo_loss


@dataclass
class GRPOConfig:
    """Hyper-parameters of GRPO (advantages and the clipped update)."""

    group_size: int = 8
    """Episodes per group (same task, same initial state)."""
    std_eps: float = 1e-6
    """Added to the group std in the advantage's denominator."""
    zero_variance_tol: float = 1e-8
    """A group whose return std is at or below this is filtered as having no signal."""
    scale_by_std: bool = True
    """Divide by the group std (False: mean-centred only, as Dr. GRPO suggests)."""
    clip_eps: float = 0.2
    """Half-width of the trust region on the proximal -> current ratio."""
    dual_clip: float | None = 3.0
    """Dual-clip constant c > 1 for negative advantages (None = off)."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip before each optimizer step."""
    epochs: int = 1
    """Passes over the batch per update."""
    minibatch_size: int = 64
    """Decision steps per optimizer step."""
    ratio_level: str = "unit"
    """"unit" (per token/action) or "chunk" (sum log-probs over L), as in PPOConfig."""
    behav_weight_cap: float | None = 5.0
    """Cap on the behaviour -> proximal importance weight (decoupled PPO)."""
    lr: float = 1e-5
    """Learning rate."""

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2, got {self.group_size}")

    def to_ppo(self) -> PPOConfig:
        """The PPOConfig that runs this GRPO update through ``ppo_update`` (no value term)."""
        shared = {f.name for f in dataclasses.fields(PPOConfig)} & {f.name for f in dataclasses.fields(self)}
        return PPOConfig(
            **{k: getattr(self, k) for k in shared},
            vf_coef=0.0,
            value_clip_eps=None,
            normalize_advantages=False,  # already standardized within groups
        )


def grpo_advantages(
    returns: torch.Tensor, group_ids: torch.Tensor, cfg: GRPOConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """Per-episode advantages ``[E]``, a keep mask ``[E]`` and group counts.

    ``returns[e]`` is episode e's return, ``group_ids[e]`` its group (any integers). Filtered
    episodes get advantage 0 and ``keep = False``.
    """
    cfg = cfg or GRPOConfig()
    if returns.shape != group_ids.shape or returns.dim() != 1:
        raise ValueError(f"returns {tuple(returns.shape)} and group_ids {tuple(group_ids.shape)} must both be [E]")
    r = returns.detach().to(torch.float64)
    advantages = torch.zeros_like(r)
    keep = torch.zeros(r.shape, dtype=torch.bool, device=r.device)

    groups = torch.unique(group_ids)
    filtered = 0
    for g in groups.tolist():
        members = group_ids == g
        rg = r[members]
        std = float(rg.std(unbiased=True)) if rg.numel() > 1 else 0.0
        if rg.numel() < 2 or std <= cfg.zero_variance_tol:
            filtered += 1
            continue
        centred = rg - rg.mean()
        advantages[members] = centred / (std + cfg.std_eps) if cfg.scale_by_std else centred
        keep[members] = True

    stats = {
        "groups": int(groups.numel()),
        "groups_filtered_zero_variance": filtered,
        "episodes_kept": int(keep.sum()),
    }
    dtype = returns.dtype if returns.is_floating_point() else torch.float32
    return advantages.to(dtype), keep, stats


def broadcast_episode_advantages(episode_advantages: torch.Tensor, episode_index: torch.Tensor) -> torch.Tensor:
    """Advantage ``[N]`` of each decision step, given the episode ``[N]`` each step belongs to."""
    return episode_advantages[episode_index.long()]


def grpo_loss(
    new_logprob: torch.Tensor,
    prox_logprob: torch.Tensor,
    behav_logprob: torch.Tensor,
    advantages: torch.Tensor,
    entropy: torch.Tensor | None,
    cfg: GRPOConfig,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The decoupled clipped surrogate (+ entropy bonus) on per-step broadcast advantages."""
    return ppo_loss(
        new_logprob, prox_logprob, behav_logprob, advantages, None, None, None, entropy, cfg.to_ppo(), mask
    )
