"""The table of busy into= target bytes (rdt/transports/busy_targets.py): which bytes a mark covers, bounded waits that wake when the
mark clears, and a table that drains to zero. The end-to-end case (a parked NIXL READ) is
tests/test_nixl_parked_read.py."""

from __future__ import annotations

import threading
import time

import torch

from rdt.transports.busy_targets import BusyTargets


def test_a_mark_covers_exactly_the_bytes_of_its_tensors() -> None:
    flat = torch.zeros(1024, dtype=torch.uint8)  # one storage, several targets cut from it (a flat parameter buffer)
    busy = BusyTargets()
    key = busy.mark([flat[100:200], flat[300:400], flat[200:250]], "the READ of x")
    assert key is not None and len(busy) == 1
    assert [h.what for h in busy.wait_free([flat[150:160]], 0.0)] == ["the READ of x"]
    assert busy.wait_free([flat[249:251]], 0.0)  # the merged run 100..250 ends at 250
    assert busy.wait_free([flat[0:101]], 0.0) and busy.wait_free([flat[399:500]], 0.0)  # partial overlaps
    assert busy.wait_free([flat[0:1000]], 0.0)  # a span around several runs
    assert not busy.wait_free([flat[0:100], flat[250:300], flat[400:]], 0.0)  # adjacent bytes are free
    assert not busy.wait_free([torch.zeros(1024, dtype=torch.uint8)], 0.0)  # another storage
    assert not busy.wait_free([flat[150:160].to("meta")], 0.0)  # another device
    assert busy.mark([flat[:0]], "nothing") is None and len(busy) == 1  # no bytes: no mark
    busy.clear(key)
    assert len(busy) == 0 and not busy.wait_free([flat], 0.0)


def test_a_non_contiguous_target_is_checked_by_its_whole_storage() -> None:
    base = torch.zeros(64, 64)
    busy = BusyTargets()
    busy.mark([base[0]], "the READ of row 0")
    assert busy.wait_free([base[:, 5]], 0.0)  # a column: not contiguous, its storage includes row 0


def test_wait_is_bounded_and_wakes_when_the_mark_clears() -> None:
    t = torch.zeros(256)
    busy = BusyTargets()
    key = busy.mark([t], "the READ of y")
    start = time.monotonic()
    held = busy.wait_free([t], 0.2)
    assert [h.what for h in held] == ["the READ of y"] and 0.2 <= time.monotonic() - start < 2.0
    threading.Timer(0.1, busy.clear, (key,)).start()
    start = time.monotonic()
    assert busy.wait_free([t], 10.0) == []
    assert time.monotonic() - start < 2.0  # woken by clear(), not by the timeout


def test_the_table_drains_to_zero_over_many_marks() -> None:
    targets = [torch.zeros(16) for _ in range(50)]
    busy = BusyTargets()
    keys = [busy.mark(targets[i:i + 5], f"read {i}") for i in range(0, 50, 5)] * 2  # each cleared twice: harmless
    assert len(busy) == 10
    for key in keys:
        busy.clear(key)
    busy.clear(None)
    assert len(busy) == 0 and not busy.wait_free(targets, 0.0)
