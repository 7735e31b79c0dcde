"""Longest test files first, so two xdist workers finish together.

``scripts/test.sh`` runs ``-n 2 --dist loadfile --no-loadscope-reorder``: whole files go to
whichever worker is free, in collection order. xdist's own order (most tests first) left a file
with one 200-second test for the very end, with the other worker idle beside it. Here the
collection is sorted by each file's seconds in the last full run (``tests/durations.json``;
``--record-durations`` rewrites it), the longest first: the classic longest-job-first rule. A
file the record does not know counts as the record's median. Order inside a file is kept.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

RECORD = Path(__file__).with_name("durations.json")


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def read_record(path: Path = RECORD) -> dict[str, float]:
    """File -> seconds; empty when the record is missing or unreadable (the order then is
    pytest's own, which is still correct, only slower)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    seconds = data.get("seconds") if isinstance(data, dict) else None
    if not isinstance(seconds, dict):
        return {}
    return {str(k): float(v) for k, v in seconds.items() if isinstance(v, (int, float))}


def longest_files_first(items: list[Any], record: dict[str, float]) -> None:
    """Sort ``items`` in place by their file's recorded seconds, longest first (stable)."""
    if not record:
        return
    default = statistics.median(record.values())
    items.sort(key=lambda item: -record.get(_file_of(item.nodeid), default))


def file_seconds(reports: list[Any]) -> dict[str, float]:
    """Seconds per file (set-up, call and tear-down of every test) from test reports."""
    total: dict[str, float] = defaultdict(float)
    for rep in reports:
        total[_file_of(rep.nodeid)] += float(getattr(rep, "duration", 0.0) or 0.0)
    return dict(total)


def write_record(seconds: dict[str, float], path: Path = RECORD) -> None:
    ordered = dict(sorted(((k, round(v, 1)) for k, v in seconds.items()), key=lambda kv: -kv[1]))
    path.write_text(json.dumps({"about": "seconds per test file in the last full run (tests/file_order.py)",
                                "seconds": ordered}, indent=1) + "\n")
