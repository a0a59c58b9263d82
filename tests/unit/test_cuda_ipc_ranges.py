"""CUDA IPC range reads without a GPU: everything but the IPC open (``shares.open_storage``, given CPU tensors
standing for the producer's storages). A consumer keeps each producer storage it opened across replayed loads while
it lives (a new share number at the same place: the storage died, reopened), closes idle ones; the runs are copied
with the road's descriptors on the loader's stream after the caller's mark and the open's event, and waited for
before the read returns; into CPU targets, through bounded staging."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List

import numpy as np
import torch

from rdt._consumer import device_ranges
from rdt._objects import device_order
from rdt.transports import Ranges
from rdt.transports.cuda_ipc import ranges as ipc_ranges, shares

from ._fake_streams import Recorder, order_of

UUID = "GPU-fake-0"


def _ipc(storage_bytes: int, buffer_offset: int, nbytes: int, share_id: int, handle: bytes = b"h0") -> shares.IpcBuffer:
    return shares.IpcBuffer(UUID, 0, handle, storage_bytes, 0, b"rc", 0, None, False, buffer_offset, nbytes,
                            share_id)


class _Producer:
    """Storages a producer 'shared' (CPU tensors), opened by the fake opener, which counts the opens."""

    def __init__(self) -> None:
        self.storages: Dict[tuple, torch.Tensor] = {}
        self.opens: List[tuple] = []

    def put(self, handle: bytes, share_id: int, data: torch.Tensor) -> None:
        self.storages[(handle, share_id)] = data

    def open(self, b: shares.IpcBuffer, index: int) -> torch.Tensor:
        self.opens.append((b.handle, b.share_id))
        return self.storages[(b.handle, b.share_id)]


class _Ctx:
    def __init__(self, maps: ipc_ranges.Mappings) -> None:
        self.maps = maps

    def transport_state(self, name, factory):
        assert name == "cuda_ipc-mappings"
        return self.maps


class _OnGpu(Ranges):
    """Ranges whose targets stand for GPU memory (CPU tensors here): the device path is taken."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


def _meta(info: shares.CudaIpcInfo) -> SimpleNamespace:
    return SimpleNamespace(export=lambda name: info if name == "cuda_ipc" else None,
                           producer=SimpleNamespace(instance=b"producer-1"))


def _ranges(cls, targets, buf, off, tgt, tgt_off, n, after=None) -> Ranges:
    r = cls(np.asarray(buf), np.asarray(off), np.zeros(len(n), np.uint64), np.asarray(n), targets)
    return device_ranges.annotate(r, {}, np.asarray(tgt), np.asarray(tgt_off), list(range(len(targets))), after)


def test_opened_storages_are_kept_across_loads_while_they_live(monkeypatch):
    monkeypatch.setattr(shares, "visible_devices", lambda: {UUID: 0})
    prod = _Producer()
    a = torch.arange(256, dtype=torch.uint8)
    prod.put(b"h0", 1, a)
    clock = [0.0]
    maps = ipc_ranges.Mappings(prod.open, clock=lambda: clock[0])
    ctx = _Ctx(maps)
    # two buffers in one storage: q at 0 (64 bytes), k at 128 (64 bytes); a column slice of 'q' viewed as 8 x 8
    info = shares.CudaIpcInfo((_ipc(256, 0, 64, 1), _ipc(256, 128, 64, 1)))
    target = torch.zeros(8, 4, dtype=torch.uint8)
    rows = np.arange(8)
    rec = Recorder()
    rec.caller_queues(lambda: target.fill_(99))  # the caller's work on the target, queued before the load
    with device_order.use(rec):
        r = _ranges(_OnGpu, [target], np.zeros(8), rows * 8 + 2, np.zeros(8), rows * 4, np.full(8, 4),
                    after=rec.mark("cuda"))
        assert r.copies.copies == 1  # a row-parallel slice: one strided copy
        assert ipc_ranges.read_ranges(ctx, _meta(info), r) == "cuda_ipc"
        assert rec.pending() == 0, "returned with copies still queued"
        assert torch.equal(target, a[:64].view(8, 8)[:, 2:6])
        log = rec.log
        assert order_of(log, "wait", "e1@caller") < order_of(log, "run") < order_of(log, "synchronize")
        assert order_of(log, "mark") < order_of(log, "wait", "e2@caller")  # the open's event, waited for too
        # replayed: the same storage, nothing opened; both buffers now
        target2 = torch.zeros(2, 64, dtype=torch.uint8)
        r2 = _ranges(_OnGpu, [target2], [0, 1], [0, 0], [0, 0], [0, 64], [64, 64], after=rec.mark("cuda"))
        assert ipc_ranges.read_ranges(ctx, _meta(info), r2) == "cuda_ipc"
    # one mapping for the storage both buffers lie in
    assert prod.opens == [(b"h0", 1)] and maps.snapshot() == {"opened": 1, "reused": 2, "closed": 0, "open": 1}
    assert torch.equal(target2[0], a[:64]) and torch.equal(target2[1], a[128:192])
    # the producer's storage died and a new one was shared at the same place (share 2): reopened
    b = torch.arange(256, dtype=torch.uint8).flip(0).contiguous()
    prod.put(b"h0", 2, b)
    info2 = shares.CudaIpcInfo((_ipc(256, 0, 64, 2),))
    out = torch.zeros(64, dtype=torch.uint8)
    with device_order.use(Recorder()):
        ipc_ranges.read_ranges(ctx, _meta(info2), _ranges(_OnGpu, [out], [0], [0], [0], [0], [64]))
    assert torch.equal(out, b[:64]) and prod.opens[-1] == (b"h0", 2)
    assert maps.snapshot()["closed"] == 1 and maps.snapshot()["open"] == 1
    clock[0] += ipc_ranges.IDLE_S + 1
    maps.trim()
    assert maps.snapshot()["open"] == 0


def test_into_cpu_targets_through_bounded_staging(monkeypatch):
    monkeypatch.setattr(shares, "visible_devices", lambda: {UUID: 0})
    monkeypatch.setattr(ipc_ranges, "STAGING", 100)
    prod = _Producer()
    data = torch.from_numpy(np.random.default_rng(3).integers(0, 255, 1000, dtype=np.uint8))
    prod.put(b"h1", 5, data)
    info = shares.CudaIpcInfo((_ipc(1000, 0, 1000, 5, b"h1"),))
    targets = [torch.zeros(300, dtype=torch.uint8), torch.zeros(400, dtype=torch.uint8)]
    off = np.array([700, 0, 350, 10, 500])
    n = np.array([120, 90, 150, 60, 180])
    tgt = np.array([0, 0, 1, 1, 1])
    tgt_off = np.array([0, 120, 0, 150, 210])
    with device_order.use(Recorder()) as rec:
        r = _ranges(Ranges, targets, np.zeros(5), off, tgt, tgt_off, n)
        assert ipc_ranges.read_ranges(_Ctx(ipc_ranges.Mappings(prod.open)), _meta(info), r) == "cuda_ipc+d2h"
        assert rec.pending() == 0
    chunks = r.memo["cuda_ipc:chunks"]
    assert len(chunks) == 6 and max(c.nbytes for c in chunks) <= 100
    assert all(t.numel() == 100 for t in r.memo["cuda_ipc:staging"])
    for o, k, t, d in zip(off, n, tgt, tgt_off):
        assert torch.equal(targets[t][d:d + k], data[o:o + k])


def test_a_read_of_cpu_memory_is_not_served_here():
    info = shares.CudaIpcInfo((_ipc(8, 0, 8, 1),))
    plain = Ranges(np.zeros(1), np.zeros(1), np.zeros(1, np.uint64), np.ones(1), [torch.zeros(1)])
    assert ipc_ranges.read_ranges(_Ctx(ipc_ranges.Mappings()), _meta(info), plain) is None
