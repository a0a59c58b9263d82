"""pytest plugin of scripts/gpu-check (loaded with ``-p tests._gpu_check_plugin``): appends one JSON line per event to
``$RDT_GPU_CHECK_JSONL`` as it happens, so a run killed mid-way keeps every result it reached.

Events: ``collected`` (the selected test ids), ``collect_error`` (one per module that failed to import), ``start``
(a test began: the watchdog of gpu-check knows which one hangs) and ``result`` (outcome, seconds, message).
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any, Dict, List

_PATH = os.environ.get("RDT_GPU_CHECK_JSONL")
_phases: Dict[str, List[Any]] = {}


def _write(record: Dict[str, Any]) -> None:
    """One line, flushed and closed at once (the process may be killed right after)."""
    if not _PATH:
        return
    record["t"] = round(time.time(), 3)
    with open(_PATH, "a") as f:
        f.write(json.dumps(record) + "\n")


def _text(report: Any, limit: int = 1500) -> str:
    """A report's message: the skip reason, or the tail of the failure (where the assertion or error is)."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    text = getattr(report, "longreprtext", "") or str(report.longrepr or "")
    return text[-limit:]


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _write({"event": "collect_error", "module": report.nodeid, "message": _text(report, 3000)})


def pytest_collection_finish(session: Any) -> None:
    _write({"event": "collected", "tests": [item.nodeid for item in session.items]})


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _phases[nodeid] = []
    _write({"event": "start", "test": nodeid})


def pytest_runtest_logreport(report: Any) -> None:
    _phases.setdefault(report.nodeid, []).append(report)


# pytest-timeout's own failure line; an error type with "Timeout" in its name (CollectiveTimeoutError) is no timeout
_TIMEOUT = re.compile(r"Failed: Timeout \(>[0-9.]+s\) from pytest-timeout")


def outcome_of(report: Any) -> str:
    """A failed report's outcome: "timeout" only when pytest-timeout ended the test, else failed (call) or error."""
    if _TIMEOUT.search(_text(report, 1_000_000)):
        return "timeout"
    return "failed" if report.when == "call" else "error"


def _crash(report: Any) -> str:
    """The failure's own line (e.g. ``AssertionError: the 1 s timeout took 4.0 s``), first in the message."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    return str(getattr(crash, "message", "") or "").strip()


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    reports = _phases.pop(nodeid, [])
    outcome, message = "passed", ""
    for r in reports:
        if r.failed:
            crash = _crash(r)
            outcome = outcome_of(r)
            message = f"{r.when}: " + (f"{crash[:600]} -- " if crash else "") + _text(r)
            break
        if r.skipped and not hasattr(r, "wasxfail"):
            outcome, message = "skipped", _text(r)
        elif hasattr(r, "wasxfail"):
            outcome, message = ("xfailed" if r.skipped else "xpassed"), str(r.wasxfail)
    _write({"event": "result", "test": nodeid, "outcome": outcome, "seconds": round(sum(r.duration for r in reports),
                                                                                        2), "message": message})
