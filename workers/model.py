"""Building the job's policy (its weights travel through ``rlvla3.weights``)."""

from __future__ import annotations

import dataclasses

import torch

from rlvla3.config import JobConfig
from workers.contract import EnvSpec
from workers.envs.base import env_spec
from workers.policies.base import Policy, make_policy, options_class
from workers.policies.vla_common import resolve_dtype
from workers.release.layouts import load_release


def resolve_device(cfg: JobConfig, device: str | None) -> torch.device:
    name = device or cfg.workers.device
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"device {name!r} asked for, but CUDA is not available on this machine")
    return torch.device(name)


def job_spec(cfg: JobConfig) -> EnvSpec:
    return env_spec(cfg.env.name, cfg.env.options, cfg.env.plugins)


def build_policy(cfg: JobConfig, spec: EnvSpec | None = None, device: str | None = None) -> Policy:
    """The job's policy, seeded with the run seed. Only trainer rank 0's build is served:
    generators wait for its version 0 (``rlvla3.weights``) and never serve their own build."""
    spec = spec or job_spec(cfg)
    opts_cls = options_class(cfg.model.family)
    dev = resolve_device(cfg, device)
    dtype = resolve_dtype(cfg.model.dtype, dev)
    options = dict(cfg.model.options)
    fam = cfg.model.family
    if opts_cls is not None:
        # One source per setting: chunk length, device and dtype come from model.chunk_size,
        # workers.device (or --gpus) and model.dtype; model.options cannot set them (RENAMED).
        fields = {f.name for f in dataclasses.fields(opts_cls)}
        job_wide = {"chunk_size": cfg.model.chunk_size, "device": str(dev), "dtype": str(dtype).removeprefix("torch.")}
        options.update({k: v for k, v in job_wide.items() if k in fields})
    torch.manual_seed(cfg.run.seed)
    ours = bool(cfg.model.checkpoint) and _is_rlvla3_checkpoint(cfg.model.checkpoint)
    if cfg.model.checkpoint and not ours:
        # A released checkpoint (safetensors + config + tokenizer): its layout's own loader.
        policy = load_release(cfg.model.checkpoint, fam, spec, options, cfg.model.tokenizer, cfg.model.base)
    else:
        policy = make_policy(fam, options, spec)
    policy.to(device=dev, dtype=dtype)  # the towers are there already (built in place)
    if cfg.model.lora.enabled:  # after a release loads (base names), before our checkpoints (adapters)
        from workers.policies.lora import add_lora

        add_lora(policy, cfg.model.lora, seed=cfg.run.seed)
    if ours:  # an rlvla3 checkpoint or run folder (sft warm start, resume)
        load_checkpoint_weights(policy, cfg.model.checkpoint)
    return policy


def freeze_prefixes(policy: torch.nn.Module, prefixes: list[str]) -> int:
    """Stop gradients to every parameter whose name starts with one of ``prefixes`` (a dotted
    module path, ``vlm`` or ``vlm.vision_tower``); returns how many tensors it froze. A prefix
    that names no parameter is a typo, and an error that lists the top-level modules."""
    named = list(policy.named_parameters())
    under = {prefix: [p for n, p in named if n == prefix or n.startswith(prefix + ".")] for prefix in prefixes}
    for prefix, params in under.items():
        if not params:
            tops = sorted({n.split(".", 1)[0] for n, _ in named})
            raise ValueError(f"algo.frozen: {prefix!r} names no parameter of this policy (its modules: {tops})")
    frozen = {id(p): p for params in under.values() for p in params}
    for p in frozen.values():
        p.requires_grad_(False)
    return len(frozen)


def _is_rlvla3_checkpoint(path: str) -> bool:
    """Our own layout: a checkpoint folder (model.safetensors + state.json), a run folder with
    checkpoints, or a bare model.safetensors file."""
    from pathlib import Path

    from workers.checkpoint import latest_checkpoint

    p = Path(path)
    return (p.is_file() and p.suffix == ".safetensors") or (p / "state.json").is_file() \
        or latest_checkpoint(p) is not None or ((p / "model.safetensors").is_file() and not (p / "config.json").is_file())


def load_checkpoint_weights(policy: Policy, path: str) -> None:
    """Load ``model.safetensors`` from a run folder's checkpoint (or a direct file), or the
    weights of a sharded (DCP) checkpoint."""
    from pathlib import Path

    from safetensors.torch import load_file

    from workers.checkpoint import DCP, checkpoint_folder, load_checkpoint

    p = Path(path)
    folder = checkpoint_folder(p) if p.is_dir() else None
    if folder is not None and (folder / DCP).is_dir():
        load_checkpoint(folder, policy, restore_rng=False)
        return
    candidates = [p] if p.is_file() else [p / "model.safetensors"]
    if folder is not None and folder != p:  # a run folder: its newest complete checkpoint
        candidates.append(folder / "model.safetensors")
    for c in candidates:
        if c.is_file():
            policy.load_state_dict(load_file(str(c)))
            return
    raise FileNotFoundError(f"model.checkpoint {path}: no model.safetensors found (looked at {[str(c) for c in candidates]})")
