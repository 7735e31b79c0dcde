"""Partitions between hosts (30 s cuts) and a lost broker host (a new one 20 s later): time to
detect, time to recover, the env steps/s dip, and what was lost or counted twice.

Two jobs over network-namespace hosts (``rlvla3/harness/faults.py``), each fault measured the same
way as ``tests/test_partition.py`` measures its short ones. The first (broker, trainer, a simulator
and a generator on the head host; a simulator host; a generator host) meets four in turn:

    simulator_host_cut   the simulator host's switch port down for --cut-s
    generator_host_cut   the generator host's
    broker_host_cut      the broker's host cut off from all the others
    broker_restart       the broker SIGKILLed, a new one on the same address --broker-down-s later

the second (two trainer ranks on two hosts) one:

    trainer_rank_cut     rank 1's host cut off: the group ends, both ranks restart from the checkpoint

On one machine every host shares the same cores, so the rates are the job's on this machine.

    python bench/faults/partition.py --quick     # 5 s cuts, about 2 minutes; --smoke: one 3 s cut
Needs root and iproute2 (network namespaces); prints a table, then one JSON object last.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from rlvla3.harness.bench import emit_to, note, parse_bench_args
from rlvla3.harness.faults import FAULTS, LIVENESS, RANK_FAULTS, RATE_WINDOW_S, REJOIN_BOUND_S, run_fault, start_job
from rlvla3.harness.netns import unavailable

def table(rows: list[dict]) -> str:
    head = f"{'fault':<20} {'cut s':>6} {'detect s':>9} {'recover s':>10} {'steps/s':>8} {'during':>8} {'dip':>6} " \
           f"{'lost':>5} {'dup':>4} {'resent':>7}  problems"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['fault']:<20} {r['cut_s']:>6.1f} {r['detect_s']:>9.2f} {r['recover_s']:>10.2f} "
                     f"{r['steps_per_s_before']:>8.0f} {r['steps_per_s_during']:>8.0f} {r['dip']:>6.0%} "
                     f"{r['lost']:>5} {r['duplicated']:>4} {r['resent_recognised']:>7}  {'; '.join(r['problems']) or '-'}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cut-s", type=float, default=None, help="how long each cut lasts (default 30; quick 5; smoke 3)")
    ap.add_argument("--broker-down-s", type=float, default=None,
                    help="how long after its kill a new broker starts (default 20; quick and smoke: --cut-s)")
    args = parse_bench_args(ap, "5 s cuts (about 2 minutes)", smoke_help="one 3 s simulator host cut, no timing value")
    cut_s = args.cut_s or (3.0 if args.smoke else 5.0 if args.quick else 30.0)
    down_s = args.broker_down_s or (cut_s if args.smoke or args.quick else 20.0)
    jobs = [(1, FAULTS[:1])] if args.smoke else [(1, FAULTS), (2, RANK_FAULTS)]  # (trainer ranks, faults)
    out = Path(args.out)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    reason = unavailable()
    if reason is not None:
        emit_to(out, "partition.json", {"skipped": reason, "mode": mode})
        return
    rows = []
    lost_allowed = {}
    for ranks, faults in jobs:
        job = start_job(Path(tempfile.mkdtemp(prefix="rlvla3-partition-")), ranks=ranks)
        try:
            for fault in faults:
                lasts = down_s if fault == "broker_restart" else cut_s
                note(f"{fault}: {lasts:.0f} s")
                rows.append(run_fault(job, fault, lasts, rate_window_s=1.0 if args.smoke else RATE_WINDOW_S).row())
                lost_allowed[fault] = job.lost_allowed
        finally:
            job.close()
    print(table(rows))
    emit_to(out, "partition.json", {
        "mode": mode, "cut_s": cut_s, "broker_down_s": down_s, "liveness": list(LIVENESS), "rejoin_bound_s": REJOIN_BOUND_S,
        "faults": rows, "lost_allowed": lost_allowed,
        "lost": sum(r["lost"] for r in rows if not lost_allowed[r["fault"]]),
        "lost_with_trainer_group": sum(r["lost"] for r in rows if lost_allowed[r["fault"]]),
        "duplicated": sum(r["duplicated"] for r in rows),
        "problems": [p for r in rows for p in r["problems"]],
    })


if __name__ == "__main__":
    main()
