"""The PaliGemma + Gemma-expert shapes pi0 and pi0.5 share: size presets and image normalisation.

pi0.5 keeps pi0's backbone and expert dimensions, so both families read their presets here.
"""

from __future__ import annotations

from typing import Any

from workers.policies.vla_common import SIGLIP_BASE, SIGLIP_SO400M, TINY_VIT

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
    # tiny with the released head layout (Gemma 8 heads / 1 KV head, SigLIP 16 heads): the only
    # tiny shape LeRobot's config (whose variants fix the heads) can describe.
    "tiny_release": {
        "image_size": 32,
        "patch_size": 8,
        "vision": dict(TINY_VIT, num_attention_heads=16),
        "text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=1, head_dim=16, vocab_size=128),
        "expert": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=1, head_dim=16),
        "image_token_id": 127,
        "pad_dims": False,
    },
    # ~0.5B with the release layout's shapes (padded dims, 224 px): the big-weight paths on CPU.
    "medium": {
        "image_size": 224,
        "patch_size": 14,
        "vision": SIGLIP_BASE,
        "text": dict(hidden_size=1024, intermediate_size=5120, num_hidden_layers=16, num_attention_heads=8,
                     num_key_value_heads=1, head_dim=128, vocab_size=32000),
        "expert": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=8,
                       num_key_value_heads=1, head_dim=128),
        "image_token_id": 31999,
        "pad_dims": True,
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

IMAGE_MEAN = (0.5, 0.5, 0.5)  # PaliGemma / SigLIP normalise to [-1, 1]
IMAGE_STD = (0.5, 0.5, 0.5)
