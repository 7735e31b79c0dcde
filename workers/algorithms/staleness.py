"""Staleness: how many trainer updates behind the policy that produced a sample is.

``staleness = trainer_version - behaviour_version``, where a version counts the trainer's
optimizer updates (one per consumed batch). Two mechanisms keep it at or under
``max_staleness``:

1. **Admission control** (``brokers.admission.AdmissionController``, run by the broker): new work is handed
   out only while the work already admitted cannot outrun the trainer by more than
   ``max_staleness`` batches (AReaL's capacity rule, derived there).
2. **Filtering** (:func:`filter_stale`, run by the trainer): a straggler that still arrives too
   stale is dropped and counted.
"""

from __future__ import annotations

from collections import Counter

import torch


def staleness(behaviour_versions: torch.Tensor, trainer_version: int) -> torch.Tensor:
    """Per-sample staleness ``[N]`` (int64)."""
    return int(trainer_version) - behaviour_versions.to(torch.int64)


def filter_stale(
    behaviour_versions: torch.Tensor, trainer_version: int, max_staleness: int | None
) -> tuple[torch.Tensor, int]:
    """Keep mask ``[N]`` of samples with staleness <= ``max_staleness`` and how many were dropped.

    ``max_staleness=None`` keeps everything. A sample from the *future* (negative staleness)
    means a version counter went wrong, so it raises instead of being trained on.
    """
    s = staleness(behaviour_versions, trainer_version)
    if bool((s < 0).any()):
        raise ValueError(f"behaviour version ahead of trainer version {trainer_version}: {behaviour_versions.max()}")
    if max_staleness is None:
        return torch.ones_like(s, dtype=torch.bool), 0
    keep = s <= int(max_staleness)
    return keep, int((~keep).sum())


def staleness_histogram(staleness_values: torch.Tensor) -> dict[int, int]:
    """Count of samples per staleness value, for the metrics log."""
    return dict(sorted(Counter(int(x) for x in staleness_values.flatten().tolist()).items()))
