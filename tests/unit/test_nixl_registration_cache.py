"""NIXL producer registrations are cached per storage, with real NIXL agents over DRAM (the same code registers
VRAM on a GPU): the same weights returned 100 times cost one registration, which lives while an object uses it or
the storage lives; once the weights die the cache drains to zero and the agent's own registrations with it."""

from __future__ import annotations

import gc
import secrets
from typing import Any, List

import pytest
import torch

from rdt.transports.nixl import (
    agent as nixl_agent,
    descriptors as nixl_descriptors,
    export as nixl_export,
    read as nixl_read,
)
from rdt._objects.flatten import flatten
from rdt._objects.table import Entry

from .._bare_context import BareContext
from ..conftest import HAS_NIXL

pytestmark = pytest.mark.skipif(not HAS_NIXL, reason="nixl not installed")


def _ctx() -> BareContext:
    """The parts of an RdtContext the NIXL object path uses: its agent slot, identity and receive pool."""
    return BareContext()


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
    nixl_agent.agent(producer)
    empty = _md_size(producer)
    entries: List[Entry] = []
    for step in range(100):  # every step returns the same tensors; the objects stay alive together
        entry = _entry(weights)
        info = nixl_export.register(producer, entry)
        entries.append(entry)
        if step % 25 == 0:  # a consumer READs through the shared registration
            got = nixl_read.read_object(consumer, info, torch.device("cpu"), timeout=30.0)
            assert [g.numel() for g in got] == [4096 * 4, 64 * 4]
            assert torch.equal(got[0].view(torch.float32), weights["w"])
    regs = producer.nixl.registrations
    assert regs.made == 2 and len(regs) == 2  # one per storage ("w" and "b"), not one per object
    one_each = _md_size(producer)
    assert one_each > empty
    for entry in entries[:-1]:
        nixl_export.release(producer, entry)
    assert len(regs) == 2 and _md_size(producer) == one_each  # the last object still uses both
    info = entries[-1].exports["nixl"][1]
    got = nixl_read.read_object(consumer, info, torch.device("cpu"), timeout=30.0)
    assert torch.equal(got[1].view(torch.float32), weights["b"])
    nixl_export.release(producer, entries[-1])
    assert len(regs) == 0 and regs.made == 2
    nixl_export.release(producer, entries[-1])  # a second release is harmless
    assert len(regs) == 0
    # No object uses them now, but the weights live on: the registrations stay for the next step's object ...
    assert regs.idle() == 2 and _md_size(producer) == one_each
    entry = _entry(weights)
    nixl_export.register(producer, entry)
    assert regs.made == 2 and len(regs) == 2 and regs.idle() == 0  # ... which registers nothing
    nixl_export.release(producer, entry)
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
    info = nixl_export.register(producer, a)
    regs = producer.nixl.registrations
    assert len(regs) == 2 and regs.users(nixl_agent.storage_key(base)) == 1  # one user per object, not per view
    got = nixl_read.read_object(consumer, info, torch.device("cpu"), timeout=30.0)
    assert sum(g.numel() for g in got) == sum(b.numel() for b in a.buffers)
    b = _entry(base)  # another object of the same storage
    nixl_export.register(producer, b)
    assert regs.made == 2 and regs.users(nixl_agent.storage_key(base)) == 2
    nixl_export.release(producer, a)
    assert len(regs) == 1 and regs.users(nixl_agent.storage_key(other)) == 0
    nixl_export.release(producer, b)
    assert len(regs) == 0
    c = _entry(base)  # no object used it meanwhile, but the storage lives: its registration is reused
    nixl_export.register(producer, c)
    assert regs.made == 2 and regs.users(nixl_agent.storage_key(base)) == 1
    nixl_export.release(producer, c)
    assert len(regs) == 0


def test_an_object_registered_twice_counts_once(agents):
    producer, _ = agents
    t = torch.zeros(128)
    entry = _entry(t)
    first = nixl_export.register(producer, entry)
    assert nixl_export.register(producer, entry) is first  # a second consumer's prepare reuses the description
    assert producer.nixl.registrations.users(nixl_agent.storage_key(t)) == 1
    nixl_export.release(producer, entry)
    assert len(producer.nixl.registrations) == 0


def _transfers(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """Spy on the READs posted: the number of remote descriptors of each."""
    posted: List[int] = []
    keep = nixl_read._transfer

    def spy(ag, info, plan, *rest):
        posted.extend(len(remote) for _, remote, _, _ in plan)
        return keep(ag, info, plan, *rest)

    monkeypatch.setattr(nixl_read, "_transfer", spy)
    return posted


def test_many_small_cpu_buffers_are_packed_and_read_with_one_descriptor(agents, monkeypatch):
    """A state dict of 300 small tensors is copied into one registered block from the agent's pool, with no
    per-storage registration; a consumer without targets READs it whole with one descriptor and gets every leaf."""
    producer, consumer = agents
    weights = {f"w{i}": torch.arange(i, i + 3 + i % 5, dtype=torch.float32) for i in range(300)}
    entry = _entry(weights)
    info = nixl_export.register(producer, entry)
    assert info.packed and len(info.descs) == 300
    assert len(producer.nixl.registrations) == 0  # the storages themselves are not registered
    posted = _transfers(monkeypatch)
    got = nixl_read.read_object(consumer, info, torch.device("cpu"), timeout=30.0)
    assert posted == [1]
    leaves = entry.flat.specs.rebuild(got)
    assert all(torch.equal(a, b) for a, b in zip(leaves, weights.values()))
    # Through the control reply (auto) as through Ray's pickle, the description stays packed.
    assert nixl_descriptors.decode_info(nixl_descriptors.encode_info(info)) == info
    import pickle

    assert pickle.loads(pickle.dumps(info)) == info
    # Packed, the buffers are described by their sizes alone (8 bytes each, where addresses, lengths and devices
    # would take 24): what Ray carries and the consumer unpickles for every fetch.
    assert len(pickle.dumps(info)) - len(info.agent_md) < 300 * 8 + 400
    # Targets: each buffer READ straight into its target, from within the packed block.
    targets = [torch.zeros_like(t).view(-1).view(torch.uint8) for t in weights.values()]
    posted.clear()
    got = nixl_read.read_object(consumer, info, torch.device("cpu"), timeout=30.0, dests=targets)
    assert posted == [300] and all(g is t for g, t in zip(got, targets))
    assert all(torch.equal(t.view(torch.float32), w) for t, w in zip(targets, weights.values()))


def test_packed_blocks_are_reused_and_the_idle_pool_stays_bounded(agents):
    """Freed objects give their block back; the next object reuses it (no new registration); idle blocks beyond
    the pool's bound are deregistered."""
    producer, consumer = agents
    weights = [torch.full((100,), float(i)) for i in range(64)]
    first = _entry(weights)
    nixl_export.register(producer, first)
    pool = producer.nixl.blocks
    block = first.exports["nixl"][2]
    nixl_export.release(producer, first)
    assert len(pool) == 1
    again = _entry(weights)
    info = nixl_export.register(producer, again)
    assert again.exports["nixl"][2] is block and len(pool) == 0  # the same registered block
    got = nixl_read.read_object(consumer, info, torch.device("cpu"), timeout=30.0)
    assert all(torch.equal(a, b) for a, b in zip(again.flat.specs.rebuild(got), weights))
    entries = [_entry([w.clone() for w in weights]) for _ in range(pool.max_idle + 4)]
    for e in entries:
        nixl_export.register(producer, e)
    for e in entries + [again]:
        nixl_export.release(producer, e)
    assert len(pool) == pool.max_idle  # the rest were deregistered


def test_large_or_few_buffers_are_not_packed(agents):
    """Few buffers, large ones, or more than PACK_MAX in all: registered in place, as before."""
    producer, _ = agents
    few = [torch.ones(10) for _ in range(nixl_export.PACK_MIN - 1)]
    large = [torch.ones(nixl_export.PACK_MEAN // 4 + 1) for _ in range(nixl_export.PACK_MIN)]
    for value in (few, large):
        entry = _entry(value)
        assert not nixl_export.register(producer, entry).packed
        nixl_export.release(producer, entry)


# What a NIXL consumer can READ (docs/security.md, "Range reads: who can read which bytes"). The bound is the
# producer's registration, not the object: these pin what the document states, so that a change to either shows.
def _descs(info: Any, address: int, nbytes: int) -> Any:
    """``info`` with one descriptor of the consumer's own making (what a modified consumer may post)."""
    return nixl_descriptors.NixlInfo(info.agent, info.agent_md, "DRAM", ((address, nbytes, 0),))


def test_a_consumer_reaches_the_whole_registered_storage_and_no_further(agents):
    """An object of a quarter of a storage: its metadata lets a consumer READ every byte of the storage (it is
    registered whole), also once the object was freed while the storage lives (its registration is kept for the
    next step's object); a descriptor past the registration, at either end, is refused, on the consumer's side
    (NIXL finds no registration covering it)."""
    producer, consumer = agents
    base = torch.arange(4096, dtype=torch.float32)
    entry = _entry({"x": base[1024:2048]})
    info = nixl_export.register(producer, entry)
    assert info.descs == ((base.data_ptr() + 4096, 4096, 0),)  # the object: bytes [4096, 8192) of 16 KiB
    whole = _descs(info, base.data_ptr(), base.numel() * 4)
    got = nixl_read.read_object(consumer, whole, torch.device("cpu"), timeout=30.0)
    assert torch.equal(got[0].view(torch.float32), base)  # bytes the object does not hold
    nixl_export.release(producer, entry)
    assert producer.nixl.registrations.idle() == 1
    got = nixl_read.read_object(consumer, whole, torch.device("cpu"), timeout=30.0)
    assert torch.equal(got[0].view(torch.float32), base)  # and after it was freed
    for address, nbytes in ((base.data_ptr(), base.numel() * 4 + 4096), (base.data_ptr() - 64, 128)):
        with pytest.raises(Exception, match="NOT_FOUND"):
            nixl_read.read_object(consumer, _descs(info, address, nbytes), torch.device("cpu"), timeout=30.0)


def test_a_packed_block_reused_for_a_later_object_is_read_with_an_earlier_objects_metadata(agents):
    """A packed object's bytes are copied into a pooled registered block; freed, the block serves the next packed
    object, so the metadata of the first reaches the second's bytes."""
    producer, consumer = agents
    first = _entry([torch.full((100,), 1.0) for _ in range(64)])
    old = nixl_export.register(producer, first)
    nixl_export.release(producer, first)
    later = [torch.full((100,), 2.0) for _ in range(64)]
    second = _entry(later)
    nixl_export.register(producer, second)
    got = nixl_read.read_object(consumer, old, torch.device("cpu"), timeout=30.0)  # the first object's metadata
    assert all(torch.equal(a, b) for a, b in zip(second.flat.specs.rebuild(got), later))
    nixl_export.release(producer, second)
