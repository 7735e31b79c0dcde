"""Training checkpoints in the run folder, written atomically so a crash never leaves half of one.

Layout::

    RUN_DIR/checkpoints/
        latest                      text: the name of the newest complete checkpoint
        v00000042/
            model.safetensors       policy weights (safetensors: no pickle, shared tensors ok)
            optimizer.pt            optimizer.state_dict() (torch.save; loaded weights_only)
            state.json              version and step counters
            rng.json                python / numpy / torch (and CUDA) RNG states
            config.yaml             the job config, verbatim

A checkpoint is assembled in a hidden temporary folder next to its final place and renamed into
place; ``latest`` is then replaced atomically. A reader following ``latest`` therefore always
finds a complete checkpoint.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model
from torch import nn

CHECKPOINTS = "checkpoints"
LATEST = "latest"
FORMAT_VERSION = 1


def checkpoint_name(version: int) -> str:
    return f"v{int(version):08d}"


def _unwrap(model: nn.Module) -> nn.Module:
    """The policy inside DDP / evaluate-forward wrappers (they all keep it as ``.module``)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


# ---------------------------------------------------------------------------------------------
# RNG states as JSON (no pickle anywhere on the load path)
# ---------------------------------------------------------------------------------------------


def _bytes_b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _tensor_from_b64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """Every RNG the trainer draws from, in a JSON-able dict."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": _bytes_b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_bytes_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_name, np.asarray(np_keys, dtype=np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(_tensor_from_b64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = [_tensor_from_b64(s) for s in state["cuda"]]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


# ---------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    run_dir: str | os.PathLike,
    policy: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    version: int,
    step_counters: dict[str, int | float],
    config_yaml: str,
    keep_last: int | None = None,
) -> Path:
    """Write checkpoint ``version`` into ``run_dir`` and point ``latest`` at it; returns its folder.

    ``keep_last`` prunes older checkpoints (None keeps them all). Call on one rank only.
    """
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(version)
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        # ---- Everything into the temporary folder ---------------------------------------------
        save_model(_unwrap(policy), str(tmp / "model.safetensors"), metadata={"version": str(int(version))})
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        state = {"format": FORMAT_VERSION, "version": int(version), "counters": dict(step_counters)}
        _write_text(tmp / "state.json", json.dumps(state, indent=1, sort_keys=True))
        _write_text(tmp / "rng.json", json.dumps(rng_state()))
        _write_text(tmp / "config.yaml", config_yaml)
        _fsync_dir(tmp)

        # ---- Rename into place (replacing a checkpoint of the same version) -------------------
        old = None
        if final.exists():
            old = root / f".old-{name}-{os.getpid()}-{time.monotonic_ns()}"
            os.rename(final, old)
        os.rename(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    # ---- Move the `latest` pointer atomically -------------------------------------------------
    pointer_tmp = root / f".{LATEST}.tmp-{os.getpid()}"
    _write_text(pointer_tmp, name + "\n")
    os.replace(pointer_tmp, root / LATEST)
    _fsync_dir(root)

    if keep_last is not None:
        done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("v"))
        for stale in done[: max(0, len(done) - keep_last)]:
            if stale.name != name:
                shutil.rmtree(stale, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The folder ``latest`` points at, or None when the run has no checkpoint yet."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text(encoding="utf-8").strip()
    return path if path.is_dir() else None


def load_checkpoint(
    run_dir: str | os.PathLike,
    policy: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore the latest checkpoint of ``run_dir`` (or ``run_dir`` itself if it is one).

    Weights go into ``policy`` on its current device, the optimizer state into ``optimizer``,
    and the RNGs are reset so random draws continue as they would have. Returns
    ``{"version", "counters", "config_yaml", "path"}``.
    """
    run_dir = Path(run_dir)
    path = run_dir if (run_dir / "model.safetensors").is_file() else latest_checkpoint(run_dir)
    if path is None:
        raise FileNotFoundError(f"no checkpoint under {run_dir}")
    state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    if state.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {state.get('format')} is not {FORMAT_VERSION}")

    model = _unwrap(policy)
    device = next(model.parameters()).device
    load_model(model, str(path / "model.safetensors"), strict=True, device=str(device))
    if optimizer is not None:
        opt_file = path / "optimizer.pt"
        if not opt_file.is_file():
            raise FileNotFoundError(f"{path}: no optimizer.pt to resume the optimizer from")
        optimizer.load_state_dict(torch.load(opt_file, map_location="cpu", weights_only=True))
    if restore_rng:
        set_rng_state(json.loads((path / "rng.json").read_text(encoding="utf-8")))
    return {
        "version": int(state["version"]),
        "counters": state["counters"],
        "config_yaml": (path / "config.yaml").read_text(encoding="utf-8"),
        "path": path,
    }
