"""Real-NIXL tests of NixlBackend: two agents (rank 0 and 1) in one process, driven from two threads."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import hashlib
import hmac
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, List, Tuple

import pytest
import torch

pytest.importorskip("nixl_cu13", reason="needs nixl-cu13")  # the backend also accepts nixl / nixl-cu12
ray = pytest.importorskip("ray")

from rdt_transports._rendezvous import Rendezvous  # noqa: E402
from rdt_transports.backends.base import BackendConfig  # noqa: E402
from rdt_transports.backends.nixl import _HEADER, _KIND_DONE, _MAGIC, _VERSION, NixlBackend  # noqa: E402
from rdt_transports.errors import (  # noqa: E402
    CollectiveTimeoutError, GroupDestroyedError, InvalidArgumentError, PeerUnavailableError, TensorMismatchError)

TIMEOUT = 20.0


@pytest.fixture(scope="module", autouse=True)
def ray_session() -> Iterator[None]:
    """One local Ray instance per module: the rendezvous lives in its GCS."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def make_pair(timeout: float = TIMEOUT) -> Tuple[NixlBackend, NixlBackend]:
    """Two backends (rank 0 and 1) of a fresh group incarnation."""
    uid = uuid.uuid4().hex
    rdv = Rendezvous(uid, "nixl-test")
    secret = os.urandom(32)
    cfgs = [BackendConfig("nixl-test", uid, r, 2, timeout, secret, rdv) for r in range(2)]
    with ThreadPoolExecutor(2) as ex:
        b0, b1 = ex.map(NixlBackend, cfgs)
    return b0, b1


@pytest.fixture()
def pair() -> Iterator[Tuple[NixlBackend, NixlBackend]]:
    """A backend pair shut down after the test."""
    b0, b1 = make_pair()
    yield b0, b1
    b0.shutdown()
    b1.shutdown()


def run_both(f0: Callable[[], object], f1: Callable[[], object]) -> List[object]:
    """Run the two ranks' bodies concurrently; re-raise the first failure."""
    with ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(f0), ex.submit(f1)]
        return [f.result(timeout=60) for f in futs]


@pytest.mark.parametrize(
    "dtype,shape",
    [(torch.float32, (7,)), (torch.float64, (3, 5)), (torch.int64, (2, 3, 4)), (torch.uint8, (1000,)),
     (torch.bfloat16, (33, 2)), (torch.float16, (1,)), (torch.int32, (0,))],
)
def test_send_recv_dtypes(pair, dtype, shape) -> None:
    b0, b1 = pair
    src = (torch.arange(int(torch.Size(shape).numel())) % 100).to(dtype).reshape(shape)
    dst = torch.zeros(shape, dtype=dtype)
    run_both(lambda: b0.isend(src, 1, 5).wait(TIMEOUT), lambda: b1.irecv(dst, 0, 5).wait(TIMEOUT))
    assert torch.equal(src, dst)


def test_out_of_order_posting(pair) -> None:
    b0, b1 = pair
    a, b = torch.randn(1000), torch.randn(2000)
    ra, rb = torch.empty_like(a), torch.empty_like(b)
    # recv posted before its send (tag 1), and send posted before its recv (tag 2); tags matched out of order.
    w_r1 = b1.irecv(ra, 0, 1)
    w_s2 = b0.isend(b, 1, 2)
    time.sleep(0.05)
    w_s1 = b0.isend(a, 1, 1)
    w_r2 = b1.irecv(rb, 0, 2)
    run_both(lambda: (w_s2.wait(TIMEOUT), w_s1.wait(TIMEOUT)), lambda: (w_r2.wait(TIMEOUT), w_r1.wait(TIMEOUT)))
    assert torch.equal(a, ra) and torch.equal(b, rb)


def test_both_directions_at_once(pair) -> None:
    b0, b1 = pair
    x0, x1 = torch.randn(1 << 18), torch.randn(1 << 18)
    y0, y1 = torch.empty_like(x0), torch.empty_like(x1)

    def rank(b: NixlBackend, x: torch.Tensor, y: torch.Tensor, peer: int) -> None:
        ws = [b.isend(x, peer, 10), b.irecv(y, peer, 10), b.isend(x[:100], peer, 11), b.irecv(y[:100], peer, 11)]
        for w in ws:
            w.wait(TIMEOUT)

    run_both(lambda: rank(b0, x0, y0, 1), lambda: rank(b1, x1, y1, 0))
    assert torch.equal(y1, x0) and torch.equal(y0, x1)


@pytest.mark.parametrize("cma", [True, False], ids=["rdt-cma", "nixl-write"])
def test_64mib_and_cache_reuse(monkeypatch, cma) -> None:
    """64 MiB twice: same-node, rdt copies it with process_vm_writev on several threads (the sender registers
    nothing); with RDT_NIXL_CMA=0 NIXL WRITEs it. The receiver's registration is cached either way."""
    from rdt_transports.backends import nixl as nixl_mod

    monkeypatch.setenv("RDT_NIXL_CMA", "1" if cma else "0")
    b0, b1 = make_pair()
    try:
        assert b0.p2p_label(64 << 20) == (f"rdt cma x{nixl_mod.CMA_THREADS}" if cma else "shm/cma")
        assert b0.p2p_label(1 << 20) == "shm/cma"
        src = torch.randint(0, 1 << 30, (16 << 20,), dtype=torch.int32)  # 64 MiB
        dst = torch.zeros_like(src)
        for tag in (0, 1):
            dst.zero_()
            run_both(lambda: b0.isend(src, 1, tag).wait(TIMEOUT), lambda: b1.irecv(dst, 0, tag).wait(TIMEOUT))
            assert torch.equal(src, dst)
        assert b1.registration_cache.registrations == 1 and b1.registration_cache.hits == 1
        assert b0.stats["cma_writes"] == (2 if cma else 0)
        assert b0.registration_cache.registrations == (0 if cma else 1)
    finally:
        b0.shutdown()
        b1.shutdown()


def test_a_reused_peer_pid_is_never_written_into(pair) -> None:
    """rdt writes into a same-node peer only while its pid still names the process that joined the group (same
    start time): a pid that now names another process fails the send with PeerUnavailableError, nothing written."""
    import subprocess
    import sys

    b0, b1 = pair
    other = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "up"
        assert b0._peer_pids is not None
        b0._peer_pids[1] = other.pid  # as if rank 1 had died and its pid gone to this process
        src = torch.ones(8 << 20)  # 32 MiB: the CMA path
        dst = torch.zeros_like(src)
        with pytest.raises(PeerUnavailableError, match="is gone"):
            run_both(lambda: b0.isend(src, 1, 0).wait(TIMEOUT), lambda: b1.irecv(dst, 0, 0).wait(3.0))
        assert b0.stats["cma_writes"] == 0 and not bool(dst.any())
    finally:
        other.kill()
        other.wait(timeout=30)


def test_large_size_mismatch_refused_before_cma(pair) -> None:
    """Above the CMA threshold a mismatch still fails both sides and leaves the receive tensor untouched."""
    b0, b1 = pair
    src, dst = torch.ones(8 << 20), torch.full((9 << 20,), 7.0)
    m0, m1 = run_both(lambda: _expect_mismatch(lambda: b0.isend(src, 1, 5).wait(TIMEOUT)),
                      lambda: _expect_mismatch(lambda: b1.irecv(dst, 0, 5).wait(TIMEOUT)))
    for m in (m0, m1):
        assert str(32 << 20) in m and str(36 << 20) in m, m
    assert b0.stats["cma_writes"] == 0 and bool((dst == 7.0).all())


def test_registration_not_reused_after_free(pair) -> None:
    b0, b1 = pair
    for tag in range(4):  # fresh tensors each time: dead storages must be deregistered, never reused stale
        src = torch.full((1 << 16,), float(tag))  # 256 KiB: above the EAGER limit, so registered
        dst = torch.zeros(1 << 16)
        run_both(lambda s=src, t=tag: b0.isend(s, 1, t).wait(TIMEOUT),
                 lambda d=dst, t=tag: b1.irecv(d, 0, t).wait(TIMEOUT))
        assert torch.equal(src, dst)
        del src, dst
    assert len(b1.registration_cache) <= 2 and len(b0.registration_cache) <= 2


def _expect_mismatch(fn: Callable[[], None]) -> str:
    with pytest.raises(TensorMismatchError) as ei:
        fn()
    return str(ei.value)


def test_size_mismatch_fails_both_sides(pair) -> None:
    """Above the EAGER limit the sender sees the receiver's RTR: both raise on that very message."""
    b0, b1 = pair
    src, dst = torch.zeros(1 << 15), torch.zeros(1 << 16)
    m0, m1 = run_both(lambda: _expect_mismatch(lambda: b0.isend(src, 1, 3).wait(TIMEOUT)),
                      lambda: _expect_mismatch(lambda: b1.irecv(dst, 0, 3).wait(TIMEOUT)))
    for m in (m0, m1):
        assert "131072 bytes" in m and "262144 bytes" in m


def test_small_mismatch_fails_both_sides(pair) -> None:
    """A small (EAGER) send waits for the receiver's answer: a refusal fails both, the receive tensor untouched."""
    b0, b1 = pair
    src, dst = torch.ones(100), torch.full((200,), 7.0)
    m0, m1 = run_both(lambda: _expect_mismatch(lambda: b0.isend(src, 1, 30).wait(TIMEOUT)),
                      lambda: _expect_mismatch(lambda: b1.irecv(dst, 0, 30).wait(TIMEOUT)))
    for m in (m0, m1):
        assert "400 bytes" in m and "800 bytes" in m, m
    assert bool((dst == 7.0).all())


def test_eager_window_bounds_unreceived_sends(pair) -> None:
    """A sender runs at most EAGER_WINDOW small sends ahead of the receiver; later ones wait for its RTR; all data
    arrives in tag order regardless, and the EAGER bookkeeping drains to zero."""
    from rdt_transports.backends.nixl import EAGER_WINDOW

    b0, b1 = pair
    n = EAGER_WINDOW + 8
    srcs = [torch.full((16,), float(i)) for i in range(n)]
    sends = [b0.isend(s, 1, 100 + i) for i, s in enumerate(srcs)]
    assert b0._eager_out[1] == EAGER_WINDOW and not any(w.is_completed() for w in sends)
    dsts = [torch.zeros(16) for _ in range(n)]

    def recv_all() -> None:
        for i, d in reversed(list(enumerate(dsts))):  # receives posted in the reverse order
            b1.irecv(d, 0, 100 + i).wait(TIMEOUT)

    run_both(lambda: [w.wait(TIMEOUT) for w in sends], recv_all)
    assert all(torch.equal(s, d) for s, d in zip(srcs, dsts))
    deadline = time.monotonic() + 5
    while (b0._eager_out[1] or b1._eager_parked[0]) and time.monotonic() < deadline:
        b0.progress()
        time.sleep(0.005)
    assert b0._eager_out[1] == 0 and not b0._sends and b1._eager_parked[0] == 0 and not b1._mailbox


def test_recv_without_sender_times_out(pair) -> None:
    _, b1 = pair
    w = b1.irecv(torch.zeros(10), 0, 99)
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as ei:
        w.wait(0.5)
    elapsed = time.monotonic() - t0
    assert 0.5 <= elapsed < 0.5 + 0.5
    assert ei.value.peer == 0 and ei.value.op == "recv" and "tag 99" in str(ei.value)


def test_forged_notification_is_ignored(pair) -> None:
    b0, b1 = pair
    dst = torch.zeros(64)
    w = b1.irecv(dst, 0, 7)
    # Rank 0's agent sends a DONE for tag 7 signed with the wrong key, then a truncated one: both dropped.
    body = _HEADER.pack(_MAGIC, _VERSION, _KIND_DONE, 0, 1, 7, 256, 8, 0, 0, 0, 0, 0, 0, 0, 0)
    forged = body + hmac.new(b"wrong key", body, hashlib.sha256).digest()
    name1 = b1._names[1]
    b0._ensure_peer(1, "send")  # load rank 1's metadata so rank 0's agent can notify it
    with b0._lock:
        b0._agent.send_notif(name1, forged)
        b0._agent.send_notif(name1, b"RDTX\x01")
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # rank 0's UCX wires up only while it progresses
        b0.progress()
        b1.progress()
    assert b1.stats["dropped_bad_mac"] == 1 and b1.stats["dropped_malformed"] == 1
    assert not w.is_completed()
    src = torch.arange(64, dtype=torch.float32)
    run_both(lambda: b0.isend(src, 1, 7).wait(TIMEOUT), lambda: w.wait(TIMEOUT))
    assert torch.equal(src, dst)


def test_abort_fails_waits_fast(pair) -> None:
    _, b1 = pair
    w = b1.irecv(torch.zeros(10), 0, 42)
    b1.abort()
    t0 = time.monotonic()
    with pytest.raises(GroupDestroyedError):
        w.wait(10.0)
    assert time.monotonic() - t0 < 5.0  # woken by the abort, not by the timeout
    with pytest.raises(GroupDestroyedError):
        b1.irecv(torch.zeros(10), 0, 43)


def test_shutdown_idempotent() -> None:
    b0, b1 = make_pair()
    w = b1.irecv(torch.zeros(10), 0, 1)  # pending at shutdown: released, its wait fails
    src, dst = torch.ones(100), torch.zeros(100)
    run_both(lambda: b0.isend(src, 1, 2).wait(TIMEOUT), lambda: b1.irecv(dst, 0, 2).wait(TIMEOUT))
    for _ in range(2):
        b1.shutdown()
        b0.shutdown()
    assert len(b1.registration_cache) == 0 and len(b0.registration_cache) == 0
    with pytest.raises(GroupDestroyedError):
        w.wait(1.0)


def test_same_node_group_runs_without_ucx_error_handling(pair) -> None:
    """Both ranks here (one Ray node, pids visible): the agent is made with ``ucx_error_handling_mode=none`` so that
    UCX may put shared memory on the endpoints, and eager and WRITE sizes still arrive intact."""
    b0, b1 = pair
    assert b0.ucx_error_mode == b1.ucx_error_mode == "none"
    assert b0.describe()["same_node"] and b0.transports() == "shm/cma"
    for n in (16, 1 << 16, 1 << 20):
        src, dst = torch.arange(n, dtype=torch.float32), torch.zeros(n)
        run_both(lambda: b0.isend(src, 1, n).wait(TIMEOUT), lambda: b1.irecv(dst, 0, n).wait(TIMEOUT))
        assert torch.equal(src, dst)


def test_error_mode_override(monkeypatch) -> None:
    """RDT_NIXL_UCX_ERROR_MODE=peer keeps UCX peer error handling (transfers still work); a bad value is refused."""
    monkeypatch.setenv("RDT_NIXL_UCX_ERROR_MODE", "peer")
    b0, b1 = make_pair()
    try:
        assert b0.ucx_error_mode == "peer" and b0.transports() == ""
        src, dst = torch.arange(1 << 18, dtype=torch.float32), torch.zeros(1 << 18)
        run_both(lambda: b0.isend(src, 1, 1).wait(TIMEOUT), lambda: b1.irecv(dst, 0, 1).wait(TIMEOUT))
        assert torch.equal(src, dst)
    finally:
        b0.shutdown()
        b1.shutdown()
    monkeypatch.setenv("RDT_NIXL_UCX_ERROR_MODE", "maybe")
    with pytest.raises(InvalidArgumentError, match="RDT_NIXL_UCX_ERROR_MODE"):
        make_pair()


def test_wait_on_a_dead_same_node_peer_fails_fast(pair) -> None:
    """Without UCX error handling nothing reports a dead peer, so a wait watches its pid: a recv from a rank whose
    process is gone fails with PeerUnavailableError naming it, long before the op's timeout."""
    import subprocess

    b0, _b1 = pair
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: its pid names no process now
    b0._peer_pids[1] = child.pid
    start = time.monotonic()
    with pytest.raises(PeerUnavailableError, match=rf"rank 1 \(pid {child.pid}, this node\) died") as ei:
        b0.irecv(torch.zeros(4), 1, 9).wait(TIMEOUT)
    assert time.monotonic() - start < TIMEOUT / 4
    assert ei.value.peer == 1 and ei.value.op == "recv"


def test_write_handles_are_reused_and_released(pair) -> None:
    """The same tensors sent again reuse one prepared WRITE handle (the data still lands each time); a handle
    goes when its local registration is dropped, and the cache never holds more than its cap."""
    from rdt_transports.backends import nixl as nixl_mod

    b0, b1 = pair
    n = 1 << 18  # above the EAGER limit: a WRITE
    src, dst = torch.zeros(n), torch.zeros(n)
    for step in range(5):
        src.fill_(float(step))
        run_both(lambda: b0.isend(src, 1, 100 + step).wait(TIMEOUT), lambda: b1.irecv(dst, 0, 100 + step).wait(TIMEOUT))
        assert float(dst[0]) == float(dst[-1]) == float(step)
    assert b0.stats["write_handles_made"] == 1 and b0.stats["write_handles_reused"] == 4
    assert len(b0._xfers) == 1 and not any(busy for _, busy in b0._xfers.values())

    other = torch.ones(n)  # another source buffer: a second handle
    run_both(lambda: b0.isend(other, 1, 200).wait(TIMEOUT), lambda: b1.irecv(dst, 0, 200).wait(TIMEOUT))
    assert torch.equal(dst, other) and len(b0._xfers) == 2
    entry = next(e for e in b0._cache._entries.values() if e.base == other.untyped_storage().data_ptr())
    b0._cache._drop(entry)  # as an eviction would: its handle is released first
    assert len(b0._xfers) == 1

    cap = nixl_mod._XFER_CACHE_ENTRIES
    m = n // 8  # 128 KiB: still a WRITE
    bufs = [torch.full((m,), float(i)) for i in range(cap + 3)]  # each its own storage, so its own handle
    for i, t in enumerate(bufs):
        run_both(lambda: b0.isend(t, 1, 300 + i).wait(TIMEOUT), lambda: b1.irecv(dst[:m], 0, 300 + i).wait(TIMEOUT))
        assert float(dst[0]) == float(dst[m - 1]) == float(i)
    assert len(b0._xfers) == cap and b0.stats["write_handles_made"] == 2 + cap + 3


def test_wait_on_a_same_node_peer_whose_pid_names_another_process_fails_fast(pair) -> None:
    """The pid watch goes by (pid, start time): once a dead peer's pid names another process (here: this one,
    with another start time than rank 1 joined with), a wait fails with PeerUnavailableError, not at its timeout."""
    b0, _b1 = pair
    assert b0._peer_pids is not None and b0._peer_starts.get(1) is not None
    b0._peer_starts[1] += 1  # rank 1 (this very pid) as if it had died and its pid gone to a later process
    start = time.monotonic()
    with pytest.raises(PeerUnavailableError, match=r"rank 1 \(pid \d+, this node\) died") as ei:
        b0.irecv(torch.zeros(4), 1, 11).wait(TIMEOUT)
    assert time.monotonic() - start < TIMEOUT / 4
    assert ei.value.peer == 1 and ei.value.op == "recv"


# ---------------------------------------------------------------------------------------------- late sends
# A receive that ends without its data (timeout, abort, destroy) cancels: whatever the sender does later, not a byte
# lands in the tensor that receive was given. Sizes: EAGER (the data inside a notification), a NIXL WRITE, and
# rdt's own process_vm_writev copy (same node, from CMA_MIN_BYTES).
SENTINEL = -7.0
LATE_SIZES = [pytest.param(1 << 10, id="eager-4KiB"), pytest.param(1 << 18, id="nixl-write-1MiB"),
              pytest.param(8 << 20, id="rdt-cma-32MiB")]
RECV_TIMEOUT = 0.3


def _warm(b0: NixlBackend, b1: NixlBackend) -> None:
    """One transfer each way, so that both UCX endpoints are wired up (as in any group that has talked)."""
    a, b = torch.ones(16), torch.zeros(16)
    run_both(lambda: b0.isend(a, 1, 900).wait(TIMEOUT), lambda: b1.irecv(b, 0, 900).wait(TIMEOUT))
    run_both(lambda: b1.isend(a, 0, 901).wait(TIMEOUT), lambda: b0.irecv(b, 1, 901).wait(TIMEOUT))


def _failed_recv(b1: NixlBackend, n: int, tag: int) -> torch.Tensor:
    """Post a recv of ``n`` float32 from rank 0 that times out (nobody sends yet); return its tensor."""
    t = torch.full((n,), SENTINEL)
    with pytest.raises(CollectiveTimeoutError):
        b1.irecv(t, 0, tag).wait(RECV_TIMEOUT)
    return t


def _outcome(fn: Callable[[], object]) -> object:
    """What ``fn`` raised, or None when it returned."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - inspected by the caller
        return e
    return None


def _drive(backends: Tuple[NixlBackend, ...], seconds: float) -> None:
    """Progress these backends for ``seconds`` (as their next operations would)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for b in backends:
            b.progress()
        time.sleep(0.002)


def _untouched(t: torch.Tensor) -> bool:
    return bool((t == SENTINEL).all())


def _assert_cancelled(outcome: object, tag: int) -> None:
    """The late send failed with a typed error saying that rank 1 cancelled that receive."""
    from rdt_transports.errors import CommunicationError

    assert isinstance(outcome, CommunicationError), f"the late send returned {outcome!r}"
    assert "cancelled" in str(outcome) and f"tag {tag}" in str(outcome) and outcome.peer == 1, outcome


@pytest.mark.parametrize("n", LATE_SIZES)
def test_a_late_send_never_writes_into_a_timed_out_recv(pair, n: int) -> None:
    """Rank 1's recv times out; rank 0 then sends: the send fails saying rank 1 cancelled, the tensor keeps its
    bytes (checked again well after), the cancel bookkeeping drains to zero, and the next pair still works."""
    b0, b1 = pair
    _warm(b0, b1)
    t = _failed_recv(b1, n, 5)
    src = torch.arange(n, dtype=torch.float32)
    sent = run_both(lambda: _outcome(lambda: b0.isend(src, 1, 5).wait(3.0)), lambda: _drive((b1,), 1.0))[0]
    assert _untouched(t), f"{int((t != SENTINEL).sum())} of {n} elements were written after the recv failed"
    _assert_cancelled(sent, 5)
    _drive((b0, b1), 0.5)
    assert _untouched(t)
    dst = torch.zeros(n)
    run_both(lambda: b0.isend(src, 1, 6).wait(TIMEOUT), lambda: b1.irecv(dst, 0, 6).wait(TIMEOUT))
    assert torch.equal(src, dst)
    assert not b1._cancelled and not b0._sends and not b1._recvs and not b0._mailbox and not b1._mailbox


@pytest.mark.parametrize("n", LATE_SIZES)
def test_a_late_send_after_the_receiver_destroyed_its_group_writes_nothing(pair, n: int) -> None:
    """Rank 1's recv times out and rank 1 shuts its side down at once; rank 0's later send must not write into the
    tensor (which the test keeps alive: after a real destroy its memory may belong to something else)."""
    b0, b1 = pair
    _warm(b0, b1)
    t = _failed_recv(b1, n, 7)
    b1.shutdown()
    src = torch.arange(n, dtype=torch.float32)
    start = time.monotonic()
    sent = _outcome(lambda: b0.isend(src, 1, 7).wait(10.0))
    assert _untouched(t), f"{int((t != SENTINEL).sum())} of {n} elements were written after the recv failed"
    _assert_cancelled(sent, 7)
    assert time.monotonic() - start < 5.0  # told at once, not at the send's timeout
    _drive((b0,), 0.3)
    assert _untouched(t)


def test_a_cancelled_recv_holds_its_tensor_until_the_sender_answers(pair) -> None:
    """While the sender has not answered the cancel, the receive's tensor and registration stay held (so nothing
    the sender might still write can land in freed memory); the sender's answer drains the table to zero, and a
    send posted later with that tag fails at once."""
    import gc
    import weakref

    b0, b1 = pair
    _warm(b0, b1)
    n = 1 << 18
    t = _failed_recv(b1, n, 11)  # rank 0 does not progress meanwhile: no answer yet
    assert len(b1._cancelled) == 1
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is not None, "the cancelled receive's tensor was released before the sender answered"
    _drive((b0, b1), 0.3)  # rank 0 reads the cancel and answers; rank 1 reads the answer
    assert not b1._cancelled
    gc.collect()
    assert ref() is None
    start = time.monotonic()
    sent = _outcome(lambda: b0.isend(torch.ones(n), 1, 11).wait(10.0))
    _assert_cancelled(sent, 11)
    assert time.monotonic() - start < 5.0  # at once, not at the send's timeout
    assert not b0._sends and not b0._mailbox and not b0._peer_cancels


def test_cancelled_receives_are_bounded(pair, monkeypatch) -> None:
    """Cancelled receives nobody answers cannot pile up: past the cap a new receive is refused with a typed error
    naming the fix, and the table drains once the sender answers."""
    from rdt_transports.backends import nixl as nixl_mod
    from rdt_transports.errors import CommunicationError

    monkeypatch.setattr(nixl_mod, "MAX_CANCELLED", 2)
    b0, b1 = pair
    _warm(b0, b1)
    n = 1 << 18
    for tag in (20, 21):
        _failed_recv(b1, n, tag)
    with pytest.raises(CommunicationError, match="cancelled receive"):
        b1.irecv(torch.zeros(n), 0, 22)
    _drive((b0, b1), 0.3)
    assert not b1._cancelled
    src, dst = torch.ones(n), torch.zeros(n)
    run_both(lambda: b0.isend(src, 1, 23).wait(TIMEOUT), lambda: b1.irecv(dst, 0, 23).wait(TIMEOUT))
    assert torch.equal(src, dst)


@pytest.mark.parametrize("end", ["abort", "shutdown"])
@pytest.mark.parametrize("n", LATE_SIZES[1:])
def test_a_late_send_never_writes_into_a_recv_ended_by_abort_or_shutdown(pair, n: int, end: str) -> None:
    """A pending receive that ends because its side was aborted (a group errored) or shut down (destroyed) cancels
    too: rank 0's later send fails saying so, and the tensor keeps its bytes."""
    b0, b1 = pair
    _warm(b0, b1)
    t = torch.full((n,), SENTINEL)
    w = b1.irecv(t, 0, 30)
    _drive((b1,), 0.05)
    getattr(b1, end)()
    with pytest.raises(GroupDestroyedError):
        w.wait(1.0)
    src = torch.arange(n, dtype=torch.float32)
    sent = _outcome(lambda: b0.isend(src, 1, 30).wait(3.0))
    _drive((b0,), 0.3)
    assert _untouched(t), f"{int((t != SENTINEL).sum())} of {n} elements were written after the recv failed"
    _assert_cancelled(sent, 30)


@pytest.mark.parametrize("cma", [True, False], ids=["rdt-cma", "nixl-write"])
def test_a_recv_that_times_out_mid_transfer_is_never_written_after_its_error(monkeypatch, cma: bool) -> None:
    """The sender starts just before, at or after the receiver's deadline, so some timeouts hit a copy or WRITE in
    flight: whatever the receive returns, no byte of its tensor changes once it has raised (the receive waits for
    the sender to stop), and one that returns has the whole message."""
    monkeypatch.setenv("RDT_NIXL_CMA", "1" if cma else "0")
    b0, b1 = make_pair()
    try:
        _warm(b0, b1)
        n = 16 << 20  # 64 MiB
        src = torch.arange(n, dtype=torch.float32)
        outcomes = []
        for i, lead in enumerate((0.03, 0.01, 0.0, -0.01, -0.03)):
            t = torch.full((n,), SENTINEL)
            tag = 40 + i
            seen: List[torch.Tensor] = []

            def receive() -> object:
                err = _outcome(lambda: b1.irecv(t, 0, tag).wait(0.2))
                seen.append(t.clone())  # what the tensor held when the receive returned or raised
                return err

            def send() -> object:
                time.sleep(0.2 - lead)
                return _outcome(lambda: b0.isend(src, 1, tag).wait(5.0))

            got, sent = run_both(receive, send)
            _drive((b0, b1), 0.3)
            assert torch.equal(t, seen[0]), f"lead {lead}: the tensor changed after the receive returned ({got!r})"
            if got is None:
                assert torch.equal(t, src) and sent is None
            else:
                assert isinstance(got, CollectiveTimeoutError), got
            outcomes.append("ok" if got is None else "timeout")
        assert not b1._cancelled and not b1._recvs and not b0._sends
    finally:
        b0.shutdown()
        b1.shutdown()


@pytest.mark.parametrize("n", LATE_SIZES[1:])
def test_a_timed_out_send_never_delivers_later(pair, n: int) -> None:
    """A send that timed out before the receiver was ready is withdrawn: when the receiver posts later, the
    sender (which changed its tensor after the error, as a caller may) writes nothing, so the receiver can never
    get those bytes as a successful message."""
    b0, b1 = pair
    _warm(b0, b1)
    src = torch.arange(n, dtype=torch.float32)
    with pytest.raises(CollectiveTimeoutError):
        b0.isend(src, 1, 50).wait(RECV_TIMEOUT)
    src.fill_(123.0)  # the caller reuses its tensor after the failed send
    t = torch.full((n,), SENTINEL)
    got = run_both(lambda: _drive((b0,), 1.0), lambda: _outcome(lambda: b1.irecv(t, 0, 50).wait(0.5)))[1]
    _drive((b0, b1), 0.3)
    assert _untouched(t), f"{int((t != SENTINEL).sum())} of {n} elements were written by a send that had failed"
    assert isinstance(got, CollectiveTimeoutError), got
    assert not b0._sends


def test_a_cancelled_recv_is_released_when_its_sender_dies_or_at_shutdown(pair) -> None:
    """The held tensor of a cancelled receive goes when its same-node sender's process is gone (its pid watched,
    as for waits) or when the backend shuts down, answer or not."""
    import gc
    import subprocess
    import weakref

    b0, b1 = pair
    _warm(b0, b1)
    refs = []
    for tag in (60, 61):
        t = _failed_recv(b1, 1 << 18, tag)  # rank 0 does not progress: no answer
        refs.append(weakref.ref(t))
        del t
    assert len(b1._cancelled) == 2
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: its pid names no process now, as if rank 0 had died
    real = b1._peer_pids[0]
    b1._peer_pids[0] = child.pid
    try:
        _drive((b1,), 0.2)
    finally:
        b1._peer_pids[0] = real
    assert not b1._cancelled
    gc.collect()
    assert all(r() is None for r in refs)
    t = _failed_recv(b1, 1 << 18, 62)
    ref = weakref.ref(t)
    del t
    b1.shutdown()
    gc.collect()
    assert not b1._cancelled and ref() is None
