"""Which error a Gloo wait reports when the group was aborted while it was timing out: a sibling receive of the same
load timed out first and its error aborted the group (``CollectiveGroup._mark_errored``). The wait's own timeout is
the cause and is reported as such; only a wait the abort ended early reports the abort."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from rdt_transports.backends.gloo import _GlooWork
from rdt_transports.errors import CollectiveTimeoutError, GroupDestroyedError

GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "1494ms for recv operation to complete")
GLOO_CLOSED = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"


class _Posted:
    """Stands in for torch's Gloo work: its wait ends the way Gloo's ends, after the group was aborted."""

    def __init__(self, aborted: threading.Event, error: str) -> None:
        self.aborted, self.error = aborted, error

    def wait(self, _timeout: Any) -> None:
        self.aborted.set()  # the sibling's abort lands while this wait is ending
        raise RuntimeError(self.error)

    def is_completed(self) -> bool:
        return False


@pytest.mark.parametrize("direct", [True, False])
def test_a_wait_that_timed_out_reports_its_timeout_even_when_the_group_was_aborted_meanwhile(direct: bool) -> None:
    """Before: GroupDestroyedError, so a sharded load over gloo that timed out raised it instead of
    TransferTimeoutError (tests/test_sharded.py::test_a_timed_out_gloo_stream_never_writes_the_targets, flaky)."""
    aborted = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        work = _GlooWork(_Posted(aborted, GLOO_TIMEOUT), "recv", 0, aborted, pool, spin=False, direct=direct)
        with pytest.raises(CollectiveTimeoutError, match="did not complete"):
            work.wait(1.0)


@pytest.mark.parametrize("direct", [True, False])
def test_a_wait_the_abort_ended_reports_the_abort(direct: bool) -> None:
    aborted = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        work = _GlooWork(_Posted(aborted, GLOO_CLOSED), "recv", 0, aborted, pool, spin=False, direct=direct)
        with pytest.raises(GroupDestroyedError, match="aborted"):
            work.wait(1.0)
