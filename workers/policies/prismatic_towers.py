"""OpenVLA's fused vision backbone: DINOv2 (4 registers, LayerScale) and SigLIP, read as the
released prismatic model reads its timm towers.

The towers are transformers' ``Dinov2WithRegistersModel`` and ``SiglipVisionModel`` configured as
timm's ``vit_large_patch14_reg4_dinov2`` and ``vit_so400m_patch14_siglip_224`` (exact GELU, LayerNorm
eps 1e-6, 16 heads); ``workers.release.openvla_oft`` converts the timm tensors. Both are read at the
output of the second-to-last block, without the final norm (prismatic's
``get_intermediate_layers(n={depth - 2})``), so the last block, the final norms and SigLIP's
attention-pool head are held (a release has them) but never run, and are frozen.

Per image the patch features are ``[DINOv2 | SigLIP]`` along the width; several images (a wrist
camera: ``num_images_in_input``) follow each other along the patches.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

TOWER_HEADS = 16
"""Heads of both released towers (timm's ids fix them; a checkpoint's shapes cannot tell)."""
DINO_REGISTERS = 4
DINO_MEAN, DINO_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SIGLIP_MEAN, SIGLIP_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)


def _vit_kwargs(t: dict[str, Any]) -> dict[str, Any]:
    return dict(hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"], num_hidden_layers=t["num_hidden_layers"],
                num_attention_heads=t.get("num_attention_heads", TOWER_HEADS), image_size=t["image_size"],
                patch_size=t["patch_size"], hidden_act="gelu", layer_norm_eps=1e-6)


class FusedTowers(nn.Module):
    """``dino`` and ``siglip`` towers; ``forward`` gives ``[B, n_images * patches, D_dino + D_siglip]``."""

    def __init__(self, dino: dict[str, Any], siglip: dict[str, Any]) -> None:
        from transformers import Dinov2WithRegistersConfig, Dinov2WithRegistersModel, SiglipVisionConfig, SiglipVisionModel

        super().__init__()
        ratio, rest = divmod(dino["intermediate_size"], dino["hidden_size"])
        if rest:
            raise ValueError(f"DINOv2 MLP width {dino['intermediate_size']} is not a whole multiple of {dino['hidden_size']}")
        self.dino = Dinov2WithRegistersModel(Dinov2WithRegistersConfig(
            num_register_tokens=DINO_REGISTERS, layerscale_value=1.0, mlp_ratio=ratio,
            **{k: v for k, v in _vit_kwargs(dino).items() if k != "intermediate_size"}))
        self.siglip = SiglipVisionModel(SiglipVisionConfig(vision_use_head=True, **_vit_kwargs(siglip)))
        self.image_size = int(dino["image_size"])
        if int(siglip["image_size"]) != self.image_size:
            raise ValueError("the two towers read one image size")
        # Held for the release, never run: the last blocks, final norms, SigLIP's pool head, DINOv2's mask token.
        for p in (*self.dino.encoder.layer[-1].parameters(), *self.dino.layernorm.parameters(), self.dino.embeddings.mask_token,
                  *self.siglip.encoder.layers[-1].parameters(), *self.siglip.post_layernorm.parameters(),
                  *self.siglip.head.parameters()):
            p.requires_grad_(False)

    @property
    def width(self) -> int:
        return self.dino.config.hidden_size + self.siglip.config.hidden_size

    def _dino(self, px: torch.Tensor) -> torch.Tensor:
        h = self.dino.embeddings(px)
        for layer in self.dino.encoder.layer[:-1]:
            h = layer(h)
        return h[:, 1 + DINO_REGISTERS:]

    def _siglip(self, px: torch.Tensor) -> torch.Tensor:
        vm = self.siglip
        h = vm.embeddings(px)
        for layer in vm.encoder.layers[:-1]:
            h = layer(h, None)
        return h

    def forward(self, dino_px: torch.Tensor, siglip_px: torch.Tensor) -> torch.Tensor:
        """Pixels ``[B, n_images, 3, S, S]`` per tower (each normalised its own way)."""
        b, n = dino_px.shape[:2]
        feats = torch.cat([self._dino(dino_px.flatten(0, 1)), self._siglip(siglip_px.flatten(0, 1))], dim=-1)
        return feats.reshape(b, n * feats.shape[1], feats.shape[2])


def resize_images(images: dict[str, Any], cameras: Sequence[str], size: int) -> np.ndarray:
    """uint8 ``[B, H, W, 3]`` per camera -> uint8 ``[B, n_images, size, size, 3]``, resized as the
    release's processor does (PIL bicubic, antialiased, back to uint8): the towers see the
    reference's pixels exactly."""
    from PIL import Image

    out = np.empty((len(np.asarray(images[cameras[0]])), len(cameras), size, size, 3), dtype=np.uint8)
    for c, cam in enumerate(cameras):
        batch = np.asarray(images[cam])
        for i, img in enumerate(batch):
            img = np.ascontiguousarray(img, dtype=np.uint8)
            out[i, c] = img if img.shape[:2] == (size, size) else np.asarray(Image.fromarray(img).resize((size, size), Image.BICUBIC))
    return out


def normalise(pixels: torch.Tensor, mean: Sequence[float], std: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    """uint8 ``[B, N, S, S, 3]`` -> ``[B, N, 3, S, S]``: ``(x / 255 - mean) / std`` as torchvision's
    ``to_tensor`` + ``normalize``."""
    x = pixels.permute(0, 1, 4, 2, 3).float().div(255.0)
    m = torch.tensor(mean, device=x.device).view(1, 1, 3, 1, 1)
    s = torch.tensor(std, device=x.device).view(1, 1, 3, 1, 1)
    return ((x - m) / s).to(dtype)
