"""What a trainer accepts as a fragment: the shapes its own policy acts in.

Fragments arrive from simulators over the network. One whose tensors do not stack with the rest
of a batch would fail the update's concatenation and, with it, the trainer. So each training
fragment is checked on arrival against the shapes the trainer's policy gives one sampled act
(actions, log-probs, every replay tensor) and the env's observation spec. A fragment that
differs is unreadable: counted, acknowledged, never trained on. Replay keys beyond the policy's
are allowed: a generator batch that mixed evaluation and training envs sends both acts' keys.
An evaluation fragment is only tallied and filmed, so only its observations are checked: the
film joins its cameras' frames and encodes them, which a frame of another size or type would fail
on the trainer's metrics thread, and every row and film after it with that thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlvla3.names import FRAGMENT_OBS, REPLAY, tensor_name
from rlvla3.observation import Observation

PER_STEP = ("value", "reward", "steps", "terminated", "truncated", "version")
"""One scalar per decision step."""


class FragmentSchema:
    """Trailing shapes per tensor name: per decision (N rows) and per observation (N + 1 rows)."""

    def __init__(self, policy: Any) -> None:
        spec = policy.spec
        obs = Observation({c: np.zeros((1, h, w, 3), np.uint8) for c, (h, w) in spec.cameras.items()},
                          np.zeros((1, spec.state_dim), np.float32), ["check the shapes"])
        device = next(policy.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            out = policy.act(obs)  # a draw of its own: the trainer's random stream is left as it was
        self.per_step: dict[str, tuple[int, ...]] = {name: () for name in PER_STEP}
        self.per_step["actions"] = tuple(out.actions.shape[1:])
        self.per_step["logprob"] = tuple(out.logprob.shape[1:])
        self.per_step.update({tensor_name(REPLAY, k): tuple(v.shape[1:]) for k, v in out.replay.items()})
        sample = obs.to_tensors(FRAGMENT_OBS)
        self.per_obs = {name: tuple(v.shape[1:]) for name, v in sample.items()}
        self.obs_dtypes = {name: v.dtype for name, v in sample.items()}  # uint8 frames, float32 state

    def check(self, arrays: dict[str, np.ndarray], evaluation: bool) -> dict[str, np.ndarray]:
        """Raise ValueError naming the first tensor that is missing or of the wrong shape or type;
        return the observations (the spec's only), all that an evaluation fragment is read for."""
        if "reward" not in arrays or np.ndim(arrays["reward"]) != 1:
            raise ValueError("fragment without a 1-D reward")
        n = len(arrays["reward"])
        wanted = ((n + 1, self.per_obs),) if evaluation else ((n, self.per_step), (n + 1, self.per_obs))
        for rows, want in wanted:
            for name, trailing in want.items():
                got = arrays.get(name)
                if got is None:
                    raise ValueError(f"fragment without {name!r}")
                if tuple(got.shape) != (rows, *trailing):
                    raise ValueError(f"fragment {name!r} of shape {tuple(got.shape)}; this policy's is {(rows, *trailing)}")
        for name, dtype in self.obs_dtypes.items():
            if arrays[name].dtype != dtype:
                raise ValueError(f"fragment {name!r} of dtype {arrays[name].dtype}; the env's is {dtype}")
        return {name: arrays[name] for name in self.per_obs}
