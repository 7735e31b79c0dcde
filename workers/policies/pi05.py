"""pi0.5 composed from transformers' PaliGemma and Gemma, with the pi0.5 differences from pi0.

* the proprio state enters the prefix as text (each dimension discretised into 256 bins), so the
  action expert sees only noisy actions - no state token;
* time conditions the action expert through adaptive RMSNorm: every expert norm reads a scale, a
  shift and a gate off the time MLP's output, and the gates scale both residual branches of
  every expert layer (openpi's ``Gemma`` with ``adarms``), instead of time joining the action tokens;
* the critic reads the VLM output (masked mean over the prefix), as in piRL for pi0.5, or with
  ``critic: expert`` the expert's output at one projected state token that sees the prefix and
  itself (pi0's critic, conditioned at t = 1): on Meta-World from pixels a small lift over the
  VLM's (docs/architecture.md, "Pixels to success").

Each expert layer attends to its VLM layer's cached keys/values (joint attention, pi0's layout):
the prefix is bidirectional, the action tokens see the prefix and each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rlvla3.observation import Observation
from workers.contract import EnvSpec
from workers.policies.base import Policy, register_policy
from workers.policies.flow_sampler import FlowOptions, FlowPolicy, FlowSampler
from workers.policies.paligemma import IMAGE_MEAN, IMAGE_STD
from workers.policies.paligemma import SIZES as PI0_SIZES
from workers.policies.stats_norm import StatsNorm
from workers.policies.vla_common import (
    VLAOptions,
    ValueHead,
    char_tokenizer,
    discretize_state,
    encode_text,
    freeze,
    freeze_query_path,
    masked_mean,
    pick_cameras,
    place,
    preprocess_images,
    seeded_init,
    sinusoid,
    size_preset,
    state_tensor,
)

# pi0's backbone and expert dimensions; "tiny" is pi0's tiny_release, whose head layout LeRobot's
# pi0.5 config (the family's export format) can describe.
SIZES = {**PI0_SIZES, "tiny": PI0_SIZES["tiny_release"]}
CRITICS = ("vlm", "expert")
INIT_STD = 0.02
"""transformers' ``initializer_range``, with which its PI05 model inits every linear layer."""


def init_as_transformers(*layers: nn.Linear) -> None:
    """Weights from normal(0, 0.02), zero bias, as transformers inits pi0.5, for the layers this
    module adds (adaRMS dense layers, action-side projections). torch's default (uniform,
    +-1/sqrt(fan_in)) for the projections gave warm starts whose PPO gained +0.14 on Meta-World
    from pixels; this init, +0.38 sync and +0.41 async over three seeds (docs/architecture.md,
    "Pixels to success")."""
    for layer in layers:
        nn.init.normal_(layer.weight, std=INIT_STD)
        nn.init.zeros_(layer.bias)


@dataclass
class Pi05Options(VLAOptions, FlowOptions):
    """Options of the pi0.5 family."""

    max_text_len: int = 96
    """Prompt tokens kept; the prompt carries the discretised state, hence longer than pi0's."""
    state_bins: int = 256
    """Bins per state dimension in the text prefix."""
    critic: str = "vlm"
    """Where the value is read: ``vlm`` (mean of the VLM's prefix output) or ``expert`` (a state token)."""

    def __post_init__(self) -> None:
        if self.critic not in CRITICS:
            raise ValueError(f"pi05: critic {self.critic!r} not in {CRITICS}")


class _Cond:
    """The time conditioning the adaptive norms read during one expert pass."""

    value: torch.Tensor | None = None


class AdaRMSNorm(nn.Module):
    """RMSNorm whose scale, shift and gate come from the time conditioning (``dense``: cond -> 3 x width).

    ``modulate`` returns the normalised input and the gate its residual branch is scaled by;
    ``forward`` (the expert's final norm, whose gate nothing reads) returns the input only.
    """

    def __init__(self, hidden: int, cond_dim: int, cond: _Cond, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.cond = cond
        self.dense = nn.Linear(cond_dim, 3 * hidden)
        init_as_transformers(self.dense)

    def modulate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cond.value
        assert c is not None, "AdaRMSNorm used outside a conditioned expert pass"
        normed = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        scale, shift, gate = self.dense(c.to(self.dense.weight.dtype))[:, None].chunk(3, dim=-1)
        return (normed * (1 + scale.float()) + shift.float()).to(x.dtype), gate.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modulate(x)[0]


class GatedExpertLayer(nn.Module):
    """A Gemma decoder layer whose two residual branches are scaled by their adaptive norm's gate
    (``x + gate * f(norm(x))``); attention and MLP are the transformers layer's own modules."""

    def __init__(self, layer: nn.Module, width: int, cond: _Cond, eps: float) -> None:
        super().__init__()
        self.self_attn = layer.self_attn
        self.mlp = layer.mlp
        self.input_layernorm = AdaRMSNorm(width, width, cond, eps)
        self.post_attention_layernorm = AdaRMSNorm(width, width, cond, eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, position_ids: Any = None,
                cache: Any = None, use_cache: bool | None = False, position_embeddings: Any = None, **kwargs: Any) -> torch.Tensor:
        h, gate = self.input_layernorm.modulate(hidden_states)
        h, _ = self.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                              use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        x = hidden_states + h * gate
        h, gate = self.post_attention_layernorm.modulate(x)
        return x + self.mlp(h) * gate


def clean_task(text: str) -> str:
    """The instruction as LeRobot's pi0.5 processor writes it into the prompt: stripped, ``_`` and
    newlines turned into spaces, case kept."""
    return text.strip().replace("_", " ").replace("\n", " ")


def _configs(a: dict[str, Any]) -> tuple[Any, Any]:
    from transformers import GemmaConfig, PaliGemmaConfig

    vlm = PaliGemmaConfig(
        text_config=dict(model_type="gemma", **a["text"]),
        vision_config=dict(model_type="siglip_vision_model", image_size=a["image_size"], patch_size=a["patch_size"],
                           vision_use_head=False, **a["vision"]),
        projection_dim=a["text"]["hidden_size"],
        image_token_id=a["image_token_id"],
    )
    vlm.text_config.use_bidirectional_attention = True  # the prefix attends both ways
    expert = GemmaConfig(**{**a["expert"], "vocab_size": 8})  # token table unused: expert reads embeddings
    expert.is_causal = True
    expert.use_bidirectional_attention = True
    return vlm, expert


class Pi05Policy(FlowPolicy):
    family = "pi05"
    OPTIONS = Pi05Options

    def __init__(self, opts: Pi05Options, spec: EnvSpec, tokenizer: Any = None, arch: dict[str, Any] | None = None) -> None:
        from transformers import AutoModel

        super().__init__(spec, opts.chunk_size)
        self.opts = opts
        self.cameras = pick_cameras(spec, opts.cameras, opts.max_cameras)
        a = arch or size_preset("pi05", SIZES, opts.size)
        vcfg, ecfg = _configs(a)
        self.arch = {**a, "max_state_dim": a.get("max_state_dim") or (32 if a["pad_dims"] else spec.state_dim),
                     "max_action_dim": a.get("max_action_dim") or (32 if a["pad_dims"] else spec.action_dim)}
        self.image_size = a["image_size"]
        self.model_action_dim = self.arch["max_action_dim"]
        self.norm = StatsNorm(spec.state_dim, spec.action_dim)
        self.state_dim = spec.state_dim
        width = ecfg.hidden_size
        self._cond = _Cond()
        with seeded_init(opts):
            self.vlm = AutoModel.from_config(vcfg)
            self.expert = AutoModel.from_config(ecfg)
            eps = ecfg.rms_norm_eps
            self.expert.layers = nn.ModuleList(GatedExpertLayer(layer, width, self._cond, eps) for layer in self.expert.layers)
            self.expert.norm = AdaRMSNorm(width, width, self._cond, eps)
            self.action_in_proj = nn.Linear(self.model_action_dim, width)
            self.time_mlp_in = nn.Linear(width, width)
            self.time_mlp_out = nn.Linear(width, width)
            self.action_out_proj = nn.Linear(width, self.model_action_dim)
            if opts.critic == "expert":  # an RL head: no release has it (workers.release.common.RL_HEADS)
                self.value_in_proj = nn.Linear(spec.state_dim, width)
                self.value_head = ValueHead(width)
                freeze_query_path(self.vlm.language_model)  # nothing reads the VLM's output then
            else:
                self.value_head = ValueHead(vcfg.text_config.hidden_size)
            self.sampler = FlowSampler(opts.sampler_config(), width, self.model_action_dim, spec.action_dim)
            init_as_transformers(self.action_in_proj, self.time_mlp_in, self.time_mlp_out, self.action_out_proj,
                                 *([self.value_in_proj] if opts.critic == "expert" else []))
        freeze(self.expert.embed_tokens.parameters())
        self.tokenizer = tokenizer or char_tokenizer()
        place(self, opts)
        self.eval()

    @property
    def _dtype(self) -> torch.dtype:
        return self.action_in_proj.weight.dtype

    def checkpoint_towers(self) -> list[Any]:
        """Only the vision tower recomputes: the expert reads the cache the language model writes."""
        return [self.vlm.vision_tower]

    def _context(self, obs: Observation) -> dict[str, Any]:
        """VLM pass over [images, "Task: ..., State: ...;\\nAction: "]; keeps cache and value."""
        dev, dt = self.device, self._dtype
        obs = obs.to_torch(dev, self.cameras)
        pixels = preprocess_images(obs.images, self.cameras, self.image_size, IMAGE_MEAN, IMAGE_STD, dev, dt, pad=True)
        b, ncam = pixels.shape[:2]
        img = self.vlm.get_image_features(pixel_values=pixels.flatten(0, 1)).pooler_output
        img = img.reshape(b, ncam * img.shape[1], -1)
        state_txt = discretize_state(state_tensor(obs.state, self.state_dim), self.opts.state_bins)
        prompts = [f"Task: {clean_task(s)}, State: {st};\nAction: " for s, st in zip(obs.instruction, state_txt)]
        ids, tmask = encode_text(self.tokenizer, prompts, self.opts.max_text_len)
        ids, tmask = ids.to(dev), tmask.to(dev)
        embeds = torch.cat([img, self.vlm.get_input_embeddings()(ids).to(img.dtype)], dim=1)
        mask = torch.cat([torch.ones(b, img.shape[1], dtype=torch.long, device=dev), tmask], dim=1)
        out = self.vlm(inputs_embeds=embeds, attention_mask=mask, position_ids=mask.cumsum(-1) - 1,
                       token_type_ids=torch.zeros_like(mask), use_cache=True)
        ctx = {"cache": out.cache, "mask": mask, "prefix_len": out.cache.get_seq_length()}
        if self.opts.critic == "expert":
            tok = self.value_in_proj(state_tensor(obs.state, self.state_dim).to(dev, dt))[:, None]
            ctx["value"] = self.value_head(self._expert_pass(ctx, tok, torch.ones(b, device=dev))[:, 0])
        else:
            ctx["value"] = self.value_head(masked_mean(out.last_hidden_state, mask))
        return ctx

    def _velocity_fn(self, ctx: dict[str, Any]):
        def velocity(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = self._expert_pass(ctx, self.action_in_proj(x.to(self._dtype)), t)
            return self.action_out_proj(out).float(), out

        return velocity

    def _expert_pass(self, ctx: dict[str, Any], h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The expert over tokens ``h`` at time ``t``: they see the cached prefix and each other; the
        cache is cropped back after, so passes never see one another."""
        from transformers.masking_utils import create_causal_mask

        b, n = h.shape[:2]
        temb = sinusoid(t, h.shape[-1]).to(h.dtype)
        self._cond.value = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(temb))))
        cache, pmask = ctx["cache"], ctx["mask"]
        full = torch.cat([pmask, torch.ones(b, n, dtype=pmask.dtype, device=pmask.device)], dim=1)
        blocks = torch.cat([torch.zeros(ctx["prefix_len"], dtype=torch.long), torch.ones(n, dtype=torch.long)])
        attn = create_causal_mask(config=self.expert.config, inputs_embeds=h, attention_mask=full, cache=cache,
                                  block_sequence_ids=blocks[None].repeat(b, 1).to(h.device))
        try:
            return self.expert(inputs_embeds=h, attention_mask=attn, position_ids=(full.cumsum(-1) - 1)[:, -n:],
                               cache=cache).last_hidden_state
        finally:
            self._cond.value = None
            cache.crop(ctx["prefix_len"] - cache.get_seq_length())


@register_policy("pi05", config=Pi05Options)
def build_pi05(opts: Pi05Options, spec: EnvSpec) -> Policy:
    return Pi05Policy(opts, spec)
