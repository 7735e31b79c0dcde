"""One trainer rank of two cut off between namespace hosts (``rlvla3/harness/faults.py``; the
other partitions are in ``tests/test_partition.py``, a file of its own so the two jobs run on
separate pytest workers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlvla3.harness.faults import RANK_FAULTS, run_fault, start_job
from rlvla3.harness.netns import unavailable
from tests.jobs import CI_CUT_S

REASON = unavailable()
pytestmark = [pytest.mark.multihost, pytest.mark.timeout(900),
              pytest.mark.skipif(REASON is not None, reason=f"multihost: {REASON}")]



def test_one_trainer_rank_of_two_cut_off(tmp_path: Path):
    """The group ends (it cannot shrink); both ranks restarted from the latest checkpoint train
    on, and what they held is lost by the ledger's rule, within the admission window."""
    job = start_job(tmp_path, ranks=2)
    try:
        out = run_fault(job, RANK_FAULTS[0], CI_CUT_S, rate_window_s=0.5)
        print(out.row())
        assert not out.problems, (out.row(), job.logs())
        assert out.duplicated == 0 and out.lost <= job.lost_allowed, out.row()
        assert out.detect_s is not None and out.detect_s < CI_CUT_S, out.row()
        assert out.version_after > out.version_before, out.row()
    finally:
        job.close()
