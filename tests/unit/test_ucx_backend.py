"""UcxBackend with real ucxx: two backends (rank 0 and 1) in one process, rendezvous through a local Ray."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
import uuid
import weakref
from typing import Callable, Iterator, List, Tuple

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("ucxx")
ray = pytest.importorskip("ray")

from rdt_transports._rendezvous import Rendezvous  # noqa: E402
from rdt_transports.backends import _ucx_ops, ucx as ucx_mod  # noqa: E402
from rdt_transports.backends.base import BackendConfig  # noqa: E402
from rdt_transports.backends.ucx import UcxBackend  # noqa: E402
from rdt_transports.errors import (  # noqa: E402
    CollectiveTimeoutError,
    GroupDestroyedError,
    PeerUnavailableError,
    TensorMismatchError,
)

SECRET = b"unit-test-secret-0123456789abcdef"


@pytest.fixture(scope="module", autouse=True)
def ray_session() -> Iterator[None]:
    """One local Ray per module (the rendezvous lives in its GCS)."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def _make_pair(timeout: float = 10.0) -> Tuple[UcxBackend, UcxBackend]:
    """Rank 0 and rank 1 of a fresh group incarnation."""
    uid = uuid.uuid4().hex
    rdv = Rendezvous(uid, "ucx-test")
    cfg = [BackendConfig("ucx-test", uid, r, 2, timeout, SECRET, rdv) for r in range(2)]
    return UcxBackend(cfg[0]), UcxBackend(cfg[1])


@pytest.fixture(scope="module")
def pair() -> Iterator[Tuple[UcxBackend, UcxBackend]]:
    b0, b1 = _make_pair()
    yield b0, b1
    b0.shutdown()
    b1.shutdown()


_tags = iter(range(1000, 1 << 30))


def _tag() -> int:
    return next(_tags)


def _exchange(src_b: UcxBackend, dst_b: UcxBackend, src: torch.Tensor, dst: torch.Tensor, tag: int,
              recv_first: bool = True) -> None:
    if recv_first:
        r = dst_b.irecv(dst, src_b.rank, tag)
        s = src_b.isend(src, dst_b.rank, tag)
    else:
        s = src_b.isend(src, dst_b.rank, tag)
        time.sleep(0.05)
        r = dst_b.irecv(dst, src_b.rank, tag)
    s.wait(10)
    r.wait(10)


@pytest.mark.parametrize(
    "dtype,shape",
    [(torch.float32, (7,)), (torch.float64, (3, 4)), (torch.bfloat16, (5, 2, 3)), (torch.int64, (1,)),
     (torch.uint8, (4096,)), (torch.int32, ()), (torch.float16, (0,)), (torch.float32, (1 << 16,))],
)
def test_send_recv_dtypes_shapes(pair, dtype: torch.dtype, shape) -> None:
    b0, b1 = pair
    src = (torch.randn(shape) * 100).to(dtype)
    dst = torch.zeros(shape, dtype=dtype)
    _exchange(b0, b1, src, dst, _tag())
    assert torch.equal(src, dst)
    back = torch.zeros(shape, dtype=dtype)
    _exchange(b1, b0, dst, back, _tag(), recv_first=False)
    assert torch.equal(src, back)


def test_out_of_order_posting(pair) -> None:
    b0, b1 = pair
    tags = [_tag() for _ in range(6)]
    srcs = [torch.full((100 + i,), float(i)) for i in range(6)]
    dsts = [torch.zeros(100 + i) for i in range(6)]
    sends = [b0.isend(s, 1, t) for s, t in zip(srcs, tags)]
    recvs = [b1.irecv(d, 0, t) for d, t in reversed(list(zip(dsts, tags)))]
    for w in sends + recvs:
        w.wait(10)
    for s, d in zip(srcs, dsts):
        assert torch.equal(s, d)


def test_simultaneous_both_ways_from_threads(pair) -> None:
    b0, b1 = pair
    n = 1 << 20
    a, b = torch.randn(n), torch.randn(n)
    got_a, got_b = torch.zeros(n), torch.zeros(n)
    t_ab, t_ba = _tag(), _tag()
    errors: List[BaseException] = []

    def rank0() -> None:
        try:
            works = [b0.isend(a, 1, t_ab), b0.irecv(got_b, 1, t_ba)]
            for w in works:
                w.wait(10)
        except BaseException as e:  # reported below
            errors.append(e)

    def rank1() -> None:
        try:
            works = [b1.isend(b, 0, t_ba), b1.irecv(got_a, 0, t_ab)]
            for w in works:
                w.wait(10)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank0), threading.Thread(target=rank1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    assert torch.equal(a, got_a) and torch.equal(b, got_b)


@pytest.mark.parametrize("nbytes", [_ucx_ops.INLINE_MAX, _ucx_ops.INLINE_MAX + 1])
def test_inline_limit_both_sides_of_it(pair, nbytes: int) -> None:
    """The largest payload that travels inside the header, and the smallest that follows it after the ACK."""
    b0, b1 = pair
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    _exchange(b0, b1, src, dst, _tag(), recv_first=False)
    assert torch.equal(src, dst)


def test_many_threads_share_one_pair(pair) -> None:
    """Eight threads per rank send and receive on one pair at once; every thread drives progress for all."""
    b0, b1 = pair
    base = _tag()
    for _ in range(64):
        _tag()
    errors: List[BaseException] = []

    def worker(i: int) -> None:
        try:
            for k in range(4):
                tag = base + i * 4 + k
                src, dst = torch.full((100 + i,), float(tag)), torch.zeros(100 + i)
                r = b1.irecv(dst, 0, tag)
                s = b0.isend(src, 1, tag)
                (s if i % 2 else r).wait(10)  # half the threads wait for the other side first
                (r if i % 2 else s).wait(10)
                assert torch.equal(src, dst)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def test_64mib_content(pair) -> None:
    b0, b1 = pair
    n = 64 << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    _exchange(b1, b0, src, dst, _tag())
    assert torch.equal(src, dst)


def test_size_and_dtype_mismatch_fail_both_sides(pair) -> None:
    b0, b1 = pair
    tag = _tag()
    s = b0.isend(torch.zeros(10), 1, tag)
    r = b1.irecv(torch.zeros(11), 0, tag)
    with pytest.raises(TensorMismatchError):
        r.wait(10)
    with pytest.raises(TensorMismatchError):
        s.wait(10)
    tag = _tag()
    s = b0.isend(torch.zeros(4, dtype=torch.int32), 1, tag)
    r = b1.irecv(torch.zeros(4, dtype=torch.float32), 0, tag)
    with pytest.raises(TensorMismatchError):
        r.wait(10)
    with pytest.raises(TensorMismatchError):
        s.wait(10)
    # the pair still works afterwards
    src, dst = torch.arange(5.0), torch.zeros(5)
    _exchange(b0, b1, src, dst, _tag())
    assert torch.equal(src, dst)


def test_refused_fast_send_is_reported_by_the_next_send() -> None:
    """A small send like one the receiver accepted before completes at once; when the receiver refuses it, it raises
    at once and the sender's next send to that peer raises the refusal."""
    b0, b1 = _make_pair()
    try:
        _exchange(b0, b1, torch.ones(8), torch.zeros(8), 1)  # (32 bytes, float32) accepted: later ones are fast
        s = b0.isend(torch.ones(8), 1, 2)
        s.wait(10)  # completes before the receiver has even posted its receive
        dst = torch.zeros(9)
        with pytest.raises(TensorMismatchError):
            b1.irecv(dst, 0, 2).wait(10)
        assert torch.equal(dst, torch.zeros(9))  # untouched
        with pytest.raises(TensorMismatchError, match="refused an earlier send"):
            b0.isend(torch.ones(8), 1, 3).wait(10)
    finally:
        b0.shutdown()
        b1.shutdown()


def test_recv_without_sender_times_out(pair) -> None:
    b0, _ = pair
    w = b0.irecv(torch.zeros(3), 1, _tag())
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        w.wait(0.5)
    elapsed = time.monotonic() - t0
    assert 0.45 <= elapsed < 1.5
    err = info.value
    assert err.group == "ucx-test" and err.rank == 0 and err.peer == 1 and err.op == "recv"


def _connect_with_wrong_secret(port: int, host: str) -> str:
    """Connect to a listener as an outsider and answer the challenge with a bad MAC; returns what happened."""
    from ucxx._lib_async.application_context import ApplicationContext

    async def attack() -> str:
        ctx = ApplicationContext(progress_mode="thread", enable_python_future=True)
        ep = await ctx.create_endpoint(host, port)
        challenge = bytearray(32)
        await asyncio.wait_for(ep.recv(challenge, tag=ucx_mod._HS_TAG_CHALLENGE), 5)
        bad = ucx_mod._RESPONSE.pack(0, os.urandom(32), b"\0" * 32)
        await asyncio.wait_for(ep.send(bytearray(bad), tag=ucx_mod._HS_TAG_RESPONSE), 5)
        confirm = bytearray(36)
        try:
            await asyncio.wait_for(ep.recv(confirm, tag=ucx_mod._HS_TAG_CONFIRM), 2)
            outcome = "accepted"
        except BaseException as e:  # closed endpoint or timeout: rejected
            outcome = f"rejected ({type(e).__name__})"
        ep.abort(period=10**8)
        ctx.stop_notifier_thread()
        ctx.worker.stop_progress_thread()
        return outcome

    result: List[str] = []
    t = threading.Thread(target=lambda: result.append(asyncio.run(attack())))
    t.start()
    t.join(20)
    return result[0] if result else "hung"


def test_unauthenticated_client_rejected_and_group_keeps_working(pair) -> None:
    b0, b1 = pair
    before = b1.stats["rejected_connections"]
    raw = b1.config.rendezvous.get("ucx/addr/1", 5)
    host, _, port = raw.decode().rpartition(":")
    outcome = _connect_with_wrong_secret(int(port), host)
    assert outcome.startswith("rejected"), outcome
    deadline = time.monotonic() + 5
    while b1.stats["rejected_connections"] == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b1.stats["rejected_connections"] == before + 1
    src, dst = torch.randn(1000), torch.zeros(1000)
    _exchange(b0, b1, src, dst, _tag())
    assert torch.equal(src, dst)
    _exchange(b1, b0, dst, src, _tag())


def test_abort_fails_pending_fast_and_shutdown_idempotent_quick() -> None:
    b0, b1 = _make_pair()
    src, dst = torch.arange(4.0), torch.zeros(4)
    _exchange(b0, b1, src, dst, 1)  # connect first
    pending = b1.irecv(torch.zeros(8), 0, 2)
    t0 = time.monotonic()
    b1.abort()
    with pytest.raises(GroupDestroyedError):
        pending.wait(10)
    assert time.monotonic() - t0 < 5.0  # woken by the abort, not by the timeout
    with pytest.raises(GroupDestroyedError):
        b1.isend(torch.zeros(1), 0, 3)
    # the peer learns that the connection is gone instead of hanging until its timeout
    w = b0.irecv(torch.zeros(8), 1, 4)
    with pytest.raises(Exception) as info:
        w.wait(5)
    assert not isinstance(info.value, CollectiveTimeoutError)
    t0 = time.monotonic()
    for b in (b0, b1, b0, b1):
        b.shutdown()
    assert time.monotonic() - t0 < 4.5  # no close waited out its 5 s bound
    assert not b0._thread.is_alive() and not b1._thread.is_alive()
    assert not b0._engine.pump_alive and not b1._engine.pump_alive  # no thread left behind


def test_shutdown_unconnected_is_quick() -> None:
    b0, b1 = _make_pair()
    t0 = time.monotonic()
    b0.shutdown()
    b1.shutdown()
    b1.shutdown()
    # No wait ran out: a close would take its 5 s bound, a join would leave its thread running. (Each shutdown's
    # full garbage collection takes about a second in a busy pytest process, so the bound is not tighter.)
    assert time.monotonic() - t0 < 4.5
    assert not b0._thread.is_alive() and not b1._thread.is_alive()
    assert not b0._engine.pump_alive and not b1._engine.pump_alive


# ---------------------------------------------------------------------------------------------- same-node path
def test_same_node_pair_uses_worker_address_shared_memory(pair) -> None:
    """Two ranks on one Ray node connect through worker-address endpoints, and UCX picks shared memory/CMA."""
    b0, b1 = pair
    for n in (1024, 16 << 20):  # 4 KiB and 64 MiB of float32
        src, dst = torch.randn(n), torch.zeros(n)
        _exchange(b0, b1, src, dst, _tag())
        assert torch.equal(src, dst)
        _exchange(b1, b0, src * 2, dst, _tag(), recv_first=False)
        assert torch.equal(src * 2, dst)
    for b, peer in ((b0, 1), (b1, 0)):
        info = b.describe()["peers"][peer]
        assert info["path"] == "worker-address", b.describe()
        assert set(info["transports"].split("+")) & {"sysv", "posix", "cma"}, info
        assert b.transports() == "shm/cma"


def test_listener_path_when_same_node_endpoints_are_off(monkeypatch) -> None:
    """RDT_UCX_SAME_NODE=0 (and peers on other nodes) keep the authenticated listener endpoints over tcp."""
    monkeypatch.setenv("RDT_UCX_SAME_NODE", "0")
    b0, b1 = _make_pair()
    try:
        src, dst = torch.randn(4096), torch.zeros(4096)
        _exchange(b0, b1, src, dst, 1)
        assert torch.equal(src, dst)
        assert b0.describe()["peers"][1] == {"path": "listener", "transports": "tcp"}
        assert b1.transports() == "tcp"
    finally:
        b0.shutdown()
        b1.shutdown()


def _outsider_at_worker(addr: bytes, server_rank: int, uid: bytes, tag: int) -> None:
    """Connect to a rank's worker address without the group secret: a hello with a bad MAC, a hello of the wrong
    size, then a forged header and payload on the plain (unkeyed) tags a user receive would use."""
    from ucxx._lib.libucxx import UCXAddress
    from ucxx._lib_async.application_context import ApplicationContext

    async def attack() -> None:
        ctx = ApplicationContext(progress_mode="thread", enable_python_future=True)
        ep = await ctx.create_endpoint_from_worker_address(UCXAddress.create_from_buffer(addr),
                                                           endpoint_error_handling=False)
        hello_tag = ucx_mod._tag64(b"hello", uid, ucx_mod._RANK.pack(server_rank))
        bad = ucx_mod._HELLO.pack(0, os.getpid(), 0, os.urandom(32), b"\0" * 32)
        await asyncio.wait_for(ep.send(bytearray(bad), tag=hello_tag, force_tag=True), 5)
        await asyncio.wait_for(ep.send(bytearray(bad + b"x" * 64), tag=hello_tag, force_tag=True), 5)
        header = ucx_mod._CTL.pack(ucx_mod._HDR, ucx_mod._dtype_code(torch.float32), 0, tag, 16, 0)
        for t in (ucx_mod._CTL_TAG, tag):
            await asyncio.wait_for(ep.send(bytearray(header), tag=t, force_tag=True), 5)
        await asyncio.wait_for(ep.send(bytearray(b"\x7f" * 16), tag=tag, force_tag=True), 5)
        await asyncio.sleep(0.2)
        ep.abort(period=10**8)
        ctx.stop_notifier_thread()
        ctx.worker.stop_progress_thread()

    t = threading.Thread(target=lambda: asyncio.run(attack()))
    t.start()
    t.join(20)
    assert not t.is_alive()


def test_outsider_at_worker_address_is_rejected_and_never_matches_user_receives(pair) -> None:
    b0, b1 = pair
    _exchange(b0, b1, torch.ones(2), torch.zeros(2), _tag())  # the pair is connected (worker-address)
    raw = b1.config.rendezvous.get("ucx/waddr/1", 5)
    node, _, addr = raw.partition(b"|")
    assert node and addr
    tag = _tag()
    dst = torch.zeros(4)
    pending = b1.irecv(dst, 0, tag)
    before = b1.stats["rejected_connections"]
    _outsider_at_worker(addr, 1, b1._uid, tag)
    deadline = time.monotonic() + 5
    while b1.stats["rejected_connections"] < before + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b1.stats["rejected_connections"] == before + 2  # the bad MAC and the wrong-size hello
    time.sleep(0.5)  # the pump thread progresses meanwhile
    assert not pending.is_completed()  # the forged header/payload did not complete it
    assert torch.equal(dst, torch.zeros(4))
    src = torch.arange(4.0)
    s = b0.isend(src, 1, tag)
    s.wait(10)
    pending.wait(10)
    assert torch.equal(dst, src)
    assert b1.describe()["peers"][0]["path"] == "worker-address"  # the real pair kept its connection


# ---------------------------------------------------------------------------------------------- no leak
def _sysv_mappings() -> int:
    """UCX shared-memory segments mapped in this process (each live UCX worker with shm transports maps some)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/SYSV" in line)


def test_destroyed_groups_free_their_ucx_workers() -> None:
    """Creating and destroying a group again and again keeps memory flat: every backend, its UCX worker and its
    shared-memory segments are freed at shutdown (they were kept alive by endpoint close callbacks)."""
    gone: List[bool] = []
    baseline = None
    for i in range(8):
        b0, b1 = _make_pair()
        src, dst = torch.randn(4 << 20), torch.zeros(4 << 20)  # 16 MiB each way: UCX's rendezvous path
        _exchange(b0, b1, src, dst, 1)
        _exchange(b1, b0, dst, src, 2, recv_first=False)
        refs = [weakref.ref(b0), weakref.ref(b1)]
        b0.shutdown()
        b1.shutdown()
        del b0, b1
        gc.collect()
        gone.extend(r() is None for r in refs)
        if i == 0:
            baseline = _sysv_mappings()
    assert all(gone), f"{gone.count(False)} of {len(gone)} shut-down UCX backends are still alive"
    assert _sysv_mappings() <= baseline, (baseline, _sysv_mappings())


def test_reused_header_buffers_never_leak_an_earlier_message(pair) -> None:
    """Header and verdict receive buffers are reused: a small message after a large one gets only its own bytes,
    neither a header nor a verdict is ever read from an earlier message, and the spare buffers stay bounded."""
    b0, b1 = pair
    for i in range(40):
        big = torch.full((15000,), float(i))  # 60 KiB: inline, fills most of the header buffer
        small = torch.full((3,), -float(i))
        for src in (big, small):
            dst = torch.zeros_like(src)
            _exchange(b0, b1, src, dst, _tag(), recv_first=bool(i % 2))
            assert torch.equal(src, dst), (i, src.numel())
    dst = torch.zeros(4099, dtype=torch.int32)
    tag = _tag()
    r = b1.irecv(dst, 0, tag)
    s = b0.isend(torch.ones(4099), 1, tag)  # a new size, other dtype: refused on both sides, dst untouched
    with pytest.raises(TensorMismatchError):
        r.wait(10)
    with pytest.raises(TensorMismatchError):
        s.wait(10)
    assert torch.equal(dst, torch.zeros(4099, dtype=torch.int32))
    for b in (b0, b1):
        assert all(len(spares) <= ucx_mod._SPARES_KEPT for spares in b._spares.values()), b._spares.keys()


def test_sends_answered_out_of_order_keep_their_own_verdicts(pair) -> None:
    """Sends in flight to one peer, received out of order: each send's verdict arrives before its predecessor's.
    A verdict buffer is reused only once both its readers (its own send, then the next send) have read it: a send
    posted meanwhile must not take the buffer of a verdict still to be read."""
    b0, b1 = pair
    for size in (4099, 7001):  # new (size, dtype) pairs: these sends wait for their own verdicts
        tags = [_tag() for _ in range(5)]
        srcs = [torch.full((size,), float(i + 1)) for i in range(5)]
        dsts = [torch.zeros(size) for _ in tags]
        sends = [b0.isend(srcs[i], 1, tags[i]) for i in range(4)]
        recvs = [b1.irecv(dsts[i], 0, tags[i]) for i in (3, 2, 1)]  # verdicts of sends 1-3 come first
        for w in recvs:
            w.wait(10)
        time.sleep(0.2)  # the sender's progress pump reads the verdicts that arrived
        sends.append(b0.isend(srcs[4], 1, tags[4]))  # takes a spare verdict buffer
        recvs += [b1.irecv(dsts[0], 0, tags[0]), b1.irecv(dsts[4], 0, tags[4])]
        for w in recvs + sends:
            w.wait(10)
        assert all(torch.equal(src, dst) for src, dst in zip(srcs, dsts))


def test_shutdown_frees_the_ucx_workers_at_once() -> None:
    """After shutdown() nothing of the group's UCX workers waits for a later garbage collection, or for interpreter
    exit, where UCX's async thread would outlive them."""
    def workers() -> int:
        return sum(type(o).__name__ == "UCXWorker" for o in gc.get_objects())

    gc.collect()
    before = workers()
    gc.disable()  # no automatic collection may free what shutdown() left behind
    try:
        b0, b1 = _make_pair()
        assert workers() == before + 2
        for _ in range(3):
            _exchange(b0, b1, torch.arange(1000.0), torch.zeros(1000), _tag())
        b0.shutdown()
        b1.shutdown()
        assert workers() == before
    finally:
        gc.enable()


def test_the_pid_watch_fails_a_peer_whose_pid_names_another_process() -> None:
    """A same-node pair watches the peer's process by (pid, start time) from its authenticated handshake: given
    the pid of a live process that is not the one that said hello (another start time), the pair fails at once."""
    import subprocess
    import sys

    from rdt_transports._proc import identity

    b0, b1 = _make_pair()
    other = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "up"
        _exchange(b0, b1, torch.ones(4), torch.zeros(4), _tag())  # the pair is connected
        state = b0._peer(1)
        pid, started = identity(other.pid)
        assert started is not None
        b0._loop.call_soon_threadsafe(b0._watch, 1, state, state.ep, (pid, started + 1))
        with pytest.raises(PeerUnavailableError, match="exited"):
            b0.irecv(torch.zeros(4), 1, _tag()).wait(5.0)
    finally:
        other.kill()
        other.wait(timeout=30)


# ---------------------------------------------------------------------------------------------- late sends
@pytest.mark.parametrize("n", [1 << 10, 1 << 18, 8 << 20], ids=["inline-4KiB", "1MiB", "32MiB"])
def test_a_late_send_never_writes_into_a_timed_out_recv(n: int) -> None:
    """Rank 1's recv times out; rank 0 then sends that tag. The tensor the failed recv was given keeps its bytes
    (checked again well after), the send fails with a typed error saying rank 1 cancelled, and the pair still
    works. (A fresh pair: a small send of a size the peer accepted lately completes before its verdict, and the
    next send reports the cancel, as for a refusal.)"""
    from rdt_transports.errors import CommunicationError

    b0, b1 = _make_pair()
    try:
        _exchange(b0, b1, torch.ones(4), torch.zeros(4), _tag())  # connected
        tag = _tag()
        t = torch.full((n,), -7.0)
        with pytest.raises(CollectiveTimeoutError):
            b1.irecv(t, 0, tag).wait(0.3)
        src = torch.arange(n, dtype=torch.float32)
        with pytest.raises(CommunicationError, match="cancelled its receive") as info:
            b0.isend(src, 1, tag).wait(3.0)
        assert info.value.peer == 1 and f"tag {tag}" in str(info.value)
        time.sleep(0.3)
        assert bool((t == -7.0).all()), f"{int((t != -7.0).sum())} of {n} elements were written after the recv failed"
        dst = torch.zeros(n)
        _exchange(b0, b1, src, dst, _tag())
        assert torch.equal(src, dst)
    finally:
        b0.shutdown()
        b1.shutdown()


def test_a_recv_that_times_out_mid_transfer_is_never_written_after_its_error() -> None:
    """The sender starts just before, at or after the receiver's deadline: whatever the receive returns, no byte of
    its tensor changes once it has returned or raised (a payload already moving is given as long again to land),
    and one that returns has the whole message."""
    b0, b1 = _make_pair()
    try:
        _exchange(b0, b1, torch.ones(4), torch.zeros(4), _tag())  # connected
        n = 16 << 20  # 64 MiB
        src = torch.arange(n, dtype=torch.float32)
        for lead in (0.03, 0.01, 0.0, -0.01, -0.03):
            t = torch.full((n,), -7.0)
            tag = _tag()
            seen: List[torch.Tensor] = []
            got: List[object] = []

            def receive() -> None:
                try:
                    b1.irecv(t, 0, tag).wait(0.2)
                    got.append(None)
                except Exception as e:  # noqa: BLE001 - inspected below
                    got.append(e)
                seen.append(t.clone())

            def send() -> None:
                time.sleep(0.2 - lead)
                try:
                    b0.isend(src, 1, tag).wait(5.0)
                except Exception:  # noqa: BLE001 - the receive's outcome is what is checked
                    pass

            threads = [threading.Thread(target=receive), threading.Thread(target=send)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(30)
            time.sleep(0.3)
            assert torch.equal(t, seen[0]), f"lead {lead}: the tensor changed after the receive returned ({got[0]!r})"
            if got[0] is None:
                assert torch.equal(t, src)
            else:
                assert isinstance(got[0], CollectiveTimeoutError), got[0]
    finally:
        b0.shutdown()
        b1.shutdown()


def _bye_read_first(b0: UcxBackend, b1: UcxBackend, peer_side: Callable[[], None], arrived: Callable[[], bool]) -> None:
    """The order a busy machine produced (a CPU hog beside a 2-rank group): rank 1 does its part of a transfer
    (``peer_side``) and leaves at once, while nothing progresses rank 0 (its waiter descheduled); rank 0 then reads
    the transfer's last message and rank 1's BYE in one progress, and its loop thread marks rank 1 gone before the
    operation itself is looked at."""
    engine = b0._engine
    deadline = time.monotonic() + 10
    waiting = 1 + bool(b0._node)  # receives of the asyncio side: the control reader's (+ same-node hellos)
    while sum(isinstance(op, ucx_mod.AwaitOp) for op in engine._ops) < waiting and time.monotonic() < deadline:
        time.sleep(0.001)  # the reader posts its receive on the loop thread, under the engine lock taken below
    with engine.lock:
        peer_side()
        b1.shutdown()  # BYE

        def readers() -> list:  # completed receives of the asyncio side (the control reader's: the BYE)
            return [op for op in engine._ops if isinstance(op, ucx_mod.AwaitOp) and op._req is not None
                    and op._req.completed]

        while not (arrived() and readers()) and time.monotonic() < deadline:
            engine._worker.progress()
        assert arrived() and readers()
        for op in readers():
            op.advance()  # hands the BYE to the loop thread, which marks rank 1 gone ...
        state = b0._peers[1]
        while state.error is None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert state.error is not None  # ... before rank 0's operation is advanced


def test_a_send_that_went_through_succeeds_when_the_peer_leaves_right_after() -> None:
    """A send whose verdict arrived before the peer's BYE completes; the departure fails only what still needs the
    peer (it used to fail with "connection to rank 1 closed: the peer aborted or shut down")."""
    b0, b1 = _make_pair()
    try:
        _exchange(b0, b1, torch.ones(4), torch.zeros(4), _tag())  # connected
        tag = _tag()
        send = b0.isend(torch.empty(0, dtype=torch.int64), 1, tag)  # a new (size, dtype): waits for its verdict
        _bye_read_first(b0, b1, lambda: b1.irecv(torch.empty(0, dtype=torch.int64), 0, tag).wait(10),
                        lambda: send._op.reply_req.completed)
        send.wait(10)
        with pytest.raises(ucx_mod.PeerUnavailableError, match="aborted or shut down"):
            b0.isend(torch.ones(3), 1, _tag()).wait(10)  # what comes after the departure does fail
    finally:
        b0.shutdown()
        b1.shutdown()


def test_a_receive_whose_message_arrived_succeeds_when_the_peer_leaves_right_after() -> None:
    """The receiving side: rank 1's fast send completes at once and rank 1 leaves; rank 0 reads the message and
    the BYE in one progress, and its loop thread marks rank 1 gone first."""
    b0, b1 = _make_pair()
    try:
        _exchange(b1, b0, torch.ones(3), torch.zeros(3), _tag())  # (12 bytes, float32) agreed: the next is fast
        tag = _tag()
        dst = torch.zeros(3)
        recv = b0.irecv(dst, 1, tag)
        _bye_read_first(b0, b1, lambda: b1.isend(torch.full((3,), 7.0), 0, tag).wait(10),
                        lambda: recv._op.head_req.completed)
        recv.wait(10)
        assert torch.equal(dst, torch.full((3,), 7.0))
    finally:
        b0.shutdown()
        b1.shutdown()


@pytest.mark.parametrize("numel", [16, 1 << 20])  # inline in the header; a payload of its own after the ACK
def test_finished_operations_keep_no_tensor(numel: int) -> None:
    """Once a send and a receive completed, the backend holds neither tensor (nor a view of its memory) and no
    table keeps the operations: a step's tensors are freed when the caller drops them, not at group destroy."""
    b0, b1 = _make_pair()  # a fresh pair: the module's keeps a receive that timed out (still pending, rightly)
    try:
        for _ in range(3):  # the second and third sends of a size are fast: they complete before their verdicts
            src, dst = torch.arange(numel, dtype=torch.float32), torch.zeros(numel)
            storages = [weakref.ref(src.untyped_storage()), weakref.ref(dst.untyped_storage())]
            _exchange(b0, b1, src, dst, _tag())
            assert torch.equal(src, dst)
            del src, dst
            gc.collect()
            assert [s() is None for s in storages] == [True, True]
        for b in (b0, b1):
            assert not b._pending
            assert not [op for op in b._engine._ops if isinstance(op, _ucx_ops.P2POp)]
    finally:
        b0.shutdown()
        b1.shutdown()
