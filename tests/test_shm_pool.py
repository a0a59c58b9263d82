"""The producer's pool of freed shared-memory segments, consumers' locks on their mappings, and the large-buffer
helpers (huge-page receive buffers, parallel copies): reuse happens, and never under a live consumer."""

from __future__ import annotations

import fcntl
import os
import time
from typing import Any, Dict

import psutil
import pytest
import ray
import torch

import rdt
from rdt.transports.shm import segments as _shm
from rdt.transports.recv_buffers import BufferPool, ParallelCopier
from rdt.transports.shm.segment_pool import SegmentPool

from .conftest import wait_for

MIB = 1 << 20


# ---------------------------------------------------------------------------------------------- in one process
def _seg_files() -> set:
    return set(_shm.segments_of(os.getpid()))


def test_reuse_overwrites_in_place_and_stale_ids_are_refused() -> None:
    pool = SegmentPool(64 * MIB, 30.0)
    try:
        a = pool.write([torch.full((2 * MIB,), 1, dtype=torch.uint8)], b"A" * 16)
        assert torch.equal(_shm.map_segment(a.name, a.layout, b"A" * 16)[0], torch.full((2 * MIB,), 1,
                                                                                         dtype=torch.uint8))
        pool.release(a)  # the mapping above is gone (no name holds it), so the segment is free
        with pytest.raises(_shm.SegmentReused, match="no longer holds"):
            _shm.map_segment(a.name, a.layout, b"A" * 16)  # freed: a stale ref finds nothing, even before reuse
        b = pool.write([torch.full((2 * MIB,), 2, dtype=torch.uint8)], b"B" * 16)
        assert b.name == a.name and pool.hits == 1  # same file, no fresh pages
        with pytest.raises(_shm.SegmentReused, match="no longer holds"):
            _shm.map_segment(a.name, a.layout, b"A" * 16)  # a stale ref for A must not see B's bytes
        assert int(_shm.map_segment(b.name, b.layout, b"B" * 16)[0][0]) == 2
        pool.release(b)
    finally:
        pool.close()
    assert not _seg_files() & {a.name}


def test_a_live_mapping_blocks_reuse_and_keeps_its_bytes() -> None:
    pool = SegmentPool(64 * MIB, 30.0)
    try:
        a = pool.write([torch.full((MIB,), 7, dtype=torch.uint8)], b"A" * 16)
        kept = _shm.map_segment(a.name, a.layout, b"A" * 16)[0]  # a consumer still using its tensor
        pool.release(a)
        b = pool.write([torch.full((MIB,), 8, dtype=torch.uint8)], b"B" * 16)
        assert b.name != a.name and pool.misses == 2  # the locked segment was skipped
        assert int(kept.sum()) == 7 * MIB
        kept[0] = 100  # copy-on-write: the file is not changed
        fd = os.open(os.path.join(_shm.SHM_DIR, a.name), os.O_RDONLY)
        try:
            assert os.pread(fd, 1, a.layout[0][0]) == b"\x07"
        finally:
            os.close(fd)
        del kept  # mapping gone -> lock gone -> reusable
        pool.release(b)
        c = pool.write([torch.full((MIB,), 9, dtype=torch.uint8)], b"C" * 16)
        assert c.name in (a.name, b.name) and pool.hits == 1
        pool.release(c)
    finally:
        pool.close()


def test_a_segment_being_rewritten_is_refused() -> None:
    seg = _shm.write_segment([torch.ones(64, dtype=torch.uint8)], b"A" * 16)
    fd = os.open(os.path.join(_shm.SHM_DIR, seg.name), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what the producer holds while it reuses a segment
        with pytest.raises(_shm.SegmentReused, match="being rewritten"):
            _shm.map_segment(seg.name, seg.layout, b"A" * 16)
    finally:
        os.close(fd)
        _shm.unlink(seg.name)


def test_pool_is_bounded_and_expires() -> None:
    pool = SegmentPool(3 * MIB, ttl=0.3)
    segs = [pool.write([torch.ones(MIB - 4096, dtype=torch.uint8)], bytes([i]) * 16) for i in range(5)]
    for s in segs:
        pool.release(s)
    try:
        assert pool.nbytes() <= 3 * MIB and len(pool.names()) == 3
        assert len(_seg_files() & {s.name for s in segs}) == 3  # the others were unlinked at once
        time.sleep(0.4)
        pool.trim()
        assert pool.names() == [] and pool.nbytes() == 0
        assert not _seg_files() & {s.name for s in segs}
    finally:
        pool.close()


def test_disabled_pool_unlinks_at_free() -> None:
    pool = SegmentPool(0, 30.0)
    s = pool.write([torch.ones(MIB, dtype=torch.uint8)], b"A" * 16)
    pool.release(s)
    assert pool.names() == [] and s.name not in _seg_files()


def test_deferred_unmap_releases_the_lock() -> None:
    unmapper = _shm.DeferredUnmapper()
    seg = _shm.write_segment([torch.ones(MIB, dtype=torch.uint8)], b"A" * 16)
    try:
        views = _shm.map_segment(seg.name, seg.layout, b"A" * 16, unmapper)
        part = views[0][10:20]  # a view outliving the first tensor keeps the mapping
        del views
        time.sleep(0.05)
        assert unmapper.pending() == 1
        fd = os.open(os.path.join(_shm.SHM_DIR, seg.name), os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            assert int(part.sum()) == 10
            del part
            assert wait_for(lambda: unmapper.pending() == 0, timeout=5)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no consumer maps it any more
        finally:
            os.close(fd)
    finally:
        _shm.unlink(seg.name)


def test_reaper_removes_dead_owners_segments_and_barrier_semaphores() -> None:
    import secrets
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)  # its pid is now dead (and reaped)
    names = [f"rdt-{proc.pid}-{secrets.token_hex(16)}", f"sem.rdt-{proc.pid}-{secrets.token_hex(16)}"]
    live = f"sem.rdt-{os.getpid()}-{secrets.token_hex(16)}"
    for n in names + [live]:
        with open(os.path.join(_shm.SHM_DIR, n), "wb"):
            pass
    try:
        _shm.reap_dead_owners()
        assert not any(os.path.exists(os.path.join(_shm.SHM_DIR, n)) for n in names)
        assert os.path.exists(os.path.join(_shm.SHM_DIR, live))  # a live owner's semaphore stays
    finally:
        for n in names + [live]:
            _shm.unlink(n)


@pytest.mark.parametrize("n", [0, 1, 4097, 16 * MIB + 3, 40 * MIB + 1])
def test_parallel_copy_is_exact(n: int) -> None:
    src = torch.randint(0, 255, (n,), dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    ParallelCopier(threads=3).copy(dst, src)
    assert torch.equal(dst, src)


def test_receive_buffers_are_writable_freed_without_a_pool_and_recycled_with_one() -> None:
    proc = psutil.Process()
    before = proc.memory_info().rss
    nopool = BufferPool(0, 30.0)
    buf = nopool.empty(256 * MIB)
    assert buf.numel() == 256 * MIB and buf.dtype == torch.uint8 and buf.is_contiguous()
    buf.fill_(3)
    assert int(buf[::4096].sum()) == 3 * 65536
    assert proc.memory_info().rss - before > 200 * MIB
    view = buf[-10:]
    del buf
    assert int(view.sum()) == 30  # views keep the memory
    del view
    assert wait_for(lambda: proc.memory_info().rss - before < 64 * MIB, timeout=5)  # unmapped with the last view
    assert nopool.idle_bytes() == 0 and nopool.empty(100).numel() == 100

    pool = BufferPool(64 * MIB, 30.0)
    a = pool.empty(16 * MIB)
    a.fill_(1)
    ptr = a.data_ptr()
    del a
    assert wait_for(lambda: pool.idle_bytes() == 16 * MIB, timeout=5)
    b = pool.empty(16 * MIB - 100)  # similar size: the same memory again
    assert b.data_ptr() == ptr and pool.hits == 1 and b.numel() == 16 * MIB - 100
    c = pool.empty(16 * MIB)  # b still lives: fresh memory
    assert c.data_ptr() != ptr and pool.misses == 2
    del b, c
    big = pool.empty(100 * MIB)  # returns, but does not fit in the 64 MiB bound: unmapped
    del big
    assert wait_for(lambda: pool.idle_bytes() == 32 * MIB, timeout=5)
    pool.close()
    assert pool.idle_bytes() == 0


# ---------------------------------------------------------------------------------------------- on a cluster
@ray.remote(num_cpus=0)
class ShmNode:
    def __init__(self) -> None:
        self.kept: Any = None

    @rdt.tensor_method(tensor_transport="shm")
    def make(self, value: float, numel: int = MIB) -> Any:
        return {"w": torch.full((numel,), value)}

    def total(self, obj: Any) -> float:
        return float(obj["w"].sum())

    def keep(self, obj: Any) -> float:
        self.kept = obj["w"]
        return float(self.kept.sum())

    def kept_total(self) -> float:
        return float(self.kept.sum())

    def configure(self, **kw: Any) -> None:
        rdt.configure(**kw)

    def pid(self) -> int:
        return os.getpid()

    def stats(self) -> Dict[str, Any]:
        return rdt.stats()


@pytest.fixture(scope="module")
def pair(ray_cluster):
    p, c = ShmNode.remote(), ShmNode.remote()
    ray.get(p.configure.remote(shm_cma=False))  # this module is about segments: no direct reads
    yield p, c
    for a in (p, c):
        ray.kill(a)


def test_pool_hits_in_a_producer_consumer_loop(pair) -> None:
    p, c = pair
    for i in range(12):
        assert ray.get(c.total.remote(p.make.remote(float(i))), timeout=60) == float(i) * MIB
    s = rdt.stats(p)["shm_pool"]
    assert s["hits"] >= 6, s  # most objects reuse a freed segment once the loop runs
    assert s["segments"] <= 4 and s["bytes"] <= 1 << 30, s


def test_kept_tensor_survives_reuse_and_later_objects_are_correct(pair) -> None:
    p, c = pair
    assert ray.get(c.keep.remote(p.make.remote(1.0)), timeout=60) == float(MIB)
    for i in range(2, 12):  # the producer makes more same-sized objects while c keeps the first one
        assert ray.get(c.total.remote(p.make.remote(float(i))), timeout=60) == float(i) * MIB
        assert ray.get(c.kept_total.remote(), timeout=60) == float(MIB)


def test_pool_off_leaves_nothing_on_disk(pair) -> None:
    p, c = pair
    ray.get(p.configure.remote(pool_bytes=0))
    try:
        for i in range(3):
            assert ray.get(c.total.remote(p.make.remote(float(i))), timeout=60) == float(i) * MIB
        pid = ray.get(p.pid.remote())

        def clean() -> bool:
            s = rdt.stats(p)
            return s["objects"] == 0 and s["shm_pool"]["segments"] == 0 and not _shm.segments_of(pid)

        assert wait_for(clean, timeout=30), rdt.stats(p)
    finally:
        ray.get(p.configure.remote(pool_bytes=1 << 30))
