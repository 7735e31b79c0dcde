"""Which folders a release's files come from: the folder itself, or a folder of peft LoRA adapters
and the base release they were trained on.

Trainers publish adapters without their base: OFT's ``finetune.py`` writes ``lora_adapter/`` beside
the statistics, processor and ``.pt`` files (weights only when it merges), RLinf's
``convert_pt_to_hf`` (``merge_lora_weighs: false``) copies the base's JSON files and writes
``lora_adapter/``, and RLinf publishes bare adapter folders (``RLinf-OpenVLAOFT-ManiSkill-Base-Lora``,
loaded with ``PeftModel.from_pretrained`` onto ``RLinf-OpenVLAOFT-ManiSkill-Base-Main``). Their
``base_model_name_or_path`` is a hub id or a path on the trainer's machine, so ``model.base`` names
the local base; a recorded path that exists here is used as peft would use it.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

from workers.release.peft_lora import CONFIG

ADAPTER_SUBDIR = "lora_adapter"


@dataclass(frozen=True)
class Sources:
    """Folders to read, in order (the checkpoint's own files first, then its base's), the folder
    with the base weights, and the folder with adapters to merge (None: none)."""

    dirs: tuple[str, ...]
    weights: str
    adapter: str | None

    def has(self, name: str) -> bool:
        return any(os.path.isfile(os.path.join(d, name)) for d in self.dirs)

    def dir_of(self, name: str) -> str:
        """The first folder holding ``name`` (the first folder when none does, so errors name it)."""
        return next((d for d in self.dirs if os.path.isfile(os.path.join(d, name))), self.dirs[0])

    def glob(self, pattern: str) -> list[str]:
        """Matches of ``pattern`` in the first folder that has any."""
        for d in self.dirs:
            hits = sorted(glob.glob(os.path.join(d, pattern)))
            if hits:
                return hits
        return []


def has_weights(local_dir: str) -> bool:
    """``model.safetensors``, or an index whose shards are all there (RLinf's unmerged export
    copies the base's index without its shards)."""
    if os.path.isfile(os.path.join(local_dir, "model.safetensors")):
        return True
    index = next((n for n in os.listdir(local_dir) if n.endswith(".safetensors.index.json")), None) if os.path.isdir(local_dir) else None
    if index is None:
        return False
    with open(os.path.join(local_dir, index)) as f:
        shards = set(json.load(f).get("weight_map", {}).values())
    return bool(shards) and all(os.path.isfile(os.path.join(local_dir, s)) for s in shards)


def resolve(local_dir: str, base: str, family: str) -> Sources:
    """The sources of ``local_dir``: with weights, the folder alone (adapters beside them merge; a
    ``lora_adapter/`` beside merged weights is already in them); without, its adapters onto
    ``base`` (``model.base``), else onto the adapters' recorded base when that folder exists here."""
    top = os.path.join(local_dir, CONFIG)
    sub = os.path.join(local_dir, ADAPTER_SUBDIR, CONFIG)
    if has_weights(local_dir):
        if base:
            raise ValueError(f"{family}: model.base is set ({base!r}) but {local_dir!r} holds its own weights; "
                             "model.base is for a checkpoint of adapters without them")
        return Sources((local_dir,), local_dir, local_dir if os.path.isfile(top) else None)
    adapter = os.path.dirname(top) if os.path.isfile(top) else os.path.dirname(sub) if os.path.isfile(sub) else None
    if adapter is None:
        if base:
            raise ValueError(f"{family}: model.base is set ({base!r}) but {local_dir!r} has no peft adapters "
                             f"({CONFIG} in it or in {ADAPTER_SUBDIR}/)")
        return Sources((local_dir,), local_dir, None)
    with open(os.path.join(adapter, CONFIG)) as f:
        wanted = json.load(f).get("base_model_name_or_path") or ""
    if not base and wanted and os.path.isdir(wanted) and has_weights(wanted):
        base = wanted
    if not base:
        raise FileNotFoundError(f"{family}: {local_dir!r} holds peft LoRA adapters ({os.path.join(adapter, CONFIG)}) but no "
                                f"base weights; they were trained on {wanted or '(base_model_name_or_path not recorded)'!r}: "
                                "set model.base to a local folder with that release")
    if not os.path.isdir(base) or not has_weights(base):
        raise FileNotFoundError(f"{family}: model.base {base!r} is not a release folder with weights (model.safetensors "
                                f"or an index with its shards); the adapters in {adapter!r} name {wanted!r}")
    return Sources((local_dir, base), base, adapter)
