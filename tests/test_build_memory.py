"""Building a model at its target dtype: a ``medium`` (~0.5B) bf16 policy is built without an fp32
copy of its weights on the host. Measured in a fresh process (peak RSS, ``VmHWM``: the high-water
mark of this process's own address space, where ``ru_maxrss`` would carry over the forking
parent's RSS across exec) so nothing the test runner imported before counts. Building is single-threaded CPU work (random init), so two
families build at once, one per core."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.jobs import ProcessPool

ROOT = Path(__file__).resolve().parent.parent

BUILD = r"""
import json, sys
import torch
from rlvla3.config import from_dict, read_yaml
from workers.model import build_policy
import transformers  # imported before the baseline: its import is not the model

family = sys.argv[1]
data = read_yaml(f"configs/synthetic_{family}.yaml")
data["model"] = read_yaml(f"configs/models/{family}_medium.yaml")["model"]
data["workers"]["device"] = "cpu"
cfg = from_dict(data)

def status_kb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

before = status_kb("VmRSS")
policy = build_policy(cfg, device="cpu")
peak = status_kb("VmHWM")
params = list(policy.parameters())
print(json.dumps({
    "params": sum(p.numel() for p in params),
    "bytes": sum(p.numel() * p.element_size() for p in params),
    "dtypes": sorted({str(p.dtype) for p in params}),
    "grew_mb": (peak - before) / 1024,
}))
"""


FAMILIES = ["pi0", "pi05", "gr00t_n15", "openvla_oft"]
AT_ONCE = 2


@pytest.fixture(scope="module")
def builds(request):
    """The selected families' build processes, ``AT_ONCE`` running at a time, in test order."""
    pool = ProcessPool(AT_ONCE)
    for item in request.session.items:
        if item.module is request.module and hasattr(item, "callspec"):
            family = item.callspec.params["family"]
            pool.add(family, [sys.executable, "-c", BUILD, family], cwd=ROOT)
    yield pool
    pool.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_medium_builds_in_bf16_without_an_fp32_copy(family: str, builds: ProcessPool) -> None:
    returncode, stdout, stderr = builds.result(family)
    assert returncode == 0, stderr[-3000:]
    row = json.loads(stdout.strip().splitlines()[-1])
    assert 0.35e9 < row["params"] < 0.6e9, row  # the medium preset is about 0.5B
    assert row["dtypes"] == ["torch.bfloat16"], row
    bf16_mb = row["params"] * 2 / 2**20
    # An fp32 build then cast peaks at >= 3x the bf16 bytes (fp32 copy + bf16 copy); building in
    # bf16 costs the bf16 bytes plus allocator slack.
    assert row["grew_mb"] < 1.4 * bf16_mb, f"{family}: grew {row['grew_mb']:.0f} MB for {bf16_mb:.0f} MB of bf16 weights"
