"""Tensor names and shapes of a prismatic (OpenVLA / OpenVLA-OFT) release <-> ``OpenVLAOFTPolicy``.

The release holds timm towers (``vision_backbone.featurizer`` = DINOv2 reg4,
``vision_backbone.fused_featurizer`` = SigLIP) and the policy holds transformers'
``Dinov2WithRegistersModel`` / ``SiglipVisionModel``, so the towers convert as transformers' own
timm conversions do: the fused ``attn.qkv`` splits into q/k/v, DINOv2's patch-only ``pos_embed``
gains a zero row for the class token (whose position row folds back into ``cls_token`` on the way
out), SigLIP's ``pos_embed`` loses its batch axis, and the attention-pool head's ``q`` + ``kv``
become one ``in_proj``. Everything else is a rename. Both directions use one table.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch

DINO, SIGLIP = "vision_backbone.featurizer.", "vision_backbone.fused_featurizer."
OURS_DINO, OURS_SIGLIP = "towers.dino.", "towers.siglip."

# (release pattern, our pattern): {i} a block index, {p} weight|bias.
_DINO_RULES = [
    ("cls_token", "embeddings.cls_token"),
    ("reg_token", "embeddings.register_tokens"),
    ("patch_embed.proj.{p}", "embeddings.patch_embeddings.projection.{p}"),
    ("blocks.{i}.norm1.{p}", "encoder.layer.{i}.norm1.{p}"),
    ("blocks.{i}.norm2.{p}", "encoder.layer.{i}.norm2.{p}"),
    ("blocks.{i}.attn.proj.{p}", "encoder.layer.{i}.attention.o_proj.{p}"),
    ("blocks.{i}.ls1.scale_factor", "encoder.layer.{i}.layer_scale1.lambda1"),
    ("blocks.{i}.ls2.scale_factor", "encoder.layer.{i}.layer_scale2.lambda1"),
    ("blocks.{i}.mlp.fc1.{p}", "encoder.layer.{i}.mlp.fc1.{p}"),
    ("blocks.{i}.mlp.fc2.{p}", "encoder.layer.{i}.mlp.fc2.{p}"),
    ("norm.{p}", "layernorm.{p}"),
]
_SIGLIP_RULES = [
    ("patch_embed.proj.{p}", "embeddings.patch_embedding.{p}"),
    ("blocks.{i}.norm1.{p}", "encoder.layers.{i}.layer_norm1.{p}"),
    ("blocks.{i}.norm2.{p}", "encoder.layers.{i}.layer_norm2.{p}"),
    ("blocks.{i}.attn.proj.{p}", "encoder.layers.{i}.self_attn.out_proj.{p}"),
    ("blocks.{i}.mlp.fc1.{p}", "encoder.layers.{i}.mlp.fc1.{p}"),
    ("blocks.{i}.mlp.fc2.{p}", "encoder.layers.{i}.mlp.fc2.{p}"),
    ("norm.{p}", "post_layernorm.{p}"),
    ("attn_pool.latent", "head.probe"),
    ("attn_pool.proj.{p}", "head.attention.out_proj.{p}"),
    ("attn_pool.norm.{p}", "head.layernorm.{p}"),
    ("attn_pool.mlp.fc1.{p}", "head.mlp.fc1.{p}"),
    ("attn_pool.mlp.fc2.{p}", "head.mlp.fc2.{p}"),
]
_PREFIXES = [("language_model.", "llm."), ("projector.fc1.", "projector.0."), ("projector.fc2.", "projector.2."),
             ("projector.fc3.", "projector.4.")]
QKV = {DINO: "encoder.layer.{i}.attention.{x}_proj.{p}", SIGLIP: "encoder.layers.{i}.self_attn.{x}_proj.{p}"}
OURS_ONLY = ("towers.dino.embeddings.mask_token",)
"""Held by transformers' DINOv2 for masked-image pretraining; no release has it (kept at zero)."""


def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)") + "$")


_TABLES = [(DINO, OURS_DINO, _DINO_RULES), (SIGLIP, OURS_SIGLIP, _SIGLIP_RULES)]
_FWD = [(rp + "", op, _regex(r), o) for rp, op, rules in _TABLES for r, o in rules]
_BWD = [(op, rp, _regex(o), r) for rp, op, rules in _TABLES for r, o in rules]


def _one_to_one(name: str, table: list) -> str | None:
    for src_prefix, dst_prefix, rx, template in table:
        if name.startswith(src_prefix):
            m = rx.match(name[len(src_prefix):])
            if m:
                return dst_prefix + template.format(**m.groupdict())
    return None


def to_ours(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Release tensors -> policy tensors, and the release names no rule takes (in order)."""
    out: dict[str, torch.Tensor] = {}
    unmapped: list[str] = []
    pool: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in sd.items():
        mapped = _one_to_one(name, _FWD)
        if mapped is not None:
            out[mapped] = t
            continue
        if any(name.startswith(rp) for rp, _ in _PREFIXES):
            rp, op = next((rp, op) for rp, op in _PREFIXES if name.startswith(rp))
            out[op + name[len(rp):]] = t
        elif name == DINO + "pos_embed":
            out[OURS_DINO + "embeddings.position_embeddings"] = torch.cat([t.new_zeros(1, 1, t.shape[-1]), t], dim=1)
        elif name == SIGLIP + "pos_embed":
            out[OURS_SIGLIP + "embeddings.position_embedding.weight"] = t[0]
        elif (m := re.match(r"^(vision_backbone\.(?:fused_)?featurizer\.)blocks\.(\d+)\.attn\.qkv\.(weight|bias)$", name)):
            tower, i, p = m.groups()
            ours = OURS_DINO if tower == DINO else OURS_SIGLIP
            for x, part in zip("qkv", t.chunk(3, dim=0)):
                out[ours + QKV[tower].format(i=i, x=x, p=p)] = part
        elif (m := re.match(r"^vision_backbone\.fused_featurizer\.attn_pool\.(q|kv)\.(weight|bias)$", name)):
            pool.setdefault(m.group(2), {})[m.group(1)] = t
        else:
            unmapped.append(name)
    for p, parts in pool.items():
        if set(parts) == {"q", "kv"}:
            out[OURS_SIGLIP + f"head.attention.in_proj_{p}"] = torch.cat([parts["q"], parts["kv"]], dim=0)
        else:
            unmapped.extend(SIGLIP + f"attn_pool.{x}.{p}" for x in parts)
    return out, unmapped


def to_release(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Policy tensors (towers, projector, language model) -> release names; the rest is the caller's."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str, str], dict[str, torch.Tensor]] = {}
    for name, t in sd.items():
        mapped = _one_to_one(name, _BWD)
        if mapped is not None:
            out[mapped] = t
        elif any(name.startswith(op) for _, op in _PREFIXES):
            rp, op = next((rp, op) for rp, op in _PREFIXES if name.startswith(op))
            out[rp + name[len(op):]] = t
        elif name == OURS_DINO + "embeddings.position_embeddings":
            out[DINO + "pos_embed"] = t[:, 1:]
        elif name == OURS_SIGLIP + "embeddings.position_embedding.weight":
            out[SIGLIP + "pos_embed"] = t[None]
        elif (m := re.match(r"^towers\.(dino|siglip)\.encoder\.layers?\.(\d+)\.(?:attention|self_attn)\.(q|k|v)_proj\.(weight|bias)$", name)):
            tower, i, x, p = m.groups()
            qkv.setdefault((DINO if tower == "dino" else SIGLIP, i, p), {})[x] = t
        elif (m := re.match(r"^towers\.siglip\.head\.attention\.in_proj_(weight|bias)$", name)):
            q, kv = t.split([t.shape[0] // 3, 2 * t.shape[0] // 3], dim=0)
            out[SIGLIP + f"attn_pool.q.{m.group(1)}"], out[SIGLIP + f"attn_pool.kv.{m.group(1)}"] = q, kv
    for (tower, i, p), parts in qkv.items():
        out[tower + f"blocks.{i}.attn.qkv.{p}"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    if OURS_DINO + "embeddings.position_embeddings" in sd:  # the class token's position row folds into the token
        out[DINO + "cls_token"] = sd[OURS_DINO + "embeddings.cls_token"] + sd[OURS_DINO + "embeddings.position_embeddings"][:, :1]
    return out


def blocks(names: Iterable[str], prefix: str) -> int:
    """Number of ``prefix``blocks.N. in a release's names."""
    idx = {int(m.group(1)) for n in names if (m := re.match(re.escape(prefix) + r"blocks\.(\d+)\.", n))}
    return max(idx) + 1 if idx else 0
