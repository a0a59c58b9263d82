"""Covering reads without Ray: a plan's reads applied to real memory (a covering range into the staging buffer, the
other runs straight into the targets), then the loader's narrow, land exactly the bytes that exact runs land."""

from __future__ import annotations

from typing import List

import numpy as np
import pytest
import torch

from rdt._consumer import cover
from rdt._sharded.layout import runs


def _apply(rp: cover.ReadPlan, sources: List[torch.Tensor], keep: List[torch.Tensor]) -> None:
    """Do what a transport does with the plan's runs: copy each source range to its destination."""
    stage = rp.staging_tensor()
    dests = keep + [stage]
    for leaf, src, t, dst, n in zip(rp.leaf.tolist(), rp.src.tolist(), rp.target.tolist(), rp.dst.tolist(),
                                    rp.n.tolist()):
        out = dests[t].reshape(-1).view(torch.uint8)
        out[dst:dst + n] = sources[leaf].reshape(-1).view(torch.uint8)[src:src + n]


@pytest.mark.parametrize("costly", [True, False])
def test_covering_reads_land_what_exact_runs_land(costly: bool) -> None:
    """A 2-D column slice (one stride: narrowed as one strided copy), a 3-D box (runs of two strides: narrowed range
    by range) and a whole tensor (one run: never covered), into targets that are views at an offset."""
    g = torch.Generator().manual_seed(3)
    sources = [torch.randn(16, 40, generator=g), torch.randn(4, 6, 10, generator=g), torch.randn(7, generator=g)]
    wanted = [sources[0][:, 8:20], sources[1][1:3, 2:5, 3:9], sources[2]]
    backing = torch.full((2000,), -1.0)
    keep, at = [], 5
    for w in wanted:  # targets that are views into one storage, at an offset
        keep.append(backing[at:at + w.numel()].view(w.shape))
        at += w.numel() + 3
    parts = []
    boxes = [([16, 40], [0, 8], [16, 12]), ([4, 6, 10], [1, 2, 3], [2, 3, 6]), ([7], [0], [7])]
    for i, (shape, lo, ext) in enumerate(boxes):
        s, d, length = runs(shape, lo, ext, [0] * len(ext), ext)
        parts.append((np.full(len(s), i, np.int64), s * 4, np.full(len(s), i, np.int64), d * 4,
                      np.full(len(s), length * 4, np.int64)))
    groups = cover.groups(parts)
    covered = cover.decide(groups, 1e-3 if costly else 1e-9, 1e9)
    assert covered.tolist() == ([True, True, False] if costly else [False, False, False])
    rp = cover.plan(groups, covered, len(keep))
    assert rp.covered == (2 if costly else 0)
    if costly:
        assert len(rp.strided) == 1 and len(rp.narrow[3]) == 2 * 3  # the 3-D box: range by range
        assert rp.read_bytes == 4 * (15 * 40 + 12) + 4 * (1 * 60 + 2 * 10 + 6) + 4 * 7  # covering ranges, whole
    _apply(rp, sources, keep)
    addrs = np.array([t.data_ptr() for t in keep], dtype=np.uint64)
    cover.narrow(rp, keep, addrs)
    for t, w in zip(keep, wanted):
        assert torch.equal(t, w)
    assert (backing[:5] == -1).all() and (backing[5 + 192:5 + 195] == -1).all()  # nothing outside the targets
