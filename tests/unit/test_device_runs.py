"""Device copies of a sharded load's runs, on CPU tensors (the same code runs on CUDA tensors on a GPU:
tests/test_gpu_sharded.py): a rank's runs batched into copy descriptors (a row-parallel slice as one strided copy,
large runs one copy each, small irregular runs one gather per pair), applied byte for byte as a per-run copy lands
them; runs cut into bounded staging chunks; a CPU object landed in "device" targets chunk by chunk through two host
buffers, ordered against the caller's stream and finished before the read returns (recording fake streams)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import List

import numpy as np
import pytest
import torch

from rdt._consumer import device_ranges
from rdt._objects import device_order, device_runs
from rdt._sharded.layout import runs as box_runs
from rdt.transports import Ranges

from ._fake_streams import Recorder, order_of


def _naive(sources: List[torch.Tensor], dests: List[torch.Tensor], src, soff, dst, doff, n) -> None:
    for s, so, d, do, k in zip(src, soff, dst, doff, n):
        dests[d].view(-1).view(torch.uint8)[do:do + k] = sources[s].view(-1).view(torch.uint8)[so:so + k]


def _fresh(sizes: List[int], fill: int) -> List[torch.Tensor]:
    return [torch.full((n,), fill, dtype=torch.uint8) for n in sizes]


def test_a_row_parallel_slice_is_one_strided_copy_and_lands_every_byte():
    """A column slice of a 64 x 96 fp32 shard (one 128-byte run per row) into a 64 x 32 target: one strided copy."""
    src, dst, length = box_runs([64, 96], [0, 32], [64, 32], [0, 0], [64, 32])
    n = np.full(len(src), length * 4)
    copies = device_runs.batch(np.zeros(len(src)), src * 4, np.zeros(len(src)), dst * 4, n)
    assert copies.copies == 1 and copies.strided[0].k == 64 and copies.strided[0].ss == 96 * 4, copies
    shard = torch.randn(64, 96)
    target = torch.full((64, 32), -1.0)
    device_runs.apply(copies, [shard], [target])
    assert torch.equal(target, shard[:, 32:64])


def test_random_runs_land_as_a_per_run_copy_lands_them():
    """Runs of many lengths and offsets over three sources and two destinations (strided stretches, large runs,
    small irregular ones at odd offsets: the gathers fall back to bytes where an address is not aligned)."""
    rng = np.random.default_rng(7)
    sizes_s, sizes_d = [70001, 4096 * 9, 333], [90000, 50000]
    rows = []
    for d, size in enumerate(sizes_d):
        at = 0
        while at < size - 9000:
            n = int(rng.choice([1, 3, 8, 40, 200, 5000, 9000]))
            s = int(rng.integers(0, 3))
            so = int(rng.integers(0, sizes_s[s] - n)) if sizes_s[s] > n else 0
            if sizes_s[s] > n:
                rows.append((s, so, d, at, n))
            at += n + int(rng.integers(0, 5))
    for i in range(60):  # a strided stretch of 100-byte rows (6000 bytes: one strided copy)
        rows.append((1, 1000 + i * 256, 1, 42000 + i * 128, 100))
    src, soff, dst, doff, n = (np.array(c) for c in zip(*rows))
    copies = device_runs.batch(src, soff, dst, doff, n)
    assert copies.nbytes == int(n.sum()) and copies.runs == len(n)
    assert any(s.k == 60 for s in copies.strided) and copies.gathered, copies
    assert copies.copies < len(n) // 4
    sources = [torch.from_numpy(rng.integers(0, 255, k, dtype=np.uint8)) for k in sizes_s]
    want, got = _fresh(sizes_d, 9), _fresh(sizes_d, 9)
    _naive(sources, want, src, soff, dst, doff, n)
    device_runs.apply(copies, sources, got)
    device_runs.apply(copies, sources, [g[1:] for g in _fresh([k + 1 for k in sizes_d], 9)])  # misaligned: bytes
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_small_runs_gather_in_the_widest_unit():
    copies = device_runs.batch([0, 0, 0], [16, 64, 128], [0, 0, 0], [0, 8, 40], [8, 32, 8])
    assert not copies.strided and [g.unit for g in copies.gathered] == [8]
    g = copies.gathered[0]  # by length, then source offset: 8 bytes at 16 and 128, then 32 at 64
    assert g.src_idx.tolist() == [2, 16, 8, 9, 10, 11] and g.dst_idx.tolist() == [0, 5, 1, 2, 3, 4]


@pytest.mark.parametrize("limit", [97, 1000, 1 << 20])
def test_chunks_are_bounded_and_land_every_run(limit):
    rng = np.random.default_rng(limit)
    n = rng.integers(1, 300, 50)
    soff = np.concatenate(([0], np.cumsum(n)[:-1])) + 5
    doff = rng.permutation(len(n))
    doff = np.concatenate(([0], np.cumsum(n[doff])[:-1]))[np.argsort(doff)]  # a shuffled dense layout
    chunks = device_runs.chunks(np.zeros(50), soff, np.zeros(50), doff, n, limit)
    assert all(c.nbytes <= limit for c in chunks) and sum(c.nbytes for c in chunks) == int(n.sum())
    src = torch.from_numpy(rng.integers(0, 255, int(soff[-1] + n[-1]), dtype=np.uint8))
    want, got = _fresh([int(n.sum())], 0), _fresh([int(n.sum())], 0)
    _naive([src], want, np.zeros(50, int), soff, np.zeros(50, int), doff, n)
    stage = torch.empty(min(limit, int(n.sum())), dtype=torch.uint8)
    for c in chunks:  # gather into the staging buffer, then scatter from it
        assert (c.stage + c.n).max() <= c.nbytes
        device_runs.apply(c.gather, [src], [stage])
        device_runs.apply(c.scatter, [stage], got)
    assert torch.equal(got[0], want[0])


class _HostOnly:
    """A transport that lands ranges in CPU memory only (as shm, gloo and NIXL DRAM do), reading ``source``."""

    name = "host-only"

    def __init__(self, source: torch.Tensor) -> None:
        self.source = source
        self.calls: List[int] = []

    def read_ranges(self, ctx, meta, ranges, site, deadline):
        for o, d, k in zip(ranges.off.tolist(), ranges.dst.tolist(), ranges.n.tolist()):
            ctypes.memmove(d, self.source.data_ptr() + o, k)
        self.calls.append(int(ranges.n.sum()))
        return "host-only"


def _ranges_into(targets: List[torch.Tensor], src_off, tgt, tgt_off, n, after=None) -> Ranges:
    r = Ranges(np.zeros(len(n), np.int64), np.asarray(src_off), np.zeros(len(n), np.uint64), np.asarray(n), targets)
    return device_ranges.annotate(r, {}, np.asarray(tgt), np.asarray(tgt_off), list(range(len(targets))), after)


def test_a_cpu_object_lands_in_device_targets_through_two_bounded_host_buffers():
    """12 chunks of 1000 bytes through two host and two 'device' staging buffers: each host buffer is refilled only
    once the upload that read it finished (with deferred fake copies, refilling earlier would upload the next
    chunk's bytes twice), the uploads follow the caller's queued work, and everything ran before the read returned."""
    rng = np.random.default_rng(1)
    source = torch.from_numpy(rng.integers(0, 255, 20000, dtype=np.uint8))
    targets = [torch.zeros(6000, dtype=torch.uint8), torch.zeros(6000, dtype=torch.uint8)]
    n = np.full(40, 300)
    src_off = rng.permutation(60)[:40] * 300
    tgt = np.repeat([0, 1], 20)
    tgt_off = np.tile(np.arange(20) * 300, 2)
    rec = Recorder()
    rec.caller_queues(lambda: [t.fill_(77) for t in targets])  # the caller's queued write, before the load
    with device_order.use(rec):
        ranges = _ranges_into(targets, src_off, tgt, tgt_off, n, after=rec.mark("cuda"))
        transport = _HostOnly(source)
        meta = SimpleNamespace(buffers=SimpleNamespace(device_types={"cpu"}))
        label = device_ranges.staged(None, transport, meta, ranges, None, 0.0, 1000, torch.device("cpu"))
    assert label == "host-only+h2d" and transport.calls == [1000] * 12
    assert rec.pending() == 0, "the read returned with copies still queued"
    stage = ranges.memo["staging"]
    assert len(stage["host"]) == 2 and all(t.numel() == 1000 for t in stage["host"] + stage["device"])
    want = [torch.zeros(6000, dtype=torch.uint8), torch.zeros(6000, dtype=torch.uint8)]
    _naive([source], want, np.zeros(40, int), src_off, tgt, tgt_off, n)
    assert all(torch.equal(a, b) for a, b in zip(targets, want))
    assert order_of(rec.log, "wait", "e1@caller") < order_of(rec.log, "run")


def test_the_whole_fallback_copies_out_with_torch_ops_after_the_callers_work(monkeypatch):
    fetched = [torch.arange(256, dtype=torch.uint8), torch.arange(100, 228, dtype=torch.uint8)]
    monkeypatch.setattr(device_ranges, "fetch_buffers", lambda ctx, meta, timeout: (
        SimpleNamespace(buffers=fetched, label="object_store"), "object_store"))
    ctx = SimpleNamespace(stats=SimpleNamespace(add=lambda *a, **k: None))
    target = torch.zeros(48, dtype=torch.uint8)
    rec = Recorder()
    rec.caller_queues(lambda: target.fill_(5))
    with device_order.use(rec):
        r = _ranges_into([target], [10, 0], [0, 0], [0, 16], [16, 32], after=rec.mark("cuda"))
        r.buf = np.array([0, 1])
        r.memo.pop("copies")
        device_ranges.annotate(r, r.memo, np.array([0, 0]), np.array([0, 16]), [0], r.after)
        label = device_ranges.whole(ctx, SimpleNamespace(nbytes=384), r, 10.0)
    assert label == "whole:object_store" and rec.pending() == 0
    assert target.tolist() == list(range(10, 26)) + list(range(100, 132))
