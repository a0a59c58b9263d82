"""Stopping a process for a test: SIGSTOP, and wait until it took effect (no side effects at import, so actors can
use it too)."""

from __future__ import annotations

import os
import signal
import time


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads is stopped. ``os.kill`` returns before that: the
    kernel wakes one thread to begin the stop, and until it runs the others go on (a thread answered a request
    sent right after the kill in over half of the tries on this machine). Raises after ``timeout``."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not _all_threads_stopped(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGCONT)
            raise AssertionError(f"pid {pid}: not every thread stopped within {timeout}s of SIGSTOP")
        time.sleep(0.001)


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (state "T" in /proc)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] not in (b"T", b"t"):
                    return False
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
    return True
