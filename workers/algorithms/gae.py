"""Generalized Advantage Estimation (Schulman et al. 2016) for trajectory fragments.

One *step* here is one policy decision: for chunked policies that is one action chunk, its
reward the (caller-chosen) sum of the env rewards over the chunk, and ``gamma`` discounts per
decision. A *fragment* is a run of consecutive decisions of one env.

How the caller tells terminated from truncated (the difference matters: a timeout is not a
failure, so its value must be bootstrapped):

* **terminated** at step t (the task ended, success or failure): ``dones[t] = True``. No value
  is bootstrapped past t. If that is the last step, ``last_value`` is ignored.
* **truncated** (time limit) or simply **cut** (the fragment ends while the episode goes on):
  the fragment must end there, with ``dones[-1] = False`` and ``last_value = V(obs after the
  last step)`` (for a truncation, the value of the final observation the env returned).
* A truncation in the middle of a fragment cannot be expressed: split the fragment there.
* **continued** by the next fragment of the same episode in the same batch: the caller names
  it (``successors``), and the sum runs on into it, as if the two were one fragment. A
  fragment then needs to be no longer than its staleness allows, and its advantages are still
  those of the whole run of fragments the batch holds.
"""

from __future__ import annotations

from typing import Sequence

import torch


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    last_value: float | torch.Tensor,
    gamma: float,
    lam: float,
    last_advantage: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns (both ``[N]``) for one fragment.

    ``rewards``, ``values`` (the behaviour policy's value estimates), ``dones`` (terminated) are
    ``[N]``; ``last_value`` bootstraps after the last step unless ``dones[-1]``. A fragment
    continued by another passes that one's first value and first advantage as ``last_value``
    and ``last_advantage``.
    ``returns = advantages + values`` are the value-head targets (TD(lambda) returns).
    """
    n = int(rewards.shape[0])
    if values.shape[0] != n or dones.shape[0] != n:
        raise ValueError(f"rewards/values/dones lengths differ: {n}, {values.shape[0]}, {dones.shape[0]}")
    # Work in float64 so long fragments do not accumulate rounding; hand back the input dtype.
    r = rewards.detach().to(torch.float64).cpu()
    v = values.detach().to(torch.float64).cpu()
    d = dones.detach().to(torch.bool).cpu()
    boot = float(last_value)

    advantages = torch.zeros(n, dtype=torch.float64)
    next_adv = float(last_advantage)
    for t in reversed(range(n)):
        not_done = 0.0 if bool(d[t]) else 1.0
        next_value = boot if t == n - 1 else float(v[t + 1])
        delta = float(r[t]) + gamma * next_value * not_done - float(v[t])
        next_adv = delta + gamma * lam * not_done * next_adv
        advantages[t] = next_adv

    returns = advantages + v
    dtype = values.dtype if values.is_floating_point() else torch.float32
    return advantages.to(dtype=dtype, device=values.device), returns.to(dtype=dtype, device=values.device)


def compute_gae_batch(
    rewards: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    dones: Sequence[torch.Tensor],
    last_values: Sequence[float] | torch.Tensor,
    gamma: float,
    lam: float,
    successors: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over several fragments, concatenated in the order given (``[sum N_i]`` each).

    Fragments are independent unless ``successors[i]`` names the fragment that continues
    fragment ``i`` (-1: none). Then ``i``'s sum runs on into it: ``last_values[i]`` is unused,
    and ``i`` may not be terminated. Each fragment has at most one predecessor.
    """
    n = len(rewards)
    if not (len(values) == len(dones) == len(last_values) == n):
        raise ValueError("rewards, values, dones and last_values need one entry per fragment")
    succ = list(successors) if successors is not None else [-1] * n
    if len(succ) != n:
        raise ValueError("successors needs one entry per fragment")
    targets = [j for j in succ if j >= 0]
    if len(set(targets)) != len(targets) or any(j >= n or j == i for i, j in enumerate(succ)):
        raise ValueError(f"successors must name distinct other fragments: {succ}")
    advs: list[torch.Tensor | None] = [None] * n
    rets: list[torch.Tensor | None] = [None] * n
    has_pred = set(targets)
    for head in (i for i in range(n) if i not in has_pred):
        chain = [head]
        while succ[chain[-1]] >= 0:
            chain.append(succ[chain[-1]])
            if len(chain) > n:
                raise ValueError(f"successors form a cycle: {succ}")
        for i in reversed(chain):  # a fragment's successor is summed before it
            j = succ[i]
            if j >= 0 and bool(dones[i][-1]):
                raise ValueError(f"fragment {i} is terminated, so nothing continues it")
            lv, la = (values[j][0], advs[j][0]) if j >= 0 else (last_values[i], 0.0)
            advs[i], rets[i] = compute_gae(rewards[i], values[i], dones[i], lv, gamma, lam, float(la))
    if any(a is None for a in advs):
        raise ValueError(f"successors form a cycle: {succ}")
    if not advs:
        return torch.zeros(0), torch.zeros(0)
    return torch.cat(advs), torch.cat(rets)
