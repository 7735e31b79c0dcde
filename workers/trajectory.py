"""Trajectory assembly inside a simulator slot: one builder per env, fragments out.

A decision step is one observation, the action chunk taken from it, the policy's log-prob /
value / replay for that chunk, the summed reward of the env steps actually executed (an episode
may end mid-chunk), and whether the episode terminated or was truncated there. A fragment is
shipped when the episode ends, and every ``fragment_len`` decisions of its slot, when all the
slot's envs ship what they hold together (``workers/simulator.py``); it carries
one extra observation - the one after its last step - so the trainer can bootstrap a value
where the fragment was cut or truncated.

Fragment tensors (N decision steps), named with ``rlvla3.protocol``'s helpers:
    obs/images/<cam> [N+1, H, W, 3] uint8   obs/state [N+1, D] float32   (an Observation)
    actions [N, T, A]   logprob [N, L]   value [N]   replay/<k> [N, ...]
    reward [N]   steps [N] int32 (env steps executed)
    terminated [N] bool   truncated [N] bool   version [N] int64
Header: instruction, env (global env index), episode (episode counter), seed, done,
episode_return / episode_success (when done).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlvla3.observation import STATE, Observation
from rlvla3.names import FRAGMENT_OBS, REPLAY, tensor_name, with_prefix


@dataclass
class StepRecord:
    obs: Observation  # this env's observation (one row, its own copy)
    actions: np.ndarray
    logprob: np.ndarray
    value: float
    replay: dict[str, np.ndarray]
    version: int
    reward: float = 0.0
    steps: int = 0
    terminated: bool = False
    truncated: bool = False


@dataclass
class EnvTrajectory:
    """The open fragment of one env."""

    env: int
    instruction: str = ""
    seed: int | None = None
    episode: int = 0
    episode_step: int = 0
    episode_return: float = 0.0
    records: list[StepRecord] = field(default_factory=list)

    def begin_episode(self, instruction: str, seed: int | None) -> None:
        self.instruction = instruction
        self.seed = seed
        self.episode += 1
        self.episode_step = 0
        self.episode_return = 0.0
        self.records = []

    def add(self, rec: StepRecord) -> None:
        self.records.append(rec)
        self.episode_step += 1
        self.episode_return += rec.reward

    def oldest_version(self) -> int:
        return min((r.version for r in self.records), default=-1)

    def fragment(self, next_obs: Observation, success: bool) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """Stack the open records and ``next_obs`` (one row: the observation after the last
        step) into a fragment; the caller clears the records."""
        recs = self.records
        n = len(recs)
        done = recs[-1].terminated or recs[-1].truncated
        tensors = Observation.concat([r.obs for r in recs] + [next_obs]).to_tensors(FRAGMENT_OBS)
        tensors["actions"] = np.stack([r.actions for r in recs]).astype(np.float32)
        tensors["logprob"] = np.stack([r.logprob for r in recs]).astype(np.float32)
        tensors["value"] = np.asarray([r.value for r in recs], np.float32)
        # Replay keys every record has: a generator batch that mixed evaluation and training envs
        # returned both acts' keys (zeros in the other's rows), so a record may carry extra ones.
        keys = sorted(set.intersection(*(set(r.replay) for r in recs)))
        tensors.update(with_prefix(REPLAY, {k: np.stack([r.replay[k] for r in recs]) for k in keys}))
        tensors["reward"] = np.asarray([r.reward for r in recs], np.float32)
        tensors["steps"] = np.asarray([r.steps for r in recs], np.int32)
        tensors["terminated"] = np.asarray([r.terminated for r in recs], bool)
        tensors["truncated"] = np.asarray([r.truncated for r in recs], bool)
        tensors["version"] = np.asarray([r.version for r in recs], np.int64)
        header = {
            "instruction": self.instruction, "env": self.env, "episode": self.episode,
            "seed": self.seed, "done": bool(done), "steps": n,
        }
        if done:
            header["episode_return"] = float(self.episode_return)
            header["episode_success"] = bool(success)
            header["episode_length"] = int(self.episode_step)
        return header, tensors



def fragment_observation(arrays: dict[str, np.ndarray], instruction: str) -> Observation:
    """A received fragment's N+1 observations (views of its arrays, no copy). The learner takes
    rows ``slice(0, -1)`` for its batch and ``slice(-1, None)`` for the bootstrap value."""
    n = len(arrays[tensor_name(FRAGMENT_OBS, STATE)])
    return Observation.from_tensors(arrays, [instruction] * n, prefix=FRAGMENT_OBS)
