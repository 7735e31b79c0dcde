"""Training checkpoints in the run folder, written atomically so a crash never leaves half of one.

Layout::

    RUN_DIR/checkpoints/
        latest                      text: the name of the newest complete checkpoint
        v00000042/
            model.safetensors       policy weights (safetensors: no pickle, shared tensors ok)
            optimizer.pt            optimizer state keyed by parameter name (torch.save; loaded
                                    weights_only), as torch.distributed.checkpoint.state_dict
                                    gives it, so that it loads with or without FSDP
            dcp/                    instead of both (``train.checkpoint_format: sharded``): one
                                    torch.distributed.checkpoint file per rank + its metadata;
                                    loads on any number of ranks (resharded), or in one process
            state.json              version and step counters
            rng.json                python / numpy / torch (and CUDA) RNG states
            config.yaml             the job config, verbatim

A checkpoint is assembled in a hidden temporary folder next to its final place, every file and
the folder fsync'd, and renamed into place; ``latest`` is then replaced atomically. A kill at any
point leaves the previous checkpoints whole, and :func:`latest_checkpoint` finds the newest
complete one by its folders, not by the pointer alone: a kill between the rename and the
pointer's update leaves the pointer one behind. Leftovers of a killed write (hidden temporary
folders, a checkpoint moved aside to be replaced) are tidied by the next save, and the moved-aside
one is put back when its replacement never arrived. ``latest`` names the newest checkpoint for
people and scripts.

Several trainer ranks: a ``full`` checkpoint of replicas (DDP) is rank 0's alone; one of an
FSDP-sharded policy, and every ``sharded`` one, is a collective (every rank calls
:func:`save_checkpoint` / :func:`load_checkpoint`; rank 0 writes the small files and renames).
"""

from __future__ import annotations

import base64
import errno
import io
import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict,
                                                     set_optimizer_state_dict, set_model_state_dict, set_state_dict)

CHECKPOINTS = "checkpoints"
LATEST = "latest"
FORMAT_VERSION = 1
FORMATS = ("full", "sharded")
DCP = "dcp"


NAME = re.compile(r"v\d{8}")
"""A checkpoint folder's name: ``v`` and its version in eight digits, so names sort as versions."""


def checkpoint_name(version: int) -> str:
    return f"v{int(version):08d}"


def _unwrap(model: nn.Module) -> nn.Module:
    """The policy inside DDP / evaluate-forward wrappers (they all keep it as ``.module``)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def _sharded(model: nn.Module) -> bool:
    """An FSDP-sharded policy: its parameters are DTensor shards."""
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _options(sharded: bool) -> StateDictOptions:
    """Whole tensors on rank 0's CPU for an FSDP-sharded policy; the tensors as they are otherwise."""
    return StateDictOptions(full_state_dict=sharded, cpu_offload=sharded)


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


def _fsync_tree(folder: Path) -> None:
    """Every file under ``folder``, then each folder: the bytes are on disk before the rename
    publishes them (torch.save, safetensors and DCP write through the page cache)."""
    for dirpath, _dirs, files in os.walk(folder, topdown=False):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _safetensors(write: Any, *args: Any, **kw: Any) -> None:
    """A safetensors write whose I/O failure is an ``OSError`` with its errno, like every other
    write here (safetensors raises its own error type, errno only in the message)."""
    try:
        write(*args, **kw)
    except SafetensorError as exc:
        code = re.search(r"os error (\d+)", str(exc))
        raise OSError(int(code.group(1)) if code else errno.EIO, f"{args[1]}: {exc}") from exc


class _WholeWrites(io.FileIO):
    """A file whose ``write`` writes every byte or raises the ``OSError`` that stopped it, and
    keeps that error: torch's writer turns a short write or a raised one into a RuntimeError
    without an errno ("basic_ios::clear", "unexpected pos")."""

    error: OSError | None = None

    def write(self, data: Any) -> int:
        view, done = memoryview(data).cast("B"), 0
        try:
            while done < len(view):
                done += super().write(view[done:])  # a short write, then ENOSPC for the rest
        except OSError as exc:
            self.error = exc
            raise
        return done


def _torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` whose I/O failure is an ``OSError`` with its errno, like every other write here."""
    with _WholeWrites(path, "wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as exc:
            if f.error is None:
                raise
            raise OSError(f.error.errno, f"{path}: {f.error.strerror}") from exc


def _complete(folder: Path) -> bool:
    """A checkpoint folder renamed into place whole: its state reads and its weights are there."""
    try:
        json.loads((folder / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (folder / "model.safetensors").is_file() or (folder / DCP / ".metadata").is_file()


def _put_back_replaced(root: Path) -> None:
    """A save of a version that already has a checkpoint moves the old one aside
    (``.old-vN-...``) before renaming the new one in: killed in between, the old one goes back."""
    for old in root.glob(".old-v*"):
        name = old.name.split("-")[1]
        if NAME.fullmatch(name) and not (root / name).exists() and _complete(old):
            os.rename(old, root / name)


def _tidy(root: Path, keep: Path) -> None:
    """Remove what killed saves left (hidden temporary folders and pointer files, replaced
    checkpoints), all but ``keep``: one saver at a time writes a run folder's checkpoints."""
    _put_back_replaced(root)
    for entry in root.glob(".*"):
        if entry != keep and (entry.name.startswith((".tmp-", ".old-", f".{LATEST}.tmp-"))):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def save_checkpoint(
    run_dir: str | os.PathLike,
    policy: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    version: int,
    step_counters: dict[str, int | float],
    config_yaml: str,
    keep_last: int | None = None,
    fmt: str = "full",
    learner: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint ``version`` into ``run_dir`` and point ``latest`` at it; returns its folder.

    ``keep_last`` prunes older checkpoints (None keeps them all). ``fmt``: ``full`` or
    ``sharded`` (DCP). Call on rank 0 only for a ``full`` checkpoint of an unsharded policy, on
    every rank otherwise (the ranks share ``run_dir``).
    """
    if fmt not in FORMATS:
        raise ValueError(f"checkpoint format {fmt!r} not in {FORMATS}")
    model = _unwrap(policy)
    sharded = _sharded(model)
    collective = sharded or fmt == "sharded"
    lead = _rank() == 0 or not collective
    root = Path(run_dir) / CHECKPOINTS
    name = checkpoint_name(version)
    final = root / name
    # Every rank of a collective save writes into the same folder: its name cannot hold a pid.
    tmp = root / (f".tmp-{name}-group" if collective else f".tmp-{name}-{os.getpid()}-{time.monotonic_ns()}")
    if lead:
        root.mkdir(parents=True, exist_ok=True)
        _tidy(root, keep=tmp)
        shutil.rmtree(tmp, ignore_errors=True)  # a collective save that died half-way
        tmp.mkdir()
    if collective and dist.is_initialized():
        dist.barrier()  # the folder exists (and holds nothing old) before any rank writes into it
    try:
        # ---- Everything into the temporary folder ---------------------------------------------
        if fmt == "sharded":
            msd, osd = get_state_dict(model, optimizer or [])
            import torch.distributed.checkpoint as dcp

            dcp.save({"model": msd, **({"optim": osd} if optimizer is not None else {})}, checkpoint_id=str(tmp / DCP))
        elif sharded:  # full, from shards: gathered whole on rank 0 (a collective)
            msd = {}
            for n, p in model.named_parameters():
                full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                if lead:
                    msd[n] = full.cpu()
            osd = get_optimizer_state_dict(model, optimizer, options=_options(True)) if optimizer is not None else None
            if lead:
                persistent = set(model.state_dict())  # no gathering: the keys only
                msd.update((n, b.detach().cpu()) for n, b in model.named_buffers() if n in persistent)
                _safetensors(save_file, {n: t.contiguous() for n, t in msd.items()}, str(tmp / "model.safetensors"),
                             metadata={"version": str(int(version))})
        else:
            _safetensors(save_model, model, str(tmp / "model.safetensors"), metadata={"version": str(int(version))})
            osd = get_optimizer_state_dict(model, optimizer, options=_options(False)) if optimizer is not None else None
        if not lead:
            return final
        if fmt == "full" and optimizer is not None:
            _torch_save(osd, tmp / "optimizer.pt")
        state = {"format": FORMAT_VERSION, "layout": fmt, "version": int(version), "counters": dict(step_counters),
                 "learner": dict(learner or {})}
        _write_text(tmp / "state.json", json.dumps(state, indent=1, sort_keys=True))
        _write_text(tmp / "rng.json", json.dumps(rng_state()))
        _write_text(tmp / "config.yaml", config_yaml)
        _fsync_tree(tmp)

        # ---- Rename into place (replacing a checkpoint of the same version) -------------------
        old = None
        if final.exists():
            old = root / f".old-{name}-{os.getpid()}-{time.monotonic_ns()}"
            os.rename(final, old)
        os.rename(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    # ---- Move the `latest` pointer atomically -------------------------------------------------
    pointer_tmp = root / f".{LATEST}.tmp-{os.getpid()}"
    _write_text(pointer_tmp, name + "\n")
    os.replace(pointer_tmp, root / LATEST)
    _fsync_dir(root)

    if keep_last is not None:
        done = sorted(p for p in root.iterdir() if p.is_dir() and NAME.fullmatch(p.name))
        for stale in done[: max(0, len(done) - max(1, keep_last))]:
            if stale.name != name:  # the one just written stays, and so does the newest (the last)
                shutil.rmtree(stale, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The run's newest complete checkpoint folder, or None when it has none yet. A replaced
    checkpoint whose replacement a kill stopped is put back first (:func:`_put_back_replaced`)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    _put_back_replaced(root)
    done = [p for p in root.iterdir() if p.is_dir() and NAME.fullmatch(p.name) and _complete(p)]
    return max(done, key=lambda p: p.name, default=None)


def checkpoint_folder(path: str | os.PathLike) -> Path | None:
    """``path`` itself when it is a checkpoint folder (either layout), else the one its
    ``latest`` points at, else None."""
    path = Path(path)
    if (path / "model.safetensors").is_file() or (path / DCP).is_dir():
        return path
    return latest_checkpoint(path)


def load_checkpoint(
    run_dir: str | os.PathLike,
    policy: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore the latest checkpoint of ``run_dir`` (or ``run_dir`` itself if it is one).

    Weights go into ``policy`` on its current device, the optimizer state into ``optimizer``,
    and the RNGs are reset so random draws continue as they would have. Either layout loads
    into a sharded or an unsharded policy, on any number of ranks (a ``sharded`` checkpoint, or
    an FSDP-sharded policy: every rank calls it). Returns ``{"version", "counters", "learner",
    "config_yaml", "path"}``.
    """
    path = checkpoint_folder(run_dir)
    if path is None:
        raise FileNotFoundError(f"no checkpoint under {run_dir}")
    state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    if state.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {state.get('format')} is not {FORMAT_VERSION}")

    model = _unwrap(policy)
    sharded = _sharded(model)
    if (path / DCP).is_dir():
        import torch.distributed.checkpoint as dcp

        msd, osd = get_state_dict(model, optimizer or [])
        target = {"model": msd, **({"optim": osd} if optimizer is not None else {})}
        if optimizer is not None:
            # Adam keeps no state for a parameter that never had a gradient (a value head under
            # GRPO): ask only for the states the checkpoint holds; the others start afresh.
            saved = set(dcp.FileSystemReader(str(path / DCP)).read_metadata().state_dict_metadata)
            if not any(k.startswith("optim.") for k in saved):
                raise FileNotFoundError(f"{path}: saved without optimizer state")
            for fqn in [f for f in osd["state"] if not any(k.startswith(f"optim.state.{f}.") for k in saved)]:
                del osd["state"][fqn]
        dcp.load(target, checkpoint_id=str(path / DCP))  # every model tensor must be there
        if optimizer is not None:
            set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"],
                           options=StateDictOptions(strict=False))
        else:
            set_model_state_dict(model, target["model"])
    else:
        if sharded:  # every rank reads the whole file and keeps its shard
            set_model_state_dict(model, load_file(str(path / "model.safetensors")), options=StateDictOptions(full_state_dict=True))
        else:
            load_model(model, str(path / "model.safetensors"), strict=True, device=str(next(model.parameters()).device))
        if optimizer is not None:
            opt_file = path / "optimizer.pt"
            if not opt_file.is_file():
                raise FileNotFoundError(f"{path}: no optimizer.pt to resume the optimizer from")
            osd = torch.load(opt_file, map_location="cpu", weights_only=True)
            if any(isinstance(k, int) for k in osd.get("state", {})):  # keyed by position (older checkpoints)
                optimizer.load_state_dict(osd)
            else:
                # strict=False: parameters that never had a gradient have no state to load
                set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(full_state_dict=sharded, strict=False))
    if restore_rng:
        set_rng_state(json.loads((path / "rng.json").read_text(encoding="utf-8")))
    return {
        "version": int(state["version"]),
        "counters": state["counters"],
        "learner": state.get("learner", {}),
        "config_yaml": (path / "config.yaml").read_text(encoding="utf-8"),
        "path": path,
    }
