"""Consistent versions, verification and bad input of sharded weight sync, on real parts: two trainer ranks that
update their shards in place (row by row) while two engine ranks pull them over shm direct reads and NIXL READs;
every landed byte is compared against the version the manifest names. The actors run with ``UCX_TLS=tcp`` so that
a NIXL READ moves only while the trainer's agent progresses (a stalled agent holds a read in flight, as in
tests/test_sharded_parked.py)."""

from __future__ import annotations

import time

import pytest
import ray
import torch

import rdt
from rdt._sharded.publish import ParamInfo, Shards

from ._version_actors import VEngine, VTrainer
from .conftest import HAS_NIXL

pytestmark = pytest.mark.timeout(180)
TCP_ONLY = {"env_vars": {"UCX_TLS": "tcp"}}


@pytest.fixture(scope="module")
def trainers(ray_cluster):
    ts = [VTrainer.options(runtime_env=TCP_ONLY).remote(r, 2) for r in range(2)]
    assert all(f.startswith(__file__.rsplit("/tests/", 1)[0]) for f in ray.get([t.file.remote() for t in ts]))
    yield ts
    for t in ts:
        ray.kill(t)


@pytest.fixture(scope="module")
def engines(ray_cluster):
    es = [VEngine.options(runtime_env=TCP_ONLY).remote(r) for r in range(2)]
    yield es
    for e in es:
        ray.kill(e)


def _publish(trainers, transport: str = "shm", keep: int = 0) -> rdt.Manifest:
    return rdt.Manifest(ray.get([t.publish.remote(transport, keep) for t in trainers]))


def _step(trainers, fence: bool = True, compute: float = 0.0):
    return ray.get([t.update.remote(fence, compute) for t in trainers])


def test_in_place_updates_racing_pulls_never_hand_out_torn_bytes(trainers, engines):
    """Failed before: Shards had no fence (AttributeError); unfenced in-place updates were read as they happened."""
    counts = {"ok": 0, "VersionGoneError": 0}
    for step in range(20):
        manifest = _publish(trainers)
        loads = [e.load_many.remote(manifest, 3) for e in engines]
        fences = _step(trainers, compute=0.002 * step)  # the fence meets the loads at every point of their run
        assert all(f["kind"] == "ok" for f in fences), fences
        for outcomes in ray.get(loads):
            for kind, exact in outcomes:
                assert kind in counts, kind
                counts[kind] += 1
                assert kind != "ok" or exact, f"a load of version {manifest.version} landed other bytes"
    assert counts["ok"] > 0, counts  # reads did run against the versions being updated
    assert counts["ok"] + counts["VersionGoneError"] == 20 * 3 * len(engines)


def test_a_reader_after_the_fence_gets_version_gone_before_any_byte_moves(trainers, engines):
    """Failed before: no fence; a load after the update read the new weights under the old version's name."""
    manifest = _publish(trainers)
    assert ray.get(engines[0].load.remote(manifest))["exact"]
    ray.get([t.fence.remote(5.0) for t in trainers])
    out = ray.get(engines[1].load.remote(manifest))
    assert out["kind"] == "VersionGoneError", out
    assert out["version"] == manifest.version and out["rank"] in (0, 1)
    assert f"version {manifest.version} of producer rank {out['rank']} is gone: fenced" in out["msg"]
    assert "Fix:" in out["msg"] and out["untouched"]
    _step(trainers, fence=False)  # already fenced


@pytest.mark.skipif(not HAS_NIXL, reason="NIXL is not installed")
def test_a_fence_that_times_out_names_the_readers_in_flight_and_they_fail(trainers, engines):
    """Failed before: no fence. A NIXL READ held in flight (the trainer's agent stalled) holds the fence; the
    fence gives up after its timeout naming the engine, and that read then fails rather than land the update."""
    manifest = _publish(trainers, "nixl")
    assert ray.get(engines[0].load.remote(manifest))["exact"]  # agents connected, memory registered
    ray.get(trainers[1].stall.remote(4.0))
    load = engines[0].load.remote(manifest, 20.0)
    time.sleep(1.0)  # the engine has registered its reads and waits on rank 1's READ
    fence = ray.get(trainers[1].fence.remote(0.5))
    assert fence["kind"] == "FenceTimeoutError", fence
    engine_id = engines[0]._actor_id.hex()[:12]
    assert fence["readers"] and engine_id in fence["readers"][0], (fence, engine_id)
    assert "version {} of producer rank 1".format(manifest.version) in fence["msg"] and 0.4 < fence["seconds"] < 3
    out = ray.get(load, timeout=60)
    assert out["kind"] == "VersionGoneError" and out["rank"] == 1, out
    assert "torn" in out["msg"]
    ray.get(trainers[0].fence.remote(5.0))
    _step(trainers, fence=False)


def test_kept_versions_stay_readable_while_the_weights_change(trainers, engines):
    """Failed before: put_shards had no keep_versions (TypeError)."""
    old = _publish(trainers, keep=2)
    fences = _step(trainers)  # a kept version is never fenced: the update goes on at once
    assert all(f["kind"] == "ok" and f["seconds"] < 0.5 for f in fences), fences
    mid = _publish(trainers, keep=2)
    sizes = [s.kept_bytes for s in mid.shards]
    assert all(n > 0 for n in sizes) and [s.kept_bytes for s in old.shards] == sizes
    stats = ray.get([t.stats.remote() for t in trainers])
    assert [s["kept_bytes"] for s in stats] == [2 * n for n in sizes], stats  # N x the shard, reported
    _step(trainers)
    # the trainers' weights are now at mid.version + 1: both kept versions still read their own bytes
    for m in (old, mid):
        out = ray.get(engines[0].load.remote(m))
        assert out["kind"] == "ok" and out["exact"], (m.version, out)
    new = _publish(trainers, keep=2)  # the oldest kept copy is dropped
    out = ray.get(engines[1].load.remote(old))
    assert out["kind"] == "VersionGoneError" and "no longer kept" in out["msg"] and out["untouched"], out
    assert ray.get(engines[1].load.remote(mid))["exact"]
    assert [s["kept_bytes"] for s in ray.get([t.stats.remote() for t in trainers])] == [2 * n for n in sizes]
    assert ray.get(engines[1].load.remote(new))["exact"]
    _step(trainers)


def test_verify_catches_a_byte_changed_in_the_producer(trainers, engines):
    """Failed before: load had no verify= (TypeError). One byte of rank 0's "o" flipped in place after the
    checksums were taken: the engine whose slice holds it gets ChecksumMismatchError naming "o" and rank 0."""
    manifest = _publish(trainers)
    out = ray.get(engines[0].load.remote(manifest, 30.0, True))
    assert out["kind"] == "ok" and out["exact"], out
    rep = out["report"]
    assert rep.verified_bytes == rep.nbytes > 0 and rep.verify_seconds > 0
    ray.get(trainers[0].corrupt.remote("o"))
    try:
        out = ray.get(engines[0].load.remote(manifest, 30.0, True))
        assert out["kind"] == "ChecksumMismatchError", out
        assert out["param"] == "o" and out["rank"] == 0 and "'o'" in out["msg"] and "rank 0" in out["msg"]
        other = ray.get(engines[0].load.remote(manifest, 30.0, False))  # without verify the wrong byte lands
        assert other["kind"] == "ok" and not other["exact"]
    finally:
        ray.get(trainers[0].corrupt.remote("o"))  # flipped back
    _step(trainers)


def _shards(rank: int, version: int, **boxes) -> Shards:
    return Shards(rank, version, tuple(ParamInfo(n, "float32", (8, 4), b) for n, b in boxes.items()), None)


def test_more_bad_input_is_refused_before_any_byte_moves():
    """Failed before: two wants into one tensor's bytes were accepted (the reads raced into them); a fractional
    narrow reached the planner (TypeError from numpy); keep_versions and verify were not checked."""
    manifest = rdt.Manifest([_shards(0, 1, w=((0, 4), (0, 4))), _shards(1, 1, w=((4, 8), (0, 4)))])
    t = torch.zeros(8, 4)
    loader = rdt.WeightLoader()
    loader.want(t[:4], rdt.Region("w", 0, 0, 4))
    with pytest.raises(rdt.InvalidArgumentError, match="overlap"):
        loader.want(t[2:6], rdt.Region("w", 0, 2, 4))
    loader = rdt.WeightLoader()
    loader.want(torch.zeros(2, 4), rdt.Region("w", 0, 1.5, 2))
    with pytest.raises(rdt.InvalidArgumentError, match="start 1.5"):
        loader.load(manifest)
    with pytest.raises(rdt.InvalidArgumentError, match="verify"):
        loader.load(manifest, verify="yes")
    with pytest.raises(rdt.InvalidArgumentError, match="keep_versions"):
        rdt.put_shards({}, version=1, keep_versions=-1)


def test_a_producer_killed_mid_pull_is_named_within_the_timeout(trainers, engines):
    """Last in the module: kills trainer rank 1 while engine 0 loads again and again (begin, read, end); the load
    it cuts fails with ProducerDiedError naming rank 1, well within its timeout."""
    manifest = _publish(trainers)
    assert ray.get(engines[0].load.remote(manifest))["exact"]
    run = engines[0].load_until_error.remote(manifest, 10.0, 30.0)
    time.sleep(1.0)
    ray.kill(trainers[1])
    out = ray.get(run, timeout=60)
    assert out["kind"] == "ProducerDiedError" and out["rank"] == 1, out
    assert "producer rank 1" in out["msg"] and out["loads"] > 0 and out["seconds"] < 10.0, out
