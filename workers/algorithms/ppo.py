"""Decoupled PPO for asynchronous training, readable top to bottom.

Samples arrive from generators that ran an *older* policy (the behaviour policy, version
``v_behav``). Standard PPO would take the ratio new / behaviour and clip it around 1, which
lets stale data pull the policy as far as the staleness already moved it. Decoupled PPO
(Hilton et al. 2022, as used by AReaL) splits the correction in two:

* ``w = min(pi_prox / pi_behav, cap)`` - an importance weight from the behaviour policy to the
  *proximal* policy (the trainer's weights at the start of this update), detached, capped so
  one very stale sample cannot dominate;
* ``r = pi_new / pi_prox`` - the ratio PPO clips, so the trust region is around the policy we
  are actually stepping from.

    surrogate = w * min(r * A, clip(r, 1 - eps, 1 + eps) * A)
    dual clip (Ye et al. 2020), only where A < 0:  max(surrogate term, c * A)

When the samples are fresh (``prox == behav``), ``w = 1`` and this is exactly standard PPO.
``trust_region="behaviour"`` is that standard PPO on stale samples too (Sample Factory's APPO):
``r = pi_new / pi_behav``, ``w = 1``, so a sample whose actor the policy has already left by more
than the clip gives no gradient, and stale batches cannot keep pushing the same way.
The proximal log-probs are *recomputed* with one forward pass of the policy before the first
optimizer step (:func:`proximal_pass`), never interpolated between versions.

Log-prob tensors are ``[B, L]`` with L the policy's units (``token`` / ``action`` / ``chunk``,
see ``workers.policies.base``). ``ratio_level="unit"`` clips a ratio per unit with the sample's
advantage broadcast to every unit; ``ratio_level="chunk"`` sums the L log-probs first and clips
one ratio per decision.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import numpy as np
import torch
from torch import nn

from rlvla3.config import AlgoConfig
from rlvla3.observation import Observation
from workers.algorithms.distributed import mean_over_ranks


# The settings (clip_eps, dual_clip, behav_weight_cap, epochs, ...) are ``AlgoConfig``'s, read
# directly: one dataclass, one default each, validated by ``rlvla3.config.validate``.


def make_optimizer(params: Iterable[nn.Parameter] | list[dict[str, Any]], cfg: AlgoConfig) -> torch.optim.Optimizer:
    """Adam with eps=1e-5, the usual PPO choice (CleanRL, OpenAI baselines), fused, over the
    parameters that train: ``params`` are parameters, or param groups with their own ``lr``
    (``algo.value_lr``). bf16 parameters (``model.dtype: bfloat16``) get :class:`MasterAdam`: fp32
    master weights and moments, the bf16 copy rewritten after each step."""
    given = list(params)
    if not given or not isinstance(given[0], dict):
        given = [{"params": given}]
    groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in given]
    groups = [g for g in groups if g["params"]]
    if any(p.dtype in (torch.bfloat16, torch.float16) for g in groups for p in g["params"]):
        from workers.algorithms.precision import MasterAdam

        return MasterAdam(groups, lr=cfg.lr, eps=1e-5)
    # fused: one kernel per step for every parameter (CPU and CUDA, torch >= 2.4); a small policy's
    # update otherwise spends a fifth of its time in Adam's per-tensor Python loop.
    return torch.optim.Adam(groups, lr=cfg.lr, eps=1e-5, fused=True)


# ---------------------------------------------------------------------------------------------
# Masked reductions
# ---------------------------------------------------------------------------------------------


def _masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: tuple[int, ...] | None = None) -> torch.Tensor:
    """Mean of ``x`` over entries where ``mask`` is true (0 when nothing is valid); with ``dim``,
    one mean per remaining index (``mask`` broadcast over the leading axes of a stack)."""
    m = mask.to(x.dtype)
    total = (x * m).sum() if dim is None else (x * m).sum(dim=dim)
    return total / m.sum().clamp(min=1.0)


def _unit_and_sample_masks(
    mask: torch.Tensor | None, shape: torch.Size, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mask`` may be ``None``, per sample ``[B]`` or per unit ``[B, L]``; return both views."""
    b, l = shape
    if mask is None:
        unit = torch.ones(b, l, dtype=torch.bool, device=device)
    elif mask.dim() == 1:
        unit = mask.to(device=device, dtype=torch.bool)[:, None].expand(b, l)
    else:
        unit = mask.to(device=device, dtype=torch.bool)
    return unit, unit.any(dim=-1)


# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------

_STAT_NAMES = ("loss", "policy_loss", "value_loss", "entropy", "clip_frac", "dual_clip_frac", "approx_kl",
               "approx_kl_behav", "ratio_mean", "behav_weight_mean", "behav_weight_capped_frac")
"""What :func:`ppo_loss` reports per minibatch, in the order it computes them."""


def ppo_loss(
    new_logprob: torch.Tensor,
    prox_logprob: torch.Tensor,
    behav_logprob: torch.Tensor,
    advantages: torch.Tensor,
    new_value: torch.Tensor | None,
    old_value: torch.Tensor | None,
    returns: torch.Tensor | None,
    entropy: torch.Tensor | None,
    cfg: AlgoConfig,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO loss for one minibatch and its diagnostics.

    Shapes: log-probs ``[B, L]``; advantages, values, returns ``[B]``; entropy ``[B, L]`` or
    ``[B]``; mask ``[B]`` or ``[B, L]`` (true = counts). The value term is skipped when
    ``cfg.vf_coef == 0`` or ``returns`` is None (GRPO: no critic). Policy terms average over
    valid units. ``dual_clip``, ``value_clip_eps`` and ``behav_weight_cap`` of 0 are off.
    """
    unit_mask, sample_mask = _unit_and_sample_masks(mask, new_logprob.shape, new_logprob.device)
    # Ratios of bf16 log-probs are too coarse to clip at 1 +- 0.2: compute in at least float32.
    dtype = torch.promote_types(new_logprob.dtype, torch.float32)
    new_logprob, prox_logprob, behav_logprob = (x.to(dtype) for x in (new_logprob, prox_logprob, behav_logprob))
    if new_value is not None:
        new_value = new_value.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=new_logprob.device)

    # ---- Units of the ratio: per token/action, or one per chunk ---------------------------
    # Padded units may hold garbage (even -inf); `where` keeps it out of sums and gradients.
    new = torch.where(unit_mask, new_logprob, zero)
    prox = torch.where(unit_mask, prox_logprob.detach(), zero)
    behav = torch.where(unit_mask, behav_logprob.detach(), zero)
    if cfg.ratio_level == "chunk":
        new, prox, behav = (x.sum(dim=-1, keepdim=True) for x in (new, prox, behav))
        pg_mask = sample_mask[:, None]
    else:
        pg_mask = unit_mask
    adv = advantages.detach().to(new.dtype)[:, None].expand_as(new)

    # ---- Behaviour -> proximal importance weight (detached, capped) ------------------------
    proximal = cfg.trust_region != "behaviour"  # behaviour: APPO, the clip around the actor
    centre = prox if proximal else behav
    log_w = _behaviour_log_weight(prox - behav, cfg)
    w = torch.exp(log_w)

    # ---- Centre -> current ratio, clipped surrogate, dual clip -----------------------------
    # Clamp the log-ratio so exp() stays finite; beyond e^20 the sample is clipped anyway.
    log_r = (new - centre).clamp(max=20.0)
    r = torch.exp(log_r)
    surr_unclipped = r * adv
    surr_clipped = r.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps) * adv
    objective = torch.minimum(surr_unclipped, surr_clipped)
    dual_active = torch.zeros_like(pg_mask)
    if cfg.dual_clip:
        lower = cfg.dual_clip * adv
        dual_active = (adv < 0) & (objective < lower)
        objective = torch.where(adv < 0, torch.maximum(objective, lower), objective)
    policy_loss = _masked_mean(-(w * objective), pg_mask)

    # ---- Value loss: max of unclipped and clipped squared error ----------------------------
    use_value = cfg.vf_coef != 0 and returns is not None and new_value is not None
    if use_value:
        ret = returns.detach().to(new_value.dtype)
        err_unclipped = (new_value - ret) ** 2
        if cfg.value_clip_eps and old_value is not None:
            old = old_value.detach().to(new_value.dtype)
            v_clipped = old + (new_value - old).clamp(-cfg.value_clip_eps, cfg.value_clip_eps)
            err = torch.maximum(err_unclipped, (v_clipped - ret) ** 2)
        else:
            err = err_unclipped
        value_loss = 0.5 * _masked_mean(err, sample_mask)
    else:
        value_loss = zero

    # ---- Entropy bonus ---------------------------------------------------------------------
    if entropy is None:
        entropy_mean = zero
    elif entropy.dim() == 2:
        entropy_mean = _masked_mean(entropy, unit_mask)
    else:
        entropy_mean = _masked_mean(entropy, sample_mask)

    loss = policy_loss
    if use_value:
        loss = loss + cfg.vf_coef * value_loss
    if cfg.ent_coef:  # a term times 0 would still cost its backward pass
        loss = loss - cfg.ent_coef * entropy_mean

    # ---- Diagnostics: one stacked masked mean, one read-out --------------------------------
    with torch.no_grad():
        ratio_d = r.detach()
        log_rb = (new - behav).clamp(max=20.0)
        rows = [
            ((ratio_d - 1.0).abs() > cfg.clip_eps).to(dtype),  # clip_frac
            dual_active.to(dtype),  # dual_clip_frac
            # k3 estimator of KL(centre || new), the centre being prox or behav (trust_region):
            # unbiased, always >= 0 (Schulman's blog note).
            (ratio_d - 1.0) - log_r.detach(),  # approx_kl
            torch.expm1(log_rb) - log_rb,  # approx_kl_behav: KL(behav || new), what algo.target_kl reads
            ratio_d,  # ratio_mean
            w.detach(),  # behav_weight_mean
            ((prox - behav > log_w) & proximal).to(dtype),  # behav_weight_capped_frac
        ]
        means = _masked_mean(torch.stack(rows), pg_mask, dim=(1, 2))
        scalars = torch.stack([loss.detach().to(dtype), policy_loss.detach(), value_loss.detach().to(dtype),
                               entropy_mean.detach().to(dtype), *means]).tolist()
        stats = dict(zip(_STAT_NAMES, scalars))
    return loss, stats


# ---------------------------------------------------------------------------------------------
# Batches: a dict of per-sample tensors plus the obs dict
# ---------------------------------------------------------------------------------------------
#
#   batch = {
#       "obs": an rlvla3.observation.Observation of N rows,
#       "actions": [N,T,A], "replay": {name: [N,...]},
#       "behav_logprob": [N,L], "prox_logprob": [N,L] (optional: recomputed when absent),
#       "advantages": [N], "returns": [N], "values": [N] (the critic's at the update's start; returns/values
#       optional when vf_coef == 0), "mask": [N] or [N,L] (optional),
#   }


def _take(x: Any, idx: torch.Tensor) -> Any:
    """Index the leading (sample) axis of tensors, arrays and lists, recursing into dicts."""
    if isinstance(x, Observation):
        return x.select(idx.cpu().numpy())
    if isinstance(x, dict):
        return {k: _take(v, idx) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x[idx.to(x.device)]
    if isinstance(x, np.ndarray):
        return x[idx.cpu().numpy()]
    if isinstance(x, (list, tuple)):
        return [x[i] for i in idx.tolist()]
    return x  # scalars and None are shared by every sample


def index_batch(batch: dict[str, Any], idx: torch.Tensor) -> dict[str, Any]:
    """The minibatch of samples ``idx`` (a LongTensor) out of a batch dict."""
    return _take(batch, idx)


def _batch_len(batch: dict[str, Any]) -> int:
    return int(batch["behav_logprob"].shape[0])


def _to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, dict):
        return {k: _to_device(v, device) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return x


# ---------------------------------------------------------------------------------------------
# Proximal log-probs: the policy as it is at the start of the update
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def proximal_pass(
    policy: nn.Module, batch: dict[str, Any], chunk: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, L]`` log-probs of the batch's actions and ``[N]`` values under the current weights,
    ``chunk`` samples a pass.

    Call before the first optimizer step of the update. The policy's train/eval mode is left as
    it is: evaluate in the same mode the loss will, or the ratio starts away from 1.
    """
    device = next(policy.parameters()).device
    n = _batch_len(batch)
    logprobs, values = [], []
    for start in range(0, n, chunk):
        idx = torch.arange(start, min(start + chunk, n))
        mb = index_batch({k: batch[k] for k in ("obs", "actions", "replay")}, idx)
        out = policy.evaluate(mb["obs"], _to_device(mb["actions"], device), _to_device(mb["replay"], device))
        logprobs.append(out.logprob.detach().float())
        values.append(out.value.detach().float().reshape(-1))
    at = batch["behav_logprob"].device
    return torch.cat(logprobs).to(at), torch.cat(values).to(at)


# ---------------------------------------------------------------------------------------------
# The update: epochs x minibatches
# ---------------------------------------------------------------------------------------------


def ppo_update(
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, Any],
    cfg: AlgoConfig,
    after_epoch: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """One PPO update on ``batch``; returns stats averaged over the optimizer steps.
    ``after_epoch(e)`` runs after every epoch ``e`` but the last (``weights.in_flight``).

    ``policy`` may be a DDP wrapper that exposes ``evaluate`` (see ``distributed.wrap_ddp``);
    every rank must then run the same number of minibatches (equal local batch sizes).
    Advantages are standardized over the valid samples of the batch (``algo.adv_norm``: as acted,
    or weighted into the proximal policy's batch), except for GRPO, whose advantages are already
    standardized within groups.
    """
    device = next(policy.parameters()).device
    params = [p for group in optimizer.param_groups for p in group["params"]]
    n = _batch_len(batch)
    if n == 0:
        raise ValueError("ppo_update got an empty batch")

    # ---- Phase 1: proximal log-probs, recomputed before any weight changes ------------------
    if batch.get("prox_logprob") is None:
        batch = {**batch, "prox_logprob": proximal_pass(policy, batch, cfg.minibatch_size)[0]}

    # ---- Phase 2: advantage normalization over the valid samples of the whole batch -------
    advantages = batch["advantages"].float()
    sample_valid = torch.ones(n, dtype=torch.bool, device=advantages.device)
    if batch.get("mask") is not None:
        m = batch["mask"].to(advantages.device).bool()
        sample_valid = m if m.dim() == 1 else m.any(dim=-1)
    if cfg.name != "grpo" and int(sample_valid.sum()) > 1:
        valid = advantages[sample_valid]
        if cfg.adv_norm == "proximal":  # normalised in log space: long decisions' ratios underflow
            weight = torch.softmax(_proximal_log_weights(batch, cfg).to(advantages.device)[sample_valid], 0)
            mean = (weight * valid).sum()
            std = (weight * (valid - mean) ** 2).sum().sqrt()
        else:
            mean, std = valid.mean(), valid.std(unbiased=False)
        advantages = (advantages - mean) / (std + 1e-8)
    batch = {**batch, "advantages": advantages}

    # ---- Phase 3: epochs x minibatches of clipped updates -----------------------------------
    # The per-sample tensors go to the policy's device once; each minibatch indexes them there.
    # Minibatches differ by at most one sample: a ragged last one (517 = 4 x 128 + 5) would get a
    # whole optimizer step from a few samples whose advantages, standardized over the batch, need
    # not average zero (async batches overshoot batch_steps by part of a fragment).
    tensors = _to_device({k: v for k, v in batch.items() if k not in ("obs", "fresh")}, device)
    totals: dict[str, float] = {}
    steps = epochs_run = 0
    minibatches = math.ceil(n / cfg.minibatch_size)
    for epoch in range(cfg.epochs):
        if epoch > 0 and after_epoch is not None:
            after_epoch(epoch - 1)
        epoch_kl = 0.0
        for idx in torch.tensor_split(torch.randperm(n), minibatches):
            mbd = index_batch(tensors, idx.to(device))
            out = policy.evaluate(batch["obs"].select(idx.numpy()), mbd["actions"], mbd["replay"])
            loss, stats = ppo_loss(
                out.logprob,
                mbd["prox_logprob"],
                mbd["behav_logprob"],
                mbd["advantages"],
                out.value,
                mbd.get("values"),
                mbd.get("returns"),
                out.entropy,
                cfg,
                mask=mbd.get("mask"),
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
            optimizer.step()
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
            steps += 1
            epoch_kl += stats["approx_kl_behav"]
        epochs_run += 1
        if cfg.target_kl and mean_over_ranks(epoch_kl / minibatches, device) > cfg.target_kl:
            break  # the policy has moved far enough from its actor for one update

    # ---- Phase 4: diagnostics over the whole batch ------------------------------------------
    result = {k: v / steps for k, v in totals.items()}
    result["optimizer_steps"] = float(steps)
    result["epochs_run"] = float(epochs_run)
    if batch.get("returns") is not None and batch.get("values") is not None:
        result["explained_variance"] = explained_variance(batch["values"][sample_valid], batch["returns"][sample_valid])
    result.update(logprob_gap(batch["behav_logprob"], batch["prox_logprob"], batch.get("mask"), batch.get("fresh")))
    return result


def _behaviour_log_weight(log_ratio: torch.Tensor, cfg: AlgoConfig) -> torch.Tensor:
    """Decoupled PPO's behaviour -> proximal weight, in log space: ``log pi_prox - log pi_behav``
    capped at ``log(behav_weight_cap)`` (0: uncapped), or 0 (a weight of 1) under
    ``trust_region: behaviour``, which clips around the actor and needs no second correction.
    The loss weighs each ratio unit by it; ``adv_norm: proximal`` weighs each decision."""
    if cfg.trust_region == "behaviour":
        return torch.zeros_like(log_ratio)
    return log_ratio.clamp(max=math.log(cfg.behav_weight_cap)) if cfg.behav_weight_cap else log_ratio


def _proximal_log_weights(batch: dict[str, Any], cfg: AlgoConfig) -> torch.Tensor:
    """``[N]`` each decision's log behaviour -> proximal weight (its units' log-ratios summed):
    what reweights the batch as acted into a batch of the policy the update starts from."""
    behav = batch["behav_logprob"].float()
    behav = behav.reshape(len(behav), -1)
    prox = batch["prox_logprob"].float().reshape(len(behav), -1).to(behav.device)
    unit, _ = _unit_and_sample_masks(batch.get("mask"), behav.shape, behav.device)
    return _behaviour_log_weight(torch.where(unit, prox - behav, torch.zeros_like(behav)).sum(-1), cfg)


def logprob_gap(behav: torch.Tensor, prox: torch.Tensor, mask: torch.Tensor | None,
                fresh: torch.Tensor | None) -> dict[str, float]:
    """Training-inference mismatch: mean |generator log-prob - trainer's recomputed log-prob| over
    the valid units. On ``fresh`` samples (acted with the weights the trainer holds now) the gap is
    numerics alone: bf16 kernels, batch shapes, the generator's own fused paths - the mismatch
    the async RL literature watches. ``logprob_gap`` (all samples) adds the policy's drift."""
    b, p = behav.float().reshape(len(behav), -1), prox.float().reshape(len(prox), -1).to(behav.device)
    unit, _ = _unit_and_sample_masks(mask, b.shape, b.device)
    unit = unit & torch.isfinite(b) & torch.isfinite(p)
    diff = torch.where(unit, (b - p).abs(), torch.zeros_like(b))
    out = {"logprob_gap": float(_masked_mean(diff, unit))}
    if fresh is not None:
        f = unit & fresh.to(device=b.device, dtype=torch.bool)[:, None]
        out["logprob_gap_fresh"] = float(_masked_mean(diff, f)) if bool(f.any()) else float("nan")
        out["logprob_gap_fresh_max"] = float(diff[f].max()) if bool(f.any()) else float("nan")
    return out


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns): 1 is a perfect value head, <= 0 is useless."""
    var_r = float(returns.float().var(unbiased=False)) if returns.numel() > 0 else 0.0
    if var_r == 0.0 or math.isnan(var_r):
        return float("nan")
    return 1.0 - float((returns.float() - values.float()).var(unbiased=False)) / var_r
