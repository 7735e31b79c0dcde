"""OpenVLA-OFT composed from transformers parts: SigLIP (+ DINOv2) -> MLP projector -> Llama.

Actions are discretised into ``n_bins`` bins per dimension, mapped onto the last ``n_bins``
vocabulary ids as in OpenVLA. OFT's parallel decoding: the prompt is followed by one learned
placeholder embedding per action token (``chunk_size * action_dim`` of them), and one forward pass
gives the logits of every action token at once - no autoregressive loop, so ``act`` and
``evaluate`` run the same single pass and the log-probs agree exactly.

Sequence: ``<bos> [image patches per camera] instruction [proprio token] [placeholders]``, the
instruction right-padded and position ids taken from the mask, so padding never shifts a sample.
The critic reads the proprio token's final hidden state (it sees the whole prompt, and causal
attention keeps it blind to the placeholders).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rlvla3.observation import Observation
from workers.contract import EnvSpec
from workers.policies.base import ActOutput, EvalOutput, Policy, register_policy
from workers.policies.stats_norm import StatsNorm
from workers.policies.vla_common import (
    SIGLIP_BASE,
    SIGLIP_SO400M,
    TINY_VIT,
    VLAOptions,
    ValueHead,
    char_tokenizer,
    encode_text,
    freeze,
    pick_cameras,
    place,
    preprocess_images,
    seeded_init,
    size_preset,
    state_tensor,
)

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "image_size": 32,
        "patch_size": 8,
        "siglip": TINY_VIT,
        "dinov2": TINY_VIT,
        "llm": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=160),
    },
    # ~0.5B: SigLIP-B + a 12-layer ViT-B DINOv2 at 224 px, a 16-layer 1024-wide Llama.
    "medium": {
        "image_size": 224,
        "patch_size": 14,
        "siglip": SIGLIP_BASE,
        "dinov2": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
        "llm": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=16,
                    num_key_value_heads=16, vocab_size=32064),
    },
    # OpenVLA-7B: SigLIP So400m/14 + DINOv2 ViT-L/14 at 224 px, Llama-2 7B.
    "7b": {
        "image_size": 224,
        "patch_size": 14,
        "siglip": SIGLIP_SO400M,
        "dinov2": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16),
        "llm": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=32, vocab_size=32064),
    },
}

SIGLIP_MEAN, SIGLIP_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
DINO_MEAN, DINO_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass
class OpenVLAOFTOptions(VLAOptions):
    """Options of the OpenVLA-OFT family."""

    n_bins: int = 32
    """Action bins per dimension (OpenVLA uses 256); they occupy the last ``n_bins`` vocab ids."""
    use_dinov2: bool = True
    """Fuse DINOv2 patch features with SigLIP's, as OpenVLA's fused backbone does."""
    temperature: float = 1.0
    """Sampling temperature of the action-token distribution (log-probs use the same one)."""


class OpenVLAOFTPolicy(Policy):
    family = "openvla_oft"
    logprob_level = "token"
    OPTIONS = OpenVLAOFTOptions

    def __init__(self, opts: OpenVLAOFTOptions, spec: EnvSpec, tokenizer: Any = None) -> None:
        from transformers import Dinov2Config, Dinov2Model, LlamaConfig, LlamaForCausalLM, SiglipVisionConfig, SiglipVisionModel

        super().__init__(spec, opts.chunk_size)
        a = size_preset(self.family, SIZES, opts.size)
        self.opts = opts
        self.cameras = pick_cameras(spec, opts.cameras, opts.max_cameras)
        self.image_size = a["image_size"]
        self.tokenizer = tokenizer or char_tokenizer()
        vocab = a["llm"]["vocab_size"]
        if opts.n_bins > vocab - len(self.tokenizer):
            raise ValueError(f"openvla_oft: {opts.n_bins} bins overlap the tokenizer's {len(self.tokenizer)} ids")
        hidden = a["llm"]["hidden_size"]
        self.norm = StatsNorm(spec.state_dim, spec.action_dim)
        with seeded_init(opts):
            self.siglip = SiglipVisionModel(SiglipVisionConfig(image_size=a["image_size"], patch_size=a["patch_size"],
                                                               vision_use_head=False, **a["siglip"]))
            vis_dim = a["siglip"]["hidden_size"]
            self.dinov2 = None
            if opts.use_dinov2:
                self.dinov2 = Dinov2Model(Dinov2Config(image_size=a["image_size"], patch_size=a["patch_size"], **a["dinov2"]))
                vis_dim += a["dinov2"]["hidden_size"]
            # OpenVLA's fused-backbone PrismaticProjector: vision -> 4 x vision -> LLM -> LLM.
            self.projector = nn.Sequential(nn.Linear(vis_dim, 4 * vis_dim), nn.GELU(), nn.Linear(4 * vis_dim, hidden),
                                           nn.GELU(), nn.Linear(hidden, hidden))
            self.llm = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **a["llm"]))
            self.proprio_proj = nn.Sequential(nn.Linear(spec.state_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden))
            self.n_action_tokens = self.chunk_size * self.action_dim
            self.action_queries = nn.Parameter(torch.randn(self.n_action_tokens, hidden) * 0.02)
            self.value_head = ValueHead(hidden)
        if self.dinov2 is not None:
            freeze([self.dinov2.embeddings.mask_token])  # only used for masked-image pretraining
        lo, hi = spec.action_low, spec.action_high
        width = (hi - lo) / opts.n_bins
        self.register_buffer("bin_centers", lo + width * (torch.arange(opts.n_bins) + 0.5), persistent=False)
        place(self, opts)
        self.eval()

    # -- observation -> hidden states of the placeholders ----------------------------------------

    def _vision(self, obs: Observation) -> torch.Tensor:
        dev, dt = self.device, self.llm.dtype
        sig = preprocess_images(obs.images, self.cameras, self.image_size, SIGLIP_MEAN, SIGLIP_STD, dev, dt)
        b, ncam = sig.shape[:2]
        feats = self.siglip(pixel_values=sig.flatten(0, 1)).last_hidden_state
        if self.dinov2 is not None:
            dino = preprocess_images(obs.images, self.cameras, self.image_size, DINO_MEAN, DINO_STD, dev, dt)
            d = self.dinov2(pixel_values=dino.flatten(0, 1)).last_hidden_state[:, 1:]  # drop CLS
            feats = torch.cat([d, feats], dim=-1)  # DINOv2 first, as OpenVLA's fused backbone
        return self.projector(feats).reshape(b, ncam * feats.shape[1], -1)

    def _forward(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass; returns bin logits ``[B, L, n_bins]`` (float32) and values ``[B]``."""
        dev = self.device
        obs = obs.to_torch(dev, self.cameras)
        img = self._vision(obs)
        b = img.shape[0]
        prompts = [f"What action should the robot take to {s.lower()}?" for s in obs.instruction]
        ids, tmask = encode_text(self.tokenizer, prompts, self.opts.max_text_len, bos=False)
        ids, tmask = ids.to(dev), tmask.to(dev)
        emb = self.llm.get_input_embeddings()
        bos = emb(torch.full((b, 1), self.tokenizer.bos_token_id, device=dev))
        proprio = self.proprio_proj(state_tensor(obs.state, self.spec.state_dim).to(img.dtype))[:, None]
        queries = self.action_queries.to(img.dtype)[None].expand(b, -1, -1)
        embeds = torch.cat([bos, img, emb(ids), proprio, queries], dim=1)
        ones = lambda n: torch.ones(b, n, dtype=torch.long, device=dev)  # noqa: E731
        mask = torch.cat([ones(1 + img.shape[1]), tmask, ones(1 + self.n_action_tokens)], dim=1)
        out = self.llm.model(inputs_embeds=embeds, attention_mask=mask, position_ids=mask.cumsum(-1) - 1)
        h = out.last_hidden_state
        n = self.n_action_tokens
        bins_w = self.llm.lm_head.weight[-self.opts.n_bins :]  # the action ids are the last vocab rows
        logits = F.linear(h[:, -n:], bins_w).float() / self.opts.temperature
        return logits, self.value_head(h[:, -n - 1])

    # -- the policy contract ----------------------------------------------------------------------

    def act(self, obs: Observation, deterministic: bool = False) -> ActOutput:
        with torch.no_grad():
            logits, value = self._forward(self.norm.state_in(obs))
            logp = logits.log_softmax(-1)
            if deterministic:
                tok = logits.argmax(-1)
            else:
                tok = torch.distributions.Categorical(logits=logits).sample()
            lp = logp.gather(-1, tok[..., None]).squeeze(-1)
        actions = self.norm.action_out(self.bin_centers[tok].view(-1, self.chunk_size, self.action_dim).float())
        return ActOutput(actions=actions, logprob=lp, value=value, replay={"action_bins": tok})

    def evaluate(self, obs: Observation, actions: torch.Tensor, replay: dict[str, torch.Tensor]) -> EvalOutput:
        logits, value = self._forward(self.norm.state_in(obs))
        logp = logits.log_softmax(-1)
        if "action_bins" in replay:
            tok = replay["action_bins"].to(self.device).long().clone()  # clone: may come from inference_mode
        else:  # given actions without a sample's replay (behaviour cloning, workers/sft.py)
            tok = self.action_bins(actions)
        lp = logp.gather(-1, tok[..., None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return EvalOutput(logprob=lp, entropy=entropy, value=value)

    def action_bins(self, actions: torch.Tensor) -> torch.Tensor:
        """Env actions ``[B, T, A]`` -> the bin of each action token ``[B, T*A]`` (the bin whose
        centre is nearest, after the release's action normalisation is undone)."""
        a = (actions.to(self.device).float() - self.norm.action_shift) / self.norm.action_scale
        lo = self.spec.action_low
        width = (self.spec.action_high - lo) / self.opts.n_bins
        tok = ((a - lo) / width).floor().long().clamp(0, self.opts.n_bins - 1)
        return tok.reshape(len(tok), -1)


@register_policy("openvla_oft", config=OpenVLAOFTOptions)
def build_openvla_oft(opts: OpenVLAOFTOptions, spec: EnvSpec) -> Policy:
    return OpenVLAOFTPolicy(opts, spec)
