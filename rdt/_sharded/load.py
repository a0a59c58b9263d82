"""The consumer's side: a :class:`WeightLoader` states what each target tensor wants (regions of global
parameters, concatenated for fused targets), plans once per layout which byte ranges come from which producer rank,
and on every ``load(manifest)`` reads exactly those ranges from all ranks at once, straight into the targets."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .._objects.meta import ObjectMeta
from ..transports.base import TransportState
from ..errors import (FenceTimeoutError, GroupDestroyedError, IntoBusyError, InvalidArgumentError, ObjectFreedError,
                      ProducerDiedError, TransferTimeoutError)
from . import cover, reads, replica as _replica
from .layout import Region, intersect, runs
from .publish import Manifest, ParamInfo, Shards
from .replica import Replica

logger = logging.getLogger(__name__)

MAX_PARALLEL = 16  # producer ranks read from at once
_ITEMSIZE: Dict[str, int] = {}  # dtype name -> bytes per element


@dataclass
class _Want:
    name: str
    target: torch.Tensor
    regions: Tuple[Region, ...]
    dim: int
    cast: bool
    landing: Optional[torch.Tensor] = None  # where a cast target's bytes land first (the source dtype)


@dataclass
class _Pulls:
    """The ranges one producer rank serves: per run its leaf, byte offset in the leaf, target, byte offset in the
    target, and length (equal-length int64 arrays)."""

    rank: int
    leaf: np.ndarray
    src: np.ndarray
    target: np.ndarray
    dst: np.ndarray
    n: np.ndarray
    used: Tuple[int, ...] = ()  # the targets these runs land in, ascending
    nbytes: int = 0
    groups: Optional[cover.Groups] = None  # the runs before merging, by box intersection (covering reads)
    reads: Dict[str, Optional[cover.ReadPlan]] = field(default_factory=dict)  # per transport; None: exact runs
    sources: Dict[Any, "_Sources"] = field(default_factory=dict)  # the exact runs' (None) and each read plan's


class _Sources:
    """Where a set of runs is read from in one publication (buffer, byte offset) and, for a covering read plan,
    where it lands: kept while the publications' leaf columns and the targets' addresses stay the same (every
    version of an unchanged layout), so that a replayed load derives nothing per run."""

    __slots__ = ("columns", "buf", "off", "addrs", "dst")

    def __init__(self) -> None:
        self.columns: Any = None
        self.buf = self.off = self.dst = np.zeros(0, np.int64)
        self.addrs: Any = None

    def of(self, meta: ObjectMeta, leaf: np.ndarray, src: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """The runs' (buffer, offset) in ``meta``'s publication; recomputed only when its leaf columns differ."""
        specs = meta.specs
        columns = (specs.names, specs.dtype, specs.buffer, specs.offset)
        if self.columns is None or self.columns != columns:  # list equality: one C-level pass, no arrays made
            self.buf, self.off = _sources(meta, leaf, src)
            self.columns = columns
        return self.buf, self.off


@dataclass
class _Plan:
    """Everything a load derives from the wants and the manifest's layout, made once and replayed: the pulls per
    rank, the tensors the bytes land in, and the runs' destination addresses for the targets' current storage
    (recomputed when a target's storage moved). Source addresses are never kept: they come from each new
    publication's metadata."""

    key: Any
    pulls: List[_Pulls]
    keep: List[torch.Tensor]
    nbytes: int
    names: List[str] = field(default_factory=list)  # the wants' names, as keep
    addrs: Optional[np.ndarray] = None
    ptrs: List[int] = field(default_factory=list)  # the targets' data pointers, as addrs (compared as a list)
    sizes: List[int] = field(default_factory=list)  # the targets' bytes when planned (every run fits in them)
    dst_addrs: List[np.ndarray] = field(default_factory=list)

    def destinations(self) -> List[np.ndarray]:
        """Per rank, each run's destination address; recomputed only when a target's data pointer changed. A target
        that no longer has the bytes it was planned with (``param.data`` swapped for another dtype or shape, a
        ``resize_``) or is no longer contiguous CPU memory is refused (InvalidArgumentError) before a byte moves:
        the runs would land past its end."""
        ptrs = list(map(torch.Tensor.data_ptr, self.keep))
        sizes = [t.nbytes for t in self.keep]
        if not self.sizes:
            self.sizes = sizes
        if sizes != self.sizes or (ptrs != self.ptrs and self.ptrs):
            for name, t, n in zip(self.names, self.keep, self.sizes):
                if t.nbytes != n or not t.is_contiguous() or t.device.type != "cpu":
                    raise InvalidArgumentError(
                        f"target {name!r} changed since it was wanted: it is {t.nbytes} bytes "
                        f"{'' if t.is_contiguous() else 'non-contiguous '}{t.dtype} on {t.device}, it was {n} bytes "
                        "of contiguous CPU memory; nothing was moved",
                        hint="want the parameter's current tensor in a new rdt.WeightLoader (its dtype or shape "
                             "changed, e.g. param.data was swapped)")
        if self.addrs is None or ptrs != self.ptrs:
            addrs = np.array(ptrs, dtype=np.uint64)
            self.dst_addrs = [addrs[p.target] + p.dst.astype(np.uint64) for p in self.pulls]
            self.addrs, self.ptrs = addrs, ptrs
        return self.dst_addrs


@dataclass
class LoadReport:
    """What one ``load`` did: the version, whether it made a new plan (False: replayed), the bytes that landed,
    the path that served each producer rank ("shm-direct", "nixl", "gloo-ranges"; "whole:<label>" where the rank's
    shards were fetched whole and narrowed here), and the seconds it took. With ``verify=True``: the bytes checked against the
    producers' checksums and the seconds the checks took, summed over the ranks (they run in parallel, each after
    its rank's read)."""

    version: int
    planned: bool
    nbytes: int
    paths: Dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0
    verified_bytes: int = 0
    verify_seconds: float = 0.0
    covered: Dict[int, int] = field(default_factory=dict)  # per rank: strided groups read as one covering range
    read_bytes: int = 0  # bytes the reads moved (more than nbytes where covering reads or whole fetches served)

    @property
    def mode(self) -> str:
        """How the bytes were read: "exact runs", "covering reads", "whole fetch", or several joined by " + "."""
        kinds = {"whole fetch" if p.startswith("whole:") else "covering reads" if self.covered.get(r) else
                 "exact runs" for r, p in self.paths.items()}
        return " + ".join(k for k in ("exact runs", "covering reads", "whole fetch") if k in kinds) or "none"


class WeightLoader:
    """A consumer's wants, planned once per manifest layout and replayed on every load.

    ``loader.want(qkv, [Region("q", 0, r * q, q), Region("k", 0, r * k, k), Region("v", 0, r * k, k)])`` fills
    ``qkv`` with its slices of q, k and v concatenated along dim 0; ``loader.load(manifest)`` pulls them."""

    def __init__(self) -> None:
        self._wants: List[_Want] = []
        self._plan: Optional[_Plan] = None  # made for one manifest layout key and these wants
        self._mirror: Optional[Tuple[List[_Want], Optional[_Plan], bytes]] = None  # reading replicas: wants, plan, sig
        self._held: Optional[int] = None  # the version the targets hold (None: none whole, or a load failed)
        self._shared: Optional[Replica] = None  # what share() offered: fenced before the next load lands a byte
        self._stream = secrets.token_bytes(16)
        self.plans = 0  # plans made (a changed layout or new wants make a new one)
        self.replays = 0  # loads that reused the plan

    def want(self, target: torch.Tensor, regions: Union[Region, Sequence[Region]], *, dim: int = 0,
             cast: bool = False, name: Optional[str] = None) -> None:
        """``target`` receives ``regions`` (one, or several concatenated along ``dim``); ``cast=True`` allows a
        source dtype other than the target's (the bytes land in a staging tensor, then are converted)."""
        regs = (regions,) if isinstance(regions, Region) else tuple(regions)
        label = name or (regs[0].param if len(regs) == 1 else "+".join(r.param for r in regs))
        if not isinstance(target, torch.Tensor) or target.device.type != "cpu" or not target.is_contiguous():
            raise InvalidArgumentError(f"target {label!r} must be a contiguous CPU tensor",
                                       hint="want into the parameter's contiguous CPU storage")
        if not regs or not all(isinstance(r, Region) for r in regs):
            raise InvalidArgumentError(f"target {label!r}: regions must be rdt.Region objects",
                                       hint='pass rdt.Region("name", dim, start, length)')
        if not -max(target.dim(), 1) <= dim < max(target.dim(), 1):
            raise InvalidArgumentError(f"target {label!r}: dim {dim} is outside its {target.dim()} dimensions",
                                       hint="concatenate along a dimension the target has")
        for w in self._wants:
            if _overlap(w.target, target):
                raise InvalidArgumentError(f"target {label!r} overlaps the bytes of target {w.name!r}",
                                           hint="give every want its own tensor (or disjoint views of one)")
        self._wants.append(_Want(label, target, regs, dim % max(target.dim(), 1), bool(cast)))
        self._plan = self._mirror = None

    def load(self, source: Union[Manifest, Replica], *, timeout: float = 60.0, verify: bool = False) -> LoadReport:
        """Pull every want's bytes of a version into the targets: from the trainer ranks of a ``Manifest``, or whole
        from a ``Replica`` that a loader with the same wants shared. Everything is checked before a byte moves,
        each source's read included: a version that is gone raises VersionGoneError, a rank that died
        ProducerDiedError, naming it. The targets hold that version on return, never torn bytes (a read the
        version did not hold through raises VersionGoneError). ``verify=True`` checks the landed bytes against
        the sources' checksums (ChecksumMismatchError names the parameter and rank)."""
        if isinstance(source, Replica):
            return self._load_replica(source, timeout, verify)
        if not isinstance(source, Manifest):
            raise InvalidArgumentError(f"load takes an rdt.Manifest or rdt.Replica, got {type(source).__name__}",
                                       hint="rdt.Manifest(ray.get([t.publish.remote(step) for t in trainers]))")
        manifest = source
        self._plan, report = self._run(self._wants, self._plan, manifest, timeout, verify)
        return report

    def share(self, *, tensor_transport: str = "auto") -> Replica:
        """Inside an actor, after a load that succeeded: offer the version the targets hold to the loaders with the
        same wants (data-parallel replicas), which ``load(replica)`` from here instead of from the trainer ranks:
        one copy of each slice crosses a trainer's link. The targets are read as they are (no copy), so this
        loader's next load first fences the offer (waiting for its readers at most half that load's timeout);
        a replica that reads after gets VersionGoneError."""
        if self._held is None:
            raise InvalidArgumentError("share() offers the version a load landed; this loader holds none (no load "
                                       "yet, or the last one failed)", hint="call loader.load(manifest) first")
        if self._shared is None or self._shared.version != self._held:
            self._shared = _replica.offer(self._wants, self._held, tensor_transport, self._stream, reads.who())
        return self._shared

    def _load_replica(self, replica: Replica, timeout: float, verify: bool) -> LoadReport:
        """Every target whole from the same target of the loader that shared ``replica`` (checked to have the same
        wants before any byte moves)."""
        if self._mirror is None:
            wants = [_Want(name, t, (region,), 0, False) for name, t, region in _replica.mirror(self._wants, replica)]
            self._mirror = (wants, None, _replica.signature(self._wants))
        wants, plan, sig = self._mirror
        _replica.check(sig, len(wants), replica)
        plan, report = self._run(wants, plan, replica.manifest, timeout, verify)
        self._mirror = (wants, plan, sig)
        return report

    def _run(self, wants: List[_Want], plan: Optional[_Plan], manifest: Manifest, timeout: float,
             verify: bool) -> Tuple[_Plan, LoadReport]:
        """Plan (or replay) ``wants`` against ``manifest`` and land its bytes; (the plan, what the load did)."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise InvalidArgumentError(f"timeout must be a number of seconds > 0, got {timeout!r}",
                                       hint="pass e.g. timeout=60.0")
        if not isinstance(verify, bool):
            raise InvalidArgumentError(f"verify must be True or False, got {verify!r}", hint="pass verify=True")
        start = time.monotonic()
        deadline = start + timeout
        planned = plan is None or plan.key != manifest.layout_key
        if planned:
            _targets_free([w.landing if w.landing is not None else w.target for w in wants]
                          + (_stagings(plan) if plan is not None else []), timeout)
            plan = _new_plan(wants, manifest)
            self.plans += 1
        else:
            _targets_free(plan.keep + _stagings(plan), timeout)
            self.replays += 1
        assert plan is not None
        by_rank = {s.rank: s for s in manifest.shards}
        report = LoadReport(manifest.version, planned, plan.nbytes)
        check = verify_with([w.name for w in wants], plan.keep, deadline) if verify else None
        dsts = dict(zip((p.rank for p in plan.pulls), plan.destinations()))
        keep, addrs = plan.keep, plan.addrs
        _read_all(_executor(), plan.pulls, by_rank, lambda p: _Prep(by_rank[p.rank], p, dsts[p.rank], keep, addrs),
                  lambda prep: _pull(prep, deadline, check), deadline, report, lambda: self._fence_shared(deadline))
        for w in wants:
            if w.landing is not None:
                w.target.copy_(w.landing)
        self._held = manifest.version
        report.seconds = time.monotonic() - start
        return plan, report

    def _fence_shared(self, deadline: float) -> None:
        """Once every source let this load in, before it lands a byte: the targets no longer hold a whole version,
        and the one share() offered is closed to new readers, its readers in flight waited for at most half the
        time left (one still in flight after that fails at its end, told its bytes may be torn)."""
        self._held = None
        shared, self._shared = self._shared, None
        if shared is None:
            return
        try:
            shared.shards.fence(timeout=max((deadline - time.monotonic()) / 2, 1e-3))
        except FenceTimeoutError as e:
            logger.warning("rdt: %s; loading the next version anyway", e)


def _stagings(plan: _Plan) -> List[torch.Tensor]:
    """The staging buffers of the plan's covering reads (a timed-out read may still land in them)."""
    return [rp.staging for p in plan.pulls for rp in p.reads.values() if rp is not None and rp.staging is not None]


def _new_plan(wants: List[_Want], manifest: Manifest) -> _Plan:
    """The plan of ``wants`` against ``manifest``'s layout, with what every replay derives from it."""
    pulls = _make_plan(wants, manifest)
    for p in pulls:
        p.used = tuple(np.unique(p.target).tolist())
        p.nbytes = int(p.n.sum())
    keep = [w.landing if w.landing is not None else w.target for w in wants]
    return _Plan(manifest.layout_key, pulls, keep, sum(p.nbytes for p in pulls), [w.name for w in wants])


class _Readers(TransportState):
    """The process's pool of reading threads for sharded loads (bounded, made once; loads only wait on it, never
    nest in it), held by the process context so it ends with it and a forked child makes its own."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(MAX_PARALLEL, thread_name_prefix="rdt-shards")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _executor() -> ThreadPoolExecutor:
    """This process's reading threads (see :class:`_Readers`)."""
    from .._process.context import get_context

    return get_context().transport_state("sharded-readers", _Readers).pool


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous CPU tensors share any byte."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _make_plan(wants: List[_Want], manifest: Manifest) -> List[_Pulls]:
    """Check every want against the manifest and turn it into runs per producer rank (before any byte moves)."""
    runs_by_rank: Dict[int, List[Tuple[np.ndarray, ...]]] = {}
    for ti, w in enumerate(wants):
        src_dtype = _check_want(w, manifest)
        itemsize = torch.empty((), dtype=src_dtype).element_size()
        cat_at = 0
        for region in w.regions:
            info = manifest.holders[region.param][0][1]
            box = region.box(info.global_shape, w.name)
            extent = [hi - lo for lo, hi in box]
            dst_shape = list(w.target.shape) or [1]
            for rank, leaf, pinfo in _holders(manifest, region.param, box, ti):
                part = intersect(box, pinfo.box)
                assert part is not None
                src_shape = [hi - lo for lo, hi in pinfo.box]
                src_lo = [a - b for (a, _), (b, _) in zip(part, pinfo.box)]
                dst_lo = [a - b for (a, _), (b, _) in zip(part, box)]
                if w.target.dim():
                    dst_lo[w.dim] += cat_at
                s, d, length = runs(src_shape, src_lo, dst_shape if w.target.dim() else [], dst_lo,
                                    [hi - lo for lo, hi in part])
                runs_by_rank.setdefault(rank, []).append(
                    (np.full(len(s), leaf, np.int64), s * itemsize, np.full(len(s), ti, np.int64), d * itemsize,
                     np.full(len(s), length * itemsize, np.int64)))
            if w.target.dim():
                cat_at += extent[w.dim]
        if w.cast:
            w.landing = torch.empty(w.target.shape, dtype=src_dtype)
    out = []
    for rank, parts in sorted(runs_by_rank.items()):
        cols = [np.concatenate(c) for c in zip(*parts)]
        out.append(_Pulls(rank, *_merge(*cols), groups=cover.groups(parts)))
    return out


def _merge(leaf: np.ndarray, src: np.ndarray, target: np.ndarray, dst: np.ndarray,
           n: np.ndarray) -> Tuple[np.ndarray, ...]:
    """Adjacent runs (same leaf and target, contiguous on both sides) joined into one."""
    order = np.lexsort((src, leaf))
    leaf, src, target, dst, n = leaf[order], src[order], target[order], dst[order], n[order]
    if len(n) < 2:
        return leaf, src, target, dst, n
    joins = (leaf[1:] == leaf[:-1]) & (target[1:] == target[:-1]) & (src[1:] == src[:-1] + n[:-1]) \
        & (dst[1:] == dst[:-1] + n[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    total = np.add.reduceat(n, starts)
    return leaf[starts], src[starts], target[starts], dst[starts], total


def _check_want(w: _Want, manifest: Manifest) -> torch.dtype:
    """The source dtype of ``w`` after checking its regions exist, agree, fit the target and its dtype."""
    infos: List[ParamInfo] = []
    for r in w.regions:
        held = manifest.holders.get(r.param)
        if held is None:
            raise InvalidArgumentError(f"target {w.name!r} wants {r.param!r}, which no rank of version "
                                       f"{manifest.version} publishes", hint="check the parameter's name")
        infos.append(held[0][1])
    dtypes = {i.dtype for i in infos}
    if len(dtypes) > 1:
        raise InvalidArgumentError(f"target {w.name!r} concatenates parameters of dtypes {sorted(dtypes)}",
                                   hint="fuse parameters of one dtype into one target")
    src = getattr(torch, dtypes.pop())
    if src != w.target.dtype and not w.cast:
        raise InvalidArgumentError(f"target {w.name!r} is {w.target.dtype}, {infos[0].name!r} is published as {src}",
                                   hint="pass cast=True to convert, or want into a target of the published dtype")
    shape: Optional[List[int]] = None
    for r, i in zip(w.regions, infos):
        ext = [hi - lo for lo, hi in r.box(i.global_shape, w.name)]
        if w.target.dim() == 0:
            ext = ext or [1]
        if shape is None:
            shape = ext
        elif len(ext) != len(shape) or any(a != b for k, (a, b) in enumerate(zip(ext, shape)) if k != w.dim):
            raise InvalidArgumentError(f"target {w.name!r}: region of {r.param!r} is {ext}, the first is {shape}; "
                                       f"they must agree except along dim {w.dim}", hint="check the narrows")
        else:
            shape[w.dim] += ext[w.dim]
    want = list(w.target.shape) or [1]
    if shape != want:
        raise InvalidArgumentError(f"target {w.name!r} is {tuple(w.target.shape)}, its regions make {tuple(shape)}",
                                   hint="size the target as the regions concatenated along dim")
    return src


def _holders(manifest: Manifest, param: str, box: Any, salt: int) -> List[Tuple[int, int, ParamInfo]]:
    """(rank, leaf index, param info) of one holder per distinct shard box meeting ``box`` (replicas: spread by
    ``salt`` so that targets read from different replicas)."""
    by_box: Dict[Any, List[Tuple[int, int, ParamInfo]]] = {}
    for shards, info in manifest.holders[param]:
        if intersect(box, info.box) is not None:
            leaf = next(i for i, p in enumerate(shards.params) if p.name == param)
            by_box.setdefault(info.box, []).append((shards.rank, leaf, info))
    return [held[salt % len(held)] for held in by_box.values()]


def _targets_free(targets: List[torch.Tensor], timeout: float) -> None:
    """Wait, at most ``timeout``, until no earlier load's timed-out read may still write into ``targets`` (it would
    overwrite this load's bytes when it ends); raises IntoBusyError naming it, having moved nothing."""
    from .._process.context import get_context

    start = time.monotonic()
    holds = get_context().busy_targets.wait_free(targets, timeout)
    if holds:
        raise IntoBusyError(
            f"the load's targets are still being written by {holds[0].what}, which timed out "
            f"{time.monotonic() - holds[0].since:.1f}s ago and is still in flight; waited "
            f"{time.monotonic() - start:.1f}s, nothing was moved",
            hint="load into other tensors meanwhile, or retry later: that read ends when its trainer serves it or "
                 "dies (kill a stuck trainer and it ends at once, leaving the targets free)")


def _read_all(pool: ThreadPoolExecutor, pulls: List[_Pulls], by_rank: Dict[int, Shards],
              prepare: Callable[[_Pulls], "_Prep"], read: Callable[["_Prep"], Tuple[str, int, float, int, int]],
              deadline: float, report: LoadReport, before: Callable[[], None]) -> None:
    """Register every rank's read with its producer (a version gone or a rank dead fails here, before any byte
    moves) and ``prepare`` it, call ``before``, then read every rank at once, each ending its registration as soon
    as its read is done; a read its version did not hold through (the producer updated the weights meanwhile)
    fails with VersionGoneError. The rank registered last calls ``before`` and starts the reads on its own thread,
    so that no thread has to wake up between the registrations and the first byte."""
    from .._process.context import get_context

    run = _Reads(get_context(), pool, pulls, by_rank, prepare, read, deadline, before)
    done, errors = run.wait()
    if errors:  # a rank's own failure first: a group aborted by a sibling's timeout is its consequence
        raise next((e for e in errors if not isinstance(e, GroupDestroyedError)), errors[0])
    for rank, ((label, checked, seconds, covered, moved), _) in done.items():
        report.paths[rank] = label
        report.verified_bytes += checked
        report.verify_seconds += seconds
        report.read_bytes += moved
        if covered:
            report.covered[rank] = covered
    torn = [rank for rank, (_, held) in sorted(done.items()) if not held]
    if torn:
        raise reads.gone(by_rank[torn[0]], "the producer updated it while this load read it (its fence gave up "
                         "waiting, or a newer version superseded it); the targets may hold torn bytes")


class _Reads:
    """One load's reads, rank by rank: register and prepare (every rank at once, the first on the calling thread),
    then, started by the rank registered last, read and end the registration (that rank's read on its own thread,
    the others on the pool). A failure before any read ends what registered and reads nothing."""

    def __init__(self, ctx: Any, pool: ThreadPoolExecutor, pulls: List[_Pulls], by_rank: Dict[int, Shards],
                 prepare: Callable[[_Pulls], "_Prep"], read: Callable[["_Prep"], Tuple[str, int, float, int, int]],
                 deadline: float, before: Callable[[], None]) -> None:
        self.ctx, self.pool, self.pulls, self.by_rank = ctx, pool, pulls, by_rank
        self.prepare, self.read, self.deadline, self.before = prepare, read, deadline, before
        self.lock = threading.Lock()
        self.readers: Dict[int, bytes] = {}
        self.preps: Dict[int, _Prep] = {}
        self.errors: Dict[int, BaseException] = {}
        self.done: Dict[int, Any] = {}
        self.registering = self.reading = len(pulls)
        self.finished = threading.Event()
        for p in pulls[1:]:
            pool.submit(self._register, p)
        if pulls:
            self._register(pulls[0])
        else:
            self.finished.set()

    def wait(self) -> Tuple[Dict[int, Any], List[BaseException]]:
        """(per rank: the read's result and whether the version held), the errors in rank order; once all ended."""
        # Every step is bounded by the deadline (its end round trips by a second more); the margin only guards
        # against a bug here turning into a hang.
        if not self.finished.wait(max(self.deadline - time.monotonic(), 0.0) + 30.0):
            raise TransferTimeoutError(f"the reads of {len(self.pulls)} producer rank(s) did not end in time",
                                       hint="a bug in rdt: please report it with the log")
        return self.done, [self.errors[r] for r in sorted(self.errors)]

    def _register(self, p: _Pulls) -> None:
        try:
            self.readers[p.rank] = reads.begin(self.ctx, self.by_rank[p.rank], self.deadline)
            self.preps[p.rank] = self.prepare(p)
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self.errors[p.rank] = e
        if self._last("registering"):
            self._start(p)

    def _last(self, counter: str) -> bool:
        """Count one rank out of ``counter`` ("registering" or "reading"): whether it was the last."""
        with self.lock:
            left = getattr(self, counter) - 1
            setattr(self, counter, left)
            return left == 0

    def _end_quietly(self, p: _Pulls, end_by: float) -> None:
        """End rank ``p``'s registration after a failure (bounded, best effort: the failure is what is raised)."""
        try:
            reads.end(self.ctx, self.by_rank[p.rank], self.readers[p.rank], end_by)
        except Exception:  # noqa: BLE001 - see above
            pass

    def _start(self, mine: _Pulls) -> None:
        """(the rank registered last) ``before``, then every rank's read; or, after a failure, end what began."""
        if not self.errors:
            try:
                self.before()
            except BaseException as e:  # noqa: BLE001 - the registered reads still end below
                self.errors[-1] = e
        if self.errors:  # nothing was read: end what began (bounded, best effort) so that no fence waits for it
            end_by = time.monotonic() + 0.5
            for p in self.pulls:
                if p.rank in self.readers:
                    self._end_quietly(p, end_by)
            self.finished.set()
            return
        for p in self.pulls:
            if p is not mine:
                self.pool.submit(self._read, p)
        self._read(mine)

    def _read(self, p: _Pulls) -> None:
        reader, shards = self.readers[p.rank], self.by_rank[p.rank]
        try:
            got = self.read(self.preps[p.rank])
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self.errors[p.rank] = e
            self._end_quietly(p, time.monotonic() + 0.5)  # a failed read still ends its registration
        else:
            try:
                self.done[p.rank] = (got, reads.end(self.ctx, shards, reader, max(self.deadline,
                                                                                   time.monotonic() + 1.0)))
            except BaseException as e:  # noqa: BLE001 - reported by wait()
                self.errors[p.rank] = e
        if self._last("reading"):
            self.finished.set()


def verify_with(names: List[str], keep: List[torch.Tensor], deadline: float) -> Callable[..., int]:
    """The check run after a rank's read when ``verify=True``: its landed bytes against the producer's sums."""
    from .._process.context import get_context

    landed = reads.landed_bytes(keep)

    def check(shards: Shards, pulls: _Pulls, buf: np.ndarray, off: np.ndarray) -> int:
        return reads.verify(get_context(), shards, pulls.leaf, buf, off, pulls.n, landed, pulls.target, pulls.dst,
                            names, deadline)

    return check


def _itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named as metadata names it (looked up once per dtype)."""
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return size


def _sources(meta: ObjectMeta, leaf: np.ndarray, src: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Per run (its leaf and byte offset in the leaf), the producer buffer it is read from and the byte offset in
    that buffer, from this publication's own metadata (never kept across publications)."""
    specs = meta.specs  # columns: read them as arrays, no TensorSpec made per leaf
    size = np.array([_itemsize(name) for name in specs.names], np.int64)
    buf = np.asarray(specs.buffer, np.int64)
    base = np.asarray(specs.offset, np.int64) * size[np.asarray(specs.dtype, np.int64)]
    return buf[leaf], base[leaf] + src


class _Prep:
    """One rank's read as far as it goes before a byte moves (from the caches on a replay): where its runs are read
    from and land, the transports to try in order, and each one's ranges (the first one's made now)."""

    def __init__(self, shards: Shards, pulls: _Pulls, dst: np.ndarray, keep: List[torch.Tensor],
                 addrs: np.ndarray) -> None:
        from .. import transports
        from .._ray.runtime import node_id

        meta: ObjectMeta = shards.meta
        self.shards, self.pulls, self.keep, self.addrs = shards, pulls, keep, addrs
        self.buf, self.off = pulls.sources.setdefault(None, _Sources()).of(meta, pulls.leaf, pulls.src)
        self.exact = transports.Ranges(self.buf, self.off, dst, pulls.n, [keep[i] for i in pulls.used])
        self.same_node = meta.producer.node_id == node_id()
        names = [n for n, _ in meta.exports]
        names += [meta.transport] if meta.transport != "auto" else [t.name for t in transports.auto_chain()]
        self.names = list(dict.fromkeys(names))
        self._ways: Dict[str, Tuple[Any, Optional[cover.ReadPlan], Any, int]] = {}
        self.way(self.names[0])

    def way(self, name: str) -> Tuple[Any, Optional[cover.ReadPlan], Any, int]:
        """How transport ``name`` reads these runs: (transport, read plan or None for exact runs, its Ranges,
        the staging buffer's address)."""
        way = self._ways.get(name)
        if way is None:
            from .. import transports
            from .._process.context import get_context

            transport = transports.get(name)
            rp = _read_plan(get_context(), self.pulls, transport, len(self.keep))
            if rp is None:
                way = (transport, None, self.exact, 0)
            else:
                ranges, staging = _covering(self.shards.meta, rp, self.keep, self.addrs,
                                            self.pulls.sources.setdefault(name, _Sources()))
                way = (transport, rp, ranges, staging)
            self._ways[name] = way
        return way


def _pull(prep: _Prep, deadline: float, check: Optional[Callable[..., int]] = None
          ) -> Tuple[str, int, float, int, int]:
    """Land one rank's runs, then check them when asked: (label of the path that served, bytes checked, seconds
    the check took, groups read covering, bytes moved). Errors name the rank."""
    label, covered, moved = _land(prep, deadline)
    if check is None or label == "whole:inline":  # inline: the bytes are the manifest's own copy
        return label, 0, 0.0, covered, moved
    t0 = time.monotonic()
    checked = check(prep.shards, prep.pulls, prep.buf, prep.off)
    return label, checked, time.monotonic() - t0, covered, moved


def _read_plan(ctx: Any, pulls: _Pulls, transport: Any, staging_index: int) -> Optional[cover.ReadPlan]:
    """How ``transport`` reads this rank's runs: None for exact runs, else a plan with covering reads (decided once
    per plan from the transport's declared range costs, or rdt.configure(range_costs=)'s)."""
    name = transport.name
    if name in pulls.reads:
        return pulls.reads[name]
    caps = transport.capabilities
    run_s, bytes_per_s = ctx.config.range_costs.get(name) or (caps.range_run_s, caps.range_bytes_per_s)
    rp = None
    if run_s is not None and bytes_per_s and pulls.groups is not None:
        covered = cover.decide(pulls.groups, run_s, bytes_per_s)
        if covered.any():
            rp = cover.plan(pulls.groups, covered, staging_index, _merge)
    pulls.reads[name] = rp
    return rp


def _covering(meta: ObjectMeta, rp: cover.ReadPlan, keep: List[torch.Tensor], addrs: np.ndarray,
              cache: _Sources) -> Tuple[Any, int]:
    """The Ranges of a read plan with covering reads (``addrs``: the targets' addresses) and the staging buffer's
    address."""
    from .. import transports

    buf, off = cache.of(meta, rp.leaf, rp.src)
    staging = rp.staging_tensor()
    everywhere = np.append(addrs, np.uint64(staging.data_ptr()))
    if cache.addrs is None or not np.array_equal(everywhere, cache.addrs):
        cache.dst, cache.addrs = everywhere[rp.target] + rp.dst.astype(np.uint64), everywhere
    tensors = [keep[i] if i < len(keep) else staging for i in rp.used]
    return transports.Ranges(buf, off, cache.dst, rp.n, tensors), staging.data_ptr()


def _narrow(rp: cover.ReadPlan, keep: List[torch.Tensor], addrs: np.ndarray, staging: int) -> None:
    """Copy the covered groups' runs from the staging buffer into the targets: one strided copy per group whose
    runs step by one stride (a row-parallel slice), range by range for the others."""
    from rdt_transports._memcopy import copy_parts

    stage = rp.staging_tensor()
    flat: Dict[int, torch.Tensor] = {}
    for t, d0, ds, s0, ss, k, n in rp.strided:
        into = flat.get(t)
        if into is None:
            into = flat[t] = keep[t].reshape(-1).view(torch.uint8)
        torch.as_strided(into, (k, n), (ds, 1), into.storage_offset() + d0).copy_(
            torch.as_strided(stage, (k, n), (ss, 1), s0))
    target, dst, at, n = rp.narrow
    if len(n):
        copy_parts(list(zip((addrs[target] + dst.astype(np.uint64)).tolist(), (at + staging).tolist(), n.tolist())))


def _land(prep: _Prep, deadline: float) -> Tuple[str, int, int]:
    """Land one rank's runs; (the label of the path that served, groups read covering, bytes moved). Errors name
    the rank."""
    from .._process.context import get_context

    shards, pulls = prep.shards, prep.pulls
    meta: ObjectMeta = shards.meta
    ctx = get_context()
    try:
        for name in prep.names:
            transport, rp, ranges, staging = prep.way(name)
            label = transport.read_ranges(ctx, meta, ranges, prep.same_node, deadline)
            if label is not None and rp is not None:
                _narrow(rp, prep.keep, prep.addrs, staging)
            if label is not None:
                moved = pulls.nbytes if rp is None else rp.read_bytes
                ctx.stats.add(name, "in", moved, path=label)
                return label, 0 if rp is None else rp.covered, moved
        return _whole(ctx, meta, prep.exact, deadline), 0, meta.nbytes
    except (ProducerDiedError, ObjectFreedError, TransferTimeoutError) as e:
        raise type(e)(f"{shards.source} (version {shards.version}): {e}", rank=shards.rank,
                      object_id=meta.id_hex, hint=e.hint) from e
    except TimeoutError as e:  # a transport's own timeout (a NIXL READ that timed out is parked, its targets busy)
        raise TransferTimeoutError(
            f"{shards.source} (version {shards.version}): the range read did not finish in time: {e}",
            rank=shards.rank, object_id=meta.id_hex,
            hint="the targets stay busy until that read ends; the next load into them waits for it (kill a stuck "
                 "trainer and it ends at once); raise timeout= for huge models") from e


def _whole(ctx: Any, meta: ObjectMeta, ranges: Any, deadline: float) -> str:
    """Fetch the rank's shards whole (a transport that cannot serve ranges) and copy the runs out here."""
    from rdt_transports._memcopy import copy_parts

    from .._consumer.resolve import fetch_buffers

    fetched, name = fetch_buffers(ctx, meta, timeout=max(deadline - time.monotonic(), 1e-3))
    bases = np.array([b.data_ptr() for b in fetched.buffers], np.uint64)
    src = bases[ranges.buf] + ranges.off.astype(np.uint64)
    copy_parts(list(zip(ranges.dst.tolist(), src.tolist(), ranges.n.tolist())))
    ctx.stats.add(name, "in", meta.nbytes, path=fetched.label)
    return f"whole:{fetched.label}"
