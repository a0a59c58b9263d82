"""Sharded weight sync on real parts: trainer actors publish Shard(0) of a few parameters (plain tensors with an
explicit layout, and DTensors in a real gloo group), consumer actors pull column-parallel, row-parallel (strided),
fused-qkv and cast targets over shm direct reads, NIXL READs, gloo range streams (counted on the producers, staging
bounded, plans cached there) and a whole-object fallback; every landed byte is compared against the narrowed full
tensor. Bad input is refused before a byte moves."""

from __future__ import annotations

import time

import pytest
import ray
import torch

import rdt
from rdt._consumer.ranges import MAX_PARALLEL
from rdt._sharded.layout import Region, runs
from rdt._sharded.publish import ParamInfo, Shards

from ._sharded_actors import SHAPES, Consumer, Trainer, expected
from ._stop import freeze
from .conftest import HAS_NIXL, _free_port

TP = 2
STAGING = 2 * (4 << 20)  # gloo's staging per consumer, at most: two messages of 4 MiB


def _check(out, rank: int, version: int) -> None:
    want = expected(rank, TP, version)
    assert set(out["targets"]) == set(want)
    for name, t in out["targets"].items():
        assert torch.equal(t, want[name]), f"consumer {rank}, target {name}, version {version}"


@pytest.fixture(scope="module")
def trainers(ray_cluster):
    ts = [Trainer.remote(r, 3) for r in range(3)]
    assert all(f.startswith(__file__.rsplit("/tests/", 1)[0]) for f in ray.get([t.file.remote() for t in ts]))
    yield ts
    for t in ts:
        ray.kill(t)


def _engine_ranks():
    """One engine's TP ranks (fresh Consumer actors), killed when the fixture ends."""
    cs = [Consumer.remote(r, TP) for r in range(TP)]
    yield cs
    for c in cs:
        ray.kill(c)


@pytest.fixture(scope="module")
def consumers(ray_cluster):
    yield from _engine_ranks()


def _manifest(trainers, transport: str) -> rdt.Manifest:
    return rdt.Manifest(ray.get([t.publish.remote(transport) for t in trainers]))


def _load(consumers, manifest):
    return ray.get([c.load.remote(manifest) for c in consumers])


def test_runs_of_a_strided_box():
    """The run planner: a column slice of a row-major matrix is one run per row; whole rows merge into one."""
    src, dst, n = runs([4, 6], [1, 2], [3, 3], [0, 0], [3, 3])
    assert n == 3 and src.tolist() == [8, 14, 20] and dst.tolist() == [0, 3, 6]
    src, dst, n = runs([4, 6], [1, 0], [5, 6], [2, 0], [3, 6])
    assert n == 18 and src.tolist() == [6] and dst.tolist() == [12]


def test_shm_pulls_only_the_wanted_bytes_and_replays_the_plan(trainers, consumers):
    outs = _load(consumers, _manifest(trainers, "shm"))
    for r, out in enumerate(outs):
        _check(out, r, 0)
        rep = out["report"]
        assert rep.planned and out["plans"] == 1
        assert set(rep.paths.values()) == {"shm-direct"} and set(rep.paths) == {0, 1, 2}
        assert rep.nbytes == out["target_bytes"]  # exactly the targets' bytes, nothing more
    ray.get([t.step.remote() for t in trainers])  # in place, then published as version 1
    outs = _load(consumers, _manifest(trainers, "shm"))
    for r, out in enumerate(outs):
        _check(out, r, 1)
        assert not out["report"].planned and out["plans"] == 1 and out["replays"] == 1


def test_a_replay_reuses_its_threads_and_follows_moved_targets(trainers, consumers):
    """Failed before: every load made (and joined) its own pool of reading threads. A replay keeps the plan's
    derived arrays; a target moved to new storage gets its new address, and a new publication's own addresses."""
    _load(consumers, _manifest(trainers, "shm"))
    threads = ray.get([c.reader_threads.remote() for c in consumers])
    assert all(threads), threads  # the pool outlives the load
    ray.get([c.move_targets.remote() for c in consumers])
    manifest = _manifest(trainers, "shm")  # a new publication: new objects, their own buffers
    for r, out in enumerate(_load(consumers, manifest)):
        _check(out, r, manifest.version)
        assert not out["report"].planned
    # The same threads, still alive (the pool may have grown by a thread where this load ran more jobs at once than
    # the first: registrations and reads share it, bounded by MAX_PARALLEL).
    after = ray.get([c.reader_threads.remote() for c in consumers])
    assert all(set(t) <= set(a) and len(a) <= MAX_PARALLEL for t, a in zip(threads, after)), (threads, after)


def test_a_target_swapped_for_another_dtype_is_refused_before_a_replay_writes_past_it(trainers):
    """Before: a replay recomputed a moved target's addresses but not its size, so ``param.data = param.data.to(
    torch.bfloat16)`` (half the bytes) had the next load write past the new storage's end. Refused naming the
    target, before a byte moves; swapped back, loads go on."""
    c = Consumer.remote(0, TP)
    try:
        first = _manifest(trainers, "shm")
        _check(ray.get(c.load.remote(first)), 0, first.version)
        ray.get(c.swap_target_data.remote("qkv", "bfloat16"))
        err = ray.get(c.try_load.remote(_manifest(trainers, "shm")))
        assert err.startswith("InvalidArgumentError") and "target 'qkv' changed" in err, err
        ray.get(c.swap_target_data.remote("qkv", "float32"))
        manifest = _manifest(trainers, "shm")
        out = ray.get(c.load.remote(manifest))
        _check(out, 0, manifest.version)
        assert not out["report"].planned
    finally:
        ray.kill(c)


@pytest.mark.skipif(not HAS_NIXL, reason="NIXL is not installed")
def test_nixl_reads_the_ranges(trainers, consumers):
    outs = _load(consumers, _manifest(trainers, "nixl"))
    version = ray.get(trainers[0].publish.remote("shm")).version
    for r, out in enumerate(outs):
        _check(out, r, version)
        assert set(out["report"].paths.values()) == {"nixl"}
        assert not out["report"].planned  # same layout as the shm load: the plan is transport-independent


def test_a_transport_without_ranges_fetches_whole_shards_and_narrows(trainers, consumers):
    manifest = _manifest(trainers, "object_store")
    for r, out in enumerate(_load(consumers, manifest)):
        _check(out, r, manifest.version)
        assert all(p.startswith("whole:") for p in out["report"].paths.values()), out["report"].paths


def test_a_changed_layout_is_planned_again(trainers, consumers):
    ray.get([t.reshard.remote("o", [2, 3, 3]) for t in trainers])
    ray.get([t.reshard.remote("gate", [1, 6, 3]) for t in trainers])
    manifest = _manifest(trainers, "shm")
    for r, out in enumerate(_load(consumers, manifest)):
        _check(out, r, manifest.version)
        assert out["report"].planned and out["plans"] == 2


@pytest.fixture(scope="module")
def cost_pair(ray_cluster):
    """Two engine ranks: one told that ranges cost more than the bytes between them, one that they cost nothing
    (the choice is made per transport, so both transports' cases share them)."""
    costly, cheap = Consumer.remote(0, TP), Consumer.remote(1, TP)
    ray.get(costly.configure.remote(range_costs={t: (1e-3, 1e9) for t in ("shm", "nixl")}))
    ray.get(cheap.configure.remote(range_costs={t: (1e-9, 1e12) for t in ("shm", "nixl")}))
    yield costly, cheap
    for c in (costly, cheap):
        ray.kill(c)


@pytest.mark.parametrize("transport", ["shm"] + (["nixl"] if HAS_NIXL else []))
def test_costly_ranges_are_read_as_covering_ranges_and_narrowed_here(trainers, cost_pair, transport):
    """Before: only exact runs were read. With a transport whose ranges cost more than the bytes between them, the
    row-parallel slice (one run per row) is read as one covering range per trainer rank into a staging buffer and
    narrowed here; every byte lands as with exact runs (verify=True too), and the report says so. Cheap ranges: the
    same loader reads exact runs."""
    costly, cheap = cost_pair
    manifest = _manifest(trainers, transport)
    out, plain = ray.get([costly.load.remote(manifest, 30.0, True), cheap.load.remote(manifest, 30.0, True)])
    _check(out, 0, manifest.version)
    _check(plain, 1, manifest.version)
    rep = out["report"]
    assert rep.mode == "covering reads" and set(rep.covered) == {0, 1, 2}, (rep.mode, rep.covered)
    assert rep.read_bytes > rep.nbytes == out["target_bytes"] and rep.verified_bytes == rep.nbytes, rep
    assert plain["report"].mode == "exact runs" and not plain["report"].covered
    assert plain["report"].read_bytes == plain["report"].nbytes


# ---------------------------------------------------------------------------------- replicas share slices
@pytest.fixture(scope="module")
def replicas(ray_cluster):
    """A second data-parallel replica of the engine: the same tensor-parallel ranks, the same wants."""
    yield from _engine_ranks()


@pytest.mark.parametrize("transport", ["shm"] + (["nixl"] if HAS_NIXL else []))
def test_replicas_load_a_version_from_each_other_not_from_the_trainers(trainers, consumers, replicas, transport):
    """Before: WeightLoader had no share() and load() refused anything but a Manifest. A replica's load reads the
    sharing consumer's targets only: the trainers update in place (fencing the version) before the replicas load,
    and the replicas still land the version the first replica loaded, byte for byte."""
    manifest = _manifest(trainers, "shm")
    _load(consumers, manifest)
    offers = ray.get([c.share.remote(transport) for c in consumers])
    assert [o.version for o in offers] == [manifest.version] * TP
    ray.get([t.step.remote() for t in trainers])  # in place: the trainers' version is gone from here on
    outs = ray.get([c.load.remote(o, 30.0, True) for c, o in zip(replicas, offers)])  # verify=True
    for r, out in enumerate(outs):
        _check(out, r, manifest.version)
        rep = out["report"]
        assert rep.version == manifest.version and rep.verified_bytes == out["report"].nbytes > 0
        assert set(rep.paths.values()) == {"shm-direct" if transport == "shm" else "nixl"}, rep.paths
        assert rep.nbytes == sum(t.nbytes for t in out["targets"].values())  # each target once, whole
    again = ray.get([c.load.remote(o) for c, o in zip(replicas, offers)])
    assert all(not out["report"].planned for out in again)  # a replica's plan is replayed too


def test_a_replica_chain_and_the_sharers_next_load_fences_its_offer(trainers, consumers, replicas):
    """A replica that loaded from a replica shares in turn (a tree); the first sharer's next load fences what it
    offered: a replica that comes after gets VersionGoneError naming the replica, its targets untouched, and its
    own offer still served (a load refused before any byte moved does not fence it)."""
    manifest = _manifest(trainers, "shm")
    _load(consumers, manifest)
    offer = ray.get(consumers[0].share.remote())
    ray.get(replicas[0].load.remote(offer))
    second = ray.get(replicas[0].share.remote())
    ray.get([t.step.remote() for t in trainers])
    _load(consumers, _manifest(trainers, "shm"))  # consumer 0 loads the next version: its offer is fenced
    before = ray.get(replicas[0].targets_now.remote())
    err = ray.get(replicas[0].try_load.remote(offer))
    assert err.startswith("VersionGoneError") and "replica actor" in err and "fenced" in err, err
    after = ray.get(replicas[0].targets_now.remote())
    assert all(torch.equal(after[k], before[k]) for k in before)
    # the chained offer still holds the older version (its sharer has not loaded since)
    third = Consumer.remote(0, TP)
    try:
        _check(ray.get(third.load.remote(second)), 0, manifest.version)
    finally:
        ray.kill(third)


def test_replicas_reading_while_the_sharer_loads_the_next_version_never_land_torn_bytes(trainers, consumers,
                                                                                        replicas):
    """The sharer's next load lands in the very tensors its replicas read: its fence waits for the replicas in
    flight, and a replica after it is refused. Every replica load either lands the offered version exactly or
    raises VersionGoneError."""
    kinds = {"ok": 0, "VersionGoneError": 0}
    for step in range(6):
        manifest = _manifest(trainers, "shm")
        _load(consumers[:1], manifest)
        offer = ray.get(consumers[0].share.remote())
        reading = replicas[0].load_outcomes.remote(offer, 3)
        ray.get([t.step.remote() for t in trainers])
        time.sleep(0.002 * step)
        _load(consumers[:1], _manifest(trainers, "shm"))  # fences the offer, then overwrites the targets
        for kind, targets in ray.get(reading):
            kinds[kind] += 1
            if kind == "ok":
                _check({"targets": targets}, 0, manifest.version)
    assert sum(kinds.values()) == 18 and kinds["ok"] > 0, kinds


def test_a_replica_with_other_wants_is_refused_before_any_byte_moves(trainers, consumers, replicas):
    manifest = _manifest(trainers, "shm")
    _load(consumers, manifest)
    offer = ray.get(consumers[0].share.remote())
    before = ray.get(replicas[1].targets_now.remote())
    err = ray.get(replicas[1].try_load.remote(offer))  # tensor-parallel rank 1 wants other slices
    assert err.startswith("InvalidArgumentError") and "wants differ" in err, err
    after = ray.get(replicas[1].targets_now.remote())
    assert all(torch.equal(after[k], before[k]) for k in before)
    with pytest.raises(rdt.InvalidArgumentError, match="holds none"):
        rdt.WeightLoader().share()


def test_dtensor_ranks_publish_their_local_shards(ray_cluster, consumers):
    """A DTensor leaf through plain tensor_method failed before with RuntimeError "Attempted to access the data
    pointer on an invalid python storage"; it is now refused naming the leaf, and put_shards publishes it."""
    port = _free_port()
    ts = [Trainer.remote(r, 2, port, {"o": 1}) for r in range(2)]  # o: Shard(1), column blocks
    try:
        with pytest.raises(rdt.InvalidArgumentError, match=r"leaf \['q'\] is a DTensor.*put_shards"):
            ray.get(ts[0].dtensor_state.remote())
        manifest = _manifest(ts, "shm")
        assert [s.rank for s in manifest.shards] == [0, 1]
        boxes = {p.name: p.box for p in manifest.shards[1].params}
        assert boxes["q"] == ((6, 12), (0, SHAPES["q"][1])) and boxes["o"] == ((0, 8), (768, 1536))  # Shard(0), (1)
        assert boxes["norm"] == ((0, SHAPES["norm"][0]),)  # Replicate: whole
        for r, out in enumerate(_load(consumers, manifest)):
            _check(out, r, 0)
            assert set(out["report"].paths.values()) == {"shm-direct"}
    finally:
        for t in ts:
            ray.kill(t)


def test_column_sharded_trainers_serve_every_slice(ray_cluster, consumers):
    """Trainer ranks holding Shard(1) (column blocks, uneven: 1536 and 2048 columns over 3 ranks; DTensors'
    Shard(1) in the DTensor test below): the row-parallel o (a column slice) comes whole from the ranks that hold
    those columns, the column-parallel gate and the fused qkv (row slices) as one short run per row from every
    rank."""
    world = 3
    ts = [Trainer.remote(r, world, 0, {"o": 1, "gate": 1, "q": 1}) for r in range(world)]
    try:
        manifest = _manifest(ts, "shm")
        boxes = {p.name: p.box for p in manifest.shards[-1].params}
        assert boxes["o"][0] == (0, 8) and boxes["o"][1][1] == 1536 and boxes["gate"][0] == (0, 10), boxes
        for r, out in enumerate(_load(consumers, manifest)):
            _check(out, r, 0)
            assert out["report"].planned and set(out["report"].paths) == set(range(world))
    finally:
        for t in ts:
            ray.kill(t)


def _shards(rank: int, version: int, **boxes) -> Shards:
    params = tuple(ParamInfo(n, "float32", (8, 4), b) for n, b in boxes.items())
    return Shards(rank, version, params, None)


def test_bad_manifests_are_refused_naming_what_is_wrong():
    with pytest.raises(rdt.InvalidArgumentError, match=r"mixes versions: \{3: \[0\], 4: \[1\]\}"):
        rdt.Manifest([_shards(0, 3, w=((0, 4), (0, 4))), _shards(1, 4, w=((4, 8), (0, 4)))])
    with pytest.raises(rdt.InvalidArgumentError, match="'w'.*overlap"):
        rdt.Manifest([_shards(0, 1, w=((0, 5), (0, 4))), _shards(1, 1, w=((4, 8), (0, 4)))])
    with pytest.raises(rdt.InvalidArgumentError, match="'w'.*cover 28 of its 32"):
        rdt.Manifest([_shards(0, 1, w=((0, 4), (0, 4))), _shards(1, 1, w=((5, 8), (0, 4)))])
    rdt.Manifest([_shards(0, 1, w=((0, 8), (0, 4))), _shards(1, 1, w=((0, 8), (0, 4)))])  # replicas are fine


def test_bad_wants_are_refused_before_any_byte_moves():
    manifest = rdt.Manifest([_shards(0, 1, w=((0, 4), (0, 4))), _shards(1, 1, w=((4, 8), (0, 4)))])
    cases = [
        (torch.zeros(4, 4), Region("w", 0, 6, 4), {}, r"\[6, 10\) is outside its global shape \(8, 4\)"),
        (torch.zeros(4, 4), Region("nope"), {}, "'nope', which no rank of version 1 publishes"),
        (torch.zeros(4, 4, dtype=torch.bfloat16), Region("w", 0, 0, 4), {}, "pass cast=True"),
        (torch.zeros(3, 4), Region("w", 0, 0, 4), {}, r"is \(3, 4\), its regions make \(4, 4\)"),
    ]
    for target, region, kw, match in cases:
        loader = rdt.WeightLoader()
        loader.want(target, region, **kw)
        with pytest.raises(rdt.InvalidArgumentError, match=match):
            loader.load(manifest)  # the metadata is None here: any attempt to move a byte would fail otherwise
        assert loader.plans == 0


# ---------------------------------------------------------------------------------- over a gloo group
@pytest.fixture(scope="module")
def gloo_ranks(ray_cluster):
    ts = [Trainer.remote(r, 3) for r in range(3)]
    cs = [Consumer.remote(r, TP) for r in range(TP)]
    assert all(f.startswith(__file__.rsplit("/tests/", 1)[0]) for f in ray.get([t.file.remote() for t in ts]))
    group = rdt.create_collective_group(ts + cs, backend="gloo")
    ray.get([c.configure.remote(range_costs={"gloo": (1e-9, 1e12)}) for c in cs])  # exact runs: bytes counted
    yield ts, cs
    rdt.destroy_collective_group(group)
    for a in ts + cs:
        ray.kill(a)


def _served(actors) -> int:
    return sum(rdt.stats(a)["transfers"].get("gloo", {}).get("out_bytes", 0) for a in actors)


def _load_gloo(trainers, consumers):
    manifest = rdt.Manifest(ray.get([t.publish.remote("gloo") for t in trainers]))
    before = _served(trainers)
    outs = ray.get([c.load.remote(manifest) for c in consumers])
    return manifest, outs, _served(trainers) - before


def test_gloo_streams_only_the_planned_ranges(gloo_ranks):
    """Before: gloo served no ranges, each rank's shards were fetched whole ("whole:gloo")."""
    trainers, consumers = gloo_ranks
    manifest, outs, served = _load_gloo(trainers, consumers)
    for r, out in enumerate(outs):
        want = expected(r, TP, manifest.version)
        for name, t in out["targets"].items():
            assert torch.equal(t, want[name]), f"consumer {r}, target {name}"
        assert out["report"].paths == {0: "gloo-ranges", 1: "gloo-ranges", 2: "gloo-ranges"}
    targets = sum(out["target_bytes"] for out in outs)
    assert served <= 1.01 * targets, (served, targets)
    for t in trainers:
        st = rdt.stats(t)["gloo_ranges"]
        assert 0 < st["staging_stream_peak"] <= STAGING and st["staging_bytes"] == 0, st
        assert st["plans_received"] == TP and st["plans"] == TP, st
    for c in consumers:  # the embed slices (runs of 80 KB and more) in direct messages, the rest packed
        st = rdt.stats(c)["gloo_ranges"]
        assert 0 < st["receive_block_bytes"] <= STAGING, st
        assert 0 < st["received_direct_bytes"] < st["received_bytes"], st


def test_a_replayed_load_sends_the_plan_key_only(gloo_ranks):
    trainers, consumers = gloo_ranks
    ray.get([t.step.remote() for t in trainers])  # in place, a new version: new objects, the same layout
    manifest, outs, served = _load_gloo(trainers, consumers)
    for r, out in enumerate(outs):
        want = expected(r, TP, manifest.version)
        assert all(torch.equal(t, want[n]) for n, t in out["targets"].items()), r
        assert not out["report"].planned and set(out["report"].paths.values()) == {"gloo-ranges"}
    assert served <= 1.01 * sum(out["target_bytes"] for out in outs)
    for t in trainers:
        st = rdt.stats(t)["gloo_ranges"]
        assert st["plans_received"] == TP and st["served"] >= 2 * TP, st  # the cached plans served the new objects


def _tensor_views(on: bool) -> None:
    from rdt.transports.group import ranges

    ranges.TENSOR_VIEWS = on


def test_the_nccl_ranges_code_over_gloo(gloo_ranks):
    """The NCCL path's code (bytes reached as tensor views: staging and packing with device copies on the trainer,
    blocks, direct receives into target views and scatters with device copies on the engine rank, on the loader's
    stream) runs here over gloo on CPU tensors: every byte lands, nothing more is served, packed and direct
    messages both used."""
    trainers, consumers = gloo_ranks
    ray.get([a.__ray_call__.remote(lambda _self: _tensor_views(True)) for a in trainers + consumers])
    try:
        before = [rdt.stats(c)["gloo_ranges"] for c in consumers]
        ray.get([t.step.remote() for t in trainers])
        manifest, outs, served = _load_gloo(trainers, consumers)
    finally:
        ray.get([a.__ray_call__.remote(lambda _self: _tensor_views(False)) for a in trainers + consumers])
    for r, out in enumerate(outs):
        want = expected(r, TP, manifest.version)
        assert all(torch.equal(t, want[n]) for n, t in out["targets"].items()), r
        assert set(out["report"].paths.values()) == {"gloo-ranges"}
    assert served <= 1.01 * sum(out["target_bytes"] for out in outs)
    for c, b in zip(consumers, before):
        st = rdt.stats(c)["gloo_ranges"]
        assert st["view_fetches"] - b["view_fetches"] == 3, st  # one per trainer rank
        assert st["received_direct_bytes"] > b["received_direct_bytes"], st
    assert sum(rdt.stats(t)["gloo_ranges"]["view_streams"] for t in trainers) == 3 * TP


def test_a_timed_out_gloo_stream_never_writes_the_targets(gloo_ranks):
    """The producers' send threads are held past the load's deadline: the load fails typed, naming a rank, and the
    streams that go out late never land in the targets (they keep the last version loaded). Breaks the group."""
    trainers, consumers = gloo_ranks
    before = ray.get(consumers[0].targets_now.remote())
    ray.get([t.step.remote() for t in trainers])
    manifest = rdt.Manifest(ray.get([t.publish.remote("gloo") for t in trainers]))
    ray.get([t.hold_send_threads.remote(3.0) for t in trainers])
    start = time.monotonic()
    with pytest.raises(rdt.TransferTimeoutError, match="producer rank"):
        ray.get(consumers[0].load.remote(manifest, 1.5))
    assert time.monotonic() - start < 3.0
    time.sleep(3.0)  # the held threads are free: the streams went out (and failed) meanwhile
    after = ray.get(consumers[0].targets_now.remote())
    assert all(torch.equal(after[k], before[k]) for k in before), "a timed-out stream wrote into the targets"


def test_a_consumer_asks_the_trainers_for_their_newest_version(trainers, consumers):
    """Before: a consumer could only load the version the driver handed it (no Manifest.newest). The trainer
    ranks are asked through Ray; while they disagree the ask waits, then names each rank's newest version."""
    first = _manifest(trainers, "shm")
    got = rdt.Manifest.newest(trainers, timeout=5.0)
    assert got.version == first.version and [s.rank for s in got.shards] == [0, 1, 2]
    ray.get([t.step.remote() for t in trainers[:2]])
    ray.get([t.publish.remote("shm") for t in trainers[:2]])  # ranks 0 and 1 published the next version; 2 not yet
    start = time.monotonic()
    with pytest.raises(rdt.TransferTimeoutError, match=rf"disagree: actor 0: {first.version + 1}, actor 1: "
                                                       rf"{first.version + 1}, actor 2: {first.version}"):
        rdt.Manifest.newest(trainers, timeout=0.5)
    assert time.monotonic() - start < 5.0
    ray.get(trainers[2].step.remote())
    later = trainers[2].publish.remote("shm")  # while the consumer already asks
    out = ray.get(consumers[0].load_newest.remote(trainers))
    ray.get(later)
    _check(out, 0, first.version + 1)


def test_a_stopped_producer_fails_the_load_in_time_and_never_writes_after(trainers, consumers):
    """A trainer rank that is stopped (SIGSTOP: alive, answering nothing) fails the load within its timeout,
    naming the rank, with the targets untouched; once it runs again, loads succeed."""
    import os
    import signal

    ray.get([t.step.remote() for t in trainers])  # a version whose bytes differ from what the targets hold
    manifest = _manifest(trainers, "shm")
    before = ray.get(consumers[0].targets_now.remote())
    pid = ray.get(trainers[1].pid.remote())
    freeze(pid)
    try:
        start = time.monotonic()
        err = ray.get(consumers[0].try_load.remote(manifest, 2.0))
        took = time.monotonic() - start
    finally:
        os.kill(pid, signal.SIGCONT)
    # refused at its registration, before any byte moved (a rank stopped after it registered would fail the load
    # at the end of its read, the targets undefined: freeze() waits until every thread of it stopped)
    assert err.startswith("TransferTimeoutError") and "producer rank 1" in err and "the start of a read" in err, err
    assert took < 6.0, took
    time.sleep(0.5)
    after = ray.get(consumers[0].targets_now.remote())
    changed = {k: (before[k].flatten()[:4].tolist(), after[k].flatten()[:4].tolist()) for k in before
               if not torch.equal(after[k], before[k])}
    assert not changed, f"a failed load ({err}, {took:.1f} s) wrote into the targets: {changed}"
    _check(ray.get(consumers[0].load.remote(_manifest(trainers, "shm"))), 0, manifest.version)


def test_a_dead_producer_is_named_by_rank(trainers, consumers):
    """Last in the module: kills a trainer rank of the shared set."""
    manifest = _manifest(trainers, "shm")
    ray.kill(trainers[1])
    time.sleep(0.5)
    start = time.monotonic()
    with pytest.raises(rdt.ProducerDiedError, match="producer rank 1"):
        ray.get(consumers[0].load.remote(manifest, 10.0))
    assert time.monotonic() - start < 10.0
