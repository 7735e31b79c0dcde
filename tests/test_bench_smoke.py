"""Every benchmark command in the README runs as written. The test reads the ```bash block under
"## Benchmarks" and runs each line's script with the line's own flags plus ``--smoke`` (a tiny
budget, seconds per script), from an empty folder and without ``--out``: so a README line that
stops working, or a default output folder that breaks, fails here. Each run must end with one
JSON object carrying the keys its script promises, and write its files under ``bench/out/``.
No timing assertions: this machine is shared."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from brokers.ledger import ACKED_PARTS

from rlvla3.lifetime import launcher_env
from tests.jobs import ProcessPool

ROOT = Path(__file__).resolve().parents[1]


def readme_bench_commands() -> list[list[str]]:
    """The argv of every command in the README's ```bash block under "## Benchmarks"."""
    text = (ROOT / "README.md").read_text()
    _, sep, rest = text.partition("\n## Benchmarks\n")
    assert sep, 'README.md has no "## Benchmarks" section'
    section = rest.split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, 'the "## Benchmarks" section has no ```bash block'
    cmds = [shlex.split(line, comments=True) for line in block.group(1).splitlines()]
    return [c for c in cmds if c]


COMMANDS = readme_bench_commands()


# ---------------------------------------------------------------------------------------------
# What each script's JSON and files must hold (a script not listed: one JSON object)
# ---------------------------------------------------------------------------------------------


def check_latency(r: dict[str, Any], out: Path) -> None:
    for key in ("p50_us", "p99_us", "p999_us", "raw_p50_us", "raw_p99_us", "relay_p50_us", "relay_p99_us",
                "p50_over_relay", "p99_over_relay", "achieved_rate", "target_rate", "ratio_p50", "curve", "parts"):
        assert key in r, key
    assert r["achieved_rate"] > 0 and r["target_rate"] > 0 and r["generator"] == "echo"
    assert 0 < r["raw_p50_us"] <= r["raw_p99_us"] and 0 < r["relay_p50_us"] <= r["relay_p99_us"]
    assert r["relay_requests"] == r["raw_requests"] > 0
    assert 0 < r["p50_us"] <= r["p99_us"] <= r["p999_us"]
    assert r["requests"] > 0 and r["errors"] == 0
    assert r["parts"]["forward_us"]["count"] == r["requests"]
    assert r["parts"]["broker_generate_us"]["count"] > 0
    assert (out / "latency.png").stat().st_size > 0
    assert json.loads((out / "latency.json").read_text())["requests"] == r["requests"]


def check_transfer(r: dict[str, Any], out: Path) -> None:
    for key in ("shm_mb_s", "inline_mb_s", "ratio", "batch_bytes", "reps"):
        assert key in r, key
    assert r["shm_mb_s"] > 0 and r["inline_mb_s"] > 0 and r["ratio"] > 0
    assert r["batch_bytes"] == r["images"] * r["size"] * r["size"] * 3
    assert set(r["parts_median_us"]) == {"shm", "shm_copy", "inline"} and r["parts_median_us"]["shm"]["write_us"] >= 0
    assert (out / "transfer.png").stat().st_size > 0
    assert json.loads((out / "transfer.json").read_text())["reps"] == r["reps"]


def check_ablation(r: dict[str, Any], out: Path) -> None:
    assert r["sim"] == "synthetic"
    for mode in ("sync", "async_rollout", "async"):
        # a window holds at least one update and some env steps, however short --smoke's is
        assert r[f"{mode}_sps"] > 0 and r[f"{mode}_detail"]["updates"] >= 1, mode
        assert r[f"{mode}_detail"]["window_s"] >= r["window_s"], (mode, r[f"{mode}_detail"])
        # the trainers of the jobs ran with train.min_update_s = the measured train cost
        assert r[f"{mode}_detail"]["update_s"] >= r["train_cost_s"] * 0.999, (mode, r[f"{mode}_detail"])
    assert set(r["stages_sps"]) == {"simulators", "generator", "trainer"}
    assert all(v > 0 for v in r["stages_sps"].values()), r["stages_sps"]
    assert r["bottleneck_stage"] in r["stages_sps"] and r["bottleneck_sps"] == min(r["stages_sps"].values())
    assert r["train_cost_s"] > 0 and r["train_cost_kind"] in ("sleep", "compute")
    for key in ("trainer_sps", "async_over_sync", "async_over_async_rollout", "async_of_bottleneck", "load"):
        assert key in r, key
    assert (out / "ablation_synthetic.png").stat().st_size > 0
    assert json.loads((out / "ablation_synthetic.json").read_text())["sync_sps"] == r["sync_sps"]


def check_sim_latency(r: dict[str, Any], out: Path) -> None:
    assert r, "no case reported"
    for case, row in r.items():
        assert "skipped" in row or {"p50_ms", "p99_ms", "steps_per_s"} <= set(row), (case, row)
    if importlib.util.find_spec("metaworld") is not None:  # the smoke case, where it is installed
        assert r["metaworld_state"].get("steps", 0) > 0, r["metaworld_state"]
        assert (out / "sim_latency.png").stat().st_size > 0
        assert (out / "metaworld_state.hdr").stat().st_size > 0
    assert json.loads((out / "sim_latency.json").read_text()) == r


def check_generator(r: dict[str, Any], out: Path) -> None:
    assert set(r) == {"openvla_oft", "pi0", "pi05", "gr00t_n15"}, sorted(r)
    for fam, rows in r.items():
        assert set(rows) == {"1", "2"} and all(v > 0 for v in rows.values()), (fam, rows)
    assert (out / "generator.png").stat().st_size > 0
    assert set(json.loads((out / "generator.json").read_text())["results"]) == set(r)


def check_learning(r: dict[str, Any], out: Path) -> None:
    for key in ("sync_steps_to_target", "async_steps_to_target", "sync_seconds_to_target",
                "async_seconds_to_target", "per_seed"):
        assert key in r, key
    folder = out / "learning"
    assert Path(r["out"]) == folder.resolve()
    for mode in ("sync", "async"):
        rows = (folder / f"{mode}-seed0" / "metrics.jsonl").read_text().splitlines()
        assert any(json.loads(line)["env_steps"] > 0 for line in rows), mode
        counts = [(row["episodes"], row["successes"]) for row in map(json.loads, rows) if row["env_steps"] > 0]
        assert all(0 <= s <= e for e, s in counts), counts  # the broker's running counts, read by fig6
        assert all(e0 <= e1 and s0 <= s1 for (e0, s0), (e1, s1) in zip(counts, counts[1:])), counts
    assert r["png"] and all(Path(p).stat().st_size > 0 for p in r["png"])
    assert json.loads((folder / "results.json").read_text()) == r
    fig6 = r["fig6"]  # one seed per mode: the per-seed figures, and no band yet
    assert [row["seed"] for row in fig6["sync"]["per_seed"]] == [0] and fig6["agreement"] is None
    assert (folder / "sync-seed0" / "learning_done.json").is_file()  # a rerun resumes from it


def check_weights(r: dict[str, Any], out: Path) -> None:
    for key in ("params_m", "bytes_mb", "publish_to_swap_ms", "memcpy_ms", "ratio", "max_serving_gap_ms",
                "broker_rss_mb", "copies", "hash_ms", "runs"):
        assert key in r, key
    assert r["copies"] == 2 and r["publish_to_swap_ms"] > 0 and r["memcpy_ms"] > 0
    assert r["bytes_mb"] < r["first_version_mb"]  # later versions carry trainable tensors only
    assert r["rejected"] == 0 and r["shm_left"] == [] and r["source"] == ["shm"]
    assert (out / "weights.json").is_file()


def check_fuzz(r: dict[str, Any], out: Path) -> None:
    for key in ("sent", "errors", "broker_alive", "job_advanced", "rss_growth_mb"):
        assert key in r, key
    assert r["errors"] > 0 and not r["client_failures"]
    assert r["broker_alive"] and r["workers_alive"] and r["all_read"]
    assert r["peer_turn_us"]["count"] > 0 and r["peer_rate"]["dropped"] == 0  # the broker's figures per peer
    assert r["keyless_answered"] is (None if not r["curve"] else False)  # CURVE: a peer without a key gets nothing
    assert (out / "fuzz.json").is_file()


def check_status_flood(r: dict[str, Any], out: Path) -> None:
    for key in ("loop_stall_ms_flood", "loop_stall_cpu_ms_flood", "status_answer_cpu_us", "statuses_per_s", "job_advanced"):
        assert key in r, key
    assert r["broker_alive"] and r["workers"] == 3 + 8 and r["status_answer_cpu_us"]["count"] > 0
    assert r["loop_stall_cpu_ms_flood"] <= r["loop_stall_ms_flood"] + 1  # CPU time within the wall time
    assert (out / "status_flood.json").is_file()


def check_multihost(r: dict[str, Any], out: Path) -> None:
    assert "not scaling" in r["note"]  # one machine: it measures cross-host overhead, and says so
    assert (out / "multihost.json").is_file()
    if "skipped" in r:  # not root, or no iproute2: the reason is the answer
        return
    assert set(r["env_steps_per_s"]) == {"0", "1", "2", "3"} and r["curve"]
    assert all(s["env_steps"] > 0 for s in r["stages"]), r["stages"]
    assert r["stages"][0]["frames"]["sim-head"]["inline"] == 0 < r["stages"][0]["frames"]["sim-head"]["shm"]
    for stage in r["stages"][1:]:
        assert all(f["shm"] == 0 < f["inline"] for f in stage["frames"].values()), stage
        assert len(stage["hosts"]) == stage["sim_hosts"]
    a = r["acked_steps"]
    assert a["acked"] == sum(a[k] for k in ACKED_PARTS)


def check_partition(r: dict[str, Any], out: Path) -> None:
    assert (out / "partition.json").is_file()
    if "skipped" in r:  # not root, or no iproute2: the reason is the answer
        return
    assert r["faults"] and set(r["lost_allowed"]) == {row["fault"] for row in r["faults"]}
    for row in r["faults"]:
        assert row["detect_s"] is not None and row["recover_s"] is not None, row
    assert r["lost"] == 0 and r["duplicated"] == 0 and not r["problems"], r


def check_soak(r: dict[str, Any], out: Path) -> None:
    if "skipped" in r:  # not root, or no iproute2 (namespace hosts): the reason is the answer
        assert (out / "soak.json").is_file()
        return
    for key in ("env_steps", "kills", "acked_steps", "rss_mb", "lost_per_trainer_kill", "targets"):
        assert key in r, key
    assert r["env_steps"] > 0 and sum(r["kills"].values()) > 0
    a = r["acked_steps"]
    assert a["acked"] > 0 and r["targets"]["fates_add_up"]  # each broker's ledger exact
    assert all(r["rss_mb"][f"{name}#1"] is not None for name in r["kept"])  # kept off the kill list
    assert (out / "soak.json").is_file() and (out / "soak_rss.png").stat().st_size > 0


def check_batching_sweep(r: dict[str, Any], out: Path) -> None:
    for key in ("best_grid_sps", "best_grid", "worst_grid_sps", "adaptive_sps", "grid", "adaptive_runs"):
        assert key in r, key
    assert len(r["grid"]) >= 2 and all(v > 0 for v in r["grid"].values()), r["grid"]
    assert r["best_grid_sps"] == max(r["grid"].values()) and r["worst_grid_sps"] == min(r["grid"].values())
    assert r["adaptive_sps"] > 0 and r["adaptive_runs"][0]["controller"] is not None  # it ran, live
    assert (out / "batching_sweep.png").stat().st_size > 0
    assert json.loads((out / "batching_sweep.json").read_text())["best_grid"] == r["best_grid"]


def check_broker_capacity(r: dict[str, Any], out: Path) -> None:
    for key in ("max_rps", "rps_per_broker_core", "p99_us_at_80pct", "broker_cpu_pct", "curve", "ramp", "saturated"):
        assert key in r, key
    assert r["max_rps"] > 0 and r["errors"] == 0 and r["broker_cpu_pct"] > 0
    assert r["max_rps"] == max(s["achieved_rps"] for s in r["ramp"])
    assert all(s["done"] > 0 and s["unanswered"] == 0 for s in [*r["ramp"], r["at_80pct"]]), r["ramp"]
    assert (out / "broker_capacity.png").stat().st_size > 0
    assert json.loads((out / "broker_capacity.json").read_text())["max_rps"] == r["max_rps"]


def check_broker_hotpath(r: dict[str, Any], out: Path) -> None:
    assert r["requests"] > 0 and r["us_per_request"] > 0
    assert set(r["stages_us"]) == {"decode_obs", "handle_obs", "tick_and_encode_batch", "decode_result",
                                   "handle_result", "encode_act"}
    assert json.loads((out / "broker_hotpath.json").read_text())["requests"] == r["requests"]


def check_gym_parity(r: dict[str, Any], out: Path) -> None:
    for key in ("final_return", "steps_per_s", "runs", "seeds"):
        assert key in r, key
    assert set(r["final_return"]["Hopper-v4"]) == {"sync", "async"}
    assert all(run["rc"] == 0 and run["episodes"] > 0 for run in r["runs"]), r["runs"]
    assert all(r["steps_per_s"]["Hopper-v4"][m] > 0 for m in ("sync", "async"))
    assert r["sync_target"]["Hopper-v4"]["published_lower"] == 2111.12  # CleanRL's published mean - std
    assert (out / "gym_parity" / "hopper.png").stat().st_size > 0
    assert "| Hopper-v4 | async |" in (out / "gym_parity" / "parity.md").read_text()


CHECKS: dict[str, Callable[[dict[str, Any], Path], None]] = {
    "latency": check_latency, "transfer": check_transfer, "ablation": check_ablation,
    "sim_latency": check_sim_latency, "generator": check_generator, "learning": check_learning, "weights": check_weights,
    "fuzz": check_fuzz, "status_flood": check_status_flood, "multihost": check_multihost, "partition": check_partition,
    "soak": check_soak,
    "batching_sweep": check_batching_sweep, "capacity": check_broker_capacity, "hotpath": check_broker_hotpath,
    "gym_parity": check_gym_parity,
}


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def test_readme_block_lists_bench_scripts() -> None:
    assert COMMANDS, 'the README\'s "## Benchmarks" block has no command'
    for argv in COMMANDS:
        assert argv[0] == "python" and re.fullmatch(r"bench/\w+/\w+\.py", argv[1]), shlex.join(argv)
        assert (ROOT / argv[1]).is_file(), argv[1]
    assert {Path(a[1]).stem for a in COMMANDS} >= set(CHECKS), "a checked benchmark left the README"


def command_id(argv: list[str]) -> str:
    return Path(argv[1]).stem if len(argv) > 1 else "?"


IDS = [command_id(a) for a in COMMANDS]


@pytest.fixture(scope="module")
def smokes(request, tmp_path_factory):
    """The selected README lines' smoke runs, two at a time in the background in README order,
    each from its own empty folder (most of a smoke run is single-threaded process start-up, so
    on a 2-core machine two overlap well)."""
    pool = ProcessPool(2)
    folders: dict[str, Path] = {}
    env = {**os.environ, **launcher_env(), "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    for item in request.session.items:
        if item.module is request.module and hasattr(item, "callspec") and "argv" in item.callspec.params:
            argv, key = item.callspec.params["argv"], item.callspec.id
            folders[key] = tmp_path_factory.mktemp(key)
            pool.add(key, [sys.executable, str(ROOT / argv[1]), *argv[2:], "--smoke"], cwd=folders[key], env=env)
    yield pool, folders
    pool.close()


@pytest.mark.timeout(600)  # a smoke run is seconds alone; process start-up is slow on a loaded 2-core VM
@pytest.mark.parametrize("argv", COMMANDS, ids=IDS)
def test_readme_bench_command_runs(argv: list[str], smokes, request) -> None:
    """The line as written (from an empty folder, so the default ``--out`` is exercised) plus
    ``--smoke``; its files must land in ``bench/out`` under the folder it ran from."""
    pool, folders = smokes
    key = request.node.callspec.id
    returncode, stdout, stderr = pool.result(key, timeout=540)
    cmd = f"{shlex.join(argv)} --smoke"
    assert returncode == 0, f"{cmd} exited {returncode}\n{stderr[-3000:]}"
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert lines, f"{cmd} printed nothing\n{stderr[-3000:]}"
    result = json.loads(lines[-1])
    assert isinstance(result, dict) and result, f"{cmd}: last line is not a JSON object"
    check = CHECKS.get(Path(argv[1]).stem)
    if check is not None:
        check(result, folders[key] / "bench" / "out")
