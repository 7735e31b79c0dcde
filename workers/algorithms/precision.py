"""Adam for bf16 parameters: an fp32 master copy of each parameter, fp32 moments.

The choice (over bf16 parameters with fp32 moments only): an Adam step is often smaller than
bf16's resolution near a weight (8 bits of mantissa), so updates applied to bf16 weights are
rounded away and training stalls; the fp32 master accumulates them, and the bf16 parameter the
forward pass reads is the master rounded once per step. Cost per trainable parameter: 2 (bf16) +
4 (master) + 8 (moments) bytes, against 16 for fp32 training. Frozen parameters (LoRA's base)
get nothing: only what trains is handed to the optimizer.

The master and the moments live in the optimizer's ``state``, so ``state_dict`` /
``load_state_dict`` (checkpoints, resume) work as for torch's Adam.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn


class MasterAdam(torch.optim.Optimizer):
    """Adam (torch's defaults and maths, no weight decay) stepping an fp32 master of each
    parameter and writing it back in the parameter's dtype. Gradients are read in fp32."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("MasterAdam takes no closure")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["master"] = p.detach().to(torch.float32, copy=True)
                    st["exp_avg"] = torch.zeros_like(st["master"])
                    st["exp_avg_sq"] = torch.zeros_like(st["master"])
                g = p.grad.to(torch.float32)
                st["step"] += 1
                t = st["step"]
                st["exp_avg"].lerp_(g, 1 - beta1)
                st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                bias1, bias2 = 1 - beta1 ** t, 1 - beta2 ** t
                denom = (st["exp_avg_sq"].sqrt() / bias2 ** 0.5).add_(group["eps"])
                st["master"].addcdiv_(st["exp_avg"], denom, value=-group["lr"] / bias1)
                p.copy_(st["master"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader casts every floating state tensor to its parameter's dtype (bf16 here):
        put the fp32 master and moments back as saved."""
        super().load_state_dict(state_dict)
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            for pid, p in zip(saved["params"], group["params"]):
                for key, value in state_dict["state"].get(pid, {}).items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        self.state[p][key] = value.to(device=p.device, dtype=torch.float32)
