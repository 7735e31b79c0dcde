"""One observation shape from the env, through the wire, to the policy.

An :class:`Observation` holds the observations of ``n`` envs: a uint8 ``[n, H, W, 3]`` image
per camera (upright), a float32 ``[n, D]`` proprio state and ``n`` instructions. Env adapters
return one, the simulator writes it into shared memory (or frames) as an OBS message, the
generator reads each request back as views and gathers a batch, and the policy reads it on its
device. The arrays are whatever the caller hands in - shared-memory views, received frames,
simulator output - and nothing here copies them unless it says so:

* :meth:`Observation.from_tensors` wraps arrays (views stay views);
* :meth:`Observation.concat` of one part is that part; of several it is one new array per
  field (exactly the one copy that batching requests costs). For a CUDA policy the new arrays
  are pinned host memory (``pinned=True``, one part copied too), so :meth:`to_torch` moves the
  batch with one asynchronous DMA copy;
* :meth:`Observation.select` with a slice is a view, with indices a copy (numpy's rule).

On the wire an observation is the tensors ``images/<camera>`` and ``state`` (under a prefix
where a message carries more than one: ``r<i>/`` in a BATCH, ``obs/`` in a TRAJ); instructions
travel in the header. Names are built with :mod:`rlvla3.protocol`'s naming helpers only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from rlvla3.names import tensor_name, under_prefix

IMAGES = "images"
"""Name (prefix) of the per-camera image tensors: ``images/<camera>``."""
STATE = "state"
"""Name of the proprio state tensor."""


@dataclass(frozen=True, eq=False)
class Observation:
    """The observations of ``n`` envs, row ``i`` of every field belonging to env ``i``
    (compared by identity: arrays have no single truth value)."""

    images: dict[str, Any]
    """Camera -> uint8 ``[n, H, W, 3]`` (numpy; torch after :meth:`to_torch`)."""
    state: Any
    """float32 ``[n, D]`` (numpy; torch after :meth:`to_torch`)."""
    instruction: list[str]
    """One task instruction per env."""

    def __post_init__(self) -> None:
        n = len(self.instruction)
        if getattr(self.state, "ndim", None) != 2 or self.state.shape[0] != n:
            raise ValueError(f"observation: state of shape {tuple(getattr(self.state, 'shape', ()))} "
                             f"for {n} instruction(s); expected [{n}, D]")
        for cam, img in self.images.items():
            if getattr(img, "ndim", None) != 4 or img.shape[0] != n:
                raise ValueError(f"observation: image {cam!r} of shape {tuple(getattr(img, 'shape', ()))} "
                                 f"for {n} instruction(s); expected [{n}, H, W, 3]")

    def __len__(self) -> int:
        return len(self.instruction)

    # -- building -----------------------------------------------------------------------------

    @classmethod
    def zeros(cls, cameras: Mapping[str, tuple[int, int]], state_dim: int, n: int) -> "Observation":
        """A blank observation of ``n`` envs (sizes the simulator's shared-memory blocks)."""
        return cls({c: np.zeros((n, h, w, 3), np.uint8) for c, (h, w) in cameras.items()},
                   np.zeros((n, state_dim), np.float32), [""] * n)

    @staticmethod
    def concat(parts: Sequence["Observation"], pinned: bool = False) -> "Observation":
        """Stack observations along the env axis: one part is returned as it is (no copy);
        several cost one new array per field, filled straight from the parts. ``pinned``: the
        new arrays are page-locked host memory for a CUDA copy, and one part is copied too."""
        if not parts:
            raise ValueError("observation: nothing to concatenate")
        if len(parts) == 1 and not pinned:
            return parts[0]
        cams = list(parts[0].images)
        for p in parts[1:]:
            if list(p.images) != cams:
                raise ValueError(f"observation: cameras {list(p.images)} do not match {cams}")

        def stacked(arrays: list[np.ndarray]) -> np.ndarray:
            shape = (sum(len(a) for a in arrays), *arrays[0].shape[1:])
            return np.concatenate(arrays, out=_host_array(shape, arrays[0].dtype, pinned))

        return Observation(
            {c: stacked([p.images[c] for p in parts]) for c in cams},
            stacked([np.asarray(p.state, np.float32) for p in parts]),
            [s for p in parts for s in p.instruction],
        )

    def select(self, idx: Sequence[int] | np.ndarray | slice) -> "Observation":
        """Envs ``idx``: a view for a slice, a copy for indices or a mask."""
        if isinstance(idx, slice):
            instr = self.instruction[idx]
        else:
            idx = np.asarray(idx)
            rows = np.flatnonzero(idx) if idx.dtype == bool else idx.astype(np.int64)
            instr = [self.instruction[i] for i in rows.tolist()]
            idx = rows
        return Observation({c: v[idx] for c, v in self.images.items()}, self.state[idx], instr)

    def copy(self) -> "Observation":
        """An observation owning its arrays (the simulator edits one while a chunk runs)."""
        return Observation({c: v.copy() for c, v in self.images.items()}, self.state.copy(), list(self.instruction))

    def assign(self, rows: Sequence[int] | np.ndarray, other: "Observation") -> None:
        """Write ``other``'s envs into ``rows`` of this observation, in place (arrays and
        instructions). Only for an observation that owns its arrays (see :meth:`copy`)."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) != len(other):
            raise ValueError(f"observation: {len(other)} env(s) for {len(rows)} row(s)")
        for c, v in self.images.items():
            v[rows] = other.images[c]
        self.state[rows] = other.state
        for j, i in enumerate(rows.tolist()):
            self.instruction[i] = other.instruction[j]

    # -- the wire -----------------------------------------------------------------------------

    def to_tensors(self, prefix: str = "") -> dict[str, np.ndarray]:
        """Named tensors for a message: ``<prefix>/images/<camera>`` and ``<prefix>/state``
        (the same arrays; the state as float32, converted only if it is not already)."""
        out: dict[str, np.ndarray] = {tensor_name(prefix, IMAGES, c): v for c, v in self.images.items()}
        out[tensor_name(prefix, STATE)] = np.asarray(self.state, dtype=np.float32)
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Any], instruction: Sequence[str], prefix: str = "") -> "Observation":
        """Wrap named arrays (as :meth:`to_tensors` names them) without copying; other names
        in ``tensors`` are ignored. Raises ValueError when the instructions are not strings,
        the state is missing or a shape disagrees with the number of instructions."""
        if not isinstance(instruction, (list, tuple)) or not all(isinstance(s, str) for s in instruction):
            raise ValueError("observation: the instructions are not a list of strings")
        state = tensors.get(tensor_name(prefix, STATE))
        if state is None:
            raise ValueError(f"observation: no tensor {tensor_name(prefix, STATE)!r}")
        return cls(under_prefix(tensor_name(prefix, IMAGES), tensors), state, list(instruction))

    # -- the policy ---------------------------------------------------------------------------

    def to_torch(self, device: Any, cameras: Sequence[str] | None = None) -> "Observation":
        """The same observation as torch tensors on ``device`` (``cameras`` only, when named):
        on the CPU these share memory with the numpy arrays; on a GPU each field is one
        host-to-device copy, asynchronous from pinned memory (:meth:`concat`); the state
        becomes float32."""
        import torch  # local: the wire side of this module must not need torch

        def moved(a: Any, dtype: Any = None) -> Any:
            return torch.as_tensor(a).to(device=device, dtype=dtype, non_blocking=True)

        cams = list(self.images) if cameras is None else list(cameras)
        return Observation({c: moved(self.images[c]) for c in cams}, moved(self.state, torch.float32),
                           list(self.instruction))


def _host_array(shape: tuple[int, ...], dtype: Any, pinned: bool) -> np.ndarray:
    """A new host array; ``pinned``: page-locked by torch's CUDA host allocator (the numpy
    array keeps the tensor, and so the memory, alive)."""
    if not pinned:
        return np.empty(shape, dtype)
    import torch

    return torch.empty(shape, dtype=torch.from_numpy(np.empty(0, dtype)).dtype, pin_memory=True).numpy()
