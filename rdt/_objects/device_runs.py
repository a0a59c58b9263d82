"""Byte runs between tensors as a few batched torch copies, and bounded staging between two devices.

A sharded load lands byte runs of a producer's buffers in local targets. Where those lie in device memory (a CUDA
IPC mapping of the producer's storage, a GPU target, a staging block) the runs cannot be copied by address on the
host: they are copied with torch ops, on whatever stream is current. :func:`batch` turns one producer rank's runs
into copy descriptors once per plan: runs of one source and one destination that step by one stride on both sides
(a row-parallel slice: one run per row) are one strided copy (``as_strided`` on both sides), a run of
:data:`SMALL` bytes or more is one copy, and the remaining small runs of each (source, destination) pair are one
gather and one scatter through index tensors (in the widest unit that divides every offset and length). :func:`apply`
runs them; the same code runs on CPU tensors in CI and on CUDA tensors on a GPU.

:func:`chunks` cuts runs into chunks of at most ``limit`` bytes laid back to back in a staging buffer (a run longer
than the limit split across chunks): each chunk gathers from the sources into the staging buffer and scatters from
it into the destinations, so that bytes cross between host and device through at most two staging buffers of
``limit`` bytes on each side, whatever the load's size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

SMALL = 4096  # bytes: a run (or a strided group) this long is one copy of its own; shorter ones are gathered
_UNITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclass(frozen=True)
class Strided:
    """``k`` runs of ``n`` bytes from source ``src`` at ``s0 + i * ss`` to destination ``dst`` at ``d0 + i * ds``:
    one strided copy (``k == 1``: one plain copy)."""

    src: int
    dst: int
    s0: int
    ss: int
    d0: int
    ds: int
    k: int
    n: int


@dataclass
class Gathered:
    """Small runs of one (source, destination) pair: element indexes (in ``unit`` bytes) on both sides, copied as
    one gather and one scatter."""

    src: int
    dst: int
    unit: int
    src_idx: np.ndarray
    dst_idx: np.ndarray

    @property
    def nbytes(self) -> int:
        return len(self.src_idx) * self.unit


@dataclass
class Copies:
    """One producer rank's runs as copy descriptors (made once per plan and replayed); ``copies``: the torch copy
    calls :func:`apply` makes (a gather and its scatter count as one)."""

    strided: List[Strided]
    gathered: List[Gathered]
    nbytes: int
    runs: int
    _index: Dict[Tuple[int, str, int], Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def copies(self) -> int:
        return len(self.strided) + len(self.gathered)

    def sources(self) -> List[int]:
        """The source indexes the descriptors read."""
        return sorted({s.src for s in self.strided} | {g.src for g in self.gathered})


def _arrays(*cols: Any) -> List[np.ndarray]:
    return [np.asarray(c, dtype=np.int64).reshape(-1) for c in cols]


def batch(src: Any, soff: Any, dst: Any, doff: Any, n: Any, small: int = SMALL) -> Copies:
    """The copy descriptors of runs (per run: source index, byte offset in it, destination index, byte offset in it,
    length). Runs must not overlap on the destination side."""
    src, soff, dst, doff, n = _arrays(src, soff, dst, doff, n)
    k = len(n)
    if k == 0:
        return Copies([], [], 0, 0)
    order = np.lexsort((soff, n, dst, src))
    src, soff, dst, doff, n = src[order], soff[order], dst[order], doff[order], n[order]
    sstep = np.zeros(k, np.int64)
    dstep = np.zeros(k, np.int64)
    sstep[1:] = soff[1:] - soff[:-1]
    dstep[1:] = doff[1:] - doff[:-1]
    link = np.zeros(k, bool)  # run i continues a stretch of run i - 1: same pair and length, rows not overlapping
    link[1:] = (src[1:] == src[:-1]) & (dst[1:] == dst[:-1]) & (n[1:] == n[:-1]) & (dstep[1:] >= n[1:])
    brk = ~link
    if k > 2:  # a stretch keeps one stride on both sides
        brk[2:] |= link[1:-1] & ((sstep[2:] != sstep[1:-1]) | (dstep[2:] != dstep[1:-1]))
    first = np.flatnonzero(brk)
    count = np.diff(np.append(first, k))
    strided: List[Strided] = []
    loose = np.zeros(k, bool)
    for a, c in zip(first.tolist(), count.tolist()):
        if c * int(n[a]) >= small:
            ss = int(sstep[a + 1]) if c > 1 else int(n[a])
            ds = int(dstep[a + 1]) if c > 1 else int(n[a])
            strided.append(Strided(int(src[a]), int(dst[a]), int(soff[a]), ss, int(doff[a]), ds, c, int(n[a])))
        else:
            loose[a:a + c] = True
    gathered: List[Gathered] = []
    if loose.any():
        idx = np.flatnonzero(loose)
        pairs = np.stack((src[idx], dst[idx]), axis=1)
        for s, d in np.unique(pairs, axis=0).tolist():
            sel = idx[(src[idx] == s) & (dst[idx] == d)]
            gathered.append(_gather(s, d, soff[sel], doff[sel], n[sel]))
    return Copies(strided, gathered, int(n.sum()), k)


def _unit(*cols: np.ndarray) -> int:
    g = int(np.gcd.reduce(np.concatenate(cols))) if sum(len(c) for c in cols) else 1
    for u in (8, 4, 2):
        if g % u == 0:
            return u
    return 1


def _expand(off: np.ndarray, n: np.ndarray, unit: int) -> np.ndarray:
    """Element indexes (in ``unit`` bytes) of runs at ``off`` of ``n`` bytes."""
    count = n // unit
    first = np.concatenate(([0], np.cumsum(count)[:-1])).astype(np.int64)
    within = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(first, count)
    return np.repeat(off // unit, count) + within


def _gather(s: int, d: int, soff: np.ndarray, doff: np.ndarray, n: np.ndarray) -> Gathered:
    unit = _unit(soff, doff, n)
    return Gathered(s, d, unit, _expand(soff, n, unit), _expand(doff, n, unit))


def flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 tensor over the same memory."""
    return t.reshape(-1).view(torch.uint8) if t.dim() != 1 or t.dtype != torch.uint8 else t


def _typed(t: torch.Tensor, unit: int) -> Optional[torch.Tensor]:
    """``t`` (uint8, 1-D) viewed in elements of ``unit`` bytes, or None where its address or size does not allow it."""
    if unit == 1:
        return t
    if t.numel() % unit or t.data_ptr() % unit:
        return None
    return t.view(_UNITS[unit])


def _indexes(copies: Copies, i: int, g: Gathered, unit: int, sdev: torch.device,
             ddev: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    key = (i, f"{sdev}>{ddev}", unit)
    got = copies._index.get(key)
    if got is None:
        if unit == g.unit:
            si, di = g.src_idx, g.dst_idx
        else:  # bytes after all: each element of g.unit bytes is g.unit bytes
            step = np.arange(g.unit, dtype=np.int64)
            si = (g.src_idx[:, None] * g.unit + step).ravel()
            di = (g.dst_idx[:, None] * g.unit + step).ravel()
        got = copies._index[key] = (torch.from_numpy(si).to(sdev), torch.from_numpy(di).to(ddev))
    return got


def apply(copies: Copies, sources: Sequence[torch.Tensor], dests: Sequence[torch.Tensor]) -> None:
    """Copy every run of ``copies`` from ``sources`` into ``dests`` (contiguous tensors, indexed as the runs were;
    read as bytes) with torch ops on the current stream: one strided copy per strided group, one copy per large run,
    a gather and a scatter per pair of the small ones. Sources and destinations may lie on different devices."""
    srcs: Dict[int, torch.Tensor] = {}
    dsts: Dict[int, torch.Tensor] = {}

    def s_of(i: int) -> torch.Tensor:
        t = srcs.get(i)
        if t is None:
            t = srcs[i] = flat(sources[i])
        return t

    def d_of(i: int) -> torch.Tensor:
        t = dsts.get(i)
        if t is None:
            t = dsts[i] = flat(dests[i])
        return t

    for c in copies.strided:
        s, d = s_of(c.src), d_of(c.dst)
        same = s.device == d.device
        if c.k == 1:
            d[c.d0:c.d0 + c.n].copy_(s[c.s0:c.s0 + c.n], non_blocking=same)
        else:
            torch.as_strided(d, (c.k, c.n), (c.ds, 1), d.storage_offset() + c.d0).copy_(
                torch.as_strided(s, (c.k, c.n), (c.ss, 1), s.storage_offset() + c.s0), non_blocking=same)
    for i, g in enumerate(copies.gathered):
        s, d = s_of(g.src), d_of(g.dst)
        unit = g.unit
        sv, dv = _typed(s, unit), _typed(d, unit)
        if sv is None or dv is None:
            unit, sv, dv = 1, s, d
        si, di = _indexes(copies, i, g, unit, s.device, d.device)
        dv.index_put_((di,), sv.index_select(0, si).to(d.device))


# ------------------------------------------------------------------------------------------------ staging
@dataclass
class Chunk:
    """Runs that fit one staging buffer, back to back from its start: per run its source, byte offset there, place
    in the staging buffer, destination, byte offset there and length; ``gather`` (sources -> staging, index 0) and
    ``scatter`` (staging, index 0 -> destinations) are their copy descriptors."""

    src: np.ndarray
    soff: np.ndarray
    stage: np.ndarray
    dst: np.ndarray
    doff: np.ndarray
    n: np.ndarray
    nbytes: int
    _gather: Optional[Copies] = field(default=None, repr=False)
    _scatter: Optional[Copies] = field(default=None, repr=False)

    @property
    def gather(self) -> Copies:
        if self._gather is None:
            self._gather = batch(self.src, self.soff, np.zeros_like(self.src), self.stage, self.n)
        return self._gather

    @property
    def scatter(self) -> Copies:
        if self._scatter is None:
            self._scatter = batch(np.zeros_like(self.dst), self.stage, self.dst, self.doff, self.n)
        return self._scatter


def chunks(src: Any, soff: Any, dst: Any, doff: Any, n: Any, limit: int) -> List[Chunk]:
    """The runs (in their order) cut into chunks of at most ``limit`` bytes each, a run longer than what is left of
    a chunk split between it and the next ones; within a chunk the runs lie back to back in the staging buffer."""
    if limit < 1:
        raise ValueError(f"a staging limit of {limit} bytes")
    src, soff, dst, doff, n = _arrays(src, soff, dst, doff, n)
    total = int(n.sum())
    if total == 0:
        return []
    ends = np.cumsum(n)
    starts = ends - n
    cuts = np.arange(0, total, limit, dtype=np.int64)  # each chunk's first byte in the stream of runs
    out: List[Chunk] = []
    for lo in cuts.tolist():
        hi = min(lo + limit, total)
        i0 = int(np.searchsorted(ends, lo, side="right"))
        i1 = int(np.searchsorted(starts, hi, side="left"))
        a = np.maximum(starts[i0:i1], lo)
        b = np.minimum(ends[i0:i1], hi)
        skip = a - starts[i0:i1]
        out.append(Chunk(src[i0:i1], soff[i0:i1] + skip, a - lo, dst[i0:i1], doff[i0:i1] + skip, b - a, hi - lo))
    return out


__all__ = ["Chunk", "Copies", "Gathered", "SMALL", "Strided", "apply", "batch", "chunks", "flat"]
