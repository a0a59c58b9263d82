"""The shared matcher through its races, on the tcp backend (real sockets) and on the NCCL-like FIFO wire.

Ranks are threads of this process (TorchFT style); tests/test_tcp_backend.py runs the backend over real Ray actors.
Every test ends with empty matching tables (``pending() == 0``) on the surviving ranks.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from typing import Any, Callable, Iterator, List, Tuple

import pytest
import torch

from rdt_transports.backends.base import TAG_KIND_OBJECT, is_object_tag
from rdt_transports.backends.tcp import TcpBackend
from rdt_transports.errors import (
    AuthenticationError,
    CollectiveTimeoutError,
    GroupDestroyedError,
    PeerUnavailableError,
    TensorMismatchError,
)
from rdt_transports.group import TAG_P2P, make_tag

from ._fifo_wire import FifoHub, MatchedFifoBackend, make_ranks

SECRET = b"matching-test-secret-0123456789ab"
TIMEOUT = 5.0


def _tcp(world: int, timeout: float = TIMEOUT) -> List[TcpBackend]:
    ranks = make_ranks(TcpBackend, world, timeout, SECRET)
    assert all(isinstance(b, TcpBackend) for b in ranks), ranks
    return ranks


def _fifo(world: int, timeout: float = TIMEOUT) -> List[MatchedFifoBackend]:
    ranks = make_ranks(MatchedFifoBackend, world, timeout, SECRET, FifoHub())
    assert all(isinstance(b, MatchedFifoBackend) for b in ranks), ranks
    return ranks


@pytest.fixture(params=["tcp", "fifo"])
def pair(request: Any) -> Iterator[List[Any]]:
    ranks = _tcp(2) if request.param == "tcp" else _fifo(2)
    yield ranks
    for b in ranks:
        b.shutdown()


def _threads(*fns: Callable[[], None], timeout: float = 20.0) -> None:
    """Run ``fns`` concurrently; re-raise the first error; fail if one is still blocked."""
    errors: List[BaseException] = []

    def run(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=run, args=(f,), daemon=True) for f in fns]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    assert not any(t.is_alive() for t in ts), "a thread is still blocked"
    if errors:
        raise errors[0]


def _data(i: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + 1000 * i


def test_both_directions_from_two_threads_per_rank(pair: List[Any]) -> None:
    """Each rank sends and receives at once from two threads; sizes vary from 0 bytes to 4 MiB."""
    sizes = [0, 1, 7, 1000, 1 << 20, 3, 1 << 18]
    got = {r: [torch.full((n,), -1.0) for n in sizes] for r in range(2)}

    def sender(r: int) -> Callable[[], None]:
        def run() -> None:
            works = [pair[r].isend(_data(i + 10 * r, n), 1 - r, make_tag(TAG_P2P, i)) for i, n in enumerate(sizes)]
            for w in works:
                w.wait(TIMEOUT)
        return run

    def receiver(r: int) -> Callable[[], None]:
        def run() -> None:
            for i, t in enumerate(got[r]):
                pair[r].irecv(t, 1 - r, make_tag(TAG_P2P, i)).wait(TIMEOUT)
        return run

    _threads(sender(0), sender(1), receiver(0), receiver(1))
    for r in range(2):
        for i, n in enumerate(sizes):
            assert torch.equal(got[r][i], _data(i + 10 * (1 - r), n))
    assert [b.matcher.pending() for b in pair] == [0, 0]


def test_object_and_user_sends_interleave_on_one_pair(pair: List[Any]) -> None:
    """An "object fetch" (object tags, control thread) and a user's sends share the pair in any order."""
    n = 20
    obj_tags = [make_tag(TAG_KIND_OBJECT, 5000 + i) for i in range(n)]
    user_tags = [make_tag(TAG_P2P, i) for i in range(n)]
    assert all(is_object_tag(t) for t in obj_tags) and not any(is_object_tag(t) for t in user_tags)
    obj_out = [torch.zeros(64) for _ in range(n)]
    user_out = [torch.zeros(16, dtype=torch.int64) for _ in range(n)]
    rng = random.Random(13)
    order = list(range(n))
    rng.shuffle(order)

    def objects_sender() -> None:
        for w in [pair[0].isend(torch.full((64,), float(i)), 1, obj_tags[i]) for i in range(n)]:
            w.wait(TIMEOUT)

    def user_sender() -> None:
        for i in range(n):
            pair[0].isend(torch.full((16,), i, dtype=torch.int64), 1, user_tags[i]).wait(TIMEOUT)

    def objects_receiver() -> None:  # posted in a shuffled order
        works = [pair[1].irecv(obj_out[i], 0, obj_tags[i]) for i in order]
        for w in works:
            w.wait(TIMEOUT)

    def user_receiver() -> None:
        for i in range(n):
            pair[1].irecv(user_out[i], 0, user_tags[i]).wait(TIMEOUT)

    _threads(objects_sender, user_sender, objects_receiver, user_receiver)
    assert all(torch.equal(obj_out[i], torch.full((64,), float(i))) for i in range(n))
    assert all(torch.equal(user_out[i], torch.full((16,), i, dtype=torch.int64)) for i in range(n))
    assert [b.matcher.pending() for b in pair] == [0, 0]


def test_receives_posted_in_reverse_order_of_sends(pair: List[Any]) -> None:
    n = 16
    sends = [pair[0].isend(_data(i, 100 + i), 1, i) for i in range(n)]
    outs = [torch.zeros(100 + i) for i in range(n)]
    recvs = [pair[1].irecv(outs[i], 0, i) for i in reversed(range(n))]
    for w in recvs + sends:
        w.wait(TIMEOUT)
    assert all(torch.equal(outs[i], _data(i, 100 + i)) for i in range(n))
    assert [b.matcher.pending() for b in pair] == [0, 0]


def test_abandoned_receive_and_send_then_more_traffic(pair: List[Any]) -> None:
    """Timed-out operations that never matched leave nothing behind: later messages land where they belong."""
    with pytest.raises(CollectiveTimeoutError, match="nothing was transferred"):
        pair[1].irecv(torch.zeros(4), 0, 100).wait(0.2)
    with pytest.raises(CollectiveTimeoutError, match="nothing was transferred"):
        pair[0].isend(torch.ones(4), 1, 200).wait(0.2)  # its RTS is dropped by CANCEL at rank 1
    deadline = time.monotonic() + 2
    while pair[1].matcher.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [b.matcher.pending() for b in pair] == [0, 0]
    x, y = _data(1, 4), torch.zeros(4)
    ws, wr = pair[0].isend(x, 1, 101), pair[1].irecv(y, 0, 101)
    wr.wait(TIMEOUT)
    ws.wait(TIMEOUT)
    assert torch.equal(y, x)
    late = torch.zeros(4)  # the abandoned send's tag, posted late: its RTS was cancelled, so it times out cleanly
    with pytest.raises(CollectiveTimeoutError):
        pair[1].irecv(late, 0, 200).wait(0.2)
    assert torch.equal(late, torch.zeros(4))
    assert [b.matcher.pending() for b in pair] == [0, 0]


@pytest.mark.parametrize("what", ["size", "dtype"])
def test_mismatch_raises_on_both_sides_at_once(pair: List[Any], what: str) -> None:
    x = torch.ones(8)
    y = torch.zeros(9) if what == "size" else torch.zeros(8, dtype=torch.int32)
    start = time.monotonic()
    ws = pair[0].isend(x, 1, 7)
    wr = pair[1].irecv(y, 0, 7)
    with pytest.raises(TensorMismatchError, match="nothing was transferred") as recv_err:
        wr.wait(TIMEOUT)
    with pytest.raises(TensorMismatchError, match="receives into") as send_err:
        ws.wait(TIMEOUT)
    assert time.monotonic() - start < TIMEOUT / 2  # at once, not at the deadline
    assert recv_err.value.peer == 0 and send_err.value.peer == 1
    assert torch.equal(y, torch.zeros_like(y))
    x2, y2 = torch.ones(8), torch.zeros(8)  # the pair stays usable: nothing touched the wire
    w1, w2 = pair[0].isend(x2, 1, 8), pair[1].irecv(y2, 0, 8)
    w1.wait(TIMEOUT)
    w2.wait(TIMEOUT)
    assert torch.equal(y2, x2)
    assert [b.matcher.pending() for b in pair] == [0, 0]


def test_abort_while_blocked_fails_at_once(pair: List[Any]) -> None:
    work = pair[0].irecv(torch.zeros(4), 1, 1)
    send = pair[0].isend(torch.zeros(4), 1, 2)
    threading.Timer(0.2, pair[0].abort).start()
    start = time.monotonic()
    with pytest.raises(GroupDestroyedError):
        work.wait(TIMEOUT)
    with pytest.raises(GroupDestroyedError):
        send.wait(TIMEOUT)
    assert time.monotonic() - start < TIMEOUT / 2
    with pytest.raises(GroupDestroyedError):
        pair[0].isend(torch.zeros(4), 1, 3)
    # The other rank sees the closed connection as its peer gone.
    with pytest.raises((PeerUnavailableError, GroupDestroyedError)) as e:
        pair[1].irecv(torch.zeros(4), 0, 1).wait(TIMEOUT)
    assert e.value.peer == 0
    assert [b.matcher.pending() for b in pair] == [0, 0]


def test_killed_rank_fails_its_peers_pending_work_naming_it() -> None:
    ranks = _tcp(3)
    try:
        w0 = ranks[0].irecv(torch.zeros(4), 2, 1)
        w1 = ranks[1].isend(torch.zeros(4), 2, 1)
        ok = ranks[0].irecv(torch.zeros(4), 1, 5)
        ranks[1].isend(torch.ones(4), 0, 5).wait(TIMEOUT)
        ok.wait(TIMEOUT)
        for link in ranks[2].matcher.links.values():  # rank 2 dies: its sockets close without any goodbye
            link.sock.shutdown(socket.SHUT_RDWR)
        start = time.monotonic()
        for w in (w0, w1):
            with pytest.raises(PeerUnavailableError, match="rank 2") as e:
                w.wait(TIMEOUT)
            assert e.value.peer == 2
        assert time.monotonic() - start < TIMEOUT / 2
        with pytest.raises(PeerUnavailableError):
            ranks[0].isend(torch.zeros(1), 2, 9)
        x, y = torch.ones(3), torch.zeros(3)  # ranks 0 and 1 still talk
        a, b = ranks[0].isend(x, 1, 6), ranks[1].irecv(y, 0, 6)
        a.wait(TIMEOUT)
        b.wait(TIMEOUT)
        assert torch.equal(x, y)
        assert ranks[0].matcher.pending() == 0 and ranks[1].matcher.pending() == 0
    finally:
        for b in ranks:
            b.shutdown()


def test_timeout_after_the_match_poisons_only_that_pair() -> None:
    """A receive whose bytes do not arrive in time (the sender is stuck after CTS) closes that pair's wire."""
    ranks = _fifo(3)
    try:
        hub_ranks = ranks
        big = torch.zeros(10)
        # Rank 1 receives from rank 0; the wire recv is posted at the match, but the FIFO send is held back by
        # posting another wire recv first on the same direction (the sender's data goes to it instead).
        hub = hub_ranks[0].hub
        stray = hub.post(0, 1, torch.zeros(10), False)  # a wire receive no matcher knows about
        wr = hub_ranks[1].irecv(big, 0, 3)
        ws = hub_ranks[0].isend(torch.ones(10), 1, 3)
        ws.wait(TIMEOUT)  # the data went to the stray receive
        assert stray.done()
        with pytest.raises(CollectiveTimeoutError):
            wr.wait(0.3)
        with pytest.raises(CollectiveTimeoutError):  # the pair 0-1 is closed now, on both sides
            hub_ranks[1].isend(torch.ones(1), 0, 4)
        with pytest.raises(PeerUnavailableError, match="rank 1"):
            hub_ranks[0].irecv(torch.ones(1), 1, 4).wait(TIMEOUT)
        assert hub.aborted >= {(0, 1), (1, 0)}
        x, y = torch.ones(2), torch.zeros(2)  # other pairs are untouched
        a, b = hub_ranks[2].isend(x, 1, 1), hub_ranks[1].irecv(y, 2, 1)
        a.wait(TIMEOUT)
        b.wait(TIMEOUT)
        assert torch.equal(x, y)
    finally:
        for b in ranks:
            b.shutdown()


def test_wrong_secret_is_refused_at_connect() -> None:
    out = make_ranks(TcpBackend, 2, 2.0, SECRET, secrets={1: b"not-the-group-secret-0123456789ab"})
    try:
        assert isinstance(out[0], AuthenticationError), out  # rank 0 connects to rank 1, which refuses it
        assert isinstance(out[1], CollectiveTimeoutError), out
    finally:
        for b in out:
            if isinstance(b, TcpBackend):
                b.shutdown()



def _rank1_listening(name: str) -> Tuple[List[Any], Callable[[int], None], threading.Thread, str, str]:
    """Rank 1 of a tcp pair starting on a thread (its listener up and published), and the builder for rank 0."""
    from ._fifo_wire import LocalRendezvous
    from rdt_transports.backends.base import BackendConfig
    import uuid

    rdv = LocalRendezvous()
    uid = uuid.uuid4().hex
    out: List[Any] = [None, None]

    def build(r: int) -> None:
        out[r] = TcpBackend(BackendConfig(name, uid, r, 2, TIMEOUT, SECRET, rdv))  # type: ignore[arg-type]

    t1 = threading.Thread(target=build, args=(1,), daemon=True)
    t1.start()
    host, _, port = rdv.get("tcp/addr/1", TIMEOUT).decode().rpartition(":")
    return out, build, t1, host, port

def test_listener_rejects_strangers_and_closes_after_init() -> None:
    """An unauthenticated connection is refused and counted; once the ranks are in, nothing more is accepted."""
    out, build, t1, host, port = _rank1_listening("cap")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:  # a stranger with no secret
        s.settimeout(TIMEOUT)
        s.recv(64)
        s.sendall(b"\0" * 68)  # rank 0, a nonce and a wrong MAC
        assert s.recv(64) == b""  # closed without an answer
    build(0)
    t1.join(TIMEOUT)
    try:
        assert out[1].stats["rejected_connections"] == 1 and out[1].stats["connections"] == 1
        with pytest.raises(OSError):
            socket.create_connection((host, int(port)), timeout=1.0).close()
        x, y = torch.ones(2), torch.zeros(2)
        a, b = out[0].isend(x, 1, 1), out[1].irecv(y, 0, 1)
        a.wait(TIMEOUT)
        b.wait(TIMEOUT)
        assert torch.equal(x, y)
    finally:
        for b in out:
            b.shutdown()


def test_silent_stranger_does_not_stall_init() -> None:
    """A connection that never answers the challenge does not hold up the ranks; it is cut when init ends."""
    out, build, t1, host, port = _rank1_listening("silent")
    stranger = socket.create_connection((host, int(port)), timeout=TIMEOUT)  # connects first, then says nothing
    try:
        start = time.monotonic()
        build(0)
        t1.join(TIMEOUT)
        assert time.monotonic() - start < TIMEOUT / 2  # not held up by the stranger's handshake timeout
        deadline = time.monotonic() + TIMEOUT
        while out[1].stats["rejected_connections"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert out[1].stats["rejected_connections"] == 1 and out[1].stats["connections"] == 1
    finally:
        stranger.close()
        for b in out:
            if b is not None:
                b.shutdown()


def test_shutdown_stops_every_thread() -> None:
    from rdt_transports import _lifecycle

    ranks = _tcp(3)
    names = [n for n in _lifecycle.live_threads() if n.startswith("rdt-tcp")]
    assert len(names) >= 12  # a reader and a writer per link, two links per rank
    for b in ranks:
        b.shutdown()
    deadline = time.monotonic() + 5
    while any(n.startswith("rdt-tcp") for n in _lifecycle.live_threads()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [n for n in _lifecycle.live_threads() if n.startswith("rdt-tcp")]


@pytest.mark.parametrize("garbage", ["unknown-kind", "data-nobody-expects", "rts-flood", "random"])
def test_bad_frames_from_an_authenticated_peer_close_only_that_pair(garbage: str) -> None:
    """Frames are parsed as fixed structs only: a bad one closes the pair's link, the rank and other pairs live."""
    from rdt_transports.backends._pairs import DATA, FRAME, RTS
    from rdt_transports.backends._matching import MAX_UNEXPECTED

    ranks = _tcp(3)
    try:
        pending = ranks[1].irecv(torch.zeros(4), 0, 1)
        sock = ranks[0].matcher.links[1].sock  # rank 0 misbehaves, bypassing its writer thread
        if garbage == "unknown-kind":
            sock.sendall(FRAME.pack(99, 0, 0, 0, 1, 4, 0))
        elif garbage == "data-nobody-expects":
            sock.sendall(FRAME.pack(DATA, 0, 0, 0, 1, 1 << 40, 0))  # claims a terabyte: nothing is allocated
        elif garbage == "rts-flood":
            sock.sendall(b"".join(FRAME.pack(RTS, 1, 0, 0, 1000 + i, 4, 0) for i in range(MAX_UNEXPECTED + 1)))
        else:
            sock.sendall(random.Random(7).randbytes(4096))
        with pytest.raises(PeerUnavailableError, match="rank 0") as e:
            pending.wait(TIMEOUT)
        assert e.value.peer == 0
        assert ranks[1].matcher.pending() == 0
        x, y = torch.ones(3), torch.zeros(3)  # rank 1 still talks to rank 2
        a, b = ranks[2].isend(x, 1, 6), ranks[1].irecv(y, 2, 6)
        a.wait(TIMEOUT)
        b.wait(TIMEOUT)
        assert torch.equal(x, y)
    finally:
        for b in ranks:
            b.shutdown()


@pytest.mark.parametrize("kind", ["tcp", "fifo"])
def test_random_interleavings_three_ranks(kind: str) -> None:
    """Every rank sends to every other from one thread and receives from another, tags in shuffled orders."""
    ranks = _tcp(3) if kind == "tcp" else _fifo(3)
    per_pair = 24
    rng = random.Random(2026)
    plans = {}
    for src in range(3):
        for dst in range(3):
            if src != dst:
                send_order = list(range(per_pair))
                recv_order = list(range(per_pair))
                rng.shuffle(send_order)
                rng.shuffle(recv_order)
                plans[(src, dst)] = (send_order, recv_order)
    size = {i: 1 + (i * 37) % 3000 for i in range(per_pair)}
    got = {key: {} for key in plans}

    def value(src: int, dst: int, i: int) -> torch.Tensor:
        return torch.full((size[i],), float(src * 10000 + dst * 100 + i))

    def sender(src: int) -> Callable[[], None]:
        def run() -> None:
            works = []
            for dst in (d for d in range(3) if d != src):
                works += [ranks[src].isend(value(src, dst, i), dst, i) for i in plans[(src, dst)][0]]
            for w in works:
                w.wait(TIMEOUT)
        return run

    def receiver(dst: int) -> Callable[[], None]:
        def run() -> None:
            works = []
            for src in (s for s in range(3) if s != dst):
                for i in plans[(src, dst)][1]:
                    t = torch.zeros(size[i])
                    got[(src, dst)][i] = t
                    works.append(ranks[dst].irecv(t, src, i))
            for w in works:
                w.wait(TIMEOUT)
        return run

    try:
        _threads(*[sender(r) for r in range(3)], *[receiver(r) for r in range(3)], timeout=60)
        for (src, dst), tensors in got.items():
            for i, t in tensors.items():
                assert torch.equal(t, value(src, dst, i)), (src, dst, i)
        assert [b.matcher.pending() for b in ranks] == [0, 0, 0]
    finally:
        for b in ranks:
            b.shutdown()
