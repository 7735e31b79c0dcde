"""transformers' pi0 layout: what ``PI0ForConditionalGeneration.save_pretrained`` writes.

The upstream class reads and writes it itself (its checkpoint conversion mapping renames the
module tree to the released, LeRobot-style names on save and back on load), so this module
never spells a key: it hands the folder to ``PI0ForConditionalGeneration.from_pretrained`` and
copies the result into our policy, and exports with the upstream ``save_pretrained``. The
normalisation statistics, which transformers' format has no place for, go in LeRobot's
processor files beside it; tokenizer and RL heads as in every export.
"""

from __future__ import annotations

import json
import os
from typing import Any

from workers.release.common import load_tokenizer, options_for, read_rlvla3_files, strict_load, write_rlvla3_files
from workers.release.lerobot_pi import TOKENIZER_NAME, read_stats, write_processors


def is_transformers_pi0(local_dir: str) -> bool:
    try:
        with open(os.path.join(local_dir, "config.json")) as f:
            return json.load(f).get("model_type") == "pi0"
    except (OSError, ValueError):
        return False


def load(local_dir: str, spec: Any, overrides: dict[str, Any]) -> Any:
    """A transformers-format pi0 folder -> ``Pi0Policy`` (upstream loader; every weight must load)."""
    from transformers import PI0Config, PI0ForConditionalGeneration

    from workers.policies.pi0 import Pi0Options, Pi0Policy

    if not is_transformers_pi0(local_dir):
        raise ValueError(f"pi0: {local_dir}/config.json is not a transformers pi0 config (model_type 'pi0')")
    pcfg = PI0Config.from_pretrained(local_dir)
    saved_opts, heads = read_rlvla3_files(local_dir, "pi0")
    release = {"chunk_size": pcfg.chunk_size, "num_steps": pcfg.num_inference_steps}
    opts = options_for(Pi0Options, release, saved_opts, overrides)
    upstream, info = PI0ForConditionalGeneration.from_pretrained(local_dir, output_loading_info=True)
    if info.get("missing_keys") or info.get("mismatched_keys"):
        raise ValueError(f"pi0: checkpoint does not match the model: missing parameters ({len(info['missing_keys'])}): "
                         f"{sorted(info['missing_keys'])[:20]}; mismatched: {list(info.get('mismatched_keys', []))[:20]}")
    policy = Pi0Policy(opts, spec, pi0_config=pcfg, tokenizer=load_tokenizer(local_dir, "pi0", TOKENIZER_NAME))
    sd = {f"pi0.{k}": v.to(policy.device) for k, v in upstream.state_dict().items()}
    sd.update(heads)
    strict_load(policy, sd, "pi0")
    state, action = read_stats(local_dir)
    policy.norm.set(state=state, action=action)
    return policy


def save(policy: Any, out_dir: str) -> None:
    """The upstream ``save_pretrained`` of the wrapped model, plus statistics and rlvla3 files."""
    os.makedirs(out_dir, exist_ok=True)
    policy.pi0.save_pretrained(out_dir)
    write_processors(policy, out_dir, "pi0_new_line_processor", policy.opts.max_text_len)
    policy.tokenizer.save_pretrained(out_dir)
    write_rlvla3_files(policy, out_dir)
