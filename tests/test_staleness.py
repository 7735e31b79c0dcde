"""Staleness helpers (the admission controller is tested in test_broker_admission.py)."""

import pytest
import torch

from workers.algorithms.staleness import filter_stale, staleness, staleness_histogram


def test_staleness_filter_and_histogram():
    versions = torch.tensor([10, 9, 7, 10, 6])
    assert staleness(versions, 10).tolist() == [0, 1, 3, 0, 4]
    keep, dropped = filter_stale(versions, 10, max_staleness=2)
    assert keep.tolist() == [True, True, False, True, False] and dropped == 2
    keep, dropped = filter_stale(versions, 10, max_staleness=None)
    assert keep.all() and dropped == 0
    assert staleness_histogram(staleness(versions, 10)) == {0: 2, 1: 1, 3: 1, 4: 1}
    with pytest.raises(ValueError):
        filter_stale(torch.tensor([11]), 10, 2)
