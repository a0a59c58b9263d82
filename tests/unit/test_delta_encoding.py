"""The delta encoding without Ray (rdt._sharded.delta): changes are found bitwise, encoded per parameter as records
(elements or blocks) or whole by density, narrowed to a loader's runs (strided rows, several targets for the same
source, uneven lengths) through the directory, and applied; the result equals the new version byte for byte, for
bf16 (6-byte records), float32 and 1-byte elements. The "read" copies the planned record runs out of the records
tensor, as the range road would."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rdt._consumer.ranges import Runs
from rdt._sharded import delta


def _change(t: torch.Tensor, frac: float, seed: int, clustered: bool = False) -> torch.Tensor:
    new = t.clone()
    g = torch.Generator().manual_seed(seed)
    flat = new.view(-1).view(delta.int_dtype(t.element_size()))
    if clustered:  # whole 32-element blocks
        nb = flat.numel() // 32
        blocks = torch.randperm(nb, generator=g)[:max(int(nb * frac), 1)]
        pos = (blocks.unsqueeze(1) * 32 + torch.arange(32)).reshape(-1)
    else:
        pos = torch.randperm(flat.numel(), generator=g)[:max(int(flat.numel() * frac), 1)]
    flat[pos] = flat[pos] ^ 1
    return new


def _read(d: delta.Delta, records: torch.Tensor, plan: delta.DeltaRead) -> None:
    for sp in plan.spans:
        for src, dst, n in zip(sp.runs.src.tolist(), sp.runs.dst.tolist(), sp.runs.n.tolist()):
            plan.staging[dst:dst + n].copy_(records[src:src + n])


def _runs(shapes, wants):
    """Runs (bytes) of wants = [(leaf, target, [(src_elem, dst_elem, n_elems), ...])] sorted by leaf then src."""
    rows = []
    for leaf, target, parts in wants:
        s = shapes[leaf][1]
        for a, b, n in parts:
            rows.append((leaf, a * s, target, b * s, n * s))
    rows.sort()
    cols = [np.array([r[i] for r in rows], np.int64) for i in range(5)]
    return Runs(*cols)


@pytest.mark.parametrize("dtype, frac, clustered", [(torch.bfloat16, 0.01, False), (torch.bfloat16, 0.05, False),
                                                    (torch.float32, 0.02, False), (torch.uint8, 0.01, False),
                                                    (torch.bfloat16, 0.02, True), (torch.bfloat16, 0.5, False)])
def test_encode_plan_apply_lands_the_new_version_exactly(dtype, frac, clustered):
    g = torch.Generator().manual_seed(1)
    rows, cols = 96, 700  # rows spanning directory blocks when DIR_BLOCK is small
    old = [(torch.randn(rows, cols, generator=g) * 100).to(dtype), (torch.randn(rows * cols, generator=g) * 100)
           .to(dtype), (torch.randn(33, generator=g) * 100).to(dtype)]
    new = [_change(t, frac, 7 + i, clustered) for i, t in enumerate(old)]
    enc = delta.encode(new, old)
    d = delta.Delta(0, 1, b"x" * 16, None, *enc.columns, nbytes=enc.records.numel() if enc.records is not None else 0)
    kinds = d.kinds.tolist()
    if frac >= 0.5:
        assert kinds[0] == delta.WHOLE and kinds[1] == delta.WHOLE
    else:
        assert kinds[0] == delta.RECORDS and kinds[1] == delta.RECORDS
        assert int(d.units[0]) == (delta.BLOCK_UNIT if clustered else 1)
    s = old[0].element_size()
    shapes = [(t.numel(), s) for t in new]
    # targets: a row-parallel half of param 0 (one run per row), its whole rows 10-20 again in another target,
    # the middle of param 1, all of param 2
    t_half = torch.zeros(rows, cols // 2, dtype=dtype)
    t_rows = torch.zeros(10, cols, dtype=dtype)
    t_mid = torch.zeros(50000, dtype=dtype)
    t_small = torch.zeros(33, dtype=dtype)
    keep = [t_half, t_rows, t_mid, t_small]
    wants = [(0, 0, [(r * cols + cols // 2, r * (cols // 2), cols // 2) for r in range(rows)]),
             (0, 1, [(10 * cols, 0, 10 * cols)]), (1, 2, [(12345, 0, 50000)]), (2, 3, [(0, 0, 33)])]
    runs = _runs(shapes, wants)

    def fill(tensors):  # the targets as a full load of version ``tensors`` lands them
        t_half.copy_(tensors[0][:, cols // 2:])
        t_rows.copy_(tensors[0][10:20])
        t_mid.copy_(tensors[1][12345:12345 + 50000])
        t_small.copy_(tensors[2])

    fill(old)
    plan = delta.read_plan([d], runs, [s, s, s])
    if enc.records is not None:
        _read(d, enc.records, plan)
    for sp in plan.spans:
        delta.apply(plan, sp, keep, [s, s, s])
    for p in plan.whole:  # read whole from the full publication: copy those runs
        lr = plan.leaves[p]
        for e0, e1, t, dst in zip(lr.e0.tolist(), lr.e1.tolist(), lr.target.tolist(), lr.dst.tolist()):
            keep[t].view(-1)[dst:dst + e1 - e0].copy_(new[p].view(-1)[e0:e1])
    want = [t.clone() for t in keep]
    fill(new)
    for got, exp in zip(want, keep):
        assert torch.equal(got.view(torch.uint8), exp.view(torch.uint8))
    if frac < 0.5:  # only a small part of the bytes was read
        assert plan.record_bytes < 0.3 * sum(t.numel() * s for t in keep)


def test_the_directory_narrows_what_a_loader_reads(monkeypatch):
    """A loader wanting rows 0-9 of a 1000-row parameter reads only the records of the blocks those rows meet."""
    monkeypatch.setattr(delta, "DIR_BLOCK", 1024)
    old = torch.zeros(1000, 512, dtype=torch.bfloat16)
    new = _change(old, 0.01, 3)
    enc = delta.encode([new], [old])
    d = delta.Delta(0, 1, b"x" * 16, None, *enc.columns, nbytes=enc.records.numel())
    runs = _runs([(new.numel(), 2)], [(0, 0, [(0, 0, 10 * 512)])])
    plan = delta.read_plan([d], runs, [2])
    assert 0 < plan.record_bytes < 0.05 * enc.records.numel(), (plan.record_bytes, enc.records.numel())
    target = torch.zeros(10, 512, dtype=torch.bfloat16)
    _read(d, enc.records, plan)
    for sp in plan.spans:
        delta.apply(plan, sp, [target], [2])
    assert torch.equal(target.view(torch.int16), new[:10].view(torch.int16))


def test_bitwise_changes_are_changes():
    old = torch.tensor([0.0, float("nan"), 1.0, -0.0] * 16, dtype=torch.float32)  # records, not whole
    new = old.clone()
    new.view(torch.int32)[0] ^= 1 << 31  # -0.0
    new.view(torch.int32)[1] ^= 1  # another NaN
    enc = delta.encode([new], [old])
    assert enc.columns[4].tolist() == [2]  # changed elements
    assert enc.changed_positions[0].tolist() == [0, 1]


@pytest.mark.parametrize("chunk", [1 << 17, 256])
def test_encode_brings_the_base_along_in_the_same_pass(monkeypatch, chunk):
    """encode(update=True) leaves the base equal to the current bytes and encodes exactly what update=False does,
    whatever mix of sparse and dense chunks, blocks and whole parameters the changes make."""
    monkeypatch.setattr(delta, "CHUNK", chunk)
    g = torch.Generator().manual_seed(5)
    old = [(torch.randn(64, 700, generator=g) * 100).to(torch.bfloat16) for _ in range(4)]
    old.append(torch.randn(999, generator=g))  # not a multiple of a block: no blocks
    new = [_change(old[0], 0.01, 1), _change(old[1], 0.03, 2, clustered=True), _change(old[2], 0.5, 3), old[3].clone(),
           _change(old[4], 0.02, 4)]
    dense = new[0].view(-1).view(torch.int16)
    dense[:300] ^= 1  # one dense chunk among sparse ones
    plain = delta.encode(new, [t.clone() for t in old])
    base = [t.clone() for t in old]
    enc = delta.encode(new, base, update=True)
    assert [int(k) for k in enc.columns[0]] == [delta.RECORDS, delta.RECORDS, delta.WHOLE, delta.UNCHANGED,
                                                delta.RECORDS]
    assert int(enc.columns[1][1]) == delta.BLOCK_UNIT
    for a, b in zip(plain.columns, enc.columns):
        assert np.array_equal(a, b)
    assert torch.equal(plain.records, enc.records)
    for b, n in zip(base, new):
        assert torch.equal(b.view(torch.uint8), n.view(torch.uint8))
