"""Pieces every VLA family shares: observation -> tensors, a tokenizer built in code, value heads,
and device/dtype choice.

Kept free of any one family so OpenVLA-OFT, pi0, pi0.5 and GR00T read observations the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from workers.contract import EnvSpec

# ---------------------------------------------------------------------------------------------
# Device and dtype
# ---------------------------------------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present: the generator runs where the accelerator is."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bf16 on CUDA (memory, tensor cores) and float32 on CPU (exact log-probs)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
    return dt


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")


def char_tokenizer() -> Any:
    """A character-level fast tokenizer built in memory (ids 0-3 special, then printable ASCII).

    Tiny configs use it so nothing downloads; it saves and loads like a released tokenizer.json.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for code in range(32, 127):
        vocab[chr(code)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def encode_text(tokenizer: Any, texts: Sequence[str], max_len: int, bos: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and mask ``[B, L]``; L is the longest prompt (capped at ``max_len``).

    Right padding keeps every sample's first tokens at the same place, so position ids derived
    from the mask make a padded sample compute what it would alone.
    """
    enc = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    bos_id = [tokenizer.bos_token_id] if bos and tokenizer.bos_token_id is not None else []
    rows = [(bos_id + ids)[:max_len] for ids in enc]
    length = max(1, max(len(r) for r in rows))
    pad = tokenizer.pad_token_id or 0
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------------
# Observations
# ---------------------------------------------------------------------------------------------


def pick_cameras(spec: EnvSpec, wanted: Sequence[str] | None, max_cameras: int) -> list[str]:
    """The cameras a model reads, in a fixed order (the env's order unless named)."""
    names = list(wanted) if wanted else list(spec.cameras)[:max_cameras]
    missing = [n for n in names if n not in spec.cameras]
    if missing:
        raise ValueError(f"cameras {missing} not in env cameras {list(spec.cameras)}")
    return names


def preprocess_images(
    images: dict[str, Any],
    cameras: Sequence[str],
    size: int,
    mean: Sequence[float],
    std: Sequence[float],
    device: torch.device,
    dtype: torch.dtype,
    pad: bool = False,
) -> torch.Tensor:
    """uint8 ``[B, H, W, 3]`` per camera (any size; numpy or torch) -> normalised ``[B, C, 3, size, size]``;
    ``pad`` keeps the aspect ratio as openpi does (:func:`resize_with_pad`), else the image is stretched."""
    out = []
    m = torch.tensor(mean, device=device, dtype=torch.float32).view(1, 3, 1, 1)
    s = torch.tensor(std, device=device, dtype=torch.float32).view(1, 3, 1, 1)
    for cam in cameras:
        img = torch.as_tensor(images[cam], device=device)
        x = img.permute(0, 3, 1, 2).float().div_(255.0)
        if pad:
            x = resize_with_pad(x, size)
        elif x.shape[-2:] != (size, size):
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        out.append((x - m) / s)
    return torch.stack(out, dim=1).to(dtype)


def state_tensor(state: torch.Tensor, dim: int) -> torch.Tensor:
    """float32 ``[B, dim]``: the env state (``Observation.to_torch``'s) zero-padded or cut to
    the model's state width."""
    st = state.float()
    if st.shape[-1] < dim:
        st = F.pad(st, (0, dim - st.shape[-1]))
    return st[:, :dim]


def discretize_state(state: Any, bins: int = 256) -> list[str]:
    """pi0.5's state text (openpi's tokenizer, LeRobot's processor): ``np.digitize`` of the
    normalised state into ``bins`` equal bins over [-1, 1), minus one - unclipped, so a value
    below -1 reads ``-1`` and one at or above 1 reads ``bins - 1``, as in the release."""
    import numpy as np

    s = np.asarray(state.detach().cpu().numpy() if isinstance(state, torch.Tensor) else state, dtype=np.float32)
    idx = np.digitize(s, bins=np.linspace(-1, 1, bins + 1)[:-1]) - 1
    return [" ".join(str(int(v)) for v in row) for row in idx]


def resize_with_pad(x: torch.Tensor, size: int) -> torch.Tensor:
    """openpi's resize: float ``[B, 3, H, W]`` in [0, 1] scaled to fit ``size`` x ``size`` keeping
    its aspect (bilinear, no antialiasing), clamped, then centred on black padding."""
    h, w = x.shape[-2:]
    if (h, w) == (size, size):
        return x
    ratio = max(w / size, h / size)
    rh, rw = int(h / ratio), int(w / ratio)
    x = F.interpolate(x, size=(rh, rw), mode="bilinear", align_corners=False).clamp(0.0, 1.0)
    top, left = (size - rh) // 2, (size - rw) // 2
    return F.pad(x, (left, size - rw - left, top, size - rh - top), value=0.0)


# ---------------------------------------------------------------------------------------------
# Heads
# ---------------------------------------------------------------------------------------------


class ValueHead(nn.Module):
    """Two-layer MLP critic on a pooled hidden state; float32 output whatever the trunk dtype."""

    def __init__(self, hidden: int, width: int | None = None) -> None:
        super().__init__()
        width = width or max(32, hidden // 2)
        self.net = nn.Sequential(nn.Linear(hidden, width), nn.GELU(), nn.Linear(width, 1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.net(h.to(self.net[0].weight.dtype)).squeeze(-1).float()


def masked_mean(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``h [B, S, H]`` over positions where ``mask [B, S]`` is set."""
    m = mask.to(h.dtype).unsqueeze(-1)
    return (h * m).sum(1) / m.sum(1).clamp_min(1.0)


def sinusoid(t: torch.Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """Sine-cosine embedding of a time in [0, 1] (pi0's periods), float32 ``[B, dim]``; the angles
    are computed in float64 as openpi does (they reach ~1.6e3 rad, where float32 loses ~1e-4)."""
    wide = torch.float64 if t.device.type != "mps" else torch.float32
    frac = torch.linspace(0.0, 1.0, dim // 2, device=t.device, dtype=wide)
    period = min_period * (max_period / min_period) ** frac
    ang = (1.0 / period * 2 * torch.pi)[None] * t.to(wide)[:, None]
    return torch.cat([ang.sin(), ang.cos()], dim=-1).float()


def freeze(params: Iterable[nn.Parameter]) -> None:
    """Freeze parameters the RL path never reads, so 'trainable' means 'receives a gradient'."""
    for p in params:
        p.requires_grad_(False)


def freeze_query_path(language_model: nn.Module) -> None:
    """The last layer's query/output path and the final norm of a language model whose output
    nothing reads: the action expert's joint attention reads only that layer's keys and values."""
    last = language_model.layers[-1]
    freeze(language_model.norm.parameters())
    for mod in (last.self_attn.q_proj, last.self_attn.o_proj, last.post_attention_layernorm, last.mlp):
        freeze(mod.parameters())


# ---------------------------------------------------------------------------------------------
# Options every family shares
# ---------------------------------------------------------------------------------------------


# Vision-tower presets the families share (SigLIP, and OpenVLA's DINOv2 at the tiny size).
TINY_VIT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
SIGLIP_SO400M = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16)
"""SigLIP So400m/14, the vision tower of the released pi0, pi0.5, GR00T N1.5 and OpenVLA."""
SIGLIP_BASE = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
"""SigLIP B/16-sized tower: the vision part of every family's ``medium`` preset (~0.5B in all)."""


def size_preset(family: str, sizes: dict[str, dict[str, Any]], size: str) -> dict[str, Any]:
    """The family's architecture preset ``size``, or an error naming the known ones."""
    if size not in sizes:
        raise ValueError(f"{family}: unknown size {size!r}; known: {sorted(sizes)}")
    return sizes[size]


@dataclass
class VLAOptions:
    size: str = "tiny"
    """Architecture preset: ``tiny`` for tests and CPU, ``medium`` (~0.5B, the big-weight paths on
    CPU), or the family's release size for GPUs."""
    chunk_size: int = 4
    """Actions per chunk (T of ``[B, T, A]``)."""
    cameras: list[str] | None = None
    """Cameras to read, in order; default the env's first ``max_cameras``."""
    max_cameras: int = 2
    """Upper bound on cameras when ``cameras`` is not given."""
    max_text_len: int = 48
    """Instruction tokens kept (longer prompts are cut); GR00T N1.5 refuses it (whole prompt, as upstream)."""
    device: str = "auto"
    """``auto`` (CUDA if present), ``cpu``, ``cuda:0`` ..."""
    dtype: str = "auto"
    """``auto`` = bf16 on CUDA, float32 on CPU; or a torch dtype name."""
    init_seed: int = 0
    """Seed of the random initialisation, so two builds of one config are identical."""


def seeded_init(opts: VLAOptions):
    """Context a family builds its towers in: seeded init (the caller's RNG stream untouched),
    on the target device and in the target dtype.

    Parameters are created where they will live, in the dtype they will have (torch's default
    device and dtype for the duration), so a bf16 model on CUDA never exists as an fp32 copy on
    the host: building a 7B model costs its bf16 bytes, once, on the device.
    """
    import contextlib

    dev = resolve_device(opts.device)
    dtype = resolve_dtype(opts.dtype, dev)

    @contextlib.contextmanager
    def ctx():
        before = torch.get_default_dtype()
        with torch.random.fork_rng(devices=[]), dev:
            torch.manual_seed(opts.init_seed)
            torch.set_default_dtype(dtype)
            try:
                yield
            finally:
                torch.set_default_dtype(before)

    return ctx()


def place(module: nn.Module, opts: VLAOptions) -> None:
    """Move what was built outside :func:`seeded_init` (norm stats, small buffers) to the policy's
    device and dtype; the towers are there already, so this copies no large tensor."""
    dev = resolve_device(opts.device)
    module.to(device=dev, dtype=resolve_dtype(opts.dtype, dev))
