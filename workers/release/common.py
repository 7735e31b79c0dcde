"""What every layout reader and writer shares: the rlvla3 side files, tokenizer lookup, safetensors
shards, prefix renaming and the strict "every parameter accounted for" load.

A published layout has no room for what RL adds (the critic, Flow-Noise's std head) or for the
sampler settings, so exports put them next to the release files, where upstream loaders ignore
them: ``rlvla3.json`` (family and options) and ``rlvla3_rl_heads.safetensors``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Iterable, Sequence

import torch
from torch import nn

RLVLA3_FILE = "rlvla3.json"
RL_HEADS_FILE = "rlvla3_rl_heads.safetensors"
TOKENIZER_FILE = "tokenizer.json"
RL_HEADS = ("value_head.", "value_in_proj.", "sampler.noise_head.")
"""Parameters RL adds to every VLA family; no release has them, so they start fresh on load."""
NORM = "norm."
"""The normalisation buffers (``StatsNorm``): set from the release's statistics files."""

Rules = Sequence[tuple[str, str]]


def rename(keys: Iterable[str], rules: Rules) -> dict[str, str]:
    """Each key renamed by the first ``(from_prefix, to_prefix)`` rule that matches (or kept)."""
    out = {}
    for k in keys:
        out[k] = next((dst + k[len(src):] for src, dst in rules if k.startswith(src)), k)
    return out


def inverted(rules: Rules) -> list[tuple[str, str]]:
    """The same table read the other way, longest prefix first."""
    return sorted(((d, s) for s, d in rules), key=lambda r: -len(r[0]))


def read_safetensors(local_dir: str, family: str, names: Sequence[str] = ("model.safetensors",)) -> dict[str, torch.Tensor]:
    """A single weights file, or an index with its shards; every missing file named."""
    from safetensors.torch import load_file

    for name in names:
        if os.path.isfile(os.path.join(local_dir, name)):
            return load_file(os.path.join(local_dir, name))
    index = next((n for n in os.listdir(local_dir) if n.endswith(".safetensors.index.json")), None) if os.path.isdir(local_dir) else None
    if index is None:
        raise FileNotFoundError(f"{family}: {local_dir!r} has no {' or '.join(names)} and no *.safetensors.index.json")
    with open(os.path.join(local_dir, index)) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    missing = [s for s in shards if not os.path.isfile(os.path.join(local_dir, s))]
    if missing:
        raise FileNotFoundError(f"{family}: {local_dir!r} is missing shards: {', '.join(missing)}")
    sd: dict[str, torch.Tensor] = {}
    for s in shards:
        sd.update(load_file(os.path.join(local_dir, s)))
    return sd


def load_tokenizer(local_dir: str, family: str, named: str | None = None) -> Any:
    """``tokenizer.json`` from the folder; a release that only names its tokenizer is an error."""
    from transformers import PreTrainedTokenizerFast

    if not os.path.isfile(os.path.join(local_dir, TOKENIZER_FILE)):
        hint = f" (the release names tokenizer {named!r}: put its tokenizer.json there)" if named else ""
        raise FileNotFoundError(f"{family}: {local_dir!r} has no {TOKENIZER_FILE}{hint}")
    return PreTrainedTokenizerFast.from_pretrained(local_dir)


def strict_load(module: nn.Module, sd: dict[str, torch.Tensor], family: str, fresh: Sequence[str] = (RL_HEADS + (NORM,))) -> None:
    """Load ``sd``; any parameter outside ``fresh`` left unset, or any extra key, is an error."""
    own = module.state_dict()
    bad_shape = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in sd.items() if k in own and own[k].shape != v.shape]
    if bad_shape:
        raise ValueError(f"{family}: checkpoint shapes do not match the model: {'; '.join(bad_shape[:10])}")
    res = module.load_state_dict(sd, strict=False)
    fresh_re = re.compile("|".join(re.escape(p) for p in fresh)) if fresh else None
    missing = [k for k in res.missing_keys if not (fresh_re and fresh_re.match(k))]
    problems = []
    if missing:
        problems.append(f"missing parameters ({len(missing)}): {', '.join(missing[:20])}")
    if res.unexpected_keys:
        problems.append(f"unexpected parameters ({len(res.unexpected_keys)}): {', '.join(res.unexpected_keys[:20])}")
    if problems:
        raise ValueError(f"{family}: checkpoint does not match the model: " + "; ".join(problems))


def write_rlvla3_files(policy: nn.Module, out_dir: str) -> None:
    """``rlvla3.json`` (family, options) and the RL heads, beside the release files."""
    from safetensors.torch import save_file

    with open(os.path.join(out_dir, RLVLA3_FILE), "w") as f:
        json.dump({"family": policy.family, "options": dataclasses.asdict(policy.opts)}, f, indent=2)  # type: ignore[attr-defined]
    heads = {k: v.detach().cpu().contiguous().clone() for k, v in policy.state_dict().items() if k.startswith(RL_HEADS)}
    if heads:
        save_file(heads, os.path.join(out_dir, RL_HEADS_FILE))


def read_rlvla3_files(local_dir: str, family: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Options and RL heads written by an rlvla3 export (empty for a plain release)."""
    from safetensors.torch import load_file

    opts: dict[str, Any] = {}
    path = os.path.join(local_dir, RLVLA3_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            meta = json.load(f)
        if meta.get("family") != family:
            raise ValueError(f"{family}: {local_dir!r} holds a {meta.get('family')!r} export")
        opts = dict(meta.get("options", {}))
    heads_path = os.path.join(local_dir, RL_HEADS_FILE)
    heads = load_file(heads_path) if os.path.isfile(heads_path) else {}
    return opts, heads


def options_for(cfg_cls: type, *layers: dict[str, Any]) -> Any:
    """The family's options: later dicts win; keys the dataclass does not know are dropped."""
    known = {f.name for f in dataclasses.fields(cfg_cls)}
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update({k: v for k, v in layer.items() if k in known})
    return cfg_cls(**merged)


def export_state(policy: nn.Module, skip: Sequence[str] = (RL_HEADS + (NORM,))) -> dict[str, torch.Tensor]:
    """The policy's tensors a release holds (no RL heads, no normalisation buffers), on CPU."""
    return {k: v.detach().cpu().contiguous().clone() for k, v in policy.state_dict().items() if not k.startswith(tuple(skip))}
