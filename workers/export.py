"""``rlvla3 export``: a run folder's trained policy written in its family's own release format.

The policy is rebuilt from the checkpoint's own ``config.yaml`` (so a run that started from a
release gets that release's architecture and statistics back), the trained weights - and the
normalisation buffers that travel with them - are loaded strictly, and the layout writer of
``workers.release.layouts`` does the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog
import torch

log = structlog.get_logger(__name__)


def trained_policy(run_dir: str | Path) -> tuple[Any, Path]:
    """The policy of the run's latest checkpoint (or of a checkpoint folder itself), on CPU."""
    import yaml

    from rlvla3.config import from_dict
    from workers.checkpoint import checkpoint_folder, load_checkpoint
    from workers.model import build_policy

    run_dir = Path(run_dir)
    ck = checkpoint_folder(run_dir)
    if ck is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint (expected checkpoints/latest or a checkpoint folder)")
    cfg = from_dict(yaml.safe_load((ck / "config.yaml").read_text(encoding="utf-8")))
    if cfg.model.family == "mlp":
        raise ValueError("the mlp policy has no release format to export to")
    cfg.model.dtype = "float32"
    policy = build_policy(cfg, device="cpu")
    load_checkpoint(ck, policy, restore_rng=False)  # either layout (full or sharded)
    if cfg.model.lora.enabled:  # release layouts hold base weights only: fold the adapters in
        from workers.policies.lora import merge_lora

        log.info("lora_merged", layers=merge_lora(policy))
    policy.to(torch.float32).eval()
    return policy, ck


def export_run(run_dir: str | Path, fmt: str, out_dir: str | Path) -> dict[str, Any]:
    """Write the run's policy as ``fmt``; returns what was written (for the CLI's summary)."""
    from workers.release.layouts import save_release

    policy, ck = trained_policy(run_dir)
    save_release(policy, str(out_dir), fmt)
    files = sorted(p.relative_to(out_dir).as_posix() for p in Path(out_dir).rglob("*") if p.is_file())
    log.info("policy_exported", family=policy.family, format=fmt, checkpoint=str(ck), out=str(out_dir), files=len(files))
    return {"family": policy.family, "format": fmt, "checkpoint": str(ck), "out": str(out_dir), "files": files}
