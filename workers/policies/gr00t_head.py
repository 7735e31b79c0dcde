"""GR00T N1.5's flow-matching action head, with the released module tree (so tensor names match).

``vlln`` + ``vl_self_attention`` refine the backbone tokens; a DiT whose blocks use AdaLN on the
time embedding, cross-attend to those tokens on even blocks and self-attend on odd ones, runs over
``[state token, future tokens, action tokens]``. State encoder, action encoder and action decoder
hold one set of weights per embodiment (``W[embodiment]``). Time runs tau: 0 (noise) -> 1 (action),
velocity ``action - noise``, discretised into ``num_timestep_buckets`` for both time embeddings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class HeadShape:
    """The action head's sizes (the release's ``action_head_cfg``)."""

    backbone_dim: int  # backbone_embedding_dim: width of the VL tokens
    embed_dim: int  # input_embedding_dim = DiT heads x head_dim
    hidden: int  # hidden_size = DiT output_dim, the decoder's input
    dit_heads: int
    dit_layers: int
    vl_heads: int  # vl_self_attention: heads x head_dim = backbone_dim
    vl_layers: int
    future_tokens: int = 32
    max_state_dim: int = 64
    action_dim: int = 32
    embodiments: int = 32
    max_seq_len: int = 1024
    buckets: int = 1000


def sampler_buckets(tau: torch.Tensor, buckets: int) -> torch.Tensor:
    """A denoising step's time tau = k/K -> N1.5's bucket ``int(k/K * buckets)``. tau arrives as
    1 - t from the shared sampler's float32 clock; the 1e-3 absorbs that rounding (far below the
    1/K gap between buckets' fractional parts for K < 1000)."""
    return torch.floor(tau.double() * buckets + 1e-3).long()


def timestep_features(steps: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """diffusers' ``Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=1)``: [cos, sin]."""
    half = dim // 2
    freq = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=steps.device) / (half - 1))
    ang = steps.float()[:, None] * freq[None]
    return torch.cat([ang.cos(), ang.sin()], dim=-1)


def action_time_features(steps: torch.Tensor, dim: int) -> torch.Tensor:
    """The action encoder's own sinusoid of the bucket ([sin, cos], period base 10000/half)."""
    half = dim // 2
    freq = torch.exp(-torch.arange(half, dtype=torch.float32, device=steps.device) * (math.log(10000.0) / half))
    ang = steps.float()[..., None] * freq
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(256, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimestepEncoder(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(dim)

    def forward(self, steps: torch.Tensor) -> torch.Tensor:
        w = self.timestep_embedder.linear_1.weight
        return self.timestep_embedder(timestep_features(steps).to(w.dtype))


class AdaLayerNorm(nn.Module):
    """LayerNorm (no affine) scaled and shifted by ``linear(silu(temb))`` = (scale, shift)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, eps=1e-5, elementwise_affine=False)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb)).chunk(2, dim=1)
        return self.norm(x) * (1 + scale[:, None]) + shift[:, None]


class Attention(nn.Module):
    """diffusers' ``Attention`` (biased q/k/v, ``to_out.0``) on SDPA. N1.5 passes no mask, so a
    padded prompt would change its neighbours' actions; here padding keys are masked, which is
    the same computation for unpadded input and keeps every sample independent of its batch
    (the trainer re-scores in other batches than the generator acted in)."""

    def __init__(self, dim: int, heads: int, ctx_dim: int | None = None) -> None:
        super().__init__()
        self.heads = heads
        kv = ctx_dim or dim
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(kv, dim), nn.Linear(kv, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])

    def forward(self, x: torch.Tensor, ctx: torch.Tensor | None = None, pad: torch.Tensor | None = None) -> torch.Tensor:
        ctx = x if ctx is None else ctx
        b, n, d = x.shape
        split = lambda t: t.view(b, -1, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        mask = None if pad is None else (~pad)[:, None, None, :]
        out = F.scaled_dot_product_attention(split(self.to_q(x)), split(self.to_k(ctx)), split(self.to_v(ctx)), attn_mask=mask)
        return self.to_out[0](out.transpose(1, 2).reshape(b, n, d))


class GeluProj(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """diffusers' ``FeedForward(activation_fn="gelu-approximate")``: ``net.0.proj``, ``net.2``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([GeluProj(dim, 4 * dim), nn.Dropout(0.0), nn.Linear(4 * dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class Block(nn.Module):
    """``x += attn(norm1(x)[, ctx]); x += ff(norm3(x))``; AdaLN blocks take the time embedding."""

    def __init__(self, dim: int, heads: int, ctx_dim: int | None, ada: bool) -> None:
        super().__init__()
        self.ada = ada
        self.norm1 = AdaLayerNorm(dim) if ada else nn.LayerNorm(dim, eps=1e-5)
        self.attn1 = Attention(dim, heads, ctx_dim)
        self.norm3 = nn.LayerNorm(dim, eps=1e-5, elementwise_affine=not ada)
        self.ff = FeedForward(dim)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor | None = None, temb: torch.Tensor | None = None,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm1(x, temb) if self.ada else self.norm1(x)
        x = x + self.attn1(h, ctx, pad)
        return x + self.ff(self.norm3(x))


class DiT(nn.Module):
    """16 AdaLN blocks (cross-attention on even indices, self-attention on odd), AdaLN-style output."""

    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        dim = s.embed_dim
        self.timestep_encoder = TimestepEncoder(dim)
        self.transformer_blocks = nn.ModuleList(
            Block(dim, s.dit_heads, None if i % 2 else s.backbone_dim, ada=True) for i in range(s.dit_layers))
        self.norm_out = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.proj_out_1 = nn.Linear(dim, 2 * dim)
        self.proj_out_2 = nn.Linear(dim, s.hidden)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, steps: torch.Tensor, ctx_pad: torch.Tensor | None) -> torch.Tensor:
        temb = self.timestep_encoder(steps)
        for i, blk in enumerate(self.transformer_blocks):
            x = blk(x, temb=temb) if i % 2 else blk(x, ctx, temb, ctx_pad)
        shift, scale = self.proj_out_1(F.silu(temb)).chunk(2, dim=1)
        return self.proj_out_2(self.norm_out(x) * (1 + scale[:, None]) + shift[:, None])


class SelfAttentionTransformer(nn.Module):
    def __init__(self, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.transformer_blocks = nn.ModuleList(Block(dim, heads, None, ada=False) for _ in range(layers))

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        for blk in self.transformer_blocks:
            x = blk(x, pad=pad)
        return x


class CategorySpecificLinear(nn.Module):
    """One ``[in, out]`` weight and bias per embodiment."""

    def __init__(self, n: int, din: int, dout: int) -> None:
        super().__init__()
        self.W = nn.Parameter(0.02 * torch.randn(n, din, dout))
        self.b = nn.Parameter(torch.zeros(n, dout))

    def forward(self, x: torch.Tensor, cat: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, self.W[cat]) + self.b[cat].unsqueeze(1)


class CategorySpecificMLP(nn.Module):
    def __init__(self, n: int, din: int, hidden: int, dout: int) -> None:
        super().__init__()
        self.layer1 = CategorySpecificLinear(n, din, hidden)
        self.layer2 = CategorySpecificLinear(n, hidden, dout)

    def forward(self, x: torch.Tensor, cat: torch.Tensor) -> torch.Tensor:
        return self.layer2(F.relu(self.layer1(x, cat)), cat)


class MultiEmbodimentActionEncoder(nn.Module):
    """``W3(swish(W2([W1(a), sinusoid(bucket)])))`` with per-embodiment weights."""

    def __init__(self, action_dim: int, dim: int, n: int) -> None:
        super().__init__()
        self.W1 = CategorySpecificLinear(n, action_dim, dim)
        self.W2 = CategorySpecificLinear(n, 2 * dim, dim)
        self.W3 = CategorySpecificLinear(n, dim, dim)

    def forward(self, actions: torch.Tensor, steps: torch.Tensor, cat: torch.Tensor) -> torch.Tensor:
        a = self.W1(actions, cat)
        tau = action_time_features(steps[:, None].expand(-1, actions.shape[1]), a.shape[-1]).to(a.dtype)
        return self.W3(F.silu(self.W2(torch.cat([a, tau], dim=-1), cat)), cat)


class FlowMatchingActionHead(nn.Module):
    """N1.5's ``action_head``: encodes the VL tokens once (:meth:`encode_vl`), then predicts the
    velocity of noisy actions (:meth:`velocity`) any number of times."""

    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        self.shape = s
        self.model = DiT(s)
        self.state_encoder = CategorySpecificMLP(s.embodiments, s.max_state_dim, s.hidden, s.embed_dim)
        self.action_encoder = MultiEmbodimentActionEncoder(s.action_dim, s.embed_dim, s.embodiments)
        self.action_decoder = CategorySpecificMLP(s.embodiments, s.hidden, s.hidden, s.action_dim)
        self.future_tokens = nn.Embedding(s.future_tokens, s.embed_dim)
        self.vlln = nn.LayerNorm(s.backbone_dim)
        self.vl_self_attention = SelfAttentionTransformer(s.backbone_dim, s.vl_heads, s.vl_layers)
        self.position_embedding = nn.Embedding(s.max_seq_len, s.embed_dim)

    def encode_vl(self, vl: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
        """``vlln`` then the VL self-attention; ``pad [B, S]`` marks padding tokens (None: no padding)."""
        return self.vl_self_attention(self.vlln(vl), pad)

    def encode_state(self, state: torch.Tensor, cat: torch.Tensor) -> torch.Tensor:
        """``[B, max_state_dim]`` -> the state token ``[B, 1, embed_dim]``."""
        return self.state_encoder(state[:, None], cat)

    def velocity(self, vl: torch.Tensor, vl_pad: torch.Tensor | None, state_tok: torch.Tensor, x: torch.Tensor,
                 steps: torch.Tensor, cat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Velocity ``[B, T, A]`` (action - noise) at time bucket ``steps [B]`` and the DiT's action features."""
        a = self.action_encoder(x, steps, cat) + self.position_embedding.weight[None, : x.shape[1]]
        fut = self.future_tokens.weight[None].expand(x.shape[0], -1, -1)
        out = self.model(torch.cat([state_tok, fut, a], dim=1), vl, steps, vl_pad)
        return self.action_decoder(out, cat)[:, -x.shape[1]:], out[:, -x.shape[1]:]

    def loss(self, vl: torch.Tensor, vl_pad: torch.Tensor | None, state_tok: torch.Tensor, actions: torch.Tensor,
             noise: torch.Tensor, tau: torch.Tensor, cat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """N1.5's flow-matching loss: masked MSE of the predicted velocity at ``(1-tau) noise + tau a``."""
        t = tau[:, None, None].to(actions.dtype)
        steps = (tau * self.shape.buckets).long()
        pred, _ = self.velocity(vl, vl_pad, state_tok, (1 - t) * noise + t * actions, steps, cat)
        err = F.mse_loss(pred, actions - noise, reduction="none") * mask
        return err.sum() / mask.sum()
