"""A NIXL consumer's fresh READ destinations lie in registered landing blocks, reused once the caller drops the
tensors: real NIXL agents over DRAM in one process (the same code registers VRAM on a GPU). Fetching the same
object every step costs one registration, not one per READ; a tensor the caller keeps is never written by a later
READ; a timed-out READ keeps its block; idle blocks are bounded, and deregistered after their time."""

from __future__ import annotations

import gc
import secrets
import threading
import time
import weakref
from typing import Any, Callable, List

import pytest
import torch

from rdt._objects.flatten import flatten
from rdt._objects.table import Entry
from rdt.transports.nixl import agent as nixl_agent, export as nixl_export, read as nixl_read
from rdt.transports.nixl.landing import LandingPool

from .._bare_context import BareContext
from ..conftest import HAS_NIXL, wait_for

pytestmark = pytest.mark.skipif(not HAS_NIXL, reason="nixl not installed")

MiB = 1 << 20
CPU = torch.device("cpu")


@pytest.fixture
def agents():
    producer, consumer = BareContext(), BareContext()
    nixl_agent.agent(producer)
    nixl_agent.agent(consumer)
    yield producer, consumer
    for ctx in (producer, consumer):  # progress threads must end before the interpreter finalizes
        ctx.nixl.close()
        assert not ctx.nixl._thread.is_alive()


def _count_registrations(ctx: BareContext) -> List[int]:
    """Spy on the agent's register_memory: one entry (the descriptor count) per call."""
    calls: List[int] = []
    ag = ctx.nixl.agent
    real: Callable[..., Any] = ag.register_memory

    def spy(descs: Any, *rest: Any) -> Any:
        calls.append(len(descs))
        return real(descs, *rest)

    ag.register_memory = spy
    return calls


def _md_size(ctx: BareContext) -> int:
    """The size of the agent's full metadata, which grows with every registration it holds (NIXL's own view)."""
    with ctx.nixl.lock:
        return len(ctx.nixl.agent.get_agent_metadata())


def _export(producer: BareContext, value: Any) -> Entry:
    entry = Entry(secrets.token_bytes(16), flatten(value), "nixl")
    nixl_export.register(producer, entry)
    return entry


def _info(entry: Entry) -> Any:
    return entry.exports["nixl"][1]


def _landing(ctx: BareContext) -> LandingPool:
    return ctx.nixl.landing


@pytest.fixture
def tcp_agents(monkeypatch):
    """A producer and a consumer over UCX TCP, where a READ moves only while the producer's agent progresses."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    producer, consumer = BareContext(), BareContext()
    yield producer, consumer
    for ctx in (producer, consumer):
        if ctx.nixl is not None:
            ctx.nixl.close()


def _stall(producer: BareContext) -> Callable[[], None]:
    """Stop the producer's agent from progressing (its lock held on a thread); the function that lets it go on."""
    stall, held = threading.Event(), threading.Event()

    def hold() -> None:
        with producer.nixl.lock:
            held.set()
            stall.wait(20.0)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    held.wait(10.0)

    def release() -> None:
        stall.set()
        holder.join(10.0)

    return release


def _connected_with_an_idle_block(producer: BareContext, consumer: BareContext, fill: float) -> tuple:
    """Export 8 MiB of ``fill`` and read it once (the agents connect, a landing block is made and goes idle):
    (the exported tensor, its entry, the consumer's landing pool)."""
    state = torch.full((2 * MiB,), fill)
    entry = _export(producer, state)
    first = nixl_read.read_object(consumer, _info(entry), CPU, timeout=30.0)
    del first
    _drain(consumer)
    return state, entry, _landing(consumer)


def _drain(ctx: BareContext) -> None:
    with ctx.nixl.lock:
        ctx.nixl.landing.drain()


def test_fetching_the_same_object_every_step_registers_one_block(agents):
    producer, consumer = agents
    weights = {"w": torch.arange(MiB // 4, dtype=torch.float32), "b": torch.arange(MiB // 8, dtype=torch.float32)}
    entry = _export(producer, weights)
    calls = _count_registrations(consumer)
    for step in range(50):
        got = nixl_read.read_object(consumer, _info(entry), CPU, timeout=30.0)
        assert torch.equal(got[0].view(torch.float32), weights["w"]) and torch.equal(got[1].view(torch.float32),
                                                                                      weights["b"])
        del got
        _drain(consumer)
    assert calls == [1]  # the first READ registered its landing block; the other 49 reused it
    s = _landing(consumer).stats()
    assert s["made"] == 1 and s["hits"] == 49 and s["lent"] == 0 and s["idle"] == 1
    nixl_export.release(producer, entry)


def test_a_kept_result_is_never_written_by_a_later_read(agents):
    producer, consumer = agents
    one, two = torch.full((MiB,), 1.0), torch.full((MiB,), 2.0)
    e1, e2 = _export(producer, one), _export(producer, two)
    kept = nixl_read.read_object(consumer, _info(e1), CPU, timeout=30.0)[0].view(torch.float32)
    leaf = kept[10:20]  # a view is enough to keep the block lent
    del kept
    gc.collect()
    _drain(consumer)
    assert _landing(consumer).stats()["lent"] == 1
    for _ in range(5):  # every later READ lands elsewhere
        got = nixl_read.read_object(consumer, _info(e2), CPU, timeout=30.0)[0].view(torch.float32)
        assert torch.equal(got, two)
        del got
        _drain(consumer)
    assert torch.equal(leaf, torch.full((10,), 1.0))  # the first result's bytes are untouched
    assert _landing(consumer).stats()["made"] == 2
    del leaf
    _drain(consumer)
    s = _landing(consumer).stats()
    assert s["lent"] == 0 and s["lent_bytes"] == 0 and s["idle"] == 2  # both back in the pool
    for e in (e1, e2):
        nixl_export.release(producer, e)


def test_idle_blocks_are_bounded_and_deregistered_after_their_time(agents):
    producer, consumer = agents
    empty = _md_size(consumer)
    pool = _landing(consumer)
    entries = [_export(producer, torch.full(((i + 1) * MiB // 4,), float(i))) for i in range(pool.max_idle + 4)]
    held = [nixl_read.read_object(consumer, _info(e), CPU, timeout=30.0) for e in entries]  # all lent at once
    assert all(torch.equal(h[0].view(torch.float32), torch.full(((i + 1) * MiB // 4,), float(i)))
               for i, h in enumerate(held))
    assert pool.stats()["lent"] == len(entries) and _md_size(consumer) > empty
    del held
    gc.collect()
    _drain(consumer)
    s = pool.stats()
    assert s["lent"] == 0 and s["lent_bytes"] == 0
    assert s["idle"] == pool.max_idle and s["idle_bytes"] <= pool.max_idle_bytes  # the rest were deregistered
    pool.ttl = 0.0
    time.sleep(0.01)
    _drain(consumer)
    assert pool.stats()["idle"] == 0
    assert _md_size(consumer) == empty  # NIXL holds nothing for them
    for e in entries:
        nixl_export.release(producer, e)


def test_small_reads_and_reads_beyond_the_lent_bound_register_per_read(agents):
    producer, consumer = agents
    pool = _landing(consumer)
    small = _export(producer, torch.full((1024,), 3.0))  # 4 KiB: below MIN_BYTES
    got = nixl_read.read_object(consumer, _info(small), CPU, timeout=30.0)
    assert torch.equal(got[0].view(torch.float32), torch.full((1024,), 3.0))
    assert pool.stats()["made"] == 0
    pool.max_lent_bytes = MiB
    big = _export(producer, torch.full((MiB,), 4.0))  # 4 MiB: beyond the bound
    calls = _count_registrations(consumer)
    for _ in range(2):
        got = nixl_read.read_object(consumer, _info(big), CPU, timeout=30.0)
        assert torch.equal(got[0].view(torch.float32), torch.full((MiB,), 4.0))
    assert calls == [1, 1] and pool.stats()["made"] == 0  # registered for each READ, as before
    for e in (small, big):
        nixl_export.release(producer, e)


def test_a_timed_out_read_keeps_its_block_until_it_ends(tcp_agents):
    """Over UCX TCP a READ moves only while the producer's agent progresses: holding its lock stalls it."""
    producer, consumer = tcp_agents
    state, entry, pool = _connected_with_an_idle_block(producer, consumer, 5.0)
    assert pool.stats()["idle"] == 1
    release = _stall(producer)
    with pytest.raises(TimeoutError):
        nixl_read.read_object(consumer, _info(entry), CPU, timeout=0.5)
    s = pool.stats()
    assert s["lent"] == 1 and s["idle"] == 0  # the parked READ's block stays out of the pool
    release()
    assert wait_for(lambda: not consumer.nixl.parked, timeout=20)  # NIXL said it ended: reaped
    assert wait_for(lambda: pool.stats()["lent"] == 0 and pool.stats()["idle"] == 1, timeout=10)
    got = nixl_read.read_object(consumer, _info(entry), CPU, timeout=30.0)
    assert torch.equal(got[0].view(torch.float32), state) and pool.stats()["made"] == 1
    nixl_export.release(producer, entry)


def test_an_error_while_a_read_is_in_flight_parks_it_like_a_timeout(tcp_agents, monkeypatch):
    """Before: an error raised while a READ was still in flight (a failing state check, an interrupt during the
    wait) released its handles and let its block go back to the pool, where the next fetch could get it while the
    READ still wrote into it (releasing a handle does not stop UCX). It is now parked, as a timed-out READ is."""
    producer, consumer = tcp_agents
    state, entry, pool = _connected_with_an_idle_block(producer, consumer, 6.0)
    release = _stall(producer)
    real = consumer.nixl.agent.check_xfer_state
    calls = []

    def failing(handle: Any) -> Any:
        calls.append(handle)
        if len(calls) == 3:
            raise RuntimeError("injected: the state check failed")
        return real(handle)

    monkeypatch.setattr(consumer.nixl.agent, "check_xfer_state", failing)
    with pytest.raises(RuntimeError, match="injected"):
        nixl_read.read_object(consumer, _info(entry), CPU, timeout=30.0)
    monkeypatch.setattr(consumer.nixl.agent, "check_xfer_state", real)
    gc.collect()
    _drain(consumer)
    assert consumer.nixl.parked and pool.stats()["lent"] == 1  # the READ may still write: its block stays out
    remote = consumer.nixl._remotes[_info(entry).agent]
    assert remote.inflight == 1  # the producer's agent stays loaded until the parked READ is reaped
    release()
    assert wait_for(lambda: not consumer.nixl.parked, timeout=20)
    assert wait_for(lambda: pool.stats()["lent"] == 0 and pool.stats()["idle"] == 1, timeout=10)
    assert remote.inflight == 0
    got = nixl_read.read_object(consumer, _info(entry), CPU, timeout=30.0)
    assert torch.equal(got[0].view(torch.float32), state) and pool.stats()["made"] == 1
    nixl_export.release(producer, entry)


def test_an_into_target_of_a_read_interrupted_in_flight_stays_busy_until_it_ends(tcp_agents, monkeypatch):
    """The same with rdt.get(into=): the caller's target is marked busy (a later fetch into it waits) until the
    interrupted READ ended, and its memory lives until then even if the caller swaps the parameter's storage."""
    producer, consumer = tcp_agents
    state = torch.full((MiB,), 7.0)
    entry = _export(producer, state)
    target = torch.zeros(MiB)
    nixl_read.read_object(consumer, _info(entry), CPU, timeout=30.0, dests=[target.view(torch.uint8)])
    target.zero_()
    release = _stall(producer)
    real = consumer.nixl.agent.check_xfer_state

    def interrupted(handle: Any) -> Any:
        raise KeyboardInterrupt  # what Ctrl-C or ray.cancel delivers while the caller waits

    monkeypatch.setattr(consumer.nixl.agent, "check_xfer_state", interrupted)
    with pytest.raises(KeyboardInterrupt):
        nixl_read.read_object(consumer, _info(entry), CPU, timeout=30.0, dests=[target.view(torch.uint8)])
    monkeypatch.setattr(consumer.nixl.agent, "check_xfer_state", real)
    busy = consumer.nixl.busy
    assert len(busy) == 1 and busy.wait_free([target], 0.2)  # still held: a fetch into it would wait
    memory = weakref.ref(target.untyped_storage())
    target.data = torch.zeros(1)  # the caller swaps its parameter's storage: the READ's memory must live on
    gc.collect()
    assert memory() is not None
    release()
    assert wait_for(lambda: len(busy) == 0, timeout=20)
    gc.collect()
    assert memory() is None  # released with the reaped READ
    nixl_export.release(producer, entry)


def test_the_progress_thread_survives_an_error_and_keeps_giving_blocks_back(agents, monkeypatch):
    """Before: any error in the progress loop ended the thread for good, so parked READs were never reaped (their
    targets busy forever) and dropped results' landing blocks came back only on the next fetch."""
    producer, consumer = agents
    real = consumer.nixl.agent.get_new_notifs
    failures = []

    def flaky() -> Any:
        if len(failures) < 3:
            failures.append(1)
            raise RuntimeError("injected: progress failed")
        return real()

    monkeypatch.setattr(consumer.nixl.agent, "get_new_notifs", flaky)
    assert wait_for(lambda: len(failures) == 3, timeout=10)
    entry = _export(producer, torch.full((MiB,), 8.0))
    got = nixl_read.read_object(consumer, _info(entry), CPU, timeout=30.0)
    assert torch.equal(got[0].view(torch.float32), torch.full((MiB,), 8.0))
    del got
    gc.collect()
    pool = _landing(consumer)
    assert wait_for(lambda: pool.stats()["idle"] == 1, timeout=10)  # given back by the progress thread alone
    assert consumer.nixl._thread.is_alive()
    monkeypatch.setattr(consumer.nixl.agent, "get_new_notifs", real)
    nixl_export.release(producer, entry)


def test_out_of_memory_gives_up_the_idle_blocks_and_tries_again(agents, monkeypatch):
    """Idle blocks hold memory torch's allocator cannot free: a new block that does not fit fails the fetch only
    once they were given up (on a GPU the same path runs on VRAM, where the out-of-memory error is real)."""
    from rdt.transports.nixl import landing

    producer, consumer = agents
    pool = _landing(consumer)
    big = _export(producer, torch.full((2 * MiB,), 1.0))  # 8 MiB: its block stays idle once dropped
    got = nixl_read.read_object(consumer, _info(big), CPU, timeout=30.0)
    del got
    gc.collect()
    _drain(consumer)
    assert pool.stats()["idle"] == 1
    real = landing.fresh_bytes
    calls = []

    def scarce(ctx: Any, nbytes: int, device: torch.device) -> torch.Tensor:
        calls.append(pool.stats()["idle"])
        if len(calls) == 1:
            raise torch.OutOfMemoryError("injected: no memory for a new block")
        return real(ctx, nbytes, device)

    monkeypatch.setattr(landing, "fresh_bytes", scarce)
    small = _export(producer, torch.full((MiB // 4,), 2.0))  # 1 MiB: the idle 8 MiB block is too big for it
    got = nixl_read.read_object(consumer, _info(small), CPU, timeout=30.0)
    assert torch.equal(got[0].view(torch.float32), torch.full((MiB // 4,), 2.0))
    assert calls == [1, 0]  # failed while the idle block was held, succeeded once it was given up
    s = pool.stats()
    assert s["idle"] == 0 and s["lent"] == 1 and s["made"] == 2
    del got
    for e in (big, small):
        nixl_export.release(producer, e)


def test_an_into_target_registration_serves_only_the_storage_it_was_made_for(agents):
    """Before: the consumer's into= registrations were found by (memory type, device, address, bytes) alone, so a
    new storage at the address of one that freed its memory but lives on (``resize_(0)``, as FSDP frees
    parameters) reused the old registration, which on RDMA pins the old pages (the READ lands there, not in the
    target). Two storage objects over the same memory stand for that here: each gets its own registration, the
    stale one undone once, and the bytes land."""
    import numpy as np

    producer, consumer = agents
    entry = _export(producer, torch.full((MiB // 4,), 9.0))
    memory = np.zeros(MiB, dtype=np.uint8)
    first = torch.from_numpy(memory)
    second = torch.from_numpy(memory)  # another storage object at the same address and size
    assert first.untyped_storage() is not second.untyped_storage() and first.data_ptr() == second.data_ptr()
    table = consumer.nixl.targets
    undone: List[Any] = []
    real = consumer.nixl.agent.deregister_memory

    def counting(reg: Any) -> Any:
        undone.append(reg)
        return real(reg)

    consumer.nixl.agent.deregister_memory = counting
    nixl_read.read_object(consumer, _info(entry), CPU, timeout=30.0, dests=[first])
    assert table.made == 1
    memory[:] = 0
    nixl_read.read_object(consumer, _info(entry), CPU, timeout=30.0, dests=[second])
    assert table.made == 2 and len(undone) == 1  # a registration of its own; the first one's undone
    assert torch.equal(second.view(torch.float32), torch.full((MiB // 4,), 9.0))
    del first
    gc.collect()
    _drain(consumer)
    with consumer.nixl.lock:
        table.drain()
    assert len(undone) == 1 and len(table) == 1  # the first storage's death undoes nothing twice
    nixl_export.release(producer, entry)


class _FakeVram:
    """Stands in for a VRAM block's tensor on a machine without a GPU: only its device and size are asked."""

    def __init__(self, size: int) -> None:
        self.device = torch.device("cuda", 0)
        self.size = size

    def numel(self) -> int:
        return self.size


def _vram_block(consumer: BareContext) -> "weakref.ref[_FakeVram]":
    """Put a fake VRAM block (with a real registration of a small CPU tensor) in the consumer's idle blocks, past
    its time: the progress thread gives it up. A weak reference to its stand-in tensor (dead once let go)."""
    from rdt.transports.nixl.landing import _Block

    fake = _FakeVram(MiB)
    keep = torch.zeros(MiB, dtype=torch.uint8)
    pool = _landing(consumer)
    with consumer.nixl.lock:
        block = _Block(fake, consumer.nixl.agent.register_memory([keep]))
        block.since = time.monotonic() - 3600.0
        pool._idle.append(block)
    pool.ttl = 0.0
    ref = weakref.ref(fake)
    return ref


def _spy_syncs(monkeypatch: pytest.MonkeyPatch, hold: Any = None) -> List[tuple]:
    """Record torch.cuda.synchronize calls as (device, thread name); ``hold``: an event the first call waits on."""
    calls: List[tuple] = []

    def sync(device: Any = None) -> None:
        calls.append((device, threading.current_thread().name))
        if hold is not None and len(calls) == 1:
            hold.wait(10.0)

    monkeypatch.setattr(torch.cuda, "synchronize", sync)
    return calls


def test_a_retired_vram_block_is_freed_by_trim_without_a_later_fetch(agents, monkeypatch):
    """Failed before: the progress thread gives up an idle block past its time; a VRAM block's memory then waited
    in the pool until the next fetch of this process synced its device and let it go, so a consumer that stopped
    fetching kept it for good. Now the context's periodic trim (``NixlAgent.trim``, on the reaper's thread, no
    agent lock held) syncs the device and lets it go; the progress thread never syncs."""
    _, consumer = agents
    pool = _landing(consumer)
    syncs = _spy_syncs(monkeypatch)
    ref = _vram_block(consumer)
    assert wait_for(lambda: not pool.stats()["idle"] and len(pool._retiring) == 1, timeout=10)
    time.sleep(0.05)  # many more progress ticks: still held, nothing synced
    assert ref() is not None and syncs == []
    consumer.nixl.trim()  # what the context's reaper calls every few seconds
    gc.collect()
    assert ref() is None, "the retired block's memory is still held after a trim"
    assert syncs == [(torch.device("cuda", 0), threading.current_thread().name)]
    assert not pool._retiring
    consumer.nixl.trim()  # nothing left: no sync
    assert len(syncs) == 1


def test_a_fetch_that_retires_waits_for_a_retire_under_way(agents, monkeypatch):
    """A fetch that ran out of VRAM retires given-up blocks, then tries again: when the reaper's trim took them
    first and is still syncing, the fetch waits for it rather than retrying before their memory is free."""
    _, consumer = agents
    pool = _landing(consumer)
    hold = threading.Event()
    syncs = _spy_syncs(monkeypatch, hold)
    ref = _vram_block(consumer)
    assert wait_for(lambda: len(pool._retiring) == 1, timeout=10)
    reaper = threading.Thread(target=consumer.nixl.trim, name="reaper")
    reaper.start()
    assert wait_for(lambda: len(syncs) == 1, timeout=10)  # the reaper is syncing, the block taken off the queue
    seen: List[bool] = []
    fetch = threading.Thread(target=lambda: (pool.retire(), seen.append(ref() is None)), name="fetch")
    fetch.start()
    fetch.join(0.2)
    assert fetch.is_alive() and not seen  # waits for the reaper's retire
    hold.set()
    reaper.join(10.0)
    fetch.join(10.0)
    assert seen == [True] and syncs == [(torch.device("cuda", 0), "reaper")]
