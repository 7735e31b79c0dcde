"""GR00T N1.5: the Eagle 2.5 backbone from transformers' SigLIP and Qwen3, and N1.5's action head.

Module tree and tensor names are the release's (``backbone.eagle_model.{vision_model,
language_model,mlp1}``, ``action_head.*``), so a released folder loads name for name.

Backbone (Eagle 2.5 as N1.5 builds it): a SigLIP vision tower (its last hidden state, post-LN;
no pixel shuffle) -> ``mlp1`` (one Linear to the LM width) written over the ``<IMG_CONTEXT>``
token embeddings; a Qwen3 LM cut to ``select_layer`` layers whose final-norm output is the
vision-language sequence. ``eagle_linear`` is the identity in the release (``project_to_dim``
null), so it holds no tensor. The LM head stays tied to the token table, as released. The prompt
is Eagle's chat turn as N1.5 builds it (``eagle_prompt``), left-padded.

GR00T's flow runs tau: 0 (noise) -> 1 (action) with velocity ``action - noise``; the shared
sampler runs t = 1 - tau with velocity ``noise - action``, so the head's output is negated and
the Euler steps coincide. The critic reads the mean VL token beside the state token.
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
from workers.policies.eagle_prompt import EaglePrompt
from workers.policies.flow_sampler import FlowOptions, FlowPolicy, FlowSampler
from workers.policies.gr00t_head import FlowMatchingActionHead, HeadShape, sampler_buckets
from workers.policies.stats_norm import StatsNorm
from workers.policies.vla_common import (
    SIGLIP_BASE,
    SIGLIP_SO400M,
    VLAOptions,
    ValueHead,
    char_tokenizer,
    freeze,
    masked_mean,
    pick_cameras,
    place,
    seeded_init,
    size_preset,
    state_tensor,
)

EMBODIMENT_IDS = {"new_embodiment": 31, "oxe_droid": 17, "agibot_genie1": 26, "gr1": 24,
                  "libero_franka": 31, "maniskill_widowx": 30, "isaaclab_franka": 31}
"""Embodiment tag -> projector index: N1.5's table plus the tags RLinf's recipes add."""

SIZES: dict[str, dict[str, Any]] = {
    # >= 3 layers in every stack so a wrong block cannot hide; same code as the release size.
    "tiny": {
        "image_size": 32, "patch_size": 8,
        "vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2),
        "llm": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=128),
        "head": dict(embed_dim=32, hidden=48, dit_heads=4, dit_layers=4, vl_heads=4, vl_layers=3,
                     future_tokens=4, max_seq_len=16),
    },
    # ~0.5B: SigLIP-B tower, a 12-layer 1024-wide Qwen3, a 1024-wide 8-layer DiT.
    "medium": {
        "image_size": 224, "patch_size": 14, "vision": SIGLIP_BASE,
        "llm": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
                    num_key_value_heads=8, head_dim=64, vocab_size=32000),
        "head": dict(embed_dim=1024, hidden=768, dit_heads=16, dit_layers=8, vl_heads=16, vl_layers=2),
    },
    # The release (nvidia/GR00T-N1.5-3B): SigLIP So400m/14 at 224, Qwen3-1.7B cut at select_layer
    # 12, 16-layer DiT 32 x 48 with 2048-wide cross-attention, 4-layer 32 x 64 VL self-attention.
    "3b": {
        "image_size": 224, "patch_size": 14, "vision": SIGLIP_SO400M,
        "llm": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=12, num_attention_heads=16,
                    num_key_value_heads=8, head_dim=128, vocab_size=151680, max_position_embeddings=40960),
        "head": dict(embed_dim=1536, hidden=1024, dit_heads=32, dit_layers=16, vl_heads=32, vl_layers=4),
    },
}



def eagle_pixels(images: dict[str, Any], cameras: list[str], size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """uint8 ``[B, H, W, 3]`` per camera -> ``[B, C, 3, size, size]`` as Eagle 2.5's image processor
    makes one tile (no thumbnail), N1.5's setting: bicubic antialiased resize of the uint8 image
    (uint8 out, as torchvision resizes uint8), then ``(x / 255 - 0.5) / 0.5``. The resize runs on
    the CPU, where torch resizes uint8 directly."""
    out = []
    for cam in cameras:
        img = torch.as_tensor(images[cam]).cpu().permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
        if img.shape[-2:] != (size, size):
            img = F.interpolate(img, size=(size, size), mode="bicubic", align_corners=False, antialias=True)
        out.append(img.to(device).float().div(255.0).sub(0.5).div(0.5))
    return torch.stack(out, dim=1).to(dtype)



@dataclass
class Gr00tOptions(VLAOptions, FlowOptions):
    """Options of the GR00T N1.5 family."""

    stochastic_steps: str = "one"
    """Flow-SDE noise in ``one`` random denoising step per chunk (RLinf's N1.5 recipe; the step is
    stored with the trajectory and replayed) or in ``all`` steps."""

    embodiment: str = "new_embodiment"
    """Embodiment tag: picks the per-embodiment state/action projectors and, in a release folder,
    the statistics in ``experiment_cfg/metadata.json``."""
    tune_llm: bool = False
    """Train the Qwen3 LM (frozen by default, as N1.5 fine-tunes)."""
    tune_visual: bool = False
    """Train the vision tower and ``mlp1`` (frozen by default for RL)."""
    max_text_len: int = 0
    """Not read: N1.5 keeps its whole prompt, as upstream's processor does. Only 0 is accepted,
    so a cap set in a config is refused instead of silently ignored."""

    def __post_init__(self) -> None:
        if self.max_text_len != 0:
            raise ValueError(f"gr00t_n15: max_text_len {self.max_text_len} would not be read: N1.5 keeps its "
                             "whole prompt, as upstream; leave the option out")


def head_shape(preset: dict[str, Any]) -> HeadShape:
    return HeadShape(backbone_dim=preset["llm"]["hidden_size"], **preset["head"])


class EagleModel(nn.Module):
    """Eagle 2.5's parts N1.5 keeps: ``vision_model``, ``language_model`` (cut), ``mlp1``."""

    def __init__(self, preset: dict[str, Any]) -> None:
        from transformers import Qwen3Config, Qwen3ForCausalLM, SiglipVisionConfig, SiglipVisionModel

        super().__init__()
        vcfg = SiglipVisionConfig(image_size=preset["image_size"], patch_size=preset["patch_size"], **preset["vision"])
        self.vision_model = SiglipVisionModel(vcfg)
        lcfg = Qwen3Config(tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6, **preset["llm"])
        lcfg._attn_implementation = "sdpa"
        self.language_model = Qwen3ForCausalLM(lcfg)
        self.mlp1 = nn.Sequential(nn.Linear(vcfg.hidden_size, lcfg.hidden_size))


class Backbone(nn.Module):
    def __init__(self, preset: dict[str, Any]) -> None:
        super().__init__()
        self.eagle_model = EagleModel(preset)


class Gr00tPolicy(FlowPolicy):
    family = "gr00t_n15"
    OPTIONS = Gr00tOptions

    def __init__(self, opts: Gr00tOptions, spec: EnvSpec, tokenizer: Any = None, shape: HeadShape | None = None,
                 chat_template: str | None = None) -> None:
        super().__init__(spec, opts.chunk_size)
        preset = size_preset(self.family, SIZES, opts.size)
        shape = shape or head_shape(preset)
        if opts.embodiment not in EMBODIMENT_IDS:
            raise ValueError(f"{self.family}: unknown embodiment {opts.embodiment!r}; known: {sorted(EMBODIMENT_IDS)}")
        if spec.state_dim > shape.max_state_dim or spec.action_dim > shape.action_dim:
            raise ValueError(f"{self.family}: env state/action widths {spec.state_dim}/{spec.action_dim} exceed the "
                             f"embodiment encoders' {shape.max_state_dim}/{shape.action_dim}")
        if opts.chunk_size > shape.max_seq_len:
            raise ValueError(f"{self.family}: chunk_size {opts.chunk_size} > the {shape.max_seq_len} action positions")
        self.opts = opts
        self.cameras = pick_cameras(spec, opts.cameras, opts.max_cameras)
        self.image_size = preset["image_size"]
        self.model_state_dim, self.model_action_dim = shape.max_state_dim, shape.action_dim
        self.norm = StatsNorm(spec.state_dim, spec.action_dim)
        with seeded_init(opts):
            self.backbone = Backbone(preset)
            self.action_head = FlowMatchingActionHead(shape)
            self.value_head = ValueHead(shape.backbone_dim + shape.embed_dim)
            self.sampler = FlowSampler(opts.sampler_config(), shape.hidden, shape.action_dim, spec.action_dim)
        self.backbone.eagle_model.language_model.tie_weights()
        self.tokenizer = tokenizer or char_tokenizer()
        patches = (self.image_size // preset["patch_size"]) ** 2  # one tile per camera, no pixel shuffle
        self.prompt = EaglePrompt(self.tokenizer, chat_template, patches)
        self.image_token_id = self.prompt.image_token_id
        vocab = self.backbone.eagle_model.language_model.config.vocab_size
        if len(self.tokenizer) > vocab:
            raise ValueError(f"{self.family}: the tokenizer's {len(self.tokenizer)} ids (with the prompt's special tokens) "
                             f"exceed the LM's vocabulary ({vocab})")
        self.set_trainable(opts.tune_llm, opts.tune_visual)
        place(self, opts)
        self.eval()

    def set_trainable(self, tune_llm: bool, tune_visual: bool) -> None:
        """N1.5's split: the LM and the vision side (tower + ``mlp1``) freeze separately."""
        eagle = self.backbone.eagle_model
        if not tune_llm:
            freeze(eagle.language_model.parameters())
        if not tune_visual:
            freeze(eagle.vision_model.parameters())
            freeze(eagle.mlp1.parameters())

    @property
    def _dtype(self) -> torch.dtype:
        return self.action_head.vlln.weight.dtype

    @property
    def embodiment_id(self) -> int:
        return EMBODIMENT_IDS[self.opts.embodiment]

    def backbone_features(self, pixels: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Eagle's forward as N1.5 reads it: the LM's ``select_layer`` output (final norm applied)."""
        eagle = self.backbone.eagle_model
        vit = eagle.mlp1(eagle.vision_model(pixel_values=pixels).last_hidden_state)
        emb = eagle.language_model.get_input_embeddings()(ids)
        slot = (ids == self.image_token_id).unsqueeze(-1)
        emb = emb.masked_scatter(slot, vit.reshape(-1, vit.shape[-1]).to(emb.dtype))
        return eagle.language_model.model(inputs_embeds=emb, attention_mask=mask).last_hidden_state

    def _context(self, obs: Observation) -> dict[str, Any]:
        dev, dt = self.device, self._dtype
        pixels = eagle_pixels(obs.images, self.cameras, self.image_size, dev, dt)
        obs = obs.to_torch(dev, [])  # the state; the images went through eagle_pixels
        b, ncam = pixels.shape[:2]
        ids, mask = self.prompt(list(obs.instruction), ncam)
        ids, mask = ids.to(dev), mask.to(dev)
        pad = None if bool(mask.all()) else mask == 0
        vl = self.action_head.encode_vl(self.backbone_features(pixels.flatten(0, 1), ids, mask), pad)
        cat = torch.full((b,), self.embodiment_id, dtype=torch.long, device=dev)
        state = self.action_head.encode_state(state_tensor(obs.state, self.model_state_dim).to(dt), cat)
        value = self.value_head(torch.cat([masked_mean(vl, mask), state[:, 0]], dim=-1))
        return {"vl": vl, "pad": pad, "state": state, "cat": cat, "value": value}

    def sft_loss(self, obs: Observation, actions: torch.Tensor, noise: torch.Tensor | None = None,
                 time: torch.Tensor | None = None) -> torch.Tensor:
        """N1.5's flow-matching loss on env action chunks ``[B, T, A]``: normalised by the release
        statistics, zero-padded to the action width and masked to the env's dims, at times from
        :meth:`sample_time` (``rlvla3 sft``'s objective for this family). ``noise`` and ``time``
        (pi0's convention, 1 = noise) fix the draws, as :meth:`FlowPolicy.sft_loss` takes them."""
        a = (actions.to(self.device).float() - self.norm.action_shift) / self.norm.action_scale
        target = F.pad(a, (0, self.model_action_dim - a.shape[-1])).to(self._dtype)
        mask = torch.zeros_like(target)
        mask[..., : a.shape[-1]] = 1
        tau = (1.0 - (self.sample_time(target.shape[0]) if time is None else time)).to(self.device)  # N1.5's: 1 = data
        ctx = self._context(self.norm.state_in(obs))
        return self.action_head.loss(ctx["vl"], ctx["pad"], ctx["state"], target,
                                     torch.randn_like(target) if noise is None else noise.to(target), tau, ctx["cat"], mask)

    def sample_time(self, batch: int) -> torch.Tensor:
        """GR00T N1.5's training times, ``(0.999 - Beta(1.5, 1)) / 0.999`` in its own convention
        (1 = data), read in pi0's (1 = noise)."""
        return torch.distributions.Beta(1.5, 1.0).sample((batch,)) / 0.999

    def _velocity_fn(self, ctx: dict[str, Any]):
        buckets = self.action_head.shape.buckets

        def velocity(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            steps = sampler_buckets(1.0 - t, buckets)
            v, h = self.action_head.velocity(ctx["vl"], ctx["pad"], ctx["state"], x.to(self._dtype), steps, ctx["cat"])
            return -v.float(), h

        return velocity


@register_policy("gr00t_n15", config=Gr00tOptions)
def build_gr00t(opts: Gr00tOptions, spec: EnvSpec) -> Policy:
    return Gr00tPolicy(opts, spec)
