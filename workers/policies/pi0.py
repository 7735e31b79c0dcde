"""pi0 on transformers' native ``PI0ForConditionalGeneration``, plus what RL needs.

transformers provides the model (PaliGemma prefix, Gemma action expert, flow-matching velocity).
This module adds: observation -> prompt/pixels, the stochastic flow sampler with log-probs
(``flow_sampler``), a critic on the action expert's state token, and a loader for a local
transformers-format pi0 release.

The critic reads the expert's hidden state at the *state token*: in pi0's attention layout that
token sees the prefix and itself only, never the noisy actions, so the value does not depend on
the sampled noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlvla3.observation import Observation
from workers.envs.base import EnvSpec
from workers.policies.base import Policy, register_policy
from workers.policies.flow_sampler import FlowOptions, FlowPolicy, FlowSampler
from workers.policies.vla_common import (
    SIGLIP_SO400M,
    TINY_VIT,
    ReleaseCheckpointMixin,
    VLAOptions,
    ValueHead,
    char_tokenizer,
    encode_text,
    freeze,
    pick_cameras,
    place,
    preprocess_images,
    read_local,
    seeded_init,
    size_preset,
    state_tensor,
)

# Architecture presets. "3b" is the released pi0 (SigLIP So400m + Gemma 2B + Gemma 300M expert).
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "image_size": 32,
        "patch_size": 8,
        "vision": TINY_VIT,
        "text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32, vocab_size=128),
        "expert": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32),
        "image_token_id": 127,
        "pad_dims": False,
    },
    "3b": {
        "image_size": 224,
        "patch_size": 14,
        "vision": SIGLIP_SO400M,
        "text": dict(hidden_size=2048, intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8,
                     num_key_value_heads=1, head_dim=256, vocab_size=257152),
        "expert": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=18, num_attention_heads=8,
                       num_key_value_heads=1, head_dim=256),
        "image_token_id": 257152,
        "pad_dims": True,
    },
}

# transformers-format release names -> ours (the wrapped model lives under ``pi0.``).
RELEASE_RULES = [
    ("model.", "pi0.model."),
    ("embed_action_time.", "pi0.embed_action_time."),
    ("action_out_proj.", "pi0.action_out_proj."),
]
FRESH = ("value_head.", "sampler.noise_head.")  # RL additions, not in a release

IMAGE_MEAN = (0.5, 0.5, 0.5)  # PaliGemma / SigLIP normalise to [-1, 1]
IMAGE_STD = (0.5, 0.5, 0.5)


@dataclass
class Pi0Options(VLAOptions, FlowOptions):
    """Options of the pi0 family (``model.options`` in the job config)."""


def build_pi0_config(size: str, spec: EnvSpec, chunk_size: int, num_steps: int) -> Any:
    from transformers import PI0Config

    a = size_preset("pi0", SIZES, size)
    width = 32 if a["pad_dims"] else None
    if width is not None and (spec.action_dim > width or spec.state_dim > width):
        raise ValueError(f"pi0 {size}: state/action dims above {width} are not supported")
    return PI0Config(
        vlm_config=dict(
            model_type="paligemma",
            text_config=dict(model_type="gemma", **a["text"]),
            vision_config=dict(model_type="siglip_vision_model", image_size=a["image_size"],
                               patch_size=a["patch_size"], vision_use_head=False, **a["vision"]),
            projection_dim=a["text"]["hidden_size"],
            image_token_id=a["image_token_id"],
        ),
        dit_config=dict(model_type="gemma", **a["expert"]),
        chunk_size=chunk_size,
        max_state_dim=width or spec.state_dim,
        max_action_dim=width or spec.action_dim,
        num_inference_steps=num_steps,
    )


class Pi0Policy(ReleaseCheckpointMixin, FlowPolicy):
    """pi0 with a stochastic sampler; log-probs per action step (summed over dims and steps)."""

    family = "pi0"
    OPTIONS = Pi0Options
    RELEASE_RULES = RELEASE_RULES
    FRESH = FRESH

    def __init__(self, opts: Pi0Options, spec: EnvSpec, pi0_config: Any = None, tokenizer: Any = None) -> None:
        from transformers import PI0ForConditionalGeneration

        super().__init__(spec, opts.chunk_size)
        self.opts = opts
        pcfg = pi0_config or build_pi0_config(opts.size, spec, opts.chunk_size, opts.num_steps)
        pcfg.chunk_size = opts.chunk_size
        self.cameras = pick_cameras(spec, opts.cameras, opts.max_cameras)
        vis = pcfg.vlm_config.vision_config
        self.image_size = int(vis.image_size)
        self.tokens_per_image = (vis.image_size // vis.patch_size) ** 2
        self.image_token_id = int(pcfg.vlm_config.image_token_id)
        self.state_dim = int(pcfg.max_state_dim)
        self.model_action_dim = int(pcfg.max_action_dim)
        hidden = int(pcfg.dit_config.hidden_size)
        with seeded_init(opts.init_seed):
            self.pi0 = PI0ForConditionalGeneration(pcfg)
            self.value_head = ValueHead(hidden)
            self.sampler = FlowSampler(opts.sampler_config(), hidden, self.model_action_dim, spec.action_dim)
        self.tokenizer = tokenizer or char_tokenizer()
        self._freeze_unread()
        place(self, opts)
        self.eval()

    def _freeze_unread(self) -> None:
        """The expert's token table and the VLM's last-layer query/output path never feed pi0's
        actions or value (only that layer's keys/values do); frozen, not silently gradient-less."""
        vlm_lm = self.pi0.model.vlm.language_model
        last = vlm_lm.layers[-1]
        freeze(self.pi0.model.dit.embed_tokens.parameters())
        freeze(vlm_lm.norm.parameters())
        for mod in (last.self_attn.q_proj, last.self_attn.o_proj, last.post_attention_layernorm, last.mlp):
            freeze(mod.parameters())

    # -- observation -> prefix ------------------------------------------------------------------

    def _context(self, obs: Observation) -> dict[str, Any]:
        """Run the VLM over images + instruction once; the cache serves every denoising step."""
        dev, dt = self.device, self.pi0.dtype
        obs = obs.to_torch(dev, self.cameras)
        pixels = preprocess_images(obs.images, self.cameras, self.image_size, IMAGE_MEAN, IMAGE_STD, dev, dt)
        b, ncam = pixels.shape[:2]
        ids, mask = encode_text(self.tokenizer, [f"{s}\n" for s in obs.instruction], self.opts.max_text_len)
        n_img = ncam * self.tokens_per_image
        ids = torch.cat([torch.full((b, n_img), self.image_token_id), ids], 1).to(dev)
        mask = torch.cat([torch.ones(b, n_img, dtype=torch.long), mask], 1).to(dev)
        cam_mask = torch.ones(b, ncam, dtype=torch.bool, device=dev)
        embeds = self.pi0.model.embed_prefix(ids, pixels, cam_mask)
        out = self.pi0.model.vlm(
            inputs_embeds=embeds,
            attention_mask=mask,
            position_ids=mask.cumsum(-1) - 1,
            token_type_ids=torch.zeros_like(mask),
            use_cache=True,
        )
        state = state_tensor(obs.state, self.state_dim).to(dt)
        ctx = {"cache": out.cache, "mask": mask, "state": state, "prefix_len": out.cache.get_seq_length()}
        ctx["value"] = self._value(ctx)
        return ctx

    def _expert(self, ctx: dict[str, Any], suffix: torch.Tensor) -> torch.Tensor:
        out = self.pi0.model(action_embeds=suffix, attention_mask=ctx["mask"], cache=ctx["cache"])
        cache = ctx["cache"]
        cache.crop(ctx["prefix_len"] - cache.get_seq_length())  # drop this step's suffix keys: steps never see each other
        return out.last_hidden_state

    def _value(self, ctx: dict[str, Any]) -> torch.Tensor:
        state_tok = self.pi0.embed_action_time.state_proj(ctx["state"])[:, None]
        return self.value_head(self._expert(ctx, state_tok)[:, 0])

    def _velocity_fn(self, ctx: dict[str, Any]):
        dt = self.pi0.dtype

        def velocity(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            suffix = self.pi0.embed_action_time(ctx["state"], x.to(dt), t)
            h = self._expert(ctx, suffix)[:, -self.chunk_size :]
            return self.pi0.action_out_proj(h).float(), h

        return velocity

    # -- checkpoints --------------------------------------------------------------------------------

    def _release_config(self) -> dict[str, Any]:
        """A transformers-format pi0 directory: its ``PI0Config`` leads ``config.json``."""
        return self.pi0.config.to_dict()

    @classmethod
    def _read_release(cls, local_dir: str) -> Any:
        """A local transformers-format pi0 release (``config.json`` with ``model_type: pi0``)."""
        ck = read_local(local_dir, cls.family)
        if ck.config.get("model_type") != "pi0":
            raise ValueError(f"pi0: {local_dir}/config.json is not a pi0 config (model_type={ck.config.get('model_type')!r})")
        return ck

    @classmethod
    def _build_loaded(cls, ck: Any, opts: Pi0Options, spec: EnvSpec, overrides: dict[str, Any]) -> "Pi0Policy":
        from transformers import PI0Config

        pcfg = PI0Config.from_dict({k: v for k, v in ck.config.items() if k not in ("rlvla3_family", "options")})
        if "chunk_size" not in overrides and "options" not in ck.config:
            opts.chunk_size = pcfg.chunk_size  # a plain release: its chunk size
        return cls(opts, spec, pi0_config=pcfg, tokenizer=ck.tokenizer)


@register_policy("pi0", config=Pi0Options)
def build_pi0(opts: Pi0Options, spec: EnvSpec) -> Policy:
    return Pi0Policy(opts, spec)
