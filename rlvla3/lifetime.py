"""Process lifetime: a launched process ends with its launcher, and every process stops on a flag.

A launcher (``rlvla3 run``, ``rlvla3 worker --count``, a bench script, a test) puts its pid in
``RLVLA3_LAUNCHER_PID`` when it starts a child (:func:`launcher_env`). The child calls
:func:`follow_launcher` first thing: Linux's ``PR_SET_PDEATHSIG`` delivers SIGTERM to it when
the launcher dies by any signal, SIGKILL included; a ``getppid()`` check right after closes the
race with a launcher that died first. Where prctl is missing, a watchdog thread polls
``getppid()`` and sends the same SIGTERM. A process started by hand has no launcher and keeps
today's behaviour (a worker reconnects to its broker for ever).

The kernel sends the parent-death signal when the *thread* that forked the child exits, so
launchers start children from their main thread only (:func:`launcher_env` checks).

Stop signals (:func:`on_stop_signals`) only set a flag, and wake the process's poll loop
through a file descriptor it polls beside its sockets (:func:`stop_wakeup_fd`), so a stop does
not wait for the poll's timeout; the loop then stops and cleans up. A process whose launcher is
gone is also forced out: :data:`ORPHAN_GRACE_S` after the signal a thread started beforehand runs
the registered exit cleanups (a simulator unlinks its shared memory) and ``os._exit`` s, so a
worker stuck in a torch op or a gloo collective still ends in time. The handler only writes a
byte to that thread's pipe: a handler that took a lock or started a thread itself deadlocked
when a second signal landed inside it (``pkill`` and the parent-death signal, a few
microseconds apart, left ``rlvla3 run`` waiting on its own lock for good).

A process that stopped cleanly (:func:`stopped_cleanly`: its loop returned after its own
cleanup, files closed and checkpoint written), and an orphan, skip the interpreter's teardown:
an ``atexit`` hook that runs after every other one ``os._exit`` s. With torch imported the
teardown takes seconds on a loaded machine, which every stop of a job would wait for.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable

LAUNCHER_ENV = "RLVLA3_LAUNCHER_PID"
"""Set by a launcher in its children's environment: the pid they follow."""
STOP_TIMEOUT_S = 30.0
"""How long a launcher waits for its children after forwarding SIGTERM (a trainer finishes its
update and writes a checkpoint) before it kills them: Slurm's and Kubernetes' default grace."""
ORPHAN_GRACE_S = 2.0
"""How long a process whose launcher died may take to stop cleanly before it is forced out."""
WATCHDOG_INTERVAL_S = 0.25
"""How often the fallback watchdog (no prctl) checks the parent pid."""

_PR_SET_PDEATHSIG = 1
_launcher: int | None = None
_cleanups: list[Callable[[], None]] = []
_forced_exit_pipe: int | None = None  # write end: a stop handler's request for the forced exit
_clean_stop = False
_teardown_skip_registered = False
_wakeup: tuple[socket.socket, socket.socket] | None = None  # (read end, write end)


# ---------------------------------------------------------------------------------------------
# Launcher side
# ---------------------------------------------------------------------------------------------


def launcher_env() -> dict[str, str]:
    """Environment entries that make a child started now follow this process.

    Raises RuntimeError off the main thread: the kernel would signal the child as soon as the
    starting thread exits, not when this process does."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("start launched processes from the main thread: PR_SET_PDEATHSIG fires when "
                           "the thread that started the child exits")
    return {LAUNCHER_ENV: str(os.getpid())}


# ---------------------------------------------------------------------------------------------
# Child side
# ---------------------------------------------------------------------------------------------


def follow_launcher() -> int | None:
    """If a launcher started this process, end with it (SIGTERM when it dies). Call it before
    anything else. Returns the launcher's pid, or None for a process started by hand."""
    global _launcher
    value = os.environ.pop(LAUNCHER_ENV, "")  # our own children get their own launcher
    if not value.isdigit():
        return None
    _launcher = int(value)
    skip_teardown_after_clean_stop()
    _start_forced_exit_thread()
    if not _set_parent_death_signal(signal.SIGTERM):
        threading.Thread(target=_watch_parent, args=(_launcher,), daemon=True, name="launcher-watchdog").start()
    if os.getppid() != _launcher:  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)
    return _launcher


def orphaned() -> bool:
    """True when this process was launched and its launcher is gone."""
    return _launcher is not None and os.getppid() != _launcher


def stop_timeout_s() -> float:
    """How long this process may wait for its own children to stop: short once orphaned (it has
    :data:`ORPHAN_GRACE_S` itself), :data:`STOP_TIMEOUT_S` otherwise."""
    return ORPHAN_GRACE_S * 0.75 if orphaned() else STOP_TIMEOUT_S


def _set_parent_death_signal(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def skip_teardown_after_clean_stop() -> None:
    """Register (once) the ``atexit`` hook that ends a cleanly stopped process, or an orphan,
    without the interpreter's teardown. The program's entry calls it before anything else, so
    the hook runs after every other one; a process that merely imports rlvla3 (pytest running a
    command in-process) never registers it and exits as usual."""
    global _teardown_skip_registered
    if not _teardown_skip_registered:
        atexit.register(_skip_teardown)
        _teardown_skip_registered = True


def stopped_cleanly() -> None:
    """Say that this process's work is done and saved (its loop returned after its own cleanup):
    once the ``atexit`` handlers have run, it then leaves with exit code 0 without the
    interpreter's teardown (:func:`_skip_teardown`). Call it only on a path that exits with 0."""
    global _clean_stop
    _clean_stop = True


def _skip_teardown() -> None:
    """A process that stopped cleanly, or an orphan, leaves without the interpreter's teardown:
    seconds on a loaded machine once torch or matplotlib is imported, tens of seconds while a
    daemon thread still draws (for an orphan: seconds during which the forced-exit thread cannot
    run). Every other ``atexit`` handler has run by now."""
    if _clean_stop or orphaned():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _watch_parent(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(WATCHDOG_INTERVAL_S)  # polling a pid; only where prctl is missing
    os.kill(os.getpid(), signal.SIGTERM)


# ---------------------------------------------------------------------------------------------
# Stopping
# ---------------------------------------------------------------------------------------------


def on_stop_signals(stop: Callable[[], None]) -> None:
    """SIGTERM, SIGINT and SIGHUP (a closed terminal) call ``stop`` (which only sets a flag) and,
    once the launcher is gone, arm the forced exit. A SIGHUP ignored at start (``nohup``) stays
    ignored. Main thread only (Python's rule for signal handlers)."""

    def handler(signum: int, frame: object) -> None:
        stop()
        if orphaned():
            _request_forced_exit()

    global _wakeup
    if _wakeup is None:
        _wakeup = socket.socketpair()
        for end in _wakeup:
            end.setblocking(False)
        signal.set_wakeup_fd(_wakeup[1].fileno(), warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, handler)


def stop_wakeup_fd() -> int | None:
    """A file descriptor that turns readable when a signal arrives, once :func:`on_stop_signals`
    ran (None before): a loop polls it beside its sockets so that a stop wakes it at once, and
    empties it with :func:`drain_wakeup`."""
    return _wakeup[0].fileno() if _wakeup is not None else None


def drain_wakeup() -> None:
    """Empty the wake-up descriptor (it stays readable until read)."""
    if _wakeup is None:
        return
    try:
        while _wakeup[0].recv(512):
            pass
    except (BlockingIOError, InterruptedError):
        pass


def add_exit_cleanup(fn: Callable[[], None]) -> None:
    """Run ``fn`` before a forced exit (it must be quick and safe from any thread)."""
    if fn not in _cleanups:
        _cleanups.append(fn)


def _start_forced_exit_thread() -> None:
    """Start (once, from :func:`follow_launcher`, outside any signal handler) the thread that
    carries out a forced exit: it waits on a pipe that :func:`_request_forced_exit` writes to,
    then gives the process :data:`ORPHAN_GRACE_S` to stop by itself."""
    global _forced_exit_pipe
    if _forced_exit_pipe is not None:
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    threading.Thread(target=_forced_exit_after_request, args=(read_end,), daemon=True, name="forced-exit").start()
    _forced_exit_pipe = write_end


def _restart_forced_exit_thread() -> None:
    """In a forked copy: the pipe is the parent's and its thread did not come along, so a
    request from here would force the parent out. Start the copy's own (none if it had none)."""
    global _forced_exit_pipe
    if _forced_exit_pipe is not None:
        _forced_exit_pipe = None
        _start_forced_exit_thread()


os.register_at_fork(after_in_child=_restart_forced_exit_thread)


def _request_forced_exit() -> None:
    """Ask for the forced exit from a signal handler: one ``write``, no lock, no thread, so a
    signal that lands while an earlier one is being handled cannot deadlock it."""
    if _forced_exit_pipe is None:
        return
    try:
        os.write(_forced_exit_pipe, b"x")
    except OSError:  # the pipe is full: an earlier request is already waiting to be read
        pass


def _forced_exit_after_request(read_end: int) -> None:
    os.read(read_end, 1)
    time.sleep(ORPHAN_GRACE_S)  # the grace: the process may still stop cleanly meanwhile
    _force_exit()


def _force_exit() -> None:
    for fn in _cleanups:
        try:
            fn()
        except Exception:  # noqa: BLE001 - leaving anyway; the next cleanup may still work
            pass
    try:
        import structlog

        structlog.get_logger().warning("forced_exit", reason="launcher_gone", grace_s=ORPHAN_GRACE_S)
        sys.stderr.flush()
    finally:
        os._exit(1)
