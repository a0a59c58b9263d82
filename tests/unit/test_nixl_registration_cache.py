"""NIXL producer registrations are cached per storage, with real NIXL agents over DRAM (the same code registers
VRAM on a GPU): the same weights returned 100 times cost one registration, which lives while an object uses it or
the storage lives; once the weights die the cache drains to zero and the agent's own registrations with it."""

from __future__ import annotations

import gc
import secrets
import threading
import types
from typing import Any, List

import pytest
import torch

from rdt import _nixl_objects
from rdt._alloc import BufferPool
from rdt._flatten import flatten
from rdt._table import Entry

from ..conftest import HAS_NIXL

pytestmark = pytest.mark.skipif(not HAS_NIXL, reason="nixl not installed")


def _ctx() -> types.SimpleNamespace:
    """The parts of an RdtContext the NIXL object path uses: its agent slot, lock, identity and receive pool."""
    return types.SimpleNamespace(nixl=None, _lock=threading.Lock(), instance=secrets.token_bytes(8),
                                 buffers=BufferPool(0, 1.0))


@pytest.fixture
def agents():
    producer, consumer = _ctx(), _ctx()
    yield producer, consumer
    for ctx in (producer, consumer):  # progress threads must end before the interpreter finalizes
        if ctx.nixl is not None:
            assert ctx.nixl.stop()


def _md_size(ctx: Any) -> int:
    """The size of the agent's full metadata, which grows with every registration it holds (NIXL's own view)."""
    with ctx.nixl.lock:
        return len(ctx.nixl.agent.get_agent_metadata())


def _entry(value: Any) -> Entry:
    return Entry(secrets.token_bytes(16), flatten(value), "nixl")


def test_weights_returned_100_times_cost_one_registration(agents):
    producer, consumer = agents
    weights = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.arange(64, dtype=torch.float32)}
    _nixl_objects.agent(producer)
    empty = _md_size(producer)
    entries: List[Entry] = []
    for step in range(100):  # every step returns the same tensors; the objects stay alive together
        entry = _entry(weights)
        info = _nixl_objects.register(producer, entry)
        entries.append(entry)
        if step % 25 == 0:  # a consumer READs through the shared registration
            got = _nixl_objects.fetch(consumer, info, torch.device("cpu"), timeout=30.0)
            assert [g.numel() for g in got] == [4096 * 4, 64 * 4]
            assert torch.equal(got[0].view(torch.float32), weights["w"])
    regs = producer.nixl.registrations
    assert regs.made == 2 and len(regs) == 2  # one per storage ("w" and "b"), not one per object
    one_each = _md_size(producer)
    assert one_each > empty
    for entry in entries[:-1]:
        _nixl_objects.release(producer, entry)
    assert len(regs) == 2 and _md_size(producer) == one_each  # the last object still uses both
    info = entries[-1].exports["nixl"][1]
    got = _nixl_objects.fetch(consumer, info, torch.device("cpu"), timeout=30.0)
    assert torch.equal(got[1].view(torch.float32), weights["b"])
    _nixl_objects.release(producer, entries[-1])
    assert len(regs) == 0 and regs.made == 2
    _nixl_objects.release(producer, entries[-1])  # a second release is harmless
    assert len(regs) == 0
    # No object uses them now, but the weights live on: the registrations stay for the next step's object ...
    assert regs.idle() == 2 and _md_size(producer) == one_each
    entry = _entry(weights)
    _nixl_objects.register(producer, entry)
    assert regs.made == 2 and len(regs) == 2 and regs.idle() == 0  # ... which registers nothing
    _nixl_objects.release(producer, entry)
    # ... until the weights die: then the storages' finalizers queue them and a sweep deregisters them.
    del weights, entries, entry, info, got
    gc.collect()
    regs.sweep()
    assert regs.idle() == 0 and len(regs) == 0
    assert _md_size(producer) == empty  # NIXL holds nothing for them


def test_views_of_one_storage_share_a_registration_and_storages_are_counted_apart(agents):
    producer, consumer = agents
    base = torch.arange(1024, dtype=torch.float32)
    other = torch.ones(256)
    a = _entry({"x": base[:100], "y": base[500:], "z": other})  # x and y view one storage
    info = _nixl_objects.register(producer, a)
    regs = producer.nixl.registrations
    assert len(regs) == 2 and regs.users(_nixl_objects.storage_key(base)) == 1  # one user per object, not per view
    got = _nixl_objects.fetch(consumer, info, torch.device("cpu"), timeout=30.0)
    assert sum(g.numel() for g in got) == sum(b.numel() for b in a.buffers)
    b = _entry(base)  # another object of the same storage
    _nixl_objects.register(producer, b)
    assert regs.made == 2 and regs.users(_nixl_objects.storage_key(base)) == 2
    _nixl_objects.release(producer, a)
    assert len(regs) == 1 and regs.users(_nixl_objects.storage_key(other)) == 0
    _nixl_objects.release(producer, b)
    assert len(regs) == 0
    c = _entry(base)  # no object used it meanwhile, but the storage lives: its registration is reused
    _nixl_objects.register(producer, c)
    assert regs.made == 2 and regs.users(_nixl_objects.storage_key(base)) == 1
    _nixl_objects.release(producer, c)
    assert len(regs) == 0


def test_an_object_registered_twice_counts_once(agents):
    producer, _ = agents
    t = torch.zeros(128)
    entry = _entry(t)
    first = _nixl_objects.register(producer, entry)
    assert _nixl_objects.register(producer, entry) is first  # a second consumer's prepare reuses the description
    assert producer.nixl.registrations.users(_nixl_objects.storage_key(t)) == 1
    _nixl_objects.release(producer, entry)
    assert len(producer.nixl.registrations) == 0
