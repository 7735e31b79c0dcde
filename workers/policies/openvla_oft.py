"""OpenVLA-OFT as the released prismatic model computes it, with the token head RL samples from.

Sequence (one pass, OFT's parallel decoding)::

    <bos> [DINOv2|SigLIP patches per image] [proprio] "In: What action ... ?\\nOut:" [▁]
    [0 x chunk*action_dim] </s>

The action positions get zero embeddings, the stop token its own; attention is bidirectional
over the whole sequence (OFT's patched Llama), padding masked out as keys. Action token ``j`` is
read, as in a causal LM, from the state one position before it: the last prompt token and the
first ``n - 1`` action positions (``predict_action``'s slice). Each gives a distribution over
OpenVLA's action ids, the last ``n_bins`` ids of the unpadded vocab (31744-31999 at 7B); id
``base - 1 - c`` is bin centre ``c`` of ``linspace(-1, 1, n_bins)`` (the lowest id shares the top
centre, as OpenVLA decodes it). RL samples those tokens at ``temperature`` and takes log-probs
and entropy from the same distribution. The L1-regression head (``action_head: l1``) reads the
same states and acts deterministically.

Prompts of one batch differ in length: the padding sits before each prompt and position ids
come from the mask, so a sample computes what it computes alone. The critic reads the last
prompt token's state, just before the action block (RLinf's choice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rlvla3.observation import Observation
from workers.contract import EnvSpec
from workers.policies.base import ActOutput, EvalOutput, Policy, register_policy
from workers.policies.prismatic_towers import DINO_MEAN, DINO_STD, SIGLIP_MEAN, SIGLIP_STD, FusedTowers, normalise, resize_images
from workers.policies.stats_norm import StatsNorm
from workers.policies.vla_common import VLAOptions, ValueHead, char_tokenizer, pick_cameras, place, seeded_init, size_preset, state_tensor

_LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                  vocab_size=32064)
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "dino": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, image_size=32, patch_size=8),
        "siglip": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, image_size=32, patch_size=8),
        "llm": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=384),
        "vocab_pad": 64,
    },
    # ~0.5B: ViT-B-sized towers at 224 px, a 16-layer 1024-wide Llama with OpenVLA's vocabulary.
    "medium": {
        "dino": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, image_size=224, patch_size=14),
        "siglip": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, image_size=224, patch_size=14),
        "llm": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                    vocab_size=32064),
        "vocab_pad": 64,
    },
    # OpenVLA-7B: DINOv2 ViT-L/14 (reg4) + SigLIP So400m/14 at 224 px, Llama-2 7B, vocab padded to 32064.
    "7b": {
        "dino": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, image_size=224, patch_size=14),
        "siglip": dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, image_size=224, patch_size=14),
        "llm": _LLAMA2_7B,
        "vocab_pad": 64,
    },
}
ACTION_HEADS = ("tokens", "l1")
READOUTS = ("argmax", "expected")


@dataclass
class OpenVLAOFTOptions(VLAOptions):
    """Options of the OpenVLA-OFT family."""

    max_text_len: int = 2048
    """Prompt tokens kept: the whole OpenVLA prompt (it wraps the instruction in ~40 characters of
    template), up to the release's ``llm_max_length``."""
    n_bins: int = 256
    """Action bins per dimension (OpenVLA's 256): the last ``n_bins`` ids of the unpadded vocabulary."""
    temperature: float = 1.0
    """Temperature of the action-token distribution: RL samples and scores at this one."""
    proprio: bool = True
    """Feed the proprio state as one token after the image patches (OFT's proprio projector)."""
    action_head: str = "tokens"
    """``tokens`` (RL's: sampled action ids, log-probs, entropy) or ``l1`` (the authors' L1-regression
    head: deterministic actions, no log-probs, so act only)."""
    unnorm_key: str | None = None
    """Which dataset's statistics a release trained on several uses (OFT's ``unnorm_key``)."""
    readout: str = "argmax"
    """How a deterministic act reads the token head: ``argmax`` (each dimension's most likely bin,
    as OpenVLA's ``predict_action`` decodes) or ``expected`` (the probability-weighted mean of the
    bin centres). A small model's bins stay spread, often over both sides of a dimension, and its
    most likely bin can then be a standstill the samples never make: a pixel checkpoint after GRPO
    scored 0.05 by argmax and 0.92 by the expected action on 100 held-out starts
    (docs/architecture.md, "Pixels to success"). Sampling, log-probs and training are the same either way."""

    def __post_init__(self) -> None:
        if self.action_head not in ACTION_HEADS:
            raise ValueError(f"openvla_oft: action_head {self.action_head!r} not in {ACTION_HEADS}")
        if self.readout not in READOUTS:
            raise ValueError(f"openvla_oft: readout {self.readout!r} not in {READOUTS}")


class L1RegressionHead(nn.Module):
    """OFT's ``L1RegressionActionHead.model`` (an MLP-ResNet on one step's action-token states)."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, blocks: int = 2) -> None:
        super().__init__()
        self.layer_norm1, self.fc1 = nn.LayerNorm(in_dim), nn.Linear(in_dim, hidden)
        self.mlp_resnet_blocks = nn.ModuleList(nn.ModuleDict({"ffn": nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.ReLU())})
                                               for _ in range(blocks))
        self.layer_norm2, self.fc2 = nn.LayerNorm(hidden), nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(self.layer_norm1(x)))
        for block in self.mlp_resnet_blocks:
            x = x + block["ffn"](x)
        return self.fc2(self.layer_norm2(x))


class OpenVLAOFTPolicy(Policy):
    family = "openvla_oft"
    logprob_level = "token"
    OPTIONS = OpenVLAOFTOptions

    def __init__(self, opts: OpenVLAOFTOptions, spec: EnvSpec, tokenizer: Any = None, arch: dict[str, Any] | None = None,
                 preprocess: dict[str, Any] | None = None) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        super().__init__(spec, opts.chunk_size)
        self.arch = a = arch or size_preset(self.family, SIZES, opts.size)
        self.opts = opts
        self.cameras = pick_cameras(spec, opts.cameras, opts.max_cameras)
        self.tokenizer = tokenizer or char_tokenizer()
        self.preprocess = dict(preprocess or {"means": [DINO_MEAN, SIGLIP_MEAN], "stds": [DINO_STD, SIGLIP_STD]})
        self.base_vocab = a["llm"]["vocab_size"] - a["vocab_pad"]
        if not 2 <= opts.n_bins <= self.base_vocab:
            raise ValueError(f"openvla_oft: {opts.n_bins} bins do not fit the {self.base_vocab}-id vocabulary")
        vocab = self.tokenizer.get_vocab()
        self.space_id = vocab.get("▁")  # Llama's empty token ends every OpenVLA prompt
        hidden = a["llm"]["hidden_size"]
        self.n_action_tokens = self.chunk_size * self.action_dim
        self.norm = StatsNorm(spec.state_dim, spec.action_dim)
        with seeded_init(opts):
            self.towers = FusedTowers(a["dino"], a["siglip"])
            vis = self.towers.width
            # PrismaticProjector for fused towers (fc1 -> GELU -> fc2 -> GELU -> fc3).
            self.projector = nn.Sequential(nn.Linear(vis, 4 * vis), nn.GELU(), nn.Linear(4 * vis, hidden), nn.GELU(), nn.Linear(hidden, hidden))
            self.llm = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **a["llm"]))
            self.proprio_proj = (nn.Sequential(nn.Linear(spec.state_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden))
                                 if opts.proprio else None)
            self.l1_head = L1RegressionHead(hidden * self.action_dim, hidden, self.action_dim) if opts.action_head == "l1" else None
            self.value_head = ValueHead(hidden)
        edges = np.linspace(-1.0, 1.0, opts.n_bins)
        self.register_buffer("bin_edges", torch.tensor(edges, dtype=torch.float32), persistent=False)
        self.register_buffer("bin_centers", torch.tensor((edges[:-1] + edges[1:]) / 2, dtype=torch.float32), persistent=False)
        place(self, opts)
        self.eval()

    # -- observation -> hidden states ---------------------------------------------------------------

    def _prompt_ids(self, instructions: list[str]) -> list[list[int]]:
        """OpenVLA's prompt per sample (bos excluded), ``▁`` appended as ``predict_action`` does."""
        prompts = [f"In: What action should the robot take to {s.lower()}?\nOut:" for s in instructions]
        rows = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        out = []
        for ids in rows:
            ids = list(ids)[: self.opts.max_text_len]
            if self.space_id is not None and (not ids or ids[-1] != self.space_id):
                ids.append(self.space_id)
            out.append(ids)
        return out

    def _images(self, obs: Observation) -> torch.Tensor:
        px = torch.from_numpy(resize_images(obs.images, self.cameras, self.towers.image_size)).to(self.device)
        dt = self.llm.dtype
        (dm, sm), (ds, ss) = self.preprocess["means"], self.preprocess["stds"]
        return self.projector(self.towers(normalise(px, dm, ds, dt), normalise(px, sm, ss, dt)))

    def _hidden(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states that predict the action tokens ``[B, n, D]`` and the last prompt token's ``[B, D]``."""
        dev = self.device
        img = self._images(obs)
        b, dt = img.shape[0], img.dtype
        parts = [img]
        if self.proprio_proj is not None:
            state = state_tensor(torch.as_tensor(np.asarray(obs.state)), self.spec.state_dim).clamp(-1.0, 1.0)
            parts.append(self.proprio_proj(state.to(dev, dt))[:, None])
        rows = self._prompt_ids(list(obs.instruction))
        width = max(1, max(len(r) for r in rows))
        ids = torch.full((b, width), self.tokenizer.pad_token_id or 0, dtype=torch.long)
        tmask = torch.zeros((b, width), dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, width - len(r):], tmask[i, width - len(r):] = torch.tensor(r, dtype=torch.long), True
        emb = self.llm.get_input_embeddings()
        special = emb(torch.tensor([self.tokenizer.bos_token_id, self.tokenizer.eos_token_id], device=dev))
        n = self.n_action_tokens
        embeds = torch.cat([special[0].expand(b, 1, -1), *parts, emb(ids.to(dev)), img.new_zeros(b, n, img.shape[-1]),
                            special[1].expand(b, 1, -1)], dim=1)
        prefix = embeds.shape[1] - width - n - 1
        keys = torch.cat([torch.ones(b, prefix, dtype=torch.bool), tmask, torch.ones(b, n + 1, dtype=torch.bool)], dim=1).to(dev)
        mask = torch.zeros(b, 1, keys.shape[1], keys.shape[1], device=dev, dtype=dt)
        mask = mask.masked_fill(~keys[:, None, None, :], torch.finfo(dt).min)  # bidirectional; padding never attended
        pos = (keys.long().cumsum(-1) - 1).clamp_min(0)
        h = self.llm.model(inputs_embeds=embeds, attention_mask=mask, position_ids=pos).last_hidden_state
        return h[:, -n - 2 : -2], h[:, -n - 2]

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Action-token logits ``[B, n, n_bins]`` (float32) at the temperature; index k is id ``base - n_bins + k``."""
        w = self.llm.lm_head.weight[self.base_vocab - self.opts.n_bins : self.base_vocab]
        return F.linear(h, w).float() / self.opts.temperature

    def _centres(self, bins: torch.Tensor) -> torch.Tensor:
        """Bin indices -> their normalised bin centres (OpenVLA's decoding), same shape."""
        return self.bin_centers[(self.opts.n_bins - 1 - bins).clamp(0, self.opts.n_bins - 2)]

    def _actions(self, bins: torch.Tensor) -> torch.Tensor:
        """Bin indices ``[B, n]`` -> normalised actions ``[B, T, A]``."""
        return self._centres(bins).view(-1, self.chunk_size, self.action_dim)

    def _bins(self, normalised: torch.Tensor) -> torch.Tensor:
        """Normalised actions -> action-token index, as OpenVLA's ActionTokenizer encodes one
        (``id = base - digitize(a, edges)``), same shape."""
        d = torch.bucketize(normalised.clamp(-1.0, 1.0).contiguous(), self.bin_edges, right=True)
        return (self.opts.n_bins - d).clamp(0, self.opts.n_bins - 1)

    def _expected(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``expected`` readout: normalised actions ``[B, T, A]`` and the bins they fall in ``[B, n]``."""
        ids = torch.arange(self.opts.n_bins, device=logits.device)
        mean = (logits.softmax(-1) * self._centres(ids)).sum(-1)
        return mean.view(-1, self.chunk_size, self.action_dim), self._bins(mean)

    # -- the policy contract ------------------------------------------------------------------------

    def act(self, obs: Observation, deterministic: bool = False) -> ActOutput:
        with torch.no_grad():
            h, last = self._hidden(self.norm.state_in(obs))
            value = self.value_head(last)
            if self.l1_head is not None:
                b = h.shape[0]
                actions = self.l1_head(h.reshape(b, self.chunk_size, -1)).float()
                return ActOutput(actions=self.norm.action_out(actions), logprob=torch.zeros(b, self.n_action_tokens, device=h.device),
                                 value=value)
            logits = self._logits(h)
            if deterministic and self.opts.readout == "expected":
                actions, tok = self._expected(logits)
            else:
                tok = logits.argmax(-1) if deterministic else torch.distributions.Categorical(logits=logits).sample()
                actions = self._actions(tok)
            lp = logits.log_softmax(-1).gather(-1, tok[..., None]).squeeze(-1)
        return ActOutput(actions=self.norm.action_out(actions), logprob=lp, value=value, replay={"action_bins": tok})

    def evaluate(self, obs: Observation, actions: torch.Tensor, replay: dict[str, torch.Tensor]) -> EvalOutput:
        if self.l1_head is not None:
            raise ValueError("openvla_oft: the L1-regression head has no action distribution; RL needs action_head: tokens")
        h, last = self._hidden(self.norm.state_in(obs))
        logp = self._logits(h).log_softmax(-1)
        if "action_bins" in replay:
            tok = replay["action_bins"].to(self.device).long().clone()  # clone: may come from inference_mode
        else:  # given actions without a sample's replay (behaviour cloning, workers/sft.py)
            tok = self.action_bins(actions)
        lp = logp.gather(-1, tok[..., None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return EvalOutput(logprob=lp, entropy=entropy, value=self.value_head(last))

    def action_bins(self, actions: torch.Tensor) -> torch.Tensor:
        """Env actions ``[B, T, A]`` -> action-token index ``[B, T*A]`` (normalised, then ``_bins``)."""
        a = (actions.to(self.device).float() - self.norm.action_shift) / self.norm.action_scale
        return self._bins(a).reshape(len(a), -1)


@register_policy("openvla_oft", config=OpenVLAOFTOptions)
def build_openvla_oft(opts: OpenVLAOFTOptions, spec: EnvSpec) -> Policy:
    return OpenVLAOFTPolicy(opts, spec)
