"""A gloo range read that its caller gave up on while direct receives were still posted (the producer was declared
dead while Gloo's wait ran on): the targets stay marked busy until the receiving thread ended, so the next load into
them waits instead of being overwritten later; a read that ended first leaves nothing marked."""

from __future__ import annotations

import torch

from rdt.transports.busy_targets import BusyTargets
from rdt.transports.group.ranges import _Guard


def test_abandoned_with_direct_receives_posted_marks_the_targets_until_the_receive_ends() -> None:
    busy, targets = BusyTargets(), [torch.zeros(1024), torch.zeros(16)]
    guard = _Guard()
    guard.direct = True  # the receiving thread posted a receive straight into a target
    guard.abandon(busy, targets, "a gloo range read")
    held = busy.wait_free(targets[:1], 0.0)
    assert [h.what for h in held] == ["a gloo range read"]
    guard.end(busy)  # the receiving thread ended: nothing it posted lands any more
    assert busy.wait_free(targets, 0.0) == [] and len(busy) == 0


def test_a_read_that_ended_before_it_was_abandoned_marks_nothing() -> None:
    busy, targets = BusyTargets(), [torch.zeros(1024)]
    guard = _Guard()
    guard.direct = True
    guard.end(busy)
    guard.abandon(busy, targets, "a gloo range read")
    assert len(busy) == 0


def test_packed_receives_only_never_mark() -> None:
    busy, targets = BusyTargets(), [torch.zeros(1024)]
    guard = _Guard()  # only packed messages: scattered under the lock, never after abandon
    guard.abandon(busy, targets, "a gloo range read")
    assert len(busy) == 0 and guard.abandoned
    guard.end(busy)
