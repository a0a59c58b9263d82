"""The poll-before-sleep window: long while the load average is low, short above 2 runnable tasks per core, and
the load re-read at most once a second."""

from __future__ import annotations

import os
from typing import Any, List

from rdt_transports import _spin


def test_window_follows_the_load_average(monkeypatch: Any) -> None:
    loads: List[float] = [0.5]
    reads: List[int] = []

    def fake_loadavg() -> tuple:
        reads.append(1)
        return (loads[0], 0.0, 0.0)

    monkeypatch.setattr(os, "getloadavg", fake_loadavg)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(_spin, "_state", [0.0, float("-inf")])
    assert _spin.window(20e-6, now=100.0) == _spin.QUIET_S
    loads[0] = 4.5  # above 2 per core
    assert _spin.window(20e-6, now=100.5) == _spin.QUIET_S  # not re-read within a second
    assert len(reads) == 1
    assert _spin.window(20e-6, now=101.1) == 20e-6
    loads[0] = 3.9
    assert _spin.window(30e-6, quiet_s=5e-4, now=102.2) == 5e-4
    assert len(reads) == 3


def test_no_load_average_counts_as_quiet(monkeypatch: Any) -> None:
    def no_loadavg() -> tuple:
        raise OSError("no load average")

    monkeypatch.setattr(os, "getloadavg", no_loadavg)
    monkeypatch.setattr(_spin, "_state", [1.0, float("-inf")])
    assert not _spin.busy(5.0)
