"""The rdt object layer on a real local Ray cluster: transfers, identity, nesting, lifetime, errors.

Real parts only: Ray actors, a real Gloo group, real NIXL agents (DRAM over UCX), real shared memory.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray
import torch

import rdt
from rdt_transports._proc import pid_alive
from rdt.errors import InvalidArgumentError, NoCollectiveGroupError, ProducerDiedError

from ._object_actors import AsyncNode, Node, leaf_digests, many_tensors
from .conftest import HAS_NIXL, wait_for

N = 1 << 16  # elements: 256 KiB of float32, above the inline threshold, so tensors move out of band
OOB = ("gloo", "shm", "nixl")


def _transports(*names):
    return [pytest.param(t, marks=pytest.mark.skipif(t == "nixl" and not HAS_NIXL, reason="nixl not installed"))
            for t in names]


@pytest.fixture(scope="module")
def nodes(ray_cluster):
    """p (producer), c1, c2 (consumers) in one gloo group; outsider in none; a coordinator not in the group."""
    p, c1, c2, outsider = (Node.remote() for _ in range(4))
    group = rdt.create_collective_group([p, c1, c2], backend="gloo")
    yield {"p": p, "c1": c1, "c2": c2, "outsider": outsider, "group": group}
    rdt.destroy_collective_group(group)
    for a in (p, c1, c2, outsider):
        ray.kill(a)


def _in(stats, transport):
    return stats["transfers"].get(transport, {}).get("in", 0)


def _held(actor):
    return rdt.stats(actor)["objects"]


@pytest.mark.parametrize("transport", _transports(*OOB, "auto", "object_store"))
def test_transfer_to_consumer(nodes, transport):
    p, c1 = nodes["p"], nodes["c1"]
    before = rdt.stats(c1)
    ref = getattr(p, f"make_{transport}").remote(N, 2.0)
    assert ray.get(c1.total.remote(ref), timeout=60) == 2.0 * N
    after = rdt.stats(c1)
    expect = {"auto": "shm"}.get(transport, transport)  # same node: auto picks shared memory
    assert _in(after, expect) == _in(before, expect) + 1


def test_quickstart_walkthrough(nodes):
    p, c1 = nodes["p"], nodes["c1"]
    ref = p.make_gloo.remote(N, 1.0, True)
    assert ray.get(c1.total.remote(ref)) == N  # out of band to c1
    assert ray.get(p.same_object.remote(ref)) is True  # back to the producer: the very same tensor
    value = ray.get(ref)  # the driver is outside the group: object-store fallback
    assert float(value["w"].sum()) == N and value["step"] == 7
    s = rdt.stats(p)
    assert s["objects"] >= 1 and s["bytes"] >= 4 * N and s["transfers"]["gloo"]["out"] >= 1


@pytest.mark.parametrize("transport", _transports(*OOB))
def test_nested_values_views_and_kinds(nodes, transport):
    out = ray.get(nodes["c1"].check_nested.remote(getattr(nodes["p"], f"nested_{transport}").remote()))
    assert out["views_share"] and out["same_storage"]
    assert out["batch"] == ("Batch", float(1 << 14), True, "hello")
    assert out["pair"] == ("Pair", 2.0 * (1 << 14), 5)
    assert out["map"] == ("FrozenMap", 3.0 * (1 << 14))
    assert out["np"] == ("ndarray", float(np.arange(1 << 14).sum()))
    assert out["param"] == ("Parameter", True, float(1 << 14))
    assert out["empty"] == (0, 3)
    assert out["plain"] == ("text", 1, None)


def test_zero_tensors_and_num_returns(nodes):
    p, c1 = nodes["p"], nodes["c1"]
    assert ray.get(p.nothing.remote()) == {"no": "tensors", "n": 3}
    r1, r2 = p.two.remote()
    assert ray.get(c1.total.remote({"w": torch.zeros(1)})) == 0.0  # plain values still pass untouched
    assert float(ray.get(r1).sum()) == N and float(ray.get(r2).sum()) == 2.0 * N


def test_ref_in_kwargs_nested_and_twice(nodes):
    p, c1 = nodes["p"], nodes["c1"]
    ref = p.make_gloo.remote(N, 3.0)
    assert ray.get(c1.total_kw.remote(value=ref)) == 3.0 * N
    assert ray.get(c1.total_nested_arg.remote([ref, ref])) == 6.0 * N
    before = _in(rdt.stats(c1), "gloo")
    assert ray.get(c1.identity_twice.remote(ref, ref)) is True  # same ref twice in one call: one transfer
    assert _in(rdt.stats(c1), "gloo") == before + 1


def test_many_consumers_and_borrower_forwarding(nodes):
    p, c1, c2, outsider = nodes["p"], nodes["c1"], nodes["c2"], nodes["outsider"]
    ref = p.make_gloo.remote(N, 5.0)
    assert ray.get([c1.total.remote(ref), c2.total.remote(ref)]) == [5.0 * N, 5.0 * N]
    # A process that did not create the group (and is not in it) passes the ref on.
    assert ray.get(outsider.forward.remote(c2, [ref])) == 5.0 * N


@pytest.mark.parametrize("transport", _transports(*OOB))
def test_consumer_mutation_is_private(nodes, transport):
    p, c1, c2 = nodes["p"], nodes["c1"], nodes["c2"]
    ref = getattr(p, f"make_{transport}").remote(N, 1.0, True)
    assert ray.get(c1.mutate_and_sum.remote(ref)) == 101.0 * N
    assert ray.get(c2.total.remote(ref)) == 1.0 * N  # another consumer is unaffected
    assert ray.get(c1.total.remote(ref)) == 1.0 * N  # a later task of the same consumer gets a fresh copy
    assert ray.get(p.same_object.remote(ref)) is True
    assert float(ray.get(ref)["w"].sum()) == 1.0 * N  # the producer's tensor is unchanged


def test_snapshot_isolates_producer_mutation(nodes):
    p, c1 = nodes["p"], nodes["c1"]
    ref = p.snap.remote(N)
    ray.wait([ref])
    ray.get(p.mutate_kept.remote(42.0))
    assert ray.get(c1.total.remote({"w": ray.get(ref)})) == 1.0 * N


@pytest.mark.parametrize("transport", _transports(*OOB))
def test_transfer_while_producer_is_busy(nodes, transport):
    p, c1 = nodes["p"], nodes["c1"]
    ref = getattr(p, f"make_{transport}").remote(N, 6.0)
    ray.wait([ref], timeout=30)
    busy = p.busy.remote(4.0)
    time.sleep(0.2)
    start = time.monotonic()
    assert ray.get(c1.total.remote(ref), timeout=30) == 6.0 * N
    assert time.monotonic() - start < 3.0, "the transfer waited for the producer's main thread"
    assert ray.get(busy) == "done"


def test_large_gloo_object_to_two_consumers(nodes):
    """From 32 MiB a Gloo fetch posts its receives before the producer sends (a one-byte go message): the
    bytes arrive intact, twice, and the producer's table drains afterwards."""
    p, c1, c2 = nodes["p"], nodes["c1"], nodes["c2"]
    numel = 10 << 20  # 40 MiB of float32
    held = _held(p)
    ref = p.make_gloo.remote(numel, 1.5)
    assert ray.get([c1.total.remote(ref), c2.total.remote(ref)], timeout=120) == [1.5 * numel] * 2
    del ref
    assert wait_for(lambda: _held(p) == held, timeout=30)


def _out(stats, transport):
    return stats["transfers"].get(transport, {}).get("out", 0)


@pytest.mark.parametrize("transport", ["shm", "auto"])
def test_same_node_reads_the_producer_memory_directly(nodes, transport):
    """Where the kernel allows it, a same-node consumer reads the producer's tensors itself (process_vm_readv):
    no segment is written and the producer serves nothing; the consumer's copy is private."""
    p, c1 = nodes["p"], nodes["c1"]
    p0, c0 = rdt.stats(p), rdt.stats(c1)
    ref = getattr(p, f"make_{transport}").remote(N, 3.0)
    assert ray.get(c1.mutate_and_sum.remote(ref)) == 103.0 * N  # the consumer changes its own copy
    assert ray.get(c1.total.remote(ref)) == 3.0 * N  # a second fetch reads the producer's unchanged tensor
    assert rdt.stats(p)["shm_segments"] == 0  # no segment written
    assert _in(rdt.stats(c1), "shm") == _in(c0, "shm") + 2
    assert _out(rdt.stats(p), "shm") == _out(p0, "shm")  # the producer was not asked


@pytest.mark.parametrize("side", ["producer", "consumer"])
def test_shm_through_segments_when_direct_reads_are_off(nodes, side):
    """With direct reads off (rdt.configure(shm_cma=False), or refused by the kernel), shm objects still move:
    the producer writes a segment at return (producer off) or when a consumer asks (consumer off)."""
    p, c1 = nodes["p"], nodes["c1"]
    target = p if side == "producer" else c1
    ray.get(target.configure.remote(shm_cma=False))
    try:
        p0 = rdt.stats(p)
        ref = p.make_shm.remote(N, 4.0)
        ray.wait([ref])
        assert rdt.stats(p)["shm_segments"] == (1 if side == "producer" else 0)  # written at return, or not yet
        assert ray.get(c1.mutate_and_sum.remote(ref)) == 104.0 * N  # copy-on-write: the segment is unchanged
        assert ray.get(c1.total.remote(ref)) == 4.0 * N
        assert rdt.stats(p)["shm_segments"] == 1
        asked = 2 if side == "consumer" else 0  # each fetch asks the producer, which writes the segment once
        assert _out(rdt.stats(p), "shm") == _out(p0, "shm") + asked
    finally:
        ray.get(target.configure.remote(shm_cma=True))
    del ref
    assert wait_for(lambda: rdt.stats(p)["shm_segments"] == 0, timeout=30)


def test_rdt_put_inside_actor(nodes):
    p, c1 = nodes["p"], nodes["c1"]
    for transport in ("gloo", "shm"):
        ref = ray.get(p.put.remote(transport, N))  # an ObjectRef made inside p; its tensors stay in p
        assert ray.get(c1.total.remote(ref)) == 9.0 * N
        assert ray.get(p.same_object.remote(ref)) is True
    with pytest.raises(InvalidArgumentError, match="inside an actor"):
        rdt.put({"t": torch.ones(3)})


def test_async_actor_producer_and_consumer(nodes):
    a = AsyncNode.remote()
    c1 = nodes["c1"]
    try:
        assert ray.get(c1.total.remote(a.make_shm.remote(N))) == 5.0 * N
        assert ray.get(a.total.remote(nodes["p"].make_shm.remote(N, 2.0))) == 2.0 * N
        assert float(ray.get(a.make.remote(N))["w"].sum()) == 4.0 * N  # gloo object, driver fallback
    finally:
        ray.kill(a)


def test_producer_exception_reaches_consumer_and_driver(nodes):
    p, c1 = nodes["p"], nodes["c1"]
    bad = p.fails.remote()
    with pytest.raises(KeyError, match="producer bug"):
        ray.get(c1.total.remote(bad))
    with pytest.raises(KeyError, match="producer bug"):
        ray.get(bad)
    assert ray.get(c1.total.remote(p.make_gloo.remote(N, 1.0))) == N  # the next transfer works


def test_invalid_transport_fails_at_decoration():
    with pytest.raises(InvalidArgumentError, match="unknown tensor_transport 'carrier-pigeon'"):
        rdt.tensor_method(tensor_transport="carrier-pigeon")
    with pytest.raises(InvalidArgumentError, match="needs arguments"):
        rdt.tensor_method(lambda self: None)


def test_collective_transport_without_common_group(nodes):
    p, outsider = nodes["p"], nodes["outsider"]
    ref = p.make_gloo.remote(N, 1.0)
    with pytest.raises(NoCollectiveGroupError, match="rdt.create_collective_group"):
        ray.get(outsider.total.remote(ref))
    assert ray.get(outsider.total.remote(p.make_shm.remote(N, 1.0))) == N  # the outsider still works


@pytest.mark.parametrize("transport", _transports(*OOB))
def test_killed_producer_gives_typed_error(ray_cluster, nodes, transport):
    victim = Node.remote()
    c1 = nodes["c1"]
    group = rdt.create_collective_group([victim, c1], backend="gloo") if transport == "gloo" else None
    ray.get(c1.configure.remote(transfer_timeout=10.0))
    try:
        ref = getattr(victim, f"make_{transport}").remote(N, 1.0)
        ray.wait([ref], timeout=30)
        pid = ray.get(victim.pid.remote())
        ray.kill(victim)
        assert wait_for(lambda: _dead(victim), timeout=30)
        # Ray may call the actor dead a moment before its process is gone; until then it can still serve.
        assert wait_for(lambda: not pid_alive(pid), timeout=30)
        start = time.monotonic()
        # Our ProducerDiedError, or Ray's own ActorDiedError when Ray notices first that the owner of the object's
        # lifetime token is gone; both are typed and name the producer actor.
        with pytest.raises((ProducerDiedError, ray.exceptions.ActorDiedError)) as info:
            ray.get(c1.total.remote(ref), timeout=60)
        assert time.monotonic() - start < 15
        assert victim._actor_id.hex()[:12] in str(info.value)
        assert ray.get(c1.total.remote(nodes["p"].make_shm.remote(N, 1.0))) == N  # consumer alive and well
    finally:
        ray.get(c1.configure.remote(transfer_timeout=60.0))
        if group is not None:
            rdt.destroy_collective_group(group)


def _dead(actor) -> bool:
    """True once Ray reports the actor dead (a slow answer on a busy machine is not death)."""
    try:
        ray.get(actor.pid.remote(), timeout=2)
        return False
    except ray.exceptions.RayActorError:
        return True
    except ray.exceptions.GetTimeoutError:
        return False


@pytest.mark.parametrize("transport", _transports(*OOB))
def test_many_leaves_of_every_layout_arrive_bit_exact(nodes, transport):
    """An object of 300 leaves (dtypes, ranks, views, shared storages, numpy, Parameters, 0-d and empty) travels
    through the compact metadata tables and the one-block landing, and every leaf arrives bit-exact."""
    p, c1 = nodes["p"], nodes["c1"]
    before = _in(rdt.stats(c1), transport)
    got = ray.get(c1.digests.remote(getattr(p, f"many_{transport}").remote(300)), timeout=60)
    assert got[:-1] == leaf_digests(many_tensors(300))
    assert got[-1] == ("tied is tied", True)
    assert _in(rdt.stats(c1), transport) == before + 1
