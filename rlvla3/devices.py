"""The CUDA devices this machine shows, checked against ``--gpus`` before anything starts.

A scheduler hands a job a device list (``CUDA_VISIBLE_DEVICES``); ``--gpus 0-3`` on a node that
shows fewer devices, or none, is refused at start with the devices it does see, instead of
starting workers that each fail later (or, without CUDA, run on the CPU unasked).
"""

from __future__ import annotations

import os


def visible_cuda_devices() -> list[int]:
    """Indices of the CUDA devices this process can use (after ``CUDA_VISIBLE_DEVICES``).

    torch's device count asks the driver without creating a context, so a supervising process
    that only checks holds no device memory."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1", "NoDevFiles"):
        return []  # hidden on purpose (Slurm writes NoDevFiles for a step without GPUs)
    try:
        import torch
    except ModuleNotFoundError:
        return []
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def check_gpus(devices: list[int]) -> list[int]:
    """``devices`` (from ``--gpus``) when this machine shows every one of them; else ValueError
    naming what it shows."""
    if not devices:
        return devices
    seen = visible_cuda_devices()
    missing = [d for d in devices if d not in seen]
    if missing:
        mask = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f"CUDA devices {seen}" if seen else "no CUDA device"
        raise ValueError(f"--gpus asks for devices {devices}, but this machine shows {shown}"
                         + (f" (CUDA_VISIBLE_DEVICES={mask})" if mask is not None else "")
                         + (": drop --gpus to run on the CPU" if not seen else ""))
    return devices
