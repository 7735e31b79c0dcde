"""GR00T N1.5 composed from transformers parts plus a small diffusion-transformer action head.

Backbone (stand-in for Eagle 2.5): SigLIP patches -> 2x2 pixel-unshuffle -> MLP projector ->
a Qwen3 LM truncated to ``llm_layers`` layers (N1.5 reads the LLM's 12th layer), then a LayerNorm.
Action head (N1.5's flow-matching DiT): a state encoder, an action encoder mixing the noisy
action with the sinusoidal time, learned "future" tokens, and DiT blocks with adaptive LayerNorm
on the time embedding that alternate cross-attention to the VL tokens and self-attention.

GR00T's own flow runs tau: 0 (noise) -> 1 (action) with velocity ``action - noise``; the shared
sampler runs t = 1 - tau with velocity ``noise - action``, so the head's output is negated.
The critic reads the mean of the VL tokens.
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
from workers.policies.stats_norm import StatsNorm
from workers.policies.vla_common import (
    SIGLIP_BASE,
    SIGLIP_SO400M,
    TINY_VIT,
    VLAOptions,
    ValueHead,
    char_tokenizer,
    encode_text,
    masked_mean,
    pick_cameras,
    place,
    preprocess_images,
    seeded_init,
    sinusoid,
    size_preset,
    state_tensor,
)

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "image_size": 32,
        "patch_size": 8,
        "vision": TINY_VIT,
        "llm": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=128),
        "dit": dict(hidden=64, heads=4, layers=4, future_tokens=4),
        "pad_dims": False,
    },
    # ~0.5B: SigLIP-B tower, a 16-layer 1024-wide Qwen3, 10-layer 1024-wide DiT.
    "medium": {
        "image_size": 224,
        "patch_size": 14,
        "vision": SIGLIP_BASE,
        "llm": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=16,
                    num_key_value_heads=8, head_dim=64, vocab_size=32000),
        "dit": dict(hidden=1024, heads=16, layers=10, future_tokens=32),
        "pad_dims": True,
    },
    # Release-like (~1.9B built here): SigLIP So400m/14 at 224, Qwen3-1.7B truncated to 12 layers
    # as N1.5 reads layer 12, 16-layer 1536-wide DiT.
    "3b": {
        "image_size": 224,
        "patch_size": 14,
        "vision": SIGLIP_SO400M,
        "llm": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=12, num_attention_heads=16,
                    num_key_value_heads=8, head_dim=128, vocab_size=151936),
        "dit": dict(hidden=1536, heads=32, layers=16, future_tokens=32),
        "pad_dims": True,
    },
}

IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)


@dataclass
class Gr00tOptions(VLAOptions, FlowOptions):
    """Options of the GR00T N1.5 family."""


class AdaLayerNorm(nn.Module):
    """LayerNorm whose scale and shift come from the time embedding (diffusers' AdaLayerNorm)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.mod = nn.Linear(dim, 2 * dim)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.mod(F.silu(temb)).chunk(2, dim=-1)
        return self.norm(x) * (1 + scale[:, None]) + shift[:, None]


class Attention(nn.Module):
    """Multi-head attention on SDPA: one code path in act and evaluate (torch's MHA fast path
    differs slightly under inference mode, which would break exact log-prob replay)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, ctx_pad: torch.Tensor | None = None) -> torch.Tensor:
        b, n, d = x.shape
        split = lambda t: t.view(b, -1, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        mask = None if ctx_pad is None else (~ctx_pad)[:, None, None, :]
        out = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(ctx)), split(self.v(ctx)), attn_mask=mask)
        return self.o(out.transpose(1, 2).reshape(b, n, d))


class DiTBlock(nn.Module):
    """AdaLN -> attention (cross to VL tokens, or self) -> residual; LN -> GELU FF -> residual."""

    def __init__(self, dim: int, heads: int, cross: bool) -> None:
        super().__init__()
        self.cross = cross
        self.norm1 = AdaLayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, temb: torch.Tensor, ctx: torch.Tensor, ctx_pad: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x, temb)
        if self.cross:
            h = self.attn(h, ctx, ctx_pad)
        else:
            h = self.attn(h, h)
        x = x + h
        return x + self.ff(self.norm2(x))


class FlowMatchingHead(nn.Module):
    """N1.5's action head: encoders, DiT over [state, future tokens, actions], action decoder."""

    def __init__(self, dim: int, heads: int, layers: int, future: int, vl_dim: int, state_dim: int,
                 action_dim: int, chunk: int) -> None:
        super().__init__()
        self.dim = dim
        self.vlln = nn.LayerNorm(vl_dim)
        self.vl_proj = nn.Linear(vl_dim, dim)
        self.state_encoder = nn.Sequential(nn.Linear(state_dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.action_w1 = nn.Linear(action_dim, dim)
        self.action_w2 = nn.Linear(2 * dim, dim)
        self.action_w3 = nn.Linear(dim, dim)
        self.time_mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.future_tokens = nn.Parameter(torch.randn(future, dim) * 0.02)
        self.position = nn.Parameter(torch.randn(chunk, dim) * 0.02)
        self.blocks = nn.ModuleList(DiTBlock(dim, heads, cross=(i % 2 == 0)) for i in range(layers))
        self.norm_out = AdaLayerNorm(dim)
        self.action_decoder = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, action_dim))

    def forward(self, vl: torch.Tensor, vl_pad: torch.Tensor, state: torch.Tensor, x: torch.Tensor,
                tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Velocity (GR00T's sign) ``[B, T, A]`` and the action tokens' features."""
        temb_raw = sinusoid(tau, self.dim).to(x.dtype)
        temb = self.time_mlp(temb_raw)
        a = self.action_w1(x)
        a = self.action_w3(F.silu(self.action_w2(torch.cat([a, temb_raw[:, None].expand_as(a)], dim=-1))))
        a = a + self.position[None, : a.shape[1]]
        b = x.shape[0]
        seq = torch.cat([self.state_encoder(state)[:, None], self.future_tokens[None].expand(b, -1, -1), a], dim=1)
        for blk in self.blocks:
            seq = blk(seq, temb, vl, vl_pad)
        h = self.norm_out(seq, temb)[:, -x.shape[1] :]
        return self.action_decoder(h), h


class Gr00tPolicy(FlowPolicy):
    family = "gr00t_n15"
    OPTIONS = Gr00tOptions

    def __init__(self, opts: Gr00tOptions, spec: EnvSpec, tokenizer: Any = None) -> None:
        from transformers import Qwen3Config, Qwen3Model, SiglipVisionConfig, SiglipVisionModel

        super().__init__(spec, opts.chunk_size)
        a = size_preset(self.family, SIZES, opts.size)
        self.opts = opts
        self.cameras = pick_cameras(spec, opts.cameras, opts.max_cameras)
        self.image_size = a["image_size"]
        self.model_state_dim = 64 if a["pad_dims"] else spec.state_dim
        self.model_action_dim = 32 if a["pad_dims"] else spec.action_dim
        lm_dim, vis_dim, d = a["llm"]["hidden_size"], a["vision"]["hidden_size"], a["dit"]
        self.norm = StatsNorm(spec.state_dim, spec.action_dim)
        with seeded_init(opts):
            self.vision = SiglipVisionModel(SiglipVisionConfig(image_size=a["image_size"], patch_size=a["patch_size"],
                                                               vision_use_head=False, **a["vision"]))
            self.projector = nn.Sequential(nn.LayerNorm(4 * vis_dim), nn.Linear(4 * vis_dim, lm_dim), nn.GELU(),
                                           nn.Linear(lm_dim, lm_dim))
            self.llm = Qwen3Model(Qwen3Config(**a["llm"]))
            self.head = FlowMatchingHead(d["hidden"], d["heads"], d["layers"], d["future_tokens"], lm_dim,
                                         self.model_state_dim, self.model_action_dim, opts.chunk_size)
            self.value_head = ValueHead(lm_dim)
            self.sampler = FlowSampler(opts.sampler_config(), d["hidden"], self.model_action_dim, spec.action_dim)
        self.tokenizer = tokenizer or char_tokenizer()
        place(self, opts)
        self.eval()

    @property
    def _dtype(self) -> torch.dtype:
        return self.head.action_w1.weight.dtype

    def _image_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """SigLIP patches, 2x2 pixel-unshuffled (4x fewer tokens, as Eagle does), projected."""
        b, ncam = pixels.shape[:2]
        p = self.vision(pixel_values=pixels.flatten(0, 1)).last_hidden_state
        side = int(round(p.shape[1] ** 0.5))
        c = p.shape[-1]
        p = p.view(-1, side // 2, 2, side // 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, (side // 2) ** 2, 4 * c)
        return self.projector(p).reshape(b, ncam * p.shape[1], -1)

    def _context(self, obs: Observation) -> dict[str, Any]:
        dev, dt = self.device, self._dtype
        obs = obs.to_torch(dev, self.cameras)
        pixels = preprocess_images(obs.images, self.cameras, self.image_size, IMAGE_MEAN, IMAGE_STD, dev, dt)
        img = self._image_tokens(pixels)
        b = img.shape[0]
        ids, tmask = encode_text(self.tokenizer, list(obs.instruction), self.opts.max_text_len)
        ids, tmask = ids.to(dev), tmask.to(dev)
        embeds = torch.cat([img, self.llm.get_input_embeddings()(ids)], dim=1)
        mask = torch.cat([torch.ones(b, img.shape[1], dtype=torch.long, device=dev), tmask], dim=1)
        vl = self.llm(inputs_embeds=embeds, attention_mask=mask, position_ids=mask.cumsum(-1) - 1).last_hidden_state
        vl = self.head.vlln(vl)
        state = state_tensor(obs.state, self.model_state_dim).to(dt)
        return {"vl": self.head.vl_proj(vl), "pad": mask == 0, "state": state,
                "value": self.value_head(masked_mean(vl, mask))}

    def sample_time(self, batch: int) -> torch.Tensor:
        """GR00T N1.5's training times, ``(0.999 - Beta(1.5, 1)) / 0.999`` in its own convention
        (1 = data), read in pi0's (1 = noise)."""
        return torch.distributions.Beta(1.5, 1.0).sample((batch,)) / 0.999

    def _velocity_fn(self, ctx: dict[str, Any]):
        def velocity(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            v, h = self.head(ctx["vl"], ctx["pad"], ctx["state"], x.to(self._dtype), 1.0 - t)
            return -v.float(), h

        return velocity


@register_policy("gr00t_n15", config=Gr00tOptions)
def build_gr00t(opts: Gr00tOptions, spec: EnvSpec) -> Policy:
    return Gr00tPolicy(opts, spec)
