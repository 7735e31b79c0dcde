"""GR00T N1.5 as released: the release-size tensor list equals the upstream class's, tensor for
tensor (test vector made with LeRobot 0.4.4's GR00TN15 on the meta device; see
tests/vectors/gr00t_n15/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from workers.contract import EnvSpec
from workers.policies.gr00t import Gr00tOptions, Gr00tPolicy
from workers.release.common import RL_HEADS, NORM, inverted, rename
from workers.release.gr00t_n15 import RELEASE_RULES

VECTORS = Path(__file__).parent / "vectors" / "gr00t_n15"
SPEC = EnvSpec(cameras={"front": (48, 64)}, state_dim=8, action_dim=7, max_episode_steps=50)


def test_release_size_tensors_equal_upstream():
    want = json.loads((VECTORS / "release_tensors.json").read_text())
    with torch.device("meta"):
        policy = Gr00tPolicy(Gr00tOptions(size="3b", chunk_size=16, device="meta", dtype="float32"), SPEC)
    sd = {k: v for k, v in policy.state_dict().items() if not k.startswith(RL_HEADS + (NORM,))}
    names = rename(sd, inverted(RELEASE_RULES))
    ours = {names[k]: list(v.shape) for k, v in sd.items()}
    assert ours == want["tensors"]
    params = {id(p): p.numel() for n, p in policy.named_parameters() if not n.startswith(RL_HEADS)}
    assert sum(params.values()) == want["num_parameters"] == 2_413_522_880
