"""Env steps/s with simulators on 1, 2 and 3 other hosts, against the same job on one host.

Hosts are network namespaces with their own hostname and /dev/shm (``rlvla3/harness/netns.py``):
a simulator on another host than the broker sends inline frames over TCP (veth pairs, one
bridge), CURVE on, as across machines. One job (broker, generator, trainer on the head host):
first one simulator on the head host (shared memory, the baseline), then it leaves and simulator
hosts join one by one; each stage measures env steps/s from STATUS over a window after a warm-up.
On one small machine every host shares the same cores: the figures measure what the cross-host
path costs, not how a job scales with machines; the JSON says so.

    python bench/fabric/multihost.py --quick     # ~1.5 min; --smoke: a few seconds per stage
Needs root and iproute2 (network namespaces); prints one JSON object last.
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from rlvla3.config import load
from rlvla3.harness.bench import emit_to, parse_bench_args
from rlvla3.harness.jobs import per_worker
from rlvla3.harness.netns import NetnsJob, unavailable

NOTE = ("all namespace hosts share one machine's CPU cores: the rates measure the fabric's cross-host overhead "
        "(inline frames over TCP with CURVE instead of shared memory), not scaling with hosts")

SMALL = ("env.num_envs=4", "env.slots=2", "env.fragment_len=8", "env.options.latency={kind: constant, mean_ms: 1.0}",
         "algo.batch_steps=128", "algo.minibatch_size=64", "algo.epochs=1", "batching.max_batch=8",
         "batching.max_wait_ms=2", "model.options.hidden=32")


def measure(job: NetnsJob, warm_s: float, window_s: float, sims: list[str]) -> dict[str, Any]:
    """Env steps/s over ``window_s`` once every simulator in ``sims`` has stepped, the trainer has
    updated since the stage began (the pipeline flows end to end) and ``warm_s`` passed."""
    v0 = job.status()["trainer_version"]
    job.wait(lambda f: all((per_worker(f, s).get("env_steps") or 0) > 0 for s in sims) and f["trainer_version"] > v0,
             300, f"{sims} to step and the trainer to update")
    time.sleep(warm_s)  # warm-up: let the new host's pipeline fill before the window opens
    window = job.rate(window_s)
    b = window["last"]
    return {
        "env_steps_per_s": round(window["rate"], 1),
        "window_s": round(window["window_s"], 2),
        "env_steps": window["count"],
        "frames": {s: per_worker(b, s).get("frames") for s in sims},
        "hosts": sorted({per_worker(b, s).get("host") for s in sims}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-hosts", type=int, default=3, help="simulator hosts to add, one by one")
    args = parse_bench_args(ap, "shorter windows (about a minute and a half)", smoke_help="tiny windows, no timing value")
    warm_s, window_s = (0.2, 0.5) if args.smoke else (3.0, 10.0) if args.quick else (10.0, 30.0)
    reason = unavailable()
    if reason is not None:
        return emit_to(args.out, "multihost.json", {"skipped": reason, "note": NOTE})

    folder = Path(tempfile.mkdtemp(prefix="rlvla3-multihost-"))
    cfg = load("synthetic.yaml", SMALL)
    cfg_path = folder / "config.yaml"
    cfg_path.write_text(cfg.to_yaml())
    job = NetnsJob(folder)
    stages: list[dict[str, Any]] = []
    try:
        job.start_broker(cfg_path)
        job.worker("head", "generator", "gen")
        job.worker("head", "trainer", "trainer", "--run-dir", str(folder / "run"))
        local = job.worker("head", "simulator", "sim-head")
        stages.append({"sim_hosts": 0, "simulators_on_broker_host": 1, **measure(job, warm_s, window_s, ["sim-head"])})
        local.send_signal(signal.SIGTERM)  # the baseline's simulator leaves; remote hosts take over
        local.wait(60)
        job.wait(lambda f: f["workers"]["simulator"] == 0, 60, "the head simulator to leave")
        sims: list[str] = []
        for i in range(1, args.max_hosts + 1):
            sims.append(f"sim{i}")
            job.worker(f"simhost{i}", "simulator", f"sim{i}")
            stages.append({"sim_hosts": i, "simulators_on_broker_host": 0, **measure(job, warm_s, window_s, sims)})
        final = job.status()
    finally:
        job.close()
    base = stages[0]["env_steps_per_s"]
    one = stages[1]["env_steps_per_s"] if len(stages) > 1 else None
    result = {
        "stages": stages,
        "env_steps_per_s": {str(s["sim_hosts"]): s["env_steps_per_s"] for s in stages},
        "same_host_env_steps_per_s": base,
        "cross_host_ratio": round(one / base, 3) if one is not None and base else None,
        "acked_steps": final.get("acked_steps"),
        "errors": final.get("errors"),
        "curve": True,
        "mode": "smoke" if args.smoke else "quick" if args.quick else "full",
        "note": NOTE,
    }
    emit_to(args.out, "multihost.json", result)


if __name__ == "__main__":
    main()
