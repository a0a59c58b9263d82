"""rdt._shm_map without Ray: describing shared storages, mapping them through /proc/<pid>/fd, and the kept mappings'
bounds (this process plays the producer: /proc/<own pid>/fd)."""

from __future__ import annotations

import os
import pickle
import time
from typing import List

import pytest
import torch

from rdt.transports.shm import cma as _cma, shared_maps as _shm_map

pytestmark = pytest.mark.skipif(not _cma.supported(), reason="no process_vm_readv in this libc")


def _reader(threads: int = 2, ttl: float = 30.0) -> _shm_map.MapReader:
    return _shm_map.MapReader(_cma.CmaReader(threads).spread, ttl, max_bytes=8 << 30)


def _read(reader: _shm_map.MapReader, info: _shm_map.MapInfo, bufs: List[torch.Tensor]) -> List[torch.Tensor]:
    out = [torch.empty(b.nbytes, dtype=torch.uint8) for b in bufs]
    reader.read(os.getpid(), info, [o.data_ptr() for o in out], [b.nbytes for b in bufs])
    return out


def _describe(tensors: List[torch.Tensor]) -> _shm_map.MapInfo:
    return _shm_map.describe(_shm_map.spans_of(tensors))  # type: ignore[return-value]


def _mapped_inodes() -> List[int]:
    with open("/proc/self/maps") as f:
        return [int(line.split()[4]) for line in f if "/dev/shm/torch_" in line]


def test_describe_needs_every_buffer_in_shared_memory():
    shared = torch.arange(1000, dtype=torch.float32).share_memory_()
    assert _shm_map.describe(_shm_map.spans_of([shared, torch.ones(3)])) is None
    info = _describe([shared[10:20], shared[500:], torch.empty(0)])
    assert info is not None and len(info.files) == 1
    assert info.parts == ((0, 40), (0, 2000), (-1, 0))
    assert pickle.loads(pickle.dumps(info)) == info  # as Ray carries it: two integer arrays


def test_a_storage_is_described_once_and_a_new_storage_afresh(monkeypatch):
    """Weights published every step: the shared file behind each storage is looked up once (kept with the storage);
    a storage made later, even at a reused address, gets its own file's description."""
    calls: List[int] = []
    real = _shm_map._shared_file
    monkeypatch.setattr(_shm_map, "_shared_file", lambda s: calls.append(1) or real(s))
    weights = [torch.full((256,), float(i)).share_memory_() for i in range(3)]
    first = _describe(weights)
    assert _describe(weights) == first and len(calls) == 3
    del weights, first
    again = torch.zeros(256).share_memory_()
    info = _describe([again])
    fd = again.untyped_storage()._get_shared_fd()
    assert len(calls) == 4 and info.files[0].ino == os.fstat(fd).st_ino


def test_storages_shared_by_file_name_are_left_alone():
    """Under torch's file_system strategy there is no descriptor to name: describe says None and moves nothing."""
    import torch.multiprocessing as tmp

    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        t = torch.ones(1024).share_memory_()
    finally:
        tmp.set_sharing_strategy(before)
    ptr = t.data_ptr()
    assert t.is_shared() and _shm_map.describe(_shm_map.spans_of([t])) is None
    assert t.data_ptr() == ptr


def test_a_mapped_read_returns_the_bytes_and_sees_later_writes():
    a = torch.randn(3 << 20).share_memory_()  # 12 MiB: together above the split threshold
    b = torch.randn(2 << 20).share_memory_()
    bufs = [a[7:], b, a[:5]]
    info = _describe(bufs)
    assert info is not None and len(info.files) == 2
    reader = _reader()
    for step in range(3):
        got = _read(reader, info, bufs)
        for g, want in zip(got, bufs):
            assert torch.equal(g.view(want.dtype), want.contiguous())
        a.add_(1.0)  # the trainer's in-place update: the next read sees it through the same mapping
        assert len(reader) == 2
    reader.close()
    assert len(reader) == 0


def test_a_reused_descriptor_is_refused_not_read():
    t = torch.ones(1024).share_memory_()
    info = _describe([t])
    assert info is not None
    f = info.files[0]
    wrong = _shm_map.MapInfo((_shm_map.SharedFile(f.fd, f.dev, f.ino + 1, f.size),), info.parts)
    reader = _reader()
    with pytest.raises(_shm_map.MapError, match="no longer the storage"):
        _read(reader, wrong, [t])
    gone = _shm_map.MapInfo((_shm_map.SharedFile(10 ** 6, f.dev, f.ino, f.size),), info.parts)
    with pytest.raises(_shm_map.MapError):
        _read(reader, gone, [t])
    outside = _shm_map.MapInfo(info.files, ((0, 8),))
    with pytest.raises(_shm_map.MapError, match="outside"):
        _read(reader, outside, [t])
    assert len(reader) == 1  # the valid file was mapped; the two refused ones were not kept


def test_mappings_stay_flat_an_unused_one_goes_after_the_ttl_and_a_freed_one_at_once():
    reader = _reader(ttl=5.0)
    t = torch.ones(1 << 16).share_memory_()
    info = _describe([t])
    assert info is not None
    for _ in range(200):
        _read(reader, info, [t])
    assert len(reader) == 1 and reader.mapped_bytes() == t.nbytes
    ino = info.files[0].ino
    assert reader.trim() == 0  # used just now, and the producer holds the file
    assert reader.trim(now=time.monotonic() + 5.0) == 1  # unused for the ttl
    assert len(reader) == 0 and reader.mapped_bytes() == 0
    _read(reader, info, [t])
    del t  # the producer frees its storage: the next trim (the reaper's pass) unmaps it, without waiting
    assert ino in _mapped_inodes()
    assert reader.trim() == 1
    assert ino not in _mapped_inodes() and len(reader) == 0 and reader.mapped_bytes() == 0


def test_the_cap_unmaps_the_least_recently_used():
    reader = _shm_map.MapReader(_cma.CmaReader(1).spread, 30.0, max_bytes=8 << 30, max_maps=3)
    tensors = [torch.full((256,), float(i)).share_memory_() for i in range(5)]
    for t in tensors:
        _read(reader, _describe([t]), [t])  # type: ignore[arg-type]
    assert len(reader) == 3


_STEPPING_PRODUCER = r"""
import pickle, sys, torch
from rdt.transports.shm import shared_maps as _shm_map
weights = []
for line in sys.stdin:  # "step N": new shared storages, the previous ones freed; "free": none left
    del weights[:]
    if line.startswith("step"):
        step = int(line.split()[1])
        weights = [torch.full((1 << 20,), float(step * 10 + i)).share_memory_() for i in range(4)]  # 4 x 4 MiB
    info = _shm_map.describe(_shm_map.spans_of(weights)) if weights else None
    sys.stdout.write(pickle.dumps(info).hex() + "\n")
    sys.stdout.flush()
"""


class _Producer:
    """A real producer process that shares fresh storages at every step and frees the previous step's."""

    def __init__(self) -> None:
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-c", _STEPPING_PRODUCER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})

    def say(self, line: str) -> "_shm_map.MapInfo | None":
        import pickle

        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return pickle.loads(bytes.fromhex(self.proc.stdout.readline().strip()))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def _read_step(reader: _shm_map.MapReader, pid: int, info: _shm_map.MapInfo, step: int) -> None:
    out = [torch.empty(4 << 20, dtype=torch.uint8) for _ in range(4)]
    reader.read(pid, info, [o.data_ptr() for o in out], [4 << 20] * 4)
    for i, o in enumerate(out):
        assert torch.equal(o.view(torch.float32), torch.full((1 << 20,), float(step * 10 + i)))


def test_a_reaper_pass_drops_the_mappings_of_storages_the_producer_freed():
    """Within the ttl and with the producer alive, a storage it freed (its descriptor closed) is unmapped at the
    next reaper pass: the consumer does not keep freed weights alive in /dev/shm for pool_ttl."""
    producer = _Producer()
    reader = _reader(threads=1, ttl=3600.0)
    try:
        for step in range(3):
            info = producer.say(f"step {step}")
            assert info is not None
            _read_step(reader, producer.proc.pid, info, step)
            reader.trim()  # the reaper's pass: the previous step's storages are freed, this step's are held
            assert reader.mapped_bytes() == 16 << 20 and len(reader) == 4, step
        assert producer.say("free") is None
        reader.trim()
        assert reader.mapped_bytes() == 0 and len(reader) == 0
    finally:
        reader.close()
        producer.close()


def test_mapped_bytes_stay_under_the_cap_while_a_producer_shares_new_storages_every_step():
    cap = 40 << 20  # two and a half steps
    producer = _Producer()
    reader = _shm_map.MapReader(_cma.CmaReader(1).spread, 3600.0, max_bytes=cap)
    try:
        for step in range(8):  # no reaper pass between steps: only the cap bounds what stays mapped
            info = producer.say(f"step {step}")
            assert info is not None
            _read_step(reader, producer.proc.pid, info, step)
            assert reader.mapped_bytes() <= cap, (step, reader.mapped_bytes())
        # Over the cap, mappings of freed storages went first: this step's are all still mapped.
        assert reader.mapped_bytes() >= 16 << 20
    finally:
        reader.close()
        producer.close()
