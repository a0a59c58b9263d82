"""Delta pulls on real parts: three trainer ranks whose weights change about 1 % of their elements per version
publish with ``put_shards(delta=True)``; two engine ranks (fused qkv, row-parallel o, column-parallel gate, a bf16
cast target, a vocabulary slice, a replicated norm) load one version after another. A loader one version behind, or
several within the versions kept, reads only the changes its slices meet; one further behind, or whose targets
moved, loads in full. Every landed byte is compared bitwise (NaN payloads and signed zeros included) with the
version the manifest names. verify=True checks the whole target and repairs a target changed behind the loader's
back; a failed delta load holds no version, writes nothing after it failed, and the next load is full. Replicas
load a sharer's changes the same way. Bad input is refused before a byte moves."""

from __future__ import annotations

import time

import pytest
import ray
import torch

import rdt

from . import _delta_actors
from ._delta_actors import DTrainer, delta_meta_ids, expected_at, same_bytes, tamper
from ._sharded_actors import Consumer
from .conftest import HAS_NIXL

pytestmark = pytest.mark.timeout(240)
TP = 2


@pytest.fixture(scope="module")
def trainers(ray_cluster):
    # the changes' records (a few KB here) travel out of band, not inside the metadata
    ts = [DTrainer.options(runtime_env={"env_vars": {"RDT_INLINE_BYTES": "256"}}).remote(r, 3) for r in range(3)]
    yield ts
    for t in ts:
        ray.kill(t)


def _engines(n: int = TP):
    cs = [Consumer.remote(r % TP, TP) for r in range(n)]
    yield cs
    for c in cs:
        ray.kill(c)


@pytest.fixture(scope="module")
def engines(ray_cluster):
    yield from _engines()


def _publish(trainers, transport="shm", **kw) -> rdt.Manifest:
    return rdt.Manifest(ray.get([t.publish.remote(transport, **kw) for t in trainers]))


def _step(trainers, transport="shm", **kw) -> rdt.Manifest:
    return rdt.Manifest(ray.get([t.step_publish.remote(transport, **kw) for t in trainers]))


def _check(out, rank: int, version: int) -> None:
    want = expected_at(rank, TP, version)
    for name, t in out["targets"].items():
        assert same_bytes(t, want[name]), f"engine rank {rank}, target {name}, version {version}"


def _load(engines, manifest, verify=False):
    outs = ray.get([c.load.remote(manifest, 30.0, verify) for c in engines])
    for r, out in enumerate(outs):
        _check(out, r % TP, manifest.version)
    return outs


@pytest.mark.parametrize("transport", ["shm"] + (["nixl"] if HAS_NIXL else []) + ["object_store"])
def test_a_loader_one_version_behind_pulls_only_the_changes(trainers, engines, transport):
    """Before: put_shards had no delta= (TypeError), and every load moved each engine rank's whole slices."""
    first = _publish(trainers, transport)
    assert all(s.lineage is not None for s in first.shards)
    full = _load(engines, first)
    for v in range(2):
        manifest = _step(trainers, transport)
        assert all(s.deltas and s.deltas[-1].base == manifest.version - 1 for s in manifest.shards)
        for out in _load(engines, manifest):
            rep = out["report"]
            assert rep.mode == "delta" and rep.delta == {0: 1, 1: 1, 2: 1}, (rep.mode, rep.delta, rep.paths)
            assert 0.004 < rep.changed_fraction < 0.03, rep.changed_fraction
            # 1 % of the elements as (index, value) records (8 bytes for a float32 element of 4): a few % of the
            # slices' bytes, the directories' spans included
            assert rep.read_bytes < 0.08 * rep.nbytes, (rep.read_bytes, rep.nbytes)
            if transport == "object_store":  # no range reads: each rank's changes fetched whole, narrowed here
                assert all(p.startswith("whole:") for p in rep.paths.values()), rep.paths
            else:
                assert set(rep.paths.values()) == {"shm-direct" if transport == "shm" else "nixl"}, rep.paths
    assert all(not o["report"].delta for o in full)


def test_a_loader_several_versions_behind_applies_each_kept_change_else_loads_in_full(trainers, engines):
    manifest = _step(trainers, delta_versions=3)
    _load(engines, manifest)
    for _ in range(2):  # two versions the engines skip
        _step(trainers, delta_versions=3)
    manifest = _step(trainers, delta_versions=3)
    for out in _load(engines, manifest):
        assert out["report"].delta == {0: 3, 1: 3, 2: 3}, out["report"].delta
    for _ in range(3):  # one more than the trainers keep
        _step(trainers, delta_versions=3)
    manifest = _step(trainers, delta_versions=3)
    for out in _load(engines, manifest):
        assert out["report"].mode == "exact runs" and not out["report"].delta, out["report"].mode
    stats = ray.get([t.stats.remote() for t in trainers])
    sizes = ray.get([t.shard_bytes.remote() for t in trainers])
    for st, size in zip(stats, sizes):
        assert st["delta_versions"] <= 3 and 0 < st["delta_bytes"] < 0.2 * size, st
        assert st["delta_base_bytes"] == size, (st, size)


def test_bitwise_changes_land_exactly(trainers, engines):
    """Each version also turns zeros into -0.0 (and back) and changes NaN payloads: equal as floats, other bytes.
    A delta load lands them bit for bit (_check compares bytes)."""
    _load(engines, _step(trainers))
    manifest = _step(trainers)
    old, new = (_delta_actors.full_at("o", v) for v in (manifest.version - 1, manifest.version))
    same_float = (old == new) | (torch.isnan(old) & torch.isnan(new))
    assert (same_float & (old.view(torch.int32) != new.view(torch.int32))).sum() >= 4  # the bitwise changes
    for out in _load(engines, manifest):
        assert out["report"].mode == "delta"


def test_verify_repairs_a_target_changed_behind_the_loaders_back(trainers, engines):
    """The single-writer rule: a delta load trusts the targets to hold the version it landed. Without verify, a
    byte changed behind its back stays wrong; with verify=True the whole target is checked against the trainers'
    current slices, and the rank whose slice holds it is loaded in full again, reported."""
    _load(engines, _step(trainers))
    ray.get(engines[0].__ray_call__.remote(lambda self: tamper(self.targets, "o", 3)))
    manifest = _step(trainers)
    out = ray.get(engines[0].load.remote(manifest, 30.0, False))
    want = expected_at(0, TP, manifest.version)
    assert out["report"].mode == "delta" and not same_bytes(out["targets"]["o"], want["o"])
    ray.get(engines[0].__ray_call__.remote(lambda self: tamper(self.targets, "o", 3)))
    manifest = _step(trainers)
    rep = _load(engines[:1], manifest, verify=True)[0]["report"]
    assert rep.repaired and set(rep.repaired) < {0, 1, 2}, rep.repaired  # the rank holding o's first row
    assert "'o'" in next(iter(rep.repaired.values())) and rep.verified_bytes == rep.nbytes
    assert set(rep.delta) == {0, 1, 2} - set(rep.repaired)
    rep = _load(engines[:1], _step(trainers), verify=True)[0]["report"]  # the repaired rank: deltas again
    assert rep.mode == "delta" and not rep.repaired and rep.delta == {0: 1, 1: 1, 2: 1}


def test_a_failed_delta_load_holds_no_version_and_never_writes_after(trainers, engines):
    """A delta load whose version was fenced first fails with VersionGoneError, its targets untouched; an
    interrupted one writes nothing after it raised. Either way the loader holds no version: the next load is full,
    exact."""
    _load(engines, _step(trainers))
    stale = _step(trainers)
    ray.get([t.step.remote() for t in trainers])  # fences the version the manifest names
    before = ray.get(engines[0].targets_now.remote())
    err = ray.get(engines[0].try_load.remote(stale))
    assert err.startswith("VersionGoneError"), err
    after = ray.get(engines[0].targets_now.remote())
    assert all(same_bytes(after[k], before[k]) for k in before)
    manifest = _publish(trainers)
    out = _load(engines[:1], manifest)[0]
    assert not out["report"].delta and out["report"].mode == "exact runs"
    # interrupted while rank 1's changes are read (delayed 1.5 s), then the next version loaded
    _load(engines[:1], _step(trainers))
    slow = _step(trainers)
    ids = delta_meta_ids(slow)
    assert ids[1] is not None
    fast = slow
    out = ray.get(engines[0].__ray_call__.remote(_interrupt_delta, slow, fast, ids[1], 1.5, 0.3))
    assert out["first"] == "KeyboardInterrupt" and not out["changed_after_failure"], out
    assert out["second"] == "ok" and out["second_mode"] != "delta", out
    want = expected_at(0, TP, fast.version)
    assert all(same_bytes(out["later"][k], want[k]) for k in want)


def _interrupt_delta(self, slow, fast, obj_id, delay, after):
    """In an engine: load ``slow`` with the read of ``obj_id`` delayed, interrupted after ``after`` s; then
    ``fast``; the outcomes and the targets ``delay`` s later."""
    import signal
    import threading

    from ._sharded_actors import delayed_reads

    def interrupt(_sig, _frame):
        raise KeyboardInterrupt("injected into the loading thread")

    old = signal.signal(signal.SIGUSR1, interrupt)
    main = threading.main_thread().ident
    timer = threading.Timer(after, lambda: signal.pthread_kill(main, signal.SIGUSR1))
    out = {}
    with delayed_reads("shm", obj_id, delay):
        timer.start()
        try:
            self.loader.load(slow, timeout=30.0)
            out["first"] = "ok"
        except BaseException as e:  # noqa: BLE001
            out["first"] = type(e).__name__
        finally:
            timer.cancel()
            signal.signal(signal.SIGUSR1, old)
    failed = self.targets_now()
    time.sleep(delay + 0.5)
    out["changed_after_failure"] = any(not torch.equal(v.view(torch.uint8), failed[k].view(torch.uint8))
                                       for k, v in self.targets_now().items())
    rep = self.loader.load(fast, timeout=30.0)
    out["second"], out["second_mode"] = "ok", rep.mode
    out["later"] = self.targets_now()
    return out


@pytest.fixture(scope="module")
def replicas(ray_cluster):
    yield from _engines()


def test_a_failed_publication_of_changes_ends_the_stream(trainers, engines):
    """The base copy is brought along as it is compared: when the changes then fail to publish, the stream ends
    (the next publication starts a new one, without changes) and a loader loads in full, exactly. Before: the
    stream went on with the same lineage."""
    _load(engines, _step(trainers))
    before = _step(trainers)
    _load(engines, before)
    assert ray.get([t.step_publish_failing_changes.remote() for t in trainers]) == \
        ["the changes' publication failed"] * len(trainers)
    after = _step(trainers)
    for a, b in zip(before.shards, after.shards):
        assert b.lineage is not None and b.lineage != a.lineage and not b.deltas
    assert all(not out["report"].delta for out in _load(engines, after))
    again = _step(trainers)
    assert all(out["report"].delta for out in _load(engines, again))


def test_a_sharers_offer_serves_its_changes_to_replicas_one_version_behind(trainers, engines, replicas):
    _load(engines, _step(trainers))
    offers = ray.get([c.share.remote() for c in engines])
    for r, out in enumerate(ray.get([c.load.remote(o) for c, o in zip(replicas, offers)])):
        _check(out, r, offers[r].version)
        assert not out["report"].delta
    for _ in range(2):
        manifest = _step(trainers)
        _load(engines, manifest)
        offers = ray.get([c.share.remote() for c in engines])
        assert all(o.shards.deltas and o.shards.deltas[-1].base == manifest.version - 1 for o in offers)
        outs = ray.get([c.load.remote(o, 30.0, True) for c, o in zip(replicas, offers)])
        for r, out in enumerate(outs):
            _check(out, r, manifest.version)
            rep = out["report"]
            assert rep.mode == "delta" and rep.delta == {0: 1} and rep.read_bytes < 0.1 * rep.nbytes, rep
            assert rep.verified_bytes == rep.nbytes and not rep.repaired


def test_bad_input_is_refused_before_a_byte_moves(trainers):
    ray.get([t.publish.remote("shm") for t in trainers])
    err = ray.get(trainers[0].try_publish.remote("dtype"))
    assert err.startswith("InvalidArgumentError") and "'o' is float64 now, it was float32" in err, err
    err = ray.get(trainers[0].try_publish.remote("layout"))
    assert err.startswith("InvalidArgumentError") and "'gate' changed its layout" in err, err
    with pytest.raises(rdt.InvalidArgumentError, match="delta must be True or False"):
        rdt.put_shards({}, version=1, delta="yes")
    with pytest.raises(rdt.InvalidArgumentError, match="delta_versions"):
        rdt.put_shards({}, version=1, delta=True, delta_versions=0)
