"""The tiny OpenVLA-OFT release the upstream code wrote, rebuilt byte for byte in its exact layout.

``tests/vectors/openvla_oft_tiny_reference.json`` was made by the upstream prismatic classes in
their own environment (its ``note`` says how). It keeps the small files that
``save_pretrained`` wrote (config.json, the shard index, processor and tokenizer configs), the
sha256 of every tensor and shard, and the reference's outputs. The tensors themselves follow a
fixed draw rule (``draw``, the same function the reference script ran), so this module rebuilds
the folder without storing 20 MB of weights, and checks each tensor against the upstream hash.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from pathlib import Path

import numpy as np
import torch

VECTORS = Path(__file__).parent / "vectors"
REFERENCE = json.loads((VECTORS / "openvla_oft_tiny_reference.json").read_text())
RELEASE_7B = json.loads((VECTORS / "openvla_oft_7b_tensors.json").read_text())
SEED = REFERENCE["seed"]


def draw(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Every tensor re-drawn at random (no default init left: LayerScale at 1e-5 would hide a wrong block)."""
    rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])
    special = any(s in name for s in ("pos_embed", "cls_token", "reg_token", "latent"))
    if len(shape) >= 2 and not special:
        x = rng.normal(0.0, 1.0 / math.sqrt(math.prod(shape[1:])), shape)
    elif len(shape) == 1 and name.endswith(".weight"):
        x = rng.uniform(0.5, 1.5, shape)
    else:
        x = rng.normal(0.0, 0.5 if special else 0.2, shape)
    if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):  # sharp attention: positions differ
        x *= 4.0
    if name.endswith("lm_head.weight"):  # action ids dominate the argmax, as in a trained release
        x[: 32000 - 256] *= 0.05
        x[32000:] *= 0.05
    return torch.from_numpy(x.astype(np.float32))


def raw_image(seed: int, h: int, w: int) -> np.ndarray:
    rng = np.random.default_rng([SEED, seed])
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([128 + 100 * np.sin(x / (9 + c) + y / (13 + 2 * c) + seed) for c in range(3)], -1)
    return np.clip(base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)


def tokenizer_json(path: Path) -> None:
    """The reference's Llama-style tokenizer (32000 ids, byte fallback, ``▁`` at 29871)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;?!'-":
        vocab[c] = len(vocab)
    merges = []
    for w in ["▁" + w for w in ("In", "What", "action", "should", "the", "robot", "take", "to", "put", "bowl", "on", "plate", "pick", "up")]:
        for i in range(2, len(w) + 1):
            if w[:i] not in vocab:
                merges.append((w[: i - 1], w[i - 1]))
                vocab[w[:i]] = len(vocab)
    i = 0
    while len(vocab) < 32000:
        if len(vocab) == 29871:
            vocab["▁"] = 29871
            continue
        vocab[f"<extra_{i}>"] = len(vocab)
        i += 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<PAD>"])
    tok.save(str(path))


def tensors() -> dict[str, torch.Tensor]:
    """The upstream model's tensors (and the side files' under ``proprio_projector.`` / ``action_head.``)."""
    return {k: draw(k, tuple(shape)) for k, shape in REFERENCE["tensor_shapes"].items()}


def write_upstream_folder(folder: Path) -> dict[str, torch.Tensor]:
    """The folder ``save_pretrained`` wrote (shards by its index), the authors' ``.pt`` files with
    DDP's ``module.`` prefix, ``dataset_statistics.json``; returns the tensors."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    sd = tensors()
    bad = [k for k, t in sd.items() if hashlib.sha256(t.numpy().tobytes()).hexdigest() != REFERENCE["tensor_sha256"][k]]
    assert not bad, f"draw rule does not reproduce the upstream tensors: {bad[:5]}"
    files = REFERENCE["files"]
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content, indent=2))
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for k, shard in files["model.safetensors.index.json"]["weight_map"].items():
        shards.setdefault(shard, {})[k] = sd[k]
    for shard, part in shards.items():
        save_file(part, str(folder / shard), metadata={"format": "pt"})
    for prefix, name in (("proprio_projector.", "proprio_projector--150000_checkpoint.pt"), ("action_head.", "action_head--150000_checkpoint.pt")):
        torch.save({"module." + k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}, folder / name)
    (folder / "dataset_statistics.json").write_text(json.dumps(REFERENCE["norm_stats"], indent=2))
    tokenizer_json(folder / "tokenizer.json")
    return sd
