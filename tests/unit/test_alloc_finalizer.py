"""Finalizers and weakref callbacks never take a lock their owner may already hold on the same thread.

A buffer's last view can die anywhere, in particular during a GC pass triggered by an allocation inside the
pool's own locked region; the finalizer then runs on that thread, under that lock. Each case runs on a worker
thread joined with a bounded timeout: a deadlock shows as a thread that never finishes.
"""

from __future__ import annotations

import gc
import secrets
import threading
from typing import Any, Callable, Dict, List

import pytest
import torch

from rdt.transports.recv_buffers import HUGE_MIN_BYTES, POOL_MIN_BYTES, BufferPool
from rdt._objects.table import ObjectTable

from ..conftest import HAS_NIXL

JOIN_S = 10.0


def _finishes(fn: Callable[[], None]) -> bool:
    """Run ``fn`` on a daemon thread; True if it returned within JOIN_S (False: it deadlocked)."""
    errors: List[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # surfaced below
            errors.append(e)

    t = threading.Thread(target=run, name="finalizer-test", daemon=True)
    t.start()
    t.join(JOIN_S)
    if errors:
        raise errors[0]
    return not t.is_alive()



def test_pool_finalizer_run_by_gc_inside_the_pool_lock_does_not_deadlock() -> None:
    pool = BufferPool(64 << 20, 30.0)
    held: List[Any] = [pool.empty(HUGE_MIN_BYTES)]
    fired: List[bool] = []

    def on_gc(phase: str, _info: Any) -> None:
        # A GC pass that starts while the pool's lock is held drops the last view of a pooled buffer, so the
        # buffer's finalizer runs right here: on the thread holding the lock.
        if phase == "start" and held and pool._lock.locked():
            held.clear()
            fired.append(True)

    def drive() -> None:
        old = gc.get_threshold()
        gc.callbacks.append(on_gc)
        gc.set_threshold(1, 1, 1)  # a collection at almost every tracked allocation, locked regions included
        try:
            for _ in range(2000):
                if fired:
                    break
                t = pool.empty(HUGE_MIN_BYTES + 4096)
                del t
        finally:
            gc.set_threshold(*old)
            gc.callbacks.remove(on_gc)

    assert _finishes(drive), "a pool finalizer run under the pool's lock deadlocked"  # (the pool stays locked)
    try:
        assert fired, "no GC pass ran inside the locked region (the test did not exercise the case)"
        # The buffer dropped under the lock still comes back to the pool (at the next call that drains returns).
        pool.trim()
        assert pool.idle_bytes() > 0
        again = pool.empty(HUGE_MIN_BYTES)
        assert again.numel() == HUGE_MIN_BYTES and pool.hits >= 1
    finally:
        pool.close()


def test_pool_returns_every_dropped_buffer_once_drained() -> None:
    pool = BufferPool(256 << 20, 30.0)
    try:
        bufs = [pool.empty(HUGE_MIN_BYTES) for _ in range(4)]
        assert pool.idle_bytes() == 0
        del bufs
        gc.collect()
        assert pool.idle_bytes() == 4 * HUGE_MIN_BYTES
        for _ in range(4):
            pool.empty(HUGE_MIN_BYTES)  # dropped at once: each reuses the same idle buffer
        assert pool.hits == 4 and pool.misses == 4
    finally:
        pool.close()



def test_pool_recycles_landings_from_one_mib_rounded_to_64_kib() -> None:
    """A 1-4 MiB landing (a many-tensor object of a few MB) is recycled, not a fresh allocation whose every page
    faults; it rounds to 64 KiB, not to a 2 MiB huge page; below POOL_MIN_BYTES torch's allocator serves."""
    pool = BufferPool(64 << 20, 30.0)
    try:
        n = POOL_MIN_BYTES + 4192 * 3
        first = pool.empty(n)
        assert first.numel() == n
        del first
        gc.collect()
        assert pool.idle_bytes() == -(-n // (64 << 10)) * (64 << 10)
        again = pool.empty(n - 100)
        assert again.numel() == n - 100 and pool.hits == 1 and pool.misses == 1
        small = pool.empty(POOL_MIN_BYTES - 1)
        assert small.numel() == POOL_MIN_BYTES - 1 and pool.misses == 1  # not the pool's
    finally:
        pool.close()


def test_table_weakref_callback_under_the_table_lock_does_not_deadlock() -> None:
    table = ObjectTable(lambda _e: None)
    leaf: List[Any] = [torch.ones(4)]
    obj_id = secrets.token_bytes(16)
    table.add_weak(obj_id, list(leaf))

    def drop_under_lock() -> None:
        with table._lock:  # e.g. a GC pass inside add_weak/get_weak that frees a remembered leaf
            leaf.clear()

    assert _finishes(drop_under_lock), "a weak-table callback run under the table's lock deadlocked"
    assert table.get_weak(obj_id) is None
    assert table.weak_count() == 0


@pytest.fixture(autouse=True)
def _gc_restored() -> Any:
    old, callbacks = gc.get_threshold(), list(gc.callbacks)
    yield
    gc.set_threshold(*old)
    gc.callbacks[:] = callbacks


class _CollectingLock:
    """A lock that runs ``hook`` right after it is acquired: a GC pass inside the owner's locked region, at will."""

    def __init__(self, inner: Any, hook: Callable[[], None]) -> None:
        self._inner, self._hook = inner, hook

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._inner.acquire(blocking, timeout)
        if got:
            self._hook()
        return got

    def release(self) -> None:
        self._inner.release()

    def locked(self) -> bool:
        return self._inner.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *_exc: Any) -> None:
        self.release()


@pytest.mark.skipif(not HAS_NIXL, reason="nixl not installed")
def test_nixl_target_finalizer_run_by_gc_inside_the_table_lock_does_not_deadlock() -> None:
    """A GC pass inside ``drain()``'s locked region (the NIXL progress thread, holding the agent's lock) frees an
    ``into=`` target whose storage finalizer then runs on that thread: it must only enqueue, and the registration
    is still deregistered at the next drain (a real NIXL agent over DRAM)."""
    from rdt.transports.nixl.agent import NixlAgent

    ag = NixlAgent("finalizer-test-" + secrets.token_hex(4))
    regs = ag.targets
    with ag.lock:
        empty_md = len(ag.agent.get_agent_metadata())
    target = torch.ones(1 << 16)
    cycle: Dict[str, Any] = {"target": target}
    cycle["self"] = cycle  # only a GC pass frees it
    with ag.lock:
        assert regs.cover([target]) == [True]
        assert len(regs) == 1 and len(ag.agent.get_agent_metadata()) > empty_md
    del target
    held: List[Any] = [cycle]
    del cycle
    worker: List[int] = []
    fired: List[bool] = []

    def gc_pass() -> None:
        # Only on the test's thread (the progress thread may drain too): the target's last view dies in this GC
        # pass, so its storage finalizer runs here, under the table's lock.
        if held and worker and threading.get_ident() == worker[0]:
            held.clear()
            gc.collect()
            fired.append(True)

    regs._mu = _CollectingLock(regs._mu, gc_pass)

    probe = torch.ones(16)

    def drive() -> None:
        worker.append(threading.get_ident())
        with ag.lock:  # as a fetch does (the progress thread drains under the same locks)
            regs.drain()
            assert regs.cover([probe]) == [True]

    deadlocked = False
    try:
        deadlocked = not _finishes(drive)
        assert not deadlocked, "a NIXL target finalizer run under the table's lock deadlocked"
        assert fired, "no GC pass ran inside the locked region (the test did not exercise the case)"
        del probe
        for _ in range(200):  # the progress thread (or the next fetch) deregisters it within a few ms
            with ag.lock:
                regs.drain()
                if len(regs) == 0:
                    break
            threading.Event().wait(0.01)
        with ag.lock:
            assert len(regs) == 0 and len(ag.agent.get_agent_metadata()) == empty_md
    finally:
        if not deadlocked:  # a deadlocked worker holds the agent's lock for good: its progress thread cannot end
            assert ag.stop()


def test_unmapper_finalizer_only_enqueues_and_its_thread_stops() -> None:
    import mmap

    from rdt.transports.shm.segments import DeferredUnmapper

    unmapper = DeferredUnmapper()
    view: List[Any] = [unmapper.adopt(mmap.mmap(-1, 1 << 20))]

    def drop_under_lock() -> None:
        with unmapper._lock:  # the finalizer runs here, under the unmapper's lock: it must not take it
            view.clear()

    assert _finishes(drop_under_lock)
    deadline = threading.Event()
    for _ in range(100):  # bounded: the background thread closes the mapping within a few ms
        if unmapper.pending() == 0:
            break
        deadline.wait(0.05)
    assert unmapper.pending() == 0
    thread = unmapper._thread
    assert thread is not None and thread.is_alive()
    assert unmapper.stop(timeout=5.0) and not thread.is_alive()
