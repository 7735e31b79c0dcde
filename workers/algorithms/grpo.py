"""GRPO: group-relative advantages over episodes that share a task and an initial state.

A *group* is ``group_size`` episodes the simulators started from the same task and seed /
init state. Each episode's advantage is its return standardized within its group, so the
critic is replaced by the group's own average:

    A_e = (R_e - mean_g(R)) / (std_g(R) + eps)

``std`` is the sample standard deviation (Bessel-corrected, as in DeepSeekMath / verl). A group
whose returns are all equal (all succeed or all fail) carries no learning signal: its episodes
are masked out and counted in ``groups_filtered_zero_variance``.

Incomplete groups are the caller's business: the learner (``workers.learner``) holds an
episode until the other ``group_size - 1`` episodes of its group have arrived (or drops the
group when a member is too stale) and passes only complete groups here. A group that still arrives here with
a single episode has no variance and is filtered.

The loss is PPO's decoupled clipped surrogate without a value term: the update
(``workers.algorithms.update``) runs ``ppo_update`` with no returns and no advantage
re-normalization, after :func:`broadcast_episode_advantages` gave every decision step of an
episode that episode's advantage (the learner does that when a group completes).
"""

from __future__ import annotations

import torch

STD_EPS = 1e-6
"""Added to the group std in the advantage's denominator."""
ZERO_VARIANCE_TOL = 1e-8
"""A group whose return std is at or below this is filtered as having no signal."""


def grpo_advantages(
    returns: torch.Tensor, group_ids: torch.Tensor, scale_by_std: bool = True, std_eps: float = STD_EPS
) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """Per-episode advantages ``[E]``, a keep mask ``[E]`` and group counts.

    ``returns[e]`` is episode e's return, ``group_ids[e]`` its group (any integers). Filtered
    episodes get advantage 0 and ``keep = False``. ``scale_by_std=False`` only centres (Dr. GRPO).
    """
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
        if rg.numel() < 2 or std <= ZERO_VARIANCE_TOL:
            filtered += 1
            continue
        centred = rg - rg.mean()
        advantages[members] = centred / (std + std_eps) if scale_by_std else centred
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
