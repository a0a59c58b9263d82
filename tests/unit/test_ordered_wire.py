"""NCCL's point-to-point design run on CPU: an ordered per-direction wire (tests/unit/_fifo_wire.py) under a group.

``nccl_like_pair`` builds two ranks the way the NCCL backend builds them (the matcher's RTS/CTS over real sockets,
data on an ordered wire), with the GPU calls replaced by the in-process FIFO wire. Before issue 13 was fixed these
failed: tags were ignored and the group's size handshake ran over the wire in posting order.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

from rdt_transports.errors import CollectiveTimeoutError
from rdt_transports.group import CollectiveGroup
from rdt_transports.types import Capabilities

from ._fifo_wire import CountingBackend, FifoHub, MatchedFifoBackend, make_ranks, wait_until

SECRET = b"ordered-wire-test-secret-0123456789"
TIMEOUT = 5.0


class _WithGroupHandshake(MatchedFifoBackend):
    """The same backend, but the group runs its Gloo-style size handshake over it (the race's original trigger)."""

    capabilities = Capabilities(name="fifo", devices=frozenset({"cpu"}), checks_p2p_sizes=False)


def nccl_like_pair(timeout: float = TIMEOUT, cls: Any = MatchedFifoBackend) -> Tuple[Any, Any]:
    """Rank 0 and rank 1 of a group built like the NCCL backend: the matcher over an ordered wire per direction."""
    b0, b1 = make_ranks(cls, 2, timeout, SECRET, FifoHub())
    return b0, b1


@pytest.mark.parametrize("handshake", [False, True], ids=["matcher-checks-sizes", "group-handshake-over-matcher"])
def test_group_send_and_recv_both_ways_from_two_threads(handshake: bool) -> None:
    b0, b1 = nccl_like_pair(cls=_WithGroupHandshake if handshake else MatchedFifoBackend)
    c0, c1 = CountingBackend(b0), CountingBackend(b1)
    g0 = CollectiveGroup("nccl-like", b0.config.group_uid, c0, TIMEOUT, lambda: None)
    g1 = CollectiveGroup("nccl-like", b1.config.group_uid, c1, TIMEOUT, lambda: None)
    n = (1 << 20) // 4  # 1 MiB
    x0 = torch.arange(n, dtype=torch.float32)
    x1 = -torch.arange(n, dtype=torch.float32)
    y0 = torch.zeros(n)
    y1 = torch.zeros(n)
    started: List[threading.Thread] = []

    def start(fn: Callable[[], None]) -> threading.Thread:
        t = threading.Thread(target=fn, daemon=True)
        t.start()
        started.append(t)
        return t

    errors: Dict[str, BaseException] = {}

    def guard(name: str, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001
                errors[name] = e
        return run

    # Each rank's send posts its header, then its verdict receive on the direction where the other rank's header
    # arrives: started in this order, a wire that matches by posting order hands each verdict receive the peer's
    # header. Any order must work when matching is by (peer, tag).
    start(guard("send0", lambda: g0.send(x0, 1)))
    wait_until(lambda: c0.recvs[1] >= 1, 0.5)
    start(guard("send1", lambda: g1.send(x1, 0)))
    wait_until(lambda: c1.recvs[0] >= 1, 0.5)
    start(guard("recv0", lambda: g0.recv(y0, 1)))
    start(guard("recv1", lambda: g1.recv(y1, 0)))
    for t in started:
        t.join(TIMEOUT + 2)
    stuck = [t for t in started if t.is_alive()]
    b0.abort()
    b1.abort()
    b0.shutdown()
    b1.shutdown()
    assert not stuck, f"{len(stuck)} calls still blocked"
    assert not errors, errors
    assert torch.equal(y0, x1) and torch.equal(y1, x0)


def test_abandoned_receive_does_not_shift_later_messages() -> None:
    b0, b1 = nccl_like_pair()
    try:
        lost = torch.zeros(4)
        with pytest.raises(CollectiveTimeoutError):
            b1.irecv(lost, 0, 100).wait(0.2)  # nothing was sent with tag 100: abandoned
        x = torch.tensor([1.0, 2.0, 3.0, 4.0])
        y = torch.zeros(4)
        ws = b0.isend(x, 1, 101)
        wr = b1.irecv(y, 0, 101)
        wr.wait(2.0)
        ws.wait(2.0)
        assert torch.equal(y, x)
        assert torch.equal(lost, torch.zeros(4))
    finally:
        b0.abort()
        b1.abort()
        b0.shutdown()
        b1.shutdown()
