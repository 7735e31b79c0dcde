"""``bench/gpu/check.sh --dry-run``: the prepared GPU check rehearsed on CPU with tiny models.

One run of the whole script (the same stage scripts and flags as on the GPU, tiny sizes): each
stage writes its own JSON as it ends, each holds the figures its GPU run will report, and the
summary is the last line of stdout. The install stage is given 1 s, less than its interpreter
needs to import torch: it times out, says so, and the stages after it run as if it had not. This is also where the GPU machine's stack is covered on
CPU: the update and job stages run the trainer's real path (build, learner, update, weights).
No timing assertions."""

from __future__ import annotations

import json
import os
import random
import sys
import zipfile
from pathlib import Path

import pytest

from rlvla3.harness.jobs import run_command
from tests.jobs import last_json

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("install", "models", "update", "job_sync", "job_async", "job_gr00t")
FAMILIES = {"pi0", "pi05", "gr00t_n15", "openvla_oft"}


@pytest.mark.timeout(900)  # ~1 min alone; process start-up is slow on a loaded 2-core VM
def test_gpu_check_dry_run_writes_every_stage(tmp_path: Path) -> None:
    out = tmp_path / "gc"
    proc = run_command(
        ["bash", str(ROOT / "bench" / "gpu" / "check.sh"), "--dry-run", "--out", str(out), "--carry", str(tmp_path / "none")],
        840, {"PYTHON": sys.executable, "GPU_CHECK_SITE": str(tmp_path / "site"),
              "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "GPU_CHECK_T_INSTALL": "1"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json(proc.stdout)
    stages = summary["stages"]
    assert summary["dry_run"] is True and set(stages) == set(STAGES)
    assert summary["failed"] == ["install"], {n: stages[n].get("error") for n in summary["failed"]}
    assert not summary["ok"] and json.loads((out / "summary.json").read_text())["failed"] == ["install"]
    install = json.loads((out / "install.json").read_text())
    assert install["timed_out"] and install["rc"] == 124 and install["result"] is None
    assert "timed out" in install["error"] and install["seconds"] < 15
    for name in STAGES[1:]:  # each stage's own file, written as it ended, says the same
        own = json.loads((out / f"{name}.json").read_text())
        assert own["stage"] == name and own["ok"] and not own["timed_out"] and own["seconds"] > 0
        assert own["result"] == stages[name]["result"]

    models = stages["models"]["result"]
    assert set(models) >= FAMILIES
    for fam in FAMILIES:
        assert set(models[fam]["batches"]) == {"1", "2"}, models[fam]
        assert all(row["samples_per_s"] > 0 for row in models[fam]["batches"].values())

    update = stages["update"]["result"]
    assert update["pi0"]["lora"] is False and update["openvla_oft"]["lora"] is True
    assert update["openvla_oft"]["trainable_m"] < update["openvla_oft"]["params_m"] / 2  # adapters and heads only
    for fam in ("pi0", "openvla_oft"):
        for algo in ("ppo", "grpo"):
            case = update[fam][algo]
            assert case["update_s"][0] > 0 and case["samples"][0] > 0, (fam, algo, case)

    for stage, mode, family in (("job_sync", "sync", "pi0"), ("job_async", "async", "pi0"), ("job_gr00t", "async", "gr00t_n15")):
        job = stages[stage]["result"]
        assert job["mode"] == mode and job["placement"] == "colocated" and job["family"] == family
        assert job["env_steps"] > 0 and job["env_steps_per_s"] > 0 and job["versions"] >= 1
        assert job["publish_to_swap_ms"]["1"] > 0 and job["staleness"]["count"] > 0
        assert job["update_s"] and job["offloading"] is False  # auto on CPU keeps the state
        assert job["samples_trained"] > 0 and 0 <= job["dropped_stale"]
    # sync alternates (brokers/pacing.py): no new request once a batch is complete, but a chunk
    # already in flight ends under the version it started with and counts toward the next batch
    assert stages["job_sync"]["result"]["staleness"]["max"] <= 1
    assert stages["job_sync"]["result"]["dropped_stale"] == 0
    head = summary["headline"]  # what a note quotes, picked out of the stages
    assert set(head["act_samples_per_s"]) >= FAMILIES and set(head["jobs"]) == {"sync", "async", "gr00t"}
    assert set(head["updates"]) == {f"{f}.{a}" for f in ("pi0", "openvla_oft") for a in ("ppo", "grpo")}
    assert head["jobs"]["async"]["publish_to_swap_ms_median"] == stages["job_async"]["result"]["publish_to_swap_ms_median"]


def _wheel(folder: Path, dist: str, version: str, files: int) -> Path:
    """A pure-Python wheel in the published layout (module, METADATA, WHEEL, RECORD)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    body = {f"{dist}/__init__.py": f"VERSION = {version!r}\n"}
    noise = random.Random(0).randbytes(100_000).hex()  # zip keeps each copy; one solid xz stream, one
    body.update({f"{dist}/part{i}.py": f"DATA = {noise!r}\n" for i in range(files)})
    info = f"{dist}-{version}.dist-info"
    body[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
    body[f"{info}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    body[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*body, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, text in body.items():
            zf.writestr(name, text)
    return path


def test_carried_wheels_are_packed_then_installed_when_missing_or_older(tmp_path: Path) -> None:
    """``--pack`` (``check.sh --prepare``) repacks a large wheel as solid xz; the install stage
    zips it back and pip installs it; a wheel no newer than what is installed stays out."""
    carry = tmp_path / "carry"
    big = _wheel(carry / "wheels", "rlvla3_carried_probe", "1.2.0", files=24)  # 2.6 MiB as a wheel, 0.1 packed
    _wheel(carry / "wheels", "click", "0.0.1", files=0)  # older than the installed click
    script = ROOT / "bench" / "gpu" / "install.py"
    packed = run_command([sys.executable, str(script), "--pack", str(carry / "wheels")], 300)
    assert packed.returncode == 0, packed.stderr[-2000:]
    assert last_json(packed.stdout)["packed"] == [big.name + ".tar.xz"] and not big.exists()
    assert (carry / "wheels" / (big.name + ".tar.xz")).stat().st_size < 0.2 * 2**20

    site = tmp_path / "site"
    proc = run_command([sys.executable, str(script), "--carry", str(carry), "--site", str(site), "--dry-run"], 300,
                       {"PYTHONPATH": f"{site}{os.pathsep}{ROOT}"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheels = last_json(proc.stdout)["wheels"]
    assert wheels["installed"] == [big.name + ".tar.xz"] and wheels["already_there"] == ["click-0.0.1-py3-none-any.whl"]
    assert "error" not in wheels
    probe = run_command([sys.executable, "-c", "import rlvla3_carried_probe as m, importlib.metadata as md; "
                         "print(m.VERSION, md.version('rlvla3_carried_probe'))"], 60, {"PYTHONPATH": str(site)})
    assert probe.stdout.split() == ["1.2.0", "1.2.0"], probe.stderr[-1000:]
