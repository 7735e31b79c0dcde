"""pi0 on transformers' native ``PI0ForConditionalGeneration``, plus what RL needs.

transformers provides the model (PaliGemma prefix, Gemma action expert, flow-matching velocity).
This module adds: observation -> prompt/pixels, the stochastic flow sampler with log-probs
(``flow_sampler``) and a critic on the action expert's state token. Checkpoints in and out
(transformers' and LeRobot's layouts) live in ``workers.release``, which builds this class.

The critic reads the expert's hidden state at the *state token*: in pi0's attention layout that
token sees the prefix and itself only, never the noisy actions, so the value does not depend on
the sampled noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlvla3.observation import Observation
from workers.contract import EnvSpec
from workers.policies.base import Policy, register_policy
from workers.policies.flow_sampler import FlowOptions, FlowPolicy, FlowSampler
from workers.policies.paligemma import IMAGE_MEAN, IMAGE_STD, SIZES
from workers.policies.stats_norm import StatsNorm
from workers.policies.vla_common import (
    VLAOptions,
    ValueHead,
    char_tokenizer,
    encode_text,
    freeze,
    freeze_query_path,
    pick_cameras,
    place,
    preprocess_images,
    seeded_init,
    size_preset,
    state_tensor,
)

@dataclass
class Pi0Options(VLAOptions, FlowOptions):
    """Options of the pi0 family (``model.options`` in the job config)."""


def build_pi0_config(size: str | dict[str, Any], spec: EnvSpec, chunk_size: int, num_steps: int) -> Any:
    """transformers' ``PI0Config`` of a size preset (or of a preset-shaped dict read off a release)."""
    from transformers import PI0Config

    a = size if isinstance(size, dict) else size_preset("pi0", SIZES, size)
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
        max_state_dim=a.get("max_state_dim") or width or spec.state_dim,
        max_action_dim=a.get("max_action_dim") or width or spec.action_dim,
        num_inference_steps=num_steps,
    )


def arch_of(pcfg: Any) -> dict[str, Any]:
    """The size-preset dict a ``PI0Config`` describes (what LeRobot's config must express)."""
    vlm, vis = pcfg.vlm_config, pcfg.vlm_config.vision_config
    gemma = lambda c: {k: getattr(c, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",  # noqa: E731
                                                  "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")}
    return {
        "image_size": vis.image_size, "patch_size": vis.patch_size,
        "vision": {k: getattr(vis, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")},
        "text": gemma(vlm.text_config), "expert": gemma(pcfg.dit_config), "image_token_id": vlm.image_token_id,
        "pad_dims": True, "max_state_dim": pcfg.max_state_dim, "max_action_dim": pcfg.max_action_dim,
    }


class Pi0Policy(FlowPolicy):
    """pi0 with a stochastic sampler; log-probs per action step (summed over dims and steps)."""

    family = "pi0"
    OPTIONS = Pi0Options

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
        self.arch = arch_of(pcfg)
        self.norm = StatsNorm(spec.state_dim, spec.action_dim)
        with seeded_init(opts):
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
        freeze(self.pi0.model.dit.embed_tokens.parameters())
        freeze_query_path(self.pi0.model.vlm.language_model)

    # -- observation -> prefix ------------------------------------------------------------------

    def model_inputs(self, obs: Observation) -> dict[str, torch.Tensor]:
        """The upstream model's inputs for ``obs`` (already normalised): what
        ``PI0ForConditionalGeneration.sample_actions`` takes, so exports can be checked against it."""
        dev, dt = self.device, self.pi0.dtype
        obs = obs.to_torch(dev, self.cameras)
        pixels = preprocess_images(obs.images, self.cameras, self.image_size, IMAGE_MEAN, IMAGE_STD, dev, dt, pad=True)
        b, ncam = pixels.shape[:2]
        ids, mask = encode_text(self.tokenizer, [f"{s}\n" for s in obs.instruction], self.opts.max_text_len)
        n_img = ncam * self.tokens_per_image
        ids = torch.cat([torch.full((b, n_img), self.image_token_id), ids], 1).to(dev)
        mask = torch.cat([torch.ones(b, n_img, dtype=torch.long), mask], 1).to(dev)
        return {"input_ids": ids, "pixel_values": pixels, "attention_mask": mask,
                "pixel_attention_mask": torch.ones(b, ncam, dtype=torch.bool, device=dev),
                "state": state_tensor(obs.state, self.state_dim).to(dt)}

    def checkpoint_towers(self) -> list[Any]:
        """Only the vision tower recomputes: the expert reads the cache the language model writes."""
        return [self.pi0.model.vlm.vision_tower]

    def _context(self, obs: Observation) -> dict[str, Any]:
        """Run the VLM over images + instruction once; the cache serves every denoising step."""
        inp = self.model_inputs(obs)
        mask = inp["attention_mask"]
        embeds = self.pi0.model.embed_prefix(inp["input_ids"], inp["pixel_values"], inp["pixel_attention_mask"])
        out = self.pi0.model.vlm(
            inputs_embeds=embeds,
            attention_mask=mask,
            position_ids=mask.cumsum(-1) - 1,
            token_type_ids=torch.zeros_like(mask),
            use_cache=True,
        )
        ctx = {"cache": out.cache, "mask": mask, "state": inp["state"], "prefix_len": out.cache.get_seq_length()}
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


@register_policy("pi0", config=Pi0Options)
def build_pi0(opts: Pi0Options, spec: EnvSpec) -> Policy:
    return Pi0Policy(opts, spec)
