"""The consumer's road for byte ranges of an object (sharded weight sync reads its slices this way).

``fetch_buffers`` lands an object's buffers whole; :func:`fetch_ranges` lands chosen byte runs of its leaves straight
into local targets. Both choose the transport the same way (``resolve.candidates``: the object's transport or
auto's chain, checked against the capabilities and the site), relabel failures the same way, and fall back the same
way: a transport whose ``read_ranges`` cannot serve here is passed over, and when none can, the object is fetched
whole (``fetch_buffers``) and the runs copied out. Per transport the runs are read exact, or strided groups as one
covering range into a staging buffer narrowed here (``cover``). What a replay would derive again (sources in the
object's buffers, destination addresses, read plans) is kept in a :class:`RangeRead` while it stays valid.
Busy targets and abandonment are ``jobs``' (a caller that stops waiting for a read leaves its targets busy).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from rdt_transports._memcopy import copy_parts

from . import cover, device_ranges
from .resolve import TYPED, candidates, fetch_buffers, relabel, site_for
from .._objects.meta import ObjectMeta
from .._process.context import State
from ..transports import Ranges

MAX_PARALLEL = 16  # range reads of one process that run at once (one per producer rank of a load)
_ITEMSIZE: Dict[str, int] = {}  # dtype name -> bytes per element


@dataclass
class Runs:
    """Byte runs of one object's leaves to land in local targets: per run its leaf, byte offset in the leaf,
    target index, byte offset in the target and length (equal-length int64 arrays, adjacent runs merged), and,
    where covering reads may serve, the same runs before merging grouped by the box they copy."""

    leaf: np.ndarray
    src: np.ndarray
    target: np.ndarray
    dst: np.ndarray
    n: np.ndarray
    groups: Optional[cover.Groups] = None
    used: Tuple[int, ...] = field(init=False)  # the targets the runs land in, ascending
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.used = tuple(np.unique(self.target).tolist())
        self.nbytes = int(self.n.sum())


@dataclass
class Landed:
    """What one range read did: the path that served ("shm-direct", "nixl", "gloo-ranges"; "whole:<label>" where
    the object was fetched whole and narrowed here), the bytes it moved, the groups read as one covering range, and
    where the exact runs were read from (buffer, byte offset: what a checksum of the runs names)."""

    label: str
    moved: int
    covered: int
    buf: np.ndarray
    off: np.ndarray


class _Way:
    """How one transport reads the runs (``plan`` None: exact runs), with the derived arrays kept while the
    object's leaf columns and the targets' addresses stay the same."""

    __slots__ = ("plan", "columns", "buf", "off", "addrs", "dst", "memo")

    def __init__(self, plan: Optional[cover.ReadPlan]) -> None:
        self.plan = plan
        self.columns: Any = None
        self.buf = self.off = self.dst = np.zeros(0, np.int64)
        self.addrs: Optional[np.ndarray] = None
        self.memo: Dict[str, Any] = {}  # what device copies and transports derive from these ranges (Ranges.memo)

    def sources(self, meta: ObjectMeta, leaf: np.ndarray, src: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """The runs' (buffer, offset) in ``meta``'s buffers; recomputed only when its leaf columns differ."""
        specs = meta.specs
        columns = (specs.names, specs.dtype, specs.buffer, specs.offset)
        if self.columns is None or self.columns != columns:  # list equality: one C-level pass, no arrays made
            self.buf, self.off = _sources(meta, leaf, src)
            self.columns, self.memo = columns, {}
        return self.buf, self.off

    def destinations(self, addrs: np.ndarray, target: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The runs' local addresses for targets at ``addrs``; recomputed only when those moved."""
        if self.addrs is None or not np.array_equal(addrs, self.addrs):
            self.dst, self.addrs, self.memo = addrs[target] + dst.astype(np.uint64), addrs, {}
        return self.dst


class RangeRead:
    """One object's runs as this road reads them, kept across reads of objects with the same layout (each version
    of unchanged weights) so that a replay derives nothing per run."""

    def __init__(self, runs: Runs) -> None:
        self.runs = runs
        self._exact = _Way(None)
        self._ways: Dict[str, _Way] = {}
        self._lock = threading.Lock()

    def stagings(self) -> List[torch.Tensor]:
        """The staging buffers the covering reads made so far (a read that failed may still land in them)."""
        return [w.plan.staging for w in list(self._ways.values()) if w.plan is not None and w.plan.staging is not None]

    def way(self, ctx: Any, transport: Any, n_targets: int) -> _Way:
        """How ``transport`` reads these runs: covering reads where its declared costs (or
        ``rdt.configure(range_costs=)``'s) make them cheaper, decided once."""
        with self._lock:
            way = self._ways.get(transport.name)
            if way is None:
                way = self._ways[transport.name] = self._decide(ctx, transport, n_targets)
            return way

    def _decide(self, ctx: Any, transport: Any, n_targets: int) -> _Way:
        caps = transport.capabilities
        run_s, bytes_per_s = ctx.config.range_costs.get(caps.name) or (caps.range_run_s, caps.range_bytes_per_s)
        groups = self.runs.groups
        if run_s is None or not bytes_per_s or groups is None:
            return self._exact
        covered = cover.decide(groups, run_s, bytes_per_s)
        return _Way(cover.plan(groups, covered, n_targets)) if covered.any() else self._exact


def fetch_ranges(ctx: Any, meta: ObjectMeta, read: RangeRead, targets: Sequence[torch.Tensor], addrs: np.ndarray,
                 deadline: float, after: Any = None) -> Landed:
    """Land ``read``'s runs of ``meta``'s leaves in ``targets`` (``addrs``: their base addresses, uint64) by the
    first transport that serves ranges here, else by a whole fetch narrowed here. Typed errors naming the object;
    a read that failed may still land later: the caller keeps the targets busy (``jobs``). Where the targets or the
    object's buffers are device memory (``device_ranges``): exact runs, copied with torch ops after ``after`` (the
    caller's stream at the load's start) and finished on the device before this returns."""
    runs = read.runs
    site = site_for(meta, task_argument=False)
    on_device = (targets[0].device.type != "cpu" if len(targets) else False) or meta.buffers.device_types != {"cpu"}
    transport: Any = None
    try:
        inline = meta.export("inline") is not None  # its bytes travel in the metadata: copied out of it
        for transport in [] if inline else candidates(meta, site, ctx):
            way = read._exact if on_device else read.way(ctx, transport, len(targets))
            rp = way.plan
            if rp is None:
                buf, off = way.sources(meta, runs.leaf, runs.src)
                ranges = Ranges(buf, off, way.destinations(addrs, runs.target, runs.dst), runs.n,
                                [targets[i] for i in runs.used])
                if on_device:
                    device_ranges.annotate(ranges, way.memo, runs.target, runs.dst, runs.used, after)
            else:
                staging = rp.staging_tensor()
                buf, off = way.sources(meta, rp.leaf, rp.src)
                everywhere = np.append(addrs, np.uint64(staging.data_ptr()))
                ranges = Ranges(buf, off, way.destinations(everywhere, rp.target, rp.dst), rp.n,
                                [targets[i] if i < len(targets) else staging for i in rp.used])
            label = transport.read_ranges(ctx, meta, ranges, site, deadline)
            if label is None and on_device:
                label = device_ranges.via_host(ctx, transport, meta, ranges, site, deadline)
            if label is None:
                continue
            if rp is not None:
                cover.narrow(rp, targets, addrs)
            moved = runs.nbytes if rp is None else rp.read_bytes
            ctx.stats.add(transport.name, "in", moved, path=label)
            buf, off = read._exact.sources(meta, runs.leaf, runs.src)
            return Landed(label, moved, 0 if rp is None else rp.covered, buf, off)
        transport = None
        way = read._exact
        buf, off = way.sources(meta, runs.leaf, runs.src)
        dst = way.destinations(addrs, runs.target, runs.dst)
        if on_device:
            ranges = device_ranges.annotate(Ranges(buf, off, dst, runs.n, [targets[i] for i in runs.used]),
                                            way.memo, runs.target, runs.dst, runs.used, after)
            return Landed(device_ranges.whole(ctx, meta, ranges, deadline), meta.nbytes, 0, buf, off)
        return Landed(_whole(ctx, meta, dst, buf, off, runs.n, deadline), meta.nbytes, 0, buf, off)
    except TYPED:
        raise
    except Exception as e:  # a transport's own failure (or timeout): typed here as for a whole fetch
        raise relabel(ctx, meta, transport.name if transport is not None else "a whole fetch", site, e,
                      max(deadline - time.monotonic(), 0.0), "reading ranges of") from e


def sources(read: RangeRead, meta: ObjectMeta) -> Tuple[np.ndarray, np.ndarray]:
    """Where ``read``'s exact runs lie in ``meta``'s buffers (buffer, byte offset): what a checksum of the runs
    names, for a caller that landed them otherwise (a sharded delta load)."""
    return read._exact.sources(meta, read.runs.leaf, read.runs.src)


def _whole(ctx: Any, meta: ObjectMeta, dst: np.ndarray, buf: np.ndarray, off: np.ndarray, n: np.ndarray,
           deadline: float) -> str:
    """Fetch the object whole (no transport serves its ranges here) and copy the runs out of its buffers."""
    fetched, name = fetch_buffers(ctx, meta, timeout=max(deadline - time.monotonic(), 1e-3))
    bases = np.array([b.data_ptr() for b in fetched.buffers], np.uint64)
    copy_parts(list(zip(dst.tolist(), (bases[buf] + off.astype(np.uint64)).tolist(), n.tolist())))
    ctx.stats.add(name, "in", meta.nbytes, path=fetched.label)
    return f"whole:{fetched.label}"


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named as metadata names it (looked up once per dtype)."""
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return size


def _sources(meta: ObjectMeta, leaf: np.ndarray, src: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Per run (its leaf and byte offset in the leaf), the buffer it is read from and the byte offset in that
    buffer, from this object's own metadata."""
    specs = meta.specs  # columns: read them as arrays, no TensorSpec made per leaf
    size = np.array([itemsize(name) for name in specs.names], np.int64)
    buf = np.asarray(specs.buffer, np.int64)
    base = np.asarray(specs.offset, np.int64) * size[np.asarray(specs.dtype, np.int64)]
    return buf[leaf], base[leaf] + src


class _Readers(State):
    """This process's threads for range reads (bounded, made once; reads never nest in it), held by the process
    context so that it ends with it and a forked child makes its own."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(MAX_PARALLEL, thread_name_prefix="rdt-ranges")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def readers(ctx: Any) -> ThreadPoolExecutor:
    """The threads range reads run on (see :class:`_Readers`)."""
    return ctx.transport_state("range-readers", _Readers).pool


__all__ = ["Landed", "RangeRead", "Runs", "fetch_ranges", "itemsize", "readers", "sources"]
