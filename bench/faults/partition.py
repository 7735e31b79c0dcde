"""Partitions between hosts and a lost broker host, each for 30 s: time to detect, time to
recover, the env steps/s dip, and what was lost or counted twice.

One job over network-namespace hosts (``rlvla3/harness/faults.py``: broker, trainer, a simulator
and a generator on the head host; a simulator host; a generator host), then one fault after
another, each measured the same way as ``tests/test_partition.py`` measures its short ones:

    simulator_host_cut   the simulator host's switch port down for --cut-s
    generator_host_cut   the generator host's
    broker_host_cut      the broker's host cut off from all the others
    broker_restart       the broker SIGKILLed, a new one on the same address --cut-s later

One trainer rank of two cut off is not among them: see ``TRAINER_RANK``.
On one machine every host shares the same cores, so the rates are the job's on this machine.

    python bench/faults/partition.py --quick     # 5 s cuts, a few minutes; --smoke: one 3 s cut
Needs root and iproute2 (network namespaces); prints a table, then one JSON object last.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from rlvla3.harness.bench import emit_to, note, parse_bench_args
from rlvla3.harness.faults import FAULTS, LIVENESS, REJOIN_BOUND_S, run_fault, start_job
from rlvla3.harness.netns import unavailable

TRAINER_RANK = (
    "not run: a torch.distributed group cannot shrink, so the broker answers a lost trainer rank by "
    "disconnecting the others (brokers/state.py, trainer_group_broken_disconnecting); a survivor inside a gloo "
    "collective waits for the group timeout first, and the job recovers only when every rank is restarted from "
    "the latest checkpoint (a supervisor's restart, not a rejoin), so there is no rejoin time to measure")


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
    ap.add_argument("--cut-s", type=float, default=None, help="how long each fault lasts (default 30; quick 5; smoke 3)")
    args = parse_bench_args(ap, "5 s cuts (a few minutes)", smoke_help="one 3 s simulator host cut, no timing value")
    cut_s = args.cut_s or (3.0 if args.smoke else 5.0 if args.quick else 30.0)
    faults = FAULTS[:1] if args.smoke else FAULTS
    out = Path(args.out)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    reason = unavailable()
    if reason is not None:
        emit_to(out, "partition.json", {"skipped": reason, "mode": mode})
        return
    job = start_job(Path(tempfile.mkdtemp(prefix="rlvla3-partition-")))
    rows = []
    try:
        for fault in faults:
            note(f"{fault}: {cut_s:.0f} s")
            rows.append(run_fault(job, fault, cut_s, rate_window_s=1.0 if args.smoke else 3.0).row())
    finally:
        job.close()
    print(table(rows))
    emit_to(out, "partition.json", {
        "mode": mode, "cut_s": cut_s, "liveness": list(LIVENESS), "rejoin_bound_s": REJOIN_BOUND_S,
        "faults": rows, "trainer_rank_cut": {"skipped": TRAINER_RANK},
        "lost": sum(r["lost"] for r in rows), "duplicated": sum(r["duplicated"] for r in rows),
        "problems": [p for r in rows for p in r["problems"]],
    })


if __name__ == "__main__":
    main()
