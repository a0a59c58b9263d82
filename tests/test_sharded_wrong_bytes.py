"""Sharded loads that landed wrong bytes with no error, each found by reading the code (Reliability IV); every test
failed on the loader that had its own read road. Real trainer and engine actors; every target compared byte for
byte. A read is delayed in the consumer (``delayed_reads``: the real transport moves the bytes, late) so that a
test can act while it is in flight."""

from __future__ import annotations

import pytest
import ray
import torch

import rdt

from ._sharded_actors import Consumer, Trainer, expected
from .conftest import HAS_NIXL

TP = 2


@pytest.fixture(scope="module")
def trainers(ray_cluster):
    ts = [Trainer.remote(r, 3) for r in range(3)]
    yield ts
    for t in ts:
        ray.kill(t)


@pytest.fixture(scope="module")
def _engine(ray_cluster):
    c = Consumer.remote(0, TP)
    yield c
    ray.kill(c)


@pytest.fixture
def engine(_engine):
    """Engine rank 0, with a new loader and fresh targets for each test."""
    ray.get(_engine.reset.remote(), timeout=180)  # the first call waits for the actor to start
    return _engine


def _publish(trainers, transport: str, keep: int = 0) -> rdt.Manifest:
    return rdt.Manifest(ray.get([t.publish.remote(transport, keep) for t in trainers]))


def _two_versions(trainers, transport: str):
    """Two versions readable at once (kept copies): the older, and the newer."""
    old = _publish(trainers, transport, keep=2)
    ray.get([t.step.remote() for t in trainers])
    return old, _publish(trainers, transport, keep=2)


def _same(got, version: int) -> bool:
    want = expected(0, TP, version)
    return all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("transport,exc", [("shm", "KeyboardInterrupt"), ("shm", "RuntimeError"),
                                           pytest.param("nixl", "KeyboardInterrupt", marks=pytest.mark.skipif(
                                               not HAS_NIXL, reason="nixl not installed"))])
def test_an_interrupted_load_never_writes_after_it_failed(trainers, engine, transport: str, exc: str):
    """Before: a load whose waiting thread was interrupted (Ctrl-C, or any exception raised there) returned while
    its reading threads went on landing; the next load succeeded at once and was then overwritten by the
    abandoned one (the targets held the older version). Now the interrupted load raises once its reads in flight
    ended (none is begun after the interrupt): nothing writes the targets after it raised, and the next load lands
    the newer version, then and later."""
    old, new = _two_versions(trainers, transport)
    out = ray.get(engine.interrupted_load.remote(old, new, transport, 1.2, 0.3, exc), timeout=120)
    assert out["first"] == exc, out["first"]
    assert out["first_s"] >= 1.0, "the interrupted load raised before its read in flight ended"
    assert not out["changed_after_failure"], "the targets changed after the interrupted load raised"
    assert out["second"] == "ok", out["second"]
    assert _same(out["right_after"], new.version), "the second load returned torn or older bytes"
    assert _same(out["later"], new.version), "the abandoned read of the older version wrote after the next load"


def test_a_cancelled_async_load_holds_its_targets_until_it_ends(trainers, engine):
    """``load_async`` cancelled while it runs goes on (it cannot be stopped), so the next load waits for it, then
    lands: the targets hold the newer version right after and later."""
    old, new = _two_versions(trainers, "shm")
    out = ray.get(engine.cancelled_async_load.remote(old, new, 1.5, 0.3), timeout=120)
    assert out["first"] == "cancelled while running", out["first"]
    assert out["second_s"] > 0.8, "the next load did not wait for the cancelled one"
    assert _same(out["right_after"], new.version) and _same(out["later"], new.version)


@pytest.mark.parametrize("how", ["dtype", "shape"])
def test_a_target_changed_at_the_same_byte_count_is_refused_before_a_replay(trainers, engine, how: str):
    """Before: a replay compared only the targets' byte counts (and only when a pointer or size changed), so
    ``param.data`` seen as another dtype, or the same storage viewed in another shape, took the old layout's
    bytes silently. Now refused naming the target, nothing moved."""
    m = _publish(trainers, "shm")
    ray.get(engine.load.remote(m), timeout=60)
    ray.get(engine.swap_target.remote("o", how), timeout=60)
    before = ray.get(engine.targets_now.remote(), timeout=60)
    ray.get([t.step.remote() for t in trainers])
    err = ray.get(engine.try_load.remote(_publish(trainers, "shm")), timeout=60)
    assert err.startswith("InvalidArgumentError") and "'o' changed since it was wanted" in err, err
    after = ray.get(engine.targets_now.remote(), timeout=60)
    assert all(torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8)) for k in before)


def test_a_target_wanted_after_a_load_is_not_shared_before_the_next(trainers, engine):
    """Before: ``load(m); want(b); share()`` offered version m with ``b``'s uninitialised memory in it, and a
    replica's load of it succeeded. Now share() refuses until a load landed every target."""
    ray.get(engine.load.remote(_publish(trainers, "shm")), timeout=60)
    ray.get(engine.want_more.remote("extra", "norm"), timeout=60)
    with pytest.raises(rdt.InvalidArgumentError, match="holds none"):
        ray.get(engine.share.remote(), timeout=60)
    m = _publish(trainers, "shm")
    ray.get(engine.load.remote(m), timeout=60)
    assert ray.get(engine.share.remote(), timeout=60).version == m.version


def test_share_waits_for_the_load_in_flight(trainers):
    """Before: share() in another thread of the engine during a load saw no version (or offered targets the load
    was overwriting). Now it waits for the load and offers the version it landed."""
    c = Consumer.options(max_concurrency=2).remote(0, TP)
    try:
        m = _publish(trainers, "shm")
        got = ray.get(c.share_during_load.remote(m, 1.5, 0.3), timeout=120)
        assert got.get("version") == m.version and got["load_ended"], got
    finally:
        ray.kill(c)
