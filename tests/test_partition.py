"""Network partitions between hosts, and a broker host that goes away (``rlvla3/harness/faults.py``
makes and measures each fault; ``bench/faults/partition.py`` runs the same with 30 s cuts).

Each case lasts ``CI_CUT_S`` (longer than the broker's liveness, so a cut worker is declared gone):
a simulator host cut, a generator host cut, the broker's own host cut off from all the others,
and the broker SIGKILLed with a new one on the same address ``CI_CUT_S`` later (one trainer rank of
two cut off is ``tests/test_partition_rank.py``, a job of its own). While a worker host
is cut, the rest of the job keeps stepping and training; afterwards every host rejoins within its
reconnect back-off plus 5 s, training goes on from the trainer's version (never back to 0), and
the ledger stays exact: every acknowledged step has one fate, none is lost, and none is
acknowledged twice. A reconnected simulator sends again what it has no ack for; the broker knows
those fragments (``brokers/trajectories.py`` ``resent``) and requests (``dispatch.duplicate``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlvla3.harness.faults import FAULTS, REJOIN_BOUND_S, run_fault, start_job
from rlvla3.harness.netns import unavailable
from tests.jobs import CI_CUT_S

REASON = unavailable()
pytestmark = [pytest.mark.multihost, pytest.mark.timeout(900),
              pytest.mark.skipif(REASON is not None, reason=f"multihost: {REASON}")]



def test_partitions_and_a_broker_restart(tmp_path: Path):
    job = start_job(tmp_path)
    try:
        for fault in FAULTS:
            out = run_fault(job, fault, CI_CUT_S, rate_window_s=0.5)
            print(out.row())
            assert not out.problems, (out.row(), job.logs())
            assert out.lost == 0 and out.duplicated == 0, out.row()
            assert out.detect_s is not None and out.detect_s < CI_CUT_S, out.row()
            assert out.recover_s is not None and out.recover_s <= REJOIN_BOUND_S, out.row()
            assert out.version_after > out.version_before, out.row()
    finally:
        job.close()
