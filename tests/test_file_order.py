"""The suite's file order (``tests/file_order.py``): longest recorded file first, order inside a
file kept, unknown files at the median, and ``--record-durations`` merging into the record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from tests import file_order

ROOT = Path(__file__).resolve().parents[1]


def _items(*nodeids: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_longest_file_first_and_order_inside_a_file_kept() -> None:
    items = _items("tests/a.py::t1", "tests/b.py::t1", "tests/a.py::t2", "tests/c.py::t1", "tests/b.py::t2")
    record = {"tests/a.py": 5.0, "tests/b.py": 100.0, "tests/x.py": 1.0, "tests/y.py": 50.0}
    file_order.longest_files_first(items, record)
    # c.py is unknown: the median of 100, 50, 5, 1 is 27.5, between b (100) and a (5)
    assert [i.nodeid for i in items] == ["tests/b.py::t1", "tests/b.py::t2", "tests/c.py::t1",
                                         "tests/a.py::t1", "tests/a.py::t2"]


def test_no_record_keeps_pytest_order(tmp_path: Path) -> None:
    items = _items("tests/z.py::t", "tests/a.py::t")
    file_order.longest_files_first(items, file_order.read_record(tmp_path / "missing.json"))
    assert [i.nodeid for i in items] == ["tests/z.py::t", "tests/a.py::t"]
    (tmp_path / "bad.json").write_text("{not json")
    assert file_order.read_record(tmp_path / "bad.json") == {}


def test_record_round_trip_sums_phases(tmp_path: Path) -> None:
    reports = [SimpleNamespace(nodeid="tests/a.py::t", duration=1.0), SimpleNamespace(nodeid="tests/a.py::t", duration=2.5),
               SimpleNamespace(nodeid="tests/b.py::u[x]", duration=0.3)]
    path = tmp_path / "durations.json"
    file_order.write_record(file_order.file_seconds(reports), path)
    assert file_order.read_record(path) == {"tests/a.py": 3.5, "tests/b.py": 0.3}
    assert list(json.loads(path.read_text())["seconds"]) == ["tests/a.py", "tests/b.py"]


def test_the_suite_collects_in_recorded_order() -> None:
    """The conftest applies the committed record: of two files, the longer recorded one runs first."""
    record = file_order.read_record()
    assert record, "tests/durations.json is missing or empty"
    slow = max(record, key=record.get)
    fast = "tests/test_file_order.py"
    assert record.get(fast, 0.0) < record[slow]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", fast, slow],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    files = [line.split("::")[0] for line in out.stdout.splitlines() if "::" in line]
    assert files and files[0] == slow and files[-1] == fast, files
