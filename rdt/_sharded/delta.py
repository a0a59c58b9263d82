"""Delta publications and delta loads (``put_shards(..., delta=True)``; docs/weight-sync.md, "Deltas").

The producer's side (:func:`encode`, :class:`Streams`): a rank that publishes with ``delta=True`` keeps a copy of the
bytes it published last (its *base*) and, with each new version, publishes beside the full shards what changed since
then, per parameter: nothing (no element changed), its changed elements as records (a 4-byte unit index and the
unit's new bytes; a unit is one element, or a block of BLOCK_UNIT elements where blocks are smaller), or "whole"
(its changes would take more than WHOLE_AT of its bytes: a loader reads the parameter's slice from the full
publication instead). Elements are compared bitwise (+0/-0 and NaN payloads count as changes). The records of a
version are one rdt object (a uint8 leaf, parameters one after another), kept for the newest ``delta_versions``
versions of the stream; a small directory per parameter (records before each block of DIR_BLOCK elements) travels
in the metadata so that a loader reads only the records of the blocks its slices meet.

The consumer's side (:func:`read_plan`, :func:`apply`): a loader holding the base version of a rank's stream reads
the records its runs meet through the consumer's range road, narrows them to its runs and scatters them into its
targets (a cast target's kept source-dtype landing).
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .._consumer.ranges import Runs
from .._objects.meta import ObjectMeta
from .._process.context import State

UNCHANGED, RECORDS, WHOLE = 0, 1, 2
DIR_BLOCK = 1 << 16  # elements per directory block
BLOCK_UNIT = 32  # elements per unit of the "changed blocks" encoding
# A parameter whose changes would take more than this fraction of its bytes is published whole (a loader reads its
# slice from the full publication): scattering a changed element costs a loader 3-20 ns here where copying one costs
# 0.35 ns, so past about a third of the bytes (10 % of bf16 elements) records no longer pay, on any link.
WHOLE_AT = 0.3
INDEX_BYTES = 4
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT = {1: "u1", 2: "<i2", 4: "<i4", 8: "<i8"}
MAX_INDEX = (1 << 31) - 1


def int_dtype(itemsize: int) -> Optional[torch.dtype]:
    """The integer dtype of ``itemsize`` bytes elements are compared and scattered as (None: not supported)."""
    return _INT.get(itemsize)


@dataclass
class Delta:
    """What changed in one rank's stream from version ``base`` to ``version`` (carried in its :class:`Shards`):
    per parameter (in the publication's order) its kind, unit (elements), records (count, byte offset in the
    records leaf), elements changed and held, and its directory (records before each DIR_BLOCK elements;
    ``dirs[dir_at[p]:dir_at[p + 1]]``). ``meta``: the records object (None where no parameter has records)."""

    base: int
    version: int
    lineage: bytes
    meta: Optional[ObjectMeta]
    kinds: np.ndarray
    units: np.ndarray
    counts: np.ndarray
    rec_off: np.ndarray
    changed: np.ndarray
    elements: np.ndarray
    dir_at: np.ndarray
    dirs: np.ndarray
    nbytes: int = 0  # bytes of the records

    def record_size(self, p: int, itemsize: int) -> int:
        return INDEX_BYTES + int(self.units[p]) * itemsize

    def __reduce__(self) -> Any:
        meta = None if self.meta is None else self.meta.__dict__.copy()
        return (_load_delta, (self.base, self.version, self.lineage, meta, self.kinds, self.units, self.counts,
                              self.rec_off, self.changed, self.elements, self.dir_at, self.dirs, self.nbytes))


def _load_delta(base: int, version: int, lineage: bytes, meta_state: Optional[dict], *arrays: Any) -> Delta:
    """Unpickle without handing the metadata to rdt's consumer (which would fetch the records whole)."""
    meta = None
    if meta_state is not None:
        meta = ObjectMeta.__new__(ObjectMeta)
        object.__setattr__(meta, "__dict__", meta_state)
    return Delta(base, version, lineage, meta, *arrays)


# ------------------------------------------------------------------------------------------- the producer
@dataclass
class Encoded:
    """:func:`encode`'s result: the records (None: none), the per-parameter columns of a :class:`Delta`, and per
    parameter the units its records hold (ascending unit indices and the unit in elements; None: no records)."""

    records: Optional[torch.Tensor]
    columns: Tuple[np.ndarray, ...]
    changed_units: List[Optional[Tuple[np.ndarray, int]]]

    @property
    def changed_positions(self) -> List[Optional[np.ndarray]]:
        """Per parameter the element positions encoded one by one (None: none, blocks, or whole)."""
        return [None if u is None or u[1] != 1 else u[0] for u in self.changed_units]


def encode(current: Sequence[torch.Tensor], base: Sequence[torch.Tensor], update: bool = False) -> Encoded:
    """Compare each tensor with its base bitwise and encode what changed (see the module docstring). Both are
    contiguous CPU tensors of equal shape and dtype, in the publication's order. Each parameter is compared in
    one pass, a cache-sized chunk at a time (:func:`_scan`); ``update`` brings the base to the current bytes in
    the same pass (the producer's base copy: a caller that fails to publish the result must drop it)."""
    kinds, units, counts, rec_off, changed, elements, dir_at = ([] for _ in range(7))
    dirs: List[np.ndarray] = []
    parts: List[np.ndarray] = []
    changed_units: List[Optional[Tuple[np.ndarray, int]]] = []
    at = 0
    d_at = 0
    for cur, old in zip(current, base):
        e = cur.numel()
        s = cur.element_size()
        dt = int_dtype(s)
        elements.append(e)
        dir_at.append(d_at)
        rec_off.append(at)
        if dt is None or e > MAX_INDEX or e == 0:
            kinds.append(WHOLE if e else UNCHANGED), units.append(1), counts.append(0), changed.append(e)
            changed_units.append(None)
            if update and e:
                old.copy_(cur)
            continue
        a = cur.reshape(-1).view(dt).numpy()
        scan = _Scan(a, old.reshape(-1).view(dt).numpy(), update)
        c = scan.count
        changed.append(c)
        unit, size = 1, c * (INDEX_BYTES + s)
        if c and e % BLOCK_UNIT == 0 and c > e // BLOCK_UNIT // 8:  # blocks can only win when some share a block
            bsize = scan.blocks() * (INDEX_BYTES + BLOCK_UNIT * s)
            if bsize < size:
                unit, size = BLOCK_UNIT, bsize
        if c == 0 or size > WHOLE_AT * e * s:
            scan.finish()
            kinds.append(WHOLE if c else UNCHANGED), units.append(1), counts.append(0), changed_units.append(None)
            continue
        idx, vals = scan.units(unit)
        rec, dir_ = _pack(idx, vals, unit, s, e)
        dirs.append(dir_)
        d_at += len(dir_)
        kinds.append(RECORDS), units.append(unit), counts.append(len(idx)), changed_units.append((idx, unit))
        parts.append(rec)
        at += rec.size
    dir_at.append(d_at)
    return _encoded(parts, (kinds, units, counts, rec_off, changed, elements, dir_at), dirs, changed_units)


CHUNK = 1 << 17  # elements compared at a time (a multiple of BLOCK_UNIT: a block never spans two chunks)
DENSE = 8  # a chunk with more than 1/DENSE of its elements changed is listed only if its parameter needs it


class _Scan:
    """One parameter's comparison (``a`` current, ``b`` base: flat integer views), made a chunk at a time while the
    chunk is in cache: the changed positions and values of each sparse chunk (and, with ``update``, the base
    brought to them at once); the dense chunks are only counted, and listed, or copied to the base, later as the
    encoding needs (so that a parameter published whole is never listed)."""

    def __init__(self, a: np.ndarray, b: np.ndarray, update: bool) -> None:
        self.a, self.b, self.update = a, b, update
        self.pos: List[np.ndarray] = []  # per chunk in order: changed positions (None: a dense chunk, not listed)
        self.vals: List[Optional[np.ndarray]] = []
        self.dense: List[Tuple[int, int]] = []
        self.count = 0
        mask = np.empty(min(CHUNK, len(a)), bool)
        for lo in range(0, len(a), CHUNK):
            hi = min(lo + CHUNK, len(a))
            m = mask[:hi - lo]
            ac, bc = a[lo:hi], b[lo:hi]
            np.not_equal(ac, bc, out=m)
            c = int(np.count_nonzero(m))
            if not c:
                continue
            self.count += c
            if c * DENSE > hi - lo:
                self.dense.append((lo, hi))
                self.pos.append(np.empty(0, np.int64)), self.vals.append(None)  # listed later if needed
                continue
            p = np.flatnonzero(m)
            v = ac[p]
            if update:
                bc[p] = v
            p += lo
            self.pos.append(p), self.vals.append(v)

    def _listed(self) -> Tuple[np.ndarray, np.ndarray]:
        """Every changed position and its value, ascending (the dense chunks listed now, before the base moves)."""
        if self.dense:
            k = 0
            for i, v in enumerate(self.vals):
                if v is None:
                    lo, hi = self.dense[k]
                    k += 1
                    p = np.flatnonzero(self.a[lo:hi] != self.b[lo:hi])
                    self.vals[i] = self.a[lo:hi][p]
                    self.pos[i] = p + lo
        pos = np.concatenate(self.pos) if self.pos else np.zeros(0, np.int64)
        vals = np.concatenate(self.vals) if self.vals else self.a[:0]
        return pos, vals

    def blocks(self) -> int:
        """The BLOCK_UNIT element blocks holding a change."""
        return sum(len(q) for q in self._blocks())

    def _blocks(self) -> List[np.ndarray]:
        """Per chunk holding a change, in order: the indices of its blocks holding one."""
        out = []
        dense = iter(self.dense)
        for p, v in zip(self.pos, self.vals):
            if v is None:
                lo, hi = next(dense)
                out.append(np.flatnonzero(_changed_blocks(self.a[lo:hi] != self.b[lo:hi])) + lo // BLOCK_UNIT)
            else:
                q = p // BLOCK_UNIT
                out.append(q[np.concatenate(([True], q[1:] != q[:-1]))])
        return out

    def units(self, unit: int) -> Tuple[np.ndarray, np.ndarray]:
        """The changed units (indices ascending; ``unit`` elements: 1 or BLOCK_UNIT) and their values, the base then
        brought to the current bytes."""
        if unit == 1:
            pos, vals = self._listed()
        else:
            pos = np.concatenate(self._blocks())
            vals = self.a.reshape(-1, unit)[pos]
        self.finish()
        return pos, vals

    def finish(self) -> None:
        """With ``update``: copy the dense chunks to the base (the sparse ones are brought already)."""
        if self.update:
            for lo, hi in self.dense:
                self.b[lo:hi] = self.a[lo:hi]
        self.dense = []


def _changed_blocks(mask: np.ndarray) -> np.ndarray:
    """Per BLOCK_UNIT elements whether any changed, from the elements' mask (its bytes OR'ed as 8-byte words)."""
    words = mask.view(np.uint64).reshape(-1, BLOCK_UNIT // 8)
    acc = words[:, 0].copy()
    for j in range(1, words.shape[1]):
        acc |= words[:, j]
    return acc != 0


def _pack(idx: np.ndarray, vals: np.ndarray, unit: int, s: int, e: int) -> Tuple[np.ndarray, np.ndarray]:
    """Records of units ``idx`` (ascending) holding ``vals`` (a parameter's elements as integers), as bytes, and
    its directory (records before each DIR_BLOCK elements)."""
    rec = np.empty(len(idx), np.dtype([("i", "<i4"), ("v", _NP_INT[s], (unit,))]))
    rec["i"] = idx
    rec["v"] = vals.reshape(len(idx), unit)
    nblocks = -(-e // DIR_BLOCK)
    bounds = -(-np.arange(nblocks + 1, dtype=np.int64) * DIR_BLOCK // unit)  # first unit at or past each boundary
    return rec.view(np.uint8), np.searchsorted(idx, bounds).astype(np.int64)


def encode_positions(current: Sequence[torch.Tensor], positions: Sequence[Optional[np.ndarray]]) -> Encoded:
    """Records of the elements at ``positions`` (per tensor: ascending element positions; None: every element may
    have changed, published whole) with their current values: what a loader that landed a delta offers its
    replicas (it knows what it wrote)."""
    kinds, units, counts, rec_off, changed, elements, dir_at = ([] for _ in range(7))
    dirs: List[np.ndarray] = []
    parts: List[np.ndarray] = []
    at = d_at = 0
    for cur, pos in zip(current, positions):
        e, s = cur.numel(), cur.element_size()
        dt = int_dtype(s)
        elements.append(e)
        dir_at.append(d_at)
        rec_off.append(at)
        units.append(1)
        if pos is None or dt is None or e > MAX_INDEX or len(pos) * (INDEX_BYTES + s) > WHOLE_AT * e * s:
            kinds.append(WHOLE if e else UNCHANGED), counts.append(0), changed.append(e if pos is None else len(pos))
            continue
        if not len(pos):
            kinds.append(UNCHANGED), counts.append(0), changed.append(0)
            continue
        rec, dir_ = _pack(pos, cur.reshape(-1).view(dt).numpy()[pos], 1, s, e)
        kinds.append(RECORDS), counts.append(len(pos)), changed.append(len(pos))
        dirs.append(dir_)
        d_at += len(dir_)
        parts.append(rec)
        at += rec.size
    dir_at.append(d_at)
    return _encoded(parts, (kinds, units, counts, rec_off, changed, elements, dir_at), dirs,
                    [None if p is None else (p, 1) for p in positions])


def _encoded(parts: List[np.ndarray], cols: Tuple[List[int], ...], dirs: List[np.ndarray],
             changed_units: List[Optional[Tuple[np.ndarray, int]]]) -> Encoded:
    """An encoding from its per-parameter lists: the records concatenated, the columns as typed arrays."""
    kinds, units, counts, rec_off, changed, elements, dir_at = cols
    records = torch.from_numpy(np.concatenate(parts)) if parts else None
    columns = (np.array(kinds, np.int8), np.array(units, np.int32), np.array(counts, np.int64),
               np.array(rec_off, np.int64), np.array(changed, np.int64), np.array(elements, np.int64),
               np.array(dir_at, np.int64), np.concatenate(dirs) if dirs else np.zeros(0, np.int64))
    return Encoded(records, columns, changed_units)


@dataclass
class Stream:
    """One stream's delta state in the producer: its lineage token, the layout it publishes, its base copy (the
    bytes it published last, as the version ``version``) and the records of its newest versions (held here so
    that they stay alive while kept)."""

    lineage: bytes
    params: Tuple[Any, ...]
    version: int
    base: List[torch.Tensor]
    kept: "OrderedDict[int, Any]" = field(default_factory=OrderedDict)  # version -> the records' Shards

    @property
    def base_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.base)


class Streams(State):
    """This process's delta streams (rank and parameter names: as versions' streams), bounded."""

    MAX = 64

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by: "OrderedDict[Hashable, Stream]" = OrderedDict()

    def get(self, key: Hashable) -> Optional[Stream]:
        with self.lock:
            return self.by.get(key)

    def put(self, key: Hashable, stream: Stream) -> List[Hashable]:
        """Keep ``stream`` under ``key``; the keys of the least recently put streams dropped beyond MAX."""
        with self.lock:
            self.by[key] = stream
            self.by.move_to_end(key)
            dropped = []
            while len(self.by) > self.MAX:
                dropped.append(self.by.popitem(last=False)[0])
            return dropped

    def drop(self, key: Hashable) -> None:
        with self.lock:
            self.by.pop(key, None)

    def close(self) -> None:
        with self.lock:
            self.by.clear()


def new_lineage() -> bytes:
    return secrets.token_bytes(16)


# ------------------------------------------------------------------------------------------- the consumer
@dataclass
class LeafRuns:
    """One parameter's runs in a rank's plan, in elements: start and end in its local shard, target, first
    destination element; and the same per target (``layers``: target, starts, ends, first destinations, each
    ascending and disjoint)."""

    e0: np.ndarray
    e1: np.ndarray
    target: np.ndarray
    dst: np.ndarray
    rows: slice  # its runs' rows in the rank's Runs arrays
    layers: List[Tuple[int, np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)

    @property
    def wanted(self) -> int:
        return int((self.e1 - self.e0).sum())


@dataclass
class RankRuns:
    """A rank's runs as delta loads read them, made once per plan: per parameter (:class:`LeafRuns`), and per run
    (sorted by parameter, then source) its parameter and first and last element."""

    leaves: Dict[int, LeafRuns]
    leaf: np.ndarray
    e0: np.ndarray
    e1: np.ndarray


def rank_runs(runs: Runs, itemsizes: Sequence[int]) -> RankRuns:
    """The rank's runs (sorted by leaf, then source) split per leaf and per target, in elements."""
    out: Dict[int, LeafRuns] = {}
    leaf = runs.leaf
    size = np.asarray(itemsizes, np.int64)[leaf] if len(leaf) else np.zeros(0, np.int64)
    e0, e1, dst = runs.src // size, (runs.src + runs.n) // size, runs.dst // size
    cut = np.flatnonzero(np.diff(leaf)) + 1
    for lo, hi in zip(np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [len(leaf)])).tolist()):
        if hi == lo:
            continue
        lr = LeafRuns(e0[lo:hi], e1[lo:hi], runs.target[lo:hi], dst[lo:hi], slice(lo, hi))
        targets = np.unique(lr.target)
        for t in targets.tolist():
            m = lr.target == t if len(targets) > 1 else slice(None)
            lr.layers.append((t, lr.e0[m], lr.e1[m], lr.dst[m]))
        out[int(leaf[lo])] = lr
    return RankRuns(out, leaf, e0, e1)


def leaf_runs(runs: Runs, itemsizes: Sequence[int]) -> Dict[int, LeafRuns]:
    """The rank's runs (sorted by leaf, then source) split per leaf, in elements."""
    return rank_runs(runs, itemsizes).leaves


@dataclass
class Group:
    """Records of one delta in the staging buffer that share a shape (unit and element size), laid out one
    parameter after another: where they start, how many there are, and per parameter its leaf and count."""

    at: int
    count: int
    unit: int
    itemsize: int
    leaves: np.ndarray
    counts: np.ndarray

    @property
    def record_size(self) -> int:
        return INDEX_BYTES + self.unit * self.itemsize


@dataclass
class Spans:
    """The records of one delta a rank's load reads: runs of the records leaf into the staging buffer, and the
    groups they form there."""

    delta: Delta
    runs: Runs
    groups: List[Group]
    nbytes: int


@dataclass
class DeltaRead:
    """A rank's delta load, planned before any byte moves: the chain's records to read (``spans``, into
    ``staging``), and the parameters read whole from the full publication instead (``whole``)."""

    spans: List[Spans]
    whole: List[int]
    staging: torch.Tensor
    leaves: Dict[int, LeafRuns]
    record_bytes: int


def read_plan(chain: Sequence[Delta], runs: Runs, itemsizes: Sequence[int],
              made: Optional[RankRuns] = None) -> DeltaRead:
    """Which records of each delta of ``chain`` (oldest first) this rank's ``runs`` meet, and which parameters are
    read whole: one published whole in some delta of the chain, or whose records would take more than WHOLE_AT of
    its wanted bytes. Whole-rank array operations per delta (``made``: :func:`rank_runs` of ``runs``, kept)."""
    rr = made if made is not None else rank_runs(runs, itemsizes)
    leaf, e0, e1 = rr.leaf, rr.e0, rr.e1
    nleaves = len(itemsizes)
    size = np.asarray(itemsizes, np.int64)
    wanted = np.bincount(leaf, weights=e1 - e0, minlength=nleaves) if len(leaf) else np.zeros(nleaves)
    present = np.zeros(nleaves, bool)
    present[leaf] = True
    whole = present & np.array([int_dtype(s) is None for s in itemsizes], bool)
    found = []  # per delta: (span leaf, start byte, end byte, record size per leaf)
    record_bytes = np.zeros(nleaves)
    for d in chain:
        whole |= present & (d.kinds == WHOLE)
        rec = (d.kinds[leaf] == RECORDS) & ~whole[leaf]
        rl, a0, a1 = leaf[rec], e0[rec], e1[rec]
        rsz = INDEX_BYTES + d.units.astype(np.int64) * size
        base = d.dir_at[:-1][rl]
        st, en = d.dirs[base + a0 // DIR_BLOCK], d.dirs[base + (a1 - 1) // DIR_BLOCK + 1]
        keep = en > st
        rl, st, en = rl[keep], st[keep], en[keep]
        gst, gen = d.rec_off[rl] + st * rsz[rl], d.rec_off[rl] + en * rsz[rl]  # bytes of the records leaf
        if len(rl) > 1:  # merge a parameter's spans where they overlap or touch
            reach = np.maximum.accumulate(gen)
            first = np.flatnonzero(np.concatenate(([True], (gst[1:] > reach[:-1]) | (rl[1:] != rl[:-1]))))
            rl, gst, gen = rl[first], gst[first], np.maximum.reduceat(gen, first)
        found.append((rl, gst, gen, rsz))
        record_bytes += np.bincount(rl, weights=gen - gst, minlength=nleaves)
    whole |= present & (record_bytes > WHOLE_AT * wanted * size)
    out: List[Spans] = []
    at = 0
    for d, (rl, gst, gen, rsz) in zip(chain, found):
        keep = ~whole[rl]
        rl, gst, gen = rl[keep], gst[keep], gen[keep]
        if not len(rl):
            continue
        shape = d.units.astype(np.int64)[rl] * 16 + size[rl]  # spans grouped by record shape, in order within
        order = np.argsort(shape, kind="stable")
        rl, gst, n, shape = rl[order], gst[order], (gen - gst)[order], shape[order]
        dst = at + np.cumsum(n) - n
        groups: List[Group] = []
        cuts = np.flatnonzero(shape[1:] != shape[:-1]) + 1
        for lo, hi in zip(np.concatenate(([0], cuts)).tolist(), np.concatenate((cuts, [len(rl)])).tolist()):
            p = int(rl[lo])
            r = int(rsz[p])
            gl = rl[lo:hi]
            leaves, first = np.unique(gl, return_index=True)
            counts = np.add.reduceat(n[lo:hi], first) // r
            groups.append(Group(int(dst[lo]), int(counts.sum()), int(d.units[p]), int(size[p]),
                                leaves.astype(np.int64), counts.astype(np.int64)))
        k = len(n)
        out.append(Spans(d, Runs(np.zeros(k, np.int64), gst.astype(np.int64), np.zeros(k, np.int64),
                                 dst.astype(np.int64), n.astype(np.int64)), groups, int(n.sum())))
        at += int(n.sum())
    return DeltaRead(out, np.flatnonzero(whole).tolist(), torch.empty(at, dtype=torch.uint8), rr.leaves, at)


def apply(read: DeltaRead, spans: Spans, keep: Sequence[torch.Tensor], itemsizes: Sequence[int],
          changes: Optional[Dict[int, List[np.ndarray]]] = None) -> int:
    """Scatter one delta's records (landed in ``read.staging``) into the targets, narrowed to this rank's runs;
    the elements written. ``changes`` (when given) collects, per target, the element positions written. Per
    parameter and target: its runs meet the records (both ascending) by a binary search of each run's ends among
    the records, and the records inside them are written with one indexed assignment."""
    staging = read.staging.numpy()
    written = 0
    views: Dict[int, np.ndarray] = {}
    for g in spans.groups:
        record = np.dtype([("i", "<i4"), ("v", _NP_INT[g.itemsize], (g.unit,))])
        rec = staging[g.at:g.at + g.count * record.itemsize].view(record)
        ends = np.cumsum(g.counts)
        for leaf, a, b in zip(g.leaves.tolist(), (ends - g.counts).tolist(), ends.tolist()):
            if b == a:
                continue
            idx, vals = rec["i"][a:b], rec["v"][a:b]
            if g.unit == 1:
                pos, vals = idx.astype(np.int64), vals[:, 0]
            else:  # ascending element positions of the blocks
                pos = ((idx.astype(np.int64) * g.unit)[:, None] + np.arange(g.unit)).reshape(-1)
                vals = vals.reshape(-1)
            for t, e0, e1, d0 in read.leaves[leaf].layers:
                lo, hi = np.searchsorted(pos, e0), np.searchsorted(pos, e1)
                if len(e0) == 1:
                    sel: Any = slice(int(lo[0]), int(hi[0]))
                    dst = pos[sel] + int(d0[0] - e0[0])
                else:
                    n = hi - lo
                    total = int(n.sum())
                    if not total:
                        continue
                    sel = np.arange(total) + np.repeat(lo - (np.cumsum(n) - n), n)
                    dst = pos[sel] + np.repeat(d0 - e0, n)
                if not len(dst):
                    continue
                view = views.get(t)
                if view is None:
                    view = views[t] = keep[t].reshape(-1).view(int_dtype(g.itemsize)).numpy()
                view[dst] = vals[sel]
                written += len(dst)
                if changes is not None:
                    changes.setdefault(t, []).append(dst)
    return written


def whole_runs(runs: Runs, read: DeltaRead) -> Optional[Runs]:
    """The rank's runs of the parameters read whole (None: none)."""
    if not read.whole:
        return None
    rows = np.concatenate([np.arange(read.leaves[p].rows.start, read.leaves[p].rows.stop) for p in read.whole])
    return Runs(runs.leaf[rows], runs.src[rows], runs.target[rows], runs.dst[rows], runs.n[rows])


def changed_estimate(chain: Sequence[Delta], read: DeltaRead, written: int) -> int:
    """Elements changed in this rank's wants: those the records wrote, and for each parameter read whole, its wanted
    elements times the fraction of its elements the newest version changed."""
    out = written
    last = chain[-1]
    for p in read.whole:
        e = int(last.elements[p])
        frac = max(int(d.changed[p]) for d in chain) / e if e else 0.0
        out += int(round(read.leaves[p].wanted * min(frac * len(chain), 1.0)))
    return out
