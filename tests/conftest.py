"""Shared fixtures: real broker and worker processes over real sockets. Helpers that tests
import live in ``tests/jobs.py`` (jobs) and ``tests/brokerscript.py`` (the broker's state)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zmq

from rlvla3.config import load
from rlvla3.harness.jobs import Job, SMALL_JOB
from tests import file_order
from tests.jobs import start_job
from tests.machine_load import machine_folder, machine_shared

# One intra-op thread in this process and in every process it starts; set before any test module
# imports torch (nothing above does). Two test files run at once on two cores, so a second
# thread only oversubscribes them, and OpenMP's spinning threads burn the CPU the other file's
# processes need: beside two busy processes a PPO update of the flow chain took 41 s instead of
# 7. Workers already run with ``workers.torch_threads`` (1).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _machine_shared(tmp_path_factory):
    """Every test shares the machine with the others, except while one loads it on purpose
    (``tests.machine_load.machine_alone``)."""
    with machine_shared(machine_folder(tmp_path_factory)):
        yield


@pytest.fixture
def job_factory(tmp_path: Path):
    jobs: list[Job] = []

    def make(*overrides: str, start: bool = True) -> Job:
        return start_job(load("synthetic.yaml", [*SMALL_JOB, *overrides]), tmp_path, jobs, start)

    yield make
    for j in jobs:
        j.stop()


@pytest.fixture
def zctx():
    """A ZMQ context that must terminate (no leaked sockets) within 5 s."""
    ctx = zmq.Context()
    yield ctx
    import threading

    t = threading.Thread(target=ctx.term, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "ZMQ context did not terminate: a socket was leaked"


def pytest_addoption(parser) -> None:
    parser.addoption("--record-durations", action="store_true",
                     help="write each test file's seconds into tests/durations.json (the order of the next run)")


def pytest_collection_modifyitems(items) -> None:
    file_order.longest_files_first(items, file_order.read_record())


def pytest_terminal_summary(terminalreporter, config) -> None:
    """Say in the CI log whether the multi-host tests ran (a quiet run shows only dots), and with
    ``--record-durations`` merge this run's seconds per file into the record (the controller's
    reporter holds every report, set-up and tear-down included)."""
    if config.getoption("--record-durations") and not hasattr(config, "workerinput"):
        reports = [rep for reps in terminalreporter.stats.values() for rep in reps if hasattr(rep, "when")]
        if reports:
            file_order.write_record({**file_order.read_record(), **file_order.file_seconds(reports)})
    for outcome in ("passed", "failed", "skipped"):
        for rep in terminalreporter.stats.get(outcome, []):
            # the report's keywords carry the marker (under xdist the controller collects nothing)
            if "multihost" in rep.keywords and (rep.when == "call" or outcome == "skipped"):
                reason = f" ({rep.longrepr[2]})" if outcome == "skipped" and isinstance(rep.longrepr, tuple) else ""
                terminalreporter.write_line(f"multihost: {rep.nodeid} {outcome} in {rep.duration:.1f} s{reason}")
