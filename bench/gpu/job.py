"""A real job on one GPU: Meta-World with one 224x224 camera x π0 at release size (3.3B, bf16),
generator and trainer colocated on device 0, for a fixed time in one mode: the ``job_sync`` and
``job_async`` stages of ``bench/gpu/check.sh`` (bench/gpu/README.md says how it runs and why).
``--family gr00t_n15`` is the ``job_gr00t`` stage: GR00T N1.5 (2.4B) colocated, as the paper
scales it (its Fig. 7).

    python bench/gpu/job.py --mode sync|async [--family pi0|gr00t_n15] [--seconds 75] [--offload auto|always|never] [--cuda-ipc]
    python bench/gpu/job.py --mode async --tiny --device cpu --until-version 1   # the same code on CPU

``startup_s``: start to the first env step; ``env_steps_per_s`` from then to the end
(``_after_v1``: from the first trained version); ``publish_to_swap_ms`` per version >= 1 from the
trainer's ``weights_written`` line (less its ``ms``) to the generator's ``weights_swapped`` line
(``first_version_ms``: version 0); ``staleness``: the broker's histogram. ``--tiny``: tiny π0 at
64x64 (the synthetic env where Meta-World is not installed).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import signal
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from rlvla3.harness.act_timing import device_or_exit
from rlvla3.app.launch import LocalJob, stop_processes
from rlvla3.config import from_dict, read_yaml
from rlvla3.harness.bench import emit
from rlvla3.harness.jobs import json_lines

ROOT = Path(__file__).resolve().parents[2]


def job_dict(args: argparse.Namespace) -> dict[str, Any]:
    model = read_yaml(ROOT / "configs" / "models" / f"{args.family}_{'tiny' if args.tiny else '3b'}.yaml")["model"]
    size = 64 if args.tiny else 224
    metaworld = importlib.util.find_spec("metaworld") is not None
    if not metaworld and not args.tiny:
        raise SystemExit("gpu_job: Meta-World is not installed (bench/gpu/check.sh installs it from the carried wheels)")
    env = ({"name": "metaworld", "options": {"benchmark": "MT1", "task": "pick-place-v3", "goal_mode": "seeded",
                                             "cameras": ["corner"], "image_size": [size, size], "state": "proprio",
                                             "max_episode_steps": 300}}
           if metaworld else {"name": "synthetic", "options": {"image_size": size, "max_episode_steps": 16}})
    gpus = {} if args.device == "cpu" else {"generator_gpus": "0", "trainer_gpus": "0"}
    return {
        "run": {"name": f"gpu_job_{args.family}_{args.mode}", "mode": args.mode, "total_env_steps": 10**12, "seed": 0},
        # Tolerant liveness: building 3.3B parameters twice on one GPU (or anything on a loaded
        # CPU) must not get a worker declared dead; this measures throughput, not failover.
        "broker": {"heartbeat_s": 1.0, "liveness": 15},
        "batching": {"max_batch": args.envs * args.simulators, "max_wait_ms": 10.0, "credits": 2},
        "env": {**env, "num_envs": args.envs, "slots": args.slots, "parallel": "process",
                "step_timeout_s": 120, "fragment_len": args.fragment_len},
        "model": model,
        "algo": {"name": "ppo", "batch_steps": args.batch_steps, "minibatch_size": args.minibatch, "epochs": 1,
                 "max_staleness": 4, "reward_scale": 0.01, "lr": 1e-5, "checkpoint_every": 0},
        "workers": {"simulators": args.simulators, "generators": 1, "trainers": 1, "device": args.device,
                    "torch_threads": 1 if args.tiny else 4},
        "placement": {"mode": "colocated", "offload": args.offload, **gpus},
        "weights": {"cuda_ipc": args.cuda_ipc},
    }


def log_events(path: Path, *events: str) -> list[dict[str, Any]]:
    """The JSON log lines of ``path`` whose event is one of ``events``."""
    return [row for row in json_lines(path) if row.get("event") in events]


def ts(row: dict[str, Any]) -> float:
    return datetime.fromisoformat(row["timestamp"].replace("Z", "+00:00")).timestamp()


def publish_to_swap(run_dir: Path) -> tuple[dict[int, float], float | None]:
    """Per version: publish() start (trainer) to swapped (generator), ms."""
    written = {int(r["version"]): ts(r) - float(r.get("ms", 0.0)) / 1000 for r in log_events(run_dir / "trainer0.log", "weights_written")}
    swapped = {int(r["version"]): ts(r) for r in log_events(run_dir / "generator0.log", "weights_swapped")}
    both = {v: round((swapped[v] - written[v]) * 1000, 1) for v in sorted(written) if v in swapped}
    return {v: ms for v, ms in both.items() if v >= 1}, both.get(0)


def gpu_mem_used_mib() -> int | None:
    """GPU 0's memory in use now, all processes together (the job's workers are separate
    processes, so torch's own counters in this one see none of it); None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.split()
        return int(out[0]) if out else None
    except (subprocess.SubprocessError, ValueError):
        return None


def staleness(fig: dict[str, Any]) -> dict[str, Any]:
    """The broker's histogram holds staleness + 1 (HdrHistogram has no 0)."""
    h = fig.get("staleness") or {}
    if not h.get("count"):
        return {"count": 0}
    return {"count": h["count"], **{k: (round(h[k] - 1, 3) if isinstance(h.get(k), (int, float)) else None)
                                    for k in ("p50", "p90", "max", "mean")}}


def dropped(run_dir: Path) -> dict[str, Any]:
    """Samples the trainer's staleness filter dropped (past ``max_staleness``), against those it
    trained on, from its per-update lines: the broker's histogram counts both."""
    rows = json_lines(run_dir / "trainer_metrics.jsonl")
    return {"dropped_stale": int(rows[-1].get("dropped_stale_total", 0)) if rows else 0,
            "samples_trained": int(sum(r.get("samples", 0) for r in rows))}


class Stopped(Exception):
    """SIGTERM (``bench/gpu/check.sh``'s stage timeout): stop the job, report what was measured."""


def _stopped(signum: int, frame: Any) -> None:
    raise Stopped()


def run(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    cfg = from_dict(job_dict(args))
    cfg_path = run_dir / "config.yaml"
    cfg_path.write_text(cfg.to_yaml())
    job = LocalJob(cfg, run_dir, cfg_path, log_json=True)
    t0 = time.monotonic()
    end = t0 + args.seconds
    samples: list[tuple[float, int, int]] = []  # (t, env_steps, policy_version)
    mem_peak: int | None = None  # sampled while the job runs: once it is stopped the GPU is empty
    fig: dict[str, Any] = {}
    error = None
    signal.signal(signal.SIGTERM, _stopped)
    try:
        job.start_broker("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
        job.start_all()
        while time.monotonic() < end:
            dead = [p for p in [job.broker_proc, *job.workers] if p is not None and p.poll() is not None]
            if dead:
                error = f"a process exited with code {dead[0].returncode}; logs in {run_dir}"
                break
            try:
                fig = job.status()
            except TimeoutError:
                continue
            samples.append((time.monotonic(), int(fig.get("env_steps", 0)), int(fig.get("policy_version", -1))))
            if args.device != "cpu" and (used := gpu_mem_used_mib()) is not None:
                mem_peak = max(mem_peak or 0, used)
            moving = [s for s in samples if s[1] > 0]
            if args.until_version is not None and samples[-1][2] >= args.until_version \
                    and len(moving) >= 2 and moving[-1][1] > moving[0][1] \
                    and args.until_version in publish_to_swap(run_dir)[0] and staleness(fig)["count"]:
                break  # --until-version: enough for every figure, a rate included (the smoke run)
            # polling STATUS with a deadline: each second for the rates; the smoke run (--until-version) stops sooner
            time.sleep(min(0.25 if args.until_version is not None else 1.0, max(0.0, end - time.monotonic())))
    except Stopped:
        error = f"stopped by SIGTERM after {time.monotonic() - t0:.0f} s (the figures so far)"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the clean-up runs to its end
        for p in job.workers[:1]:  # the trainer (started first): no release-size shutdown checkpoint
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        stop_processes(job.workers, timeout_s=6)
        if job.broker_proc is not None:
            stop_processes([job.broker_proc], timeout_s=3)
    moving = [s for s in samples if s[1] > 0]
    first = moving[0] if moving else None
    last = samples[-1] if samples else None
    trained = [s for s in moving if s[2] >= 1]
    p2s, first_ms = publish_to_swap(run_dir)
    placement = log_events(run_dir / "trainer0.log", "trainer_placement")
    out: dict[str, Any] = {
        "mode": args.mode, "env": cfg.env.name, "family": cfg.model.family, "size": cfg.model.options.get("size"),
        "image": cfg.env.options.get("image_size"), "device": args.device, "placement": cfg.placement.mode,
        "seconds": round(time.monotonic() - t0, 1),
        "startup_s": round(first[0] - t0, 1) if first else None,
        "env_steps": last[1] if last else 0,
        "env_steps_per_s": round((last[1] - first[1]) / (last[0] - first[0]), 2) if first and last[0] > first[0] else None,
        "env_steps_per_s_after_v1": (round((last[1] - trained[0][1]) / (last[0] - trained[0][0]), 2)
                                     if trained and last[0] > trained[0][0] else None),
        "versions": last[2] if last else -1,
        "publish_to_swap_ms": p2s,
        "publish_to_swap_ms_median": sorted(p2s.values())[len(p2s) // 2] if p2s else None,
        "first_version_ms": first_ms,
        "staleness": staleness(fig),
        **dropped(run_dir),
        "update_s": [r.get("update_s") for r in log_events(run_dir / "trainer0.log", "update_done")],
        "generate_us_p50": (fig.get("generate_us") or {}).get("p50"),
        "batch_size_p50": (fig.get("batch_size") or {}).get("p50"),
        "offloading": placement[0].get("offloading") if placement else None,
        "weights_source": sorted({str(r.get("source")) for r in log_events(run_dir / "generator0.log", "weights_swapped")}),
        "gpu_mem_peak_mib": mem_peak,
    }
    if not error and not moving:
        error = f"no env step within {args.seconds} s"
    if error:
        out["error"] = error
        out["log_errors"] = {p.stem: e for p in sorted(run_dir.glob("*.log")) if (e := last_error(p))}
    return out


def last_error(path: Path) -> str | None:
    """The last error-level JSON log line of ``path``, or else its last exception line (a
    traceback's), for the JSON of a failed run (its run folder is temporary)."""
    lines = path.read_text(errors="replace").splitlines()
    for line in reversed(lines):
        if line.startswith("{") and '"level": "error"' in line:
            return line[:600]
    plain = [ln for ln in lines if not ln.startswith("{") and re.search(r"Error|Exception|Traceback", ln)]
    return plain[-1][:600] if plain else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("sync", "async"), required=True)
    ap.add_argument("--family", choices=("pi0", "gr00t_n15"), default="pi0")
    ap.add_argument("--seconds", type=float, default=75.0, help="from start to stop, start-up included")
    ap.add_argument("--offload", choices=("auto", "always", "never"), default="auto")
    ap.add_argument("--simulators", type=int, default=2)
    ap.add_argument("--envs", type=int, default=8, help="envs per simulator")
    ap.add_argument("--slots", type=int, default=2, help="slots per simulator")
    ap.add_argument("--batch-steps", type=int, default=32, help="decisions per update (x the chunk's env steps: 50 for π0, 16 for N1.5)")
    ap.add_argument("--minibatch", type=int, default=8)
    ap.add_argument("--fragment-len", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cuda-ipc", action="store_true",
                    help="weights.cuda_ipc: the generator copies trainable weights from the trainer's GPU buffer")
    ap.add_argument("--tiny", action="store_true", help="the tiny model at 64x64 (a smoke test of this script)")
    ap.add_argument("--until-version", type=int, default=None,
                    help="stop early once this version is trained and swapped in (the smoke run)")
    args = ap.parse_args()
    device_or_exit(args.device, "gpu_job")
    with tempfile.TemporaryDirectory(prefix="rlvla3-gpu-job-") as tmp:
        emit(run(args, Path(tmp)))


if __name__ == "__main__":
    main()
