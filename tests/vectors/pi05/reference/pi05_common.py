"""Shared setup for the pi0.5 reference vectors (runs in /work/ref/lerobot, LeRobot 0.6.1)."""
import json, math, os
import numpy as np
import torch

SEED = 20240601
TINY = {
    "gemma_2b": dict(width=64, depth=3, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=16),
    "gemma_300m": dict(width=32, depth=3, mlp_dim=64, num_heads=8, num_kv_heads=1, head_dim=16),
}
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=16, patch_size=8, image_size=32)
VOCAB = 128


def char_tokenizer():
    """Same vocabulary as rlvla3's char_tokenizer, plus the PaliGemma-like <bos> post-processor."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    specials = ("<pad>", "<bos>", "<eos>", "<unk>")
    vocab = {t: i for i, t in enumerate(specials)}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")


def make_tiny():
    """Patch LeRobot's size constants only (variants -> tiny widths, SigLIP / vocab -> tiny)."""
    from lerobot.policies.pi05 import modeling_pi05 as m
    from lerobot.policies.pi0 import modeling_pi0 as m0
    orig = m.get_gemma_config
    def tiny_cfg(variant):
        return m.GemmaConfig(**TINY[variant])
    m.get_gemma_config = tiny_cfg
    m0.get_gemma_config = tiny_cfg
    for mod in (m, m0):
        pal = mod.PaliGemmaForConditionalGenerationWithPiGemma
        exp = mod.PiGemmaForCausalLM
        def pal_ctor(config, _pal=pal):
            v = config.vision_config
            for k, val in VISION.items():
                setattr(v, k, val)
            v.projection_dim = config.text_config.hidden_size
            config.projection_dim = config.text_config.hidden_size
            config.text_config.vocab_size = VOCAB
            config.vocab_size = VOCAB
            config.image_token_index = VOCAB - 1
            return _pal(config=config)
        def exp_ctor(config, _exp=exp):
            config.vocab_size = VOCAB
            return _exp(config=config)
        mod.PaliGemmaForConditionalGenerationWithPiGemma = pal_ctor
        mod.PiGemmaForCausalLM = exp_ctor


def redraw(names_shapes, seed=SEED):
    """Every tensor re-drawn: N(0,1) * fan_in^-1/2 (>=2-d) or * 0.1 (1-d), keys in sorted order."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k in sorted(names_shapes):
        shape = names_shapes[k]
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        scale = (math.prod(shape[1:]) ** -0.5) if len(shape) >= 2 else 0.1
        out[k] = t * scale
    return out
