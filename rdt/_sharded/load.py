"""The consumer's side of sharded sync: a :class:`WeightLoader` states what each target tensor wants (regions of
global parameters, concatenated for fused targets), plans once per layout which byte runs come from which producer
rank (``plan``), and on every ``load(manifest)`` registers its read with every rank, then reads every rank's runs at
once through the consumer's range road (``rdt._consumer.ranges``), straight into the targets."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .._consumer import jobs
from .._consumer.ranges import Landed, RangeRead, fetch_ranges, readers, sources
from .._consumer.versions import who
from .._process.context import get_context
from ..errors import (ChecksumMismatchError, FenceTimeoutError, GroupDestroyedError, InvalidArgumentError,
                      ObjectFreedError, TransferTimeoutError, VersionGoneError)
from . import delta as _delta, register, replica as _replica, verify as _verify
from .layout import Region
from .plan import Plan, Want, make
from .publish import Manifest, Shards
from .replica import Replica

logger = logging.getLogger(__name__)


@dataclass
class LoadReport:
    """What one ``load`` did: the version, whether it made a new plan (False: replayed), the bytes that landed,
    the path that served each producer rank ("shm-direct", "nixl", "gloo-ranges"; "whole:<label>" where the rank's
    shards were fetched whole and narrowed here), and the seconds it took. With ``verify=True``: the bytes checked
    against the producers' checksums and the seconds the checks took, summed over the ranks (they run in parallel,
    each after its rank's read)."""

    version: int
    planned: bool
    nbytes: int
    paths: Dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0
    verified_bytes: int = 0
    verify_seconds: float = 0.0
    covered: Dict[int, int] = field(default_factory=dict)  # per rank: strided groups read as one covering range
    read_bytes: int = 0  # bytes the reads moved (more than nbytes where covering reads or whole fetches served)
    delta: Dict[int, int] = field(default_factory=dict)  # per rank loaded as changes: the versions' changes applied
    changed_elements: int = 0  # elements the changes wrote (delta ranks; see docs/weight-sync.md, "Deltas")
    delta_elements: int = 0  # elements the delta ranks' wants hold
    repaired: Dict[int, str] = field(default_factory=dict)  # per rank: why verify reloaded its slices in full

    @property
    def changed_fraction(self) -> Optional[float]:
        """The fraction of the delta ranks' wanted elements the changes wrote (None: no rank loaded changes)."""
        return self.changed_elements / self.delta_elements if self.delta_elements else None

    @property
    def mode(self) -> str:
        """How the bytes were read: "delta" (the changes since the version held), "exact runs", "covering
        reads", "whole fetch", or several joined by " + "."""
        kinds = {"delta" if r in self.delta else "whole fetch" if p.startswith("whole:") else "covering reads"
                 if self.covered.get(r) else "exact runs" for r, p in self.paths.items()}
        return " + ".join(k for k in ("delta", "exact runs", "covering reads", "whole fetch") if k in kinds) or \
            "none"


class WeightLoader:
    """A consumer's wants, planned once per manifest layout and replayed on every load.

    ``loader.want(qkv, [Region("q", 0, r * q, q), Region("k", 0, r * k, k), Region("v", 0, r * k, k)])`` fills
    ``qkv`` with its slices of q, k and v concatenated along dim 0; ``loader.load(manifest)`` pulls them. One load
    (or share) runs at a time: a second waits for it, within its own timeout."""

    def __init__(self) -> None:
        self._wants: List[Want] = []
        self._plan: Optional[Plan] = None  # made for one manifest layout key and these wants
        self._mirror: Optional[Tuple[List[Want], Optional[Plan], bytes]] = None  # reading replicas: wants, plan, sig
        self._held: Optional[int] = None  # the version every target holds (None: none, or a load failed)
        self._shared: Optional[Replica] = None  # what share() offered: fenced before the next load lands a byte
        self._stream = secrets.token_bytes(16)
        # per source ("trainer", rank) or ("replica", 0): (its lineage, version) the targets hold (delta loads)
        self._lineage: Dict[Tuple[str, int], Tuple[bytes, int]] = {}
        # after a load made of changes: the version it held before and per want the element positions it wrote
        # (None: every element): what share() offers replicas as changes
        self._changes: Optional[Tuple[int, Dict[int, Optional[List[np.ndarray]]]]] = None
        self._offered: "OrderedDict[int, _delta.Delta]" = OrderedDict()  # the changes share() offered, newest last
        self._busy = threading.Lock()  # one load, want or share at a time
        self.plans = 0  # plans made (a changed layout or new wants make a new one)
        self.replays = 0  # loads that reused the plan

    def want(self, target: torch.Tensor, regions: Union[Region, Sequence[Region]], *, dim: int = 0,
             cast: bool = False, name: Optional[str] = None) -> None:
        """``target`` receives ``regions`` (one, or several concatenated along ``dim``); ``cast=True`` allows a
        source dtype other than the target's (the bytes land in a staging tensor, then are converted). The new
        target holds no version yet, so until the next load succeeds ``share()`` offers nothing."""
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
        with self._exclusive(60.0, "want()"):
            for w in self._wants:
                if _overlap(w.target, target):
                    raise InvalidArgumentError(f"target {label!r} overlaps the bytes of target {w.name!r}",
                                               hint="give every want its own tensor (or disjoint views of one)")
            self._wants.append(Want(label, target, regs, dim % max(target.dim(), 1), bool(cast)))
            self._plan = self._mirror = None
            self._held = None
            self._lineage, self._changes = {}, None

    def load(self, source: Union[Manifest, Replica], *, timeout: float = 60.0, verify: bool = False) -> LoadReport:
        """Pull every want's bytes of a version into the targets: from the trainer ranks of a ``Manifest``, or whole
        from a ``Replica`` that a loader with the same wants shared. Everything is checked before a byte moves,
        each source's read included: a version that is gone raises VersionGoneError, a rank that died
        ProducerDiedError, naming it. The targets hold that version on return, never torn bytes (a read the
        version did not hold through raises VersionGoneError). ``verify=True`` checks the landed bytes against
        the sources' checksums (ChecksumMismatchError names the parameter and rank). A load that failed leaves its
        targets undefined, and no byte of it lands after it raised."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise InvalidArgumentError(f"timeout must be a number of seconds > 0, got {timeout!r}",
                                       hint="pass e.g. timeout=60.0")
        if not isinstance(verify, bool):
            raise InvalidArgumentError(f"verify must be True or False, got {verify!r}", hint="pass verify=True")
        if not isinstance(source, (Manifest, Replica)):
            raise InvalidArgumentError(f"load takes an rdt.Manifest or rdt.Replica, got {type(source).__name__}",
                                       hint="rdt.Manifest(ray.get([t.publish.remote(step) for t in trainers]))")
        deadline = time.monotonic() + timeout
        with self._exclusive(timeout, "load()"):
            try:
                if isinstance(source, Replica):
                    return self._load_replica(source, deadline, verify)
                self._plan, report = self._run(self._wants, self._plan, source, deadline, verify, "trainer")
                return report
            except BaseException:
                self._lineage, self._changes = {}, None  # a failed load: the next one is full
                raise

    async def load_async(self, source: Union[Manifest, Replica], *, timeout: float = 60.0,
                         verify: bool = False) -> LoadReport:
        """``load`` for async actors (an inference engine's event loop keeps serving meanwhile). Cancelling the
        awaiting task cannot stop a load already running: it goes on until it ends (within ``timeout``), its
        targets stay marked busy and the loader held until then, so the next load waits for it; a load not yet
        begun never begins."""
        loop = asyncio.get_running_loop()
        targets = [t for w in self._wants for t in (w.target, w.landing) if t is not None]
        job = jobs.Job(get_context(), functools.partial(self.load, source, timeout=timeout, verify=verify),
                       targets + (self._plan.stagings() if self._plan is not None else []),
                       "a WeightLoader.load_async")
        try:
            return await loop.run_in_executor(None, job)
        except asyncio.CancelledError:
            job.abandon()
            raise

    def share(self, *, tensor_transport: str = "auto", timeout: float = 60.0) -> Replica:
        """Inside an actor, after a load that succeeded: offer the version the targets hold to the loaders with the
        same wants (data-parallel replicas), which ``load(replica)`` from here instead of from the trainer ranks:
        one copy of each slice crosses a trainer's link. The targets are read as they are (no copy), so this
        loader's next load first fences the offer (waiting for its readers at most half that load's timeout);
        a replica that reads after gets VersionGoneError. Waits (at most ``timeout``) for a load in flight."""
        with self._exclusive(timeout, "share()"):
            if self._held is None:
                raise InvalidArgumentError("share() offers the version a load landed; this loader holds none (no "
                                           "load yet, the last one failed, or a target was wanted since)",
                                           hint="call loader.load(manifest) first")
            if self._shared is None or self._shared.version != self._held:
                self._shared = _replica.offer(self._wants, self._held, tensor_transport, self._stream, who(),
                                              self._changes, self._offered)
            return self._shared

    @contextlib.contextmanager
    def _exclusive(self, timeout: float, what: str) -> Iterator[None]:
        """Hold the loader for ``what``, waiting at most ``timeout`` for the one in flight."""
        if not self._busy.acquire(timeout=max(timeout, 0.0)):
            raise TransferTimeoutError(f"{what} waited {timeout:.1f}s for this loader's load in flight",
                                       hint="a loader runs one load at a time: wait for it, or raise timeout=")
        try:
            yield
        finally:
            self._busy.release()

    def _load_replica(self, source: Replica, deadline: float, verify: bool) -> LoadReport:
        """Every target whole from the same target of the loader that shared ``source`` (checked to have the same
        wants before any byte moves)."""
        if self._mirror is None:
            wants = [Want(name, t, (region,), 0, False) for name, t, region in _replica.mirror(self._wants, source)]
            self._mirror = (wants, None, _replica.signature(self._wants))
        wants, plan, sig = self._mirror
        _replica.check(sig, len(wants), source)
        plan, report = self._run(wants, plan, source.manifest, deadline, verify, "replica")
        self._mirror = (wants, plan, sig)
        return report

    def _run(self, wants: List[Want], plan: Optional[Plan], manifest: Manifest, deadline: float,
             verify: bool, kind: str) -> Tuple[Plan, LoadReport]:
        """Plan (or replay) ``wants`` against ``manifest`` and land its bytes; (the plan, what the load did). A rank
        whose stream the targets hold an older version of (``kind`` names the sources) is loaded as the changes
        since (a delta load), the others in full."""
        start = time.monotonic()
        ctx = get_context()
        planned = plan is None or plan.key != manifest.layout_key
        busy = [w.landing if w.landing is not None else w.target for w in wants] if planned else plan.keep
        jobs.wait_free(ctx, busy + (plan.stagings() if plan is not None else []), deadline - start,
                       f"a load of version {manifest.version}")
        if planned:
            plan = make(wants, manifest)
            self.plans += 1
        else:
            self.replays += 1
        assert plan is not None
        addrs = plan.addresses()
        report = LoadReport(manifest.version, planned, plan.nbytes)
        by_rank = {s.rank: s for s in manifest.shards}
        chains = {} if planned or plan.moved else _chains(kind, self._lineage, plan, by_rank)
        held_before = self._held
        ranks = [r for r, _ in plan.reads]
        delta_srcs = [(r, _delta_shards(by_rank[r], d)) for r in ranks for d in chains.get(r, ()) if d.meta is not None]
        tokens = _register(ctx, [by_rank[r] for r in ranks] + [d for _, d in delta_srcs], deadline,
                           optional=range(len(ranks), len(ranks) + len(delta_srcs)))
        readers_ = list(zip([by_rank[r] for r in ranks], tokens[:len(ranks)]))
        dreg: Dict[int, List[Tuple[Shards, bytes]]] = {}
        for (r, d), token in zip(delta_srcs, tokens[len(ranks):]):
            if token is None:
                chains.pop(r, None)  # its changes are no longer kept: this rank loads in full
            dreg.setdefault(r, []).append((d, token))
        for r, regs in dreg.items():
            if r not in chains:
                _end_all(ctx, [(d, t) for d, t in regs if t is not None])
                dreg[r] = []
        try:
            self._fence_shared(deadline)
            reads = []
            for (rank, rr), (_, reader) in zip(plan.reads, readers_):
                shards = by_rank[rank]
                if rank in chains:
                    dread = _delta.read_plan(chains[rank], rr.runs, _itemsizes(shards))
                    reads.append(jobs.Job(
                        ctx, functools.partial(_delta_rank, ctx, shards, rr, reader, dreg.get(rank, []),
                                               chains[rank], dread, plan.keep, addrs, [w.name for w in wants]
                                               if verify else None, deadline),
                        [plan.keep[i] for i in rr.runs.used] + rr.stagings() + [dread.staging],
                        f"a sharded delta load's read of {shards.source} (version {manifest.version})",
                        instead=functools.partial(_end_all, ctx, [(shards, reader)] + dreg.get(rank, []))))
                else:
                    reads.append(jobs.Job(
                        ctx, functools.partial(_read_rank, ctx, shards, rr, reader, plan.keep, addrs,
                                               [w.name for w in wants] if verify else None, deadline),
                        [plan.keep[i] for i in rr.runs.used] + rr.stagings(),
                        f"a sharded load's read of {shards.source} (version {manifest.version})",
                        instead=functools.partial(register.end_quietly, ctx, shards, reader)))
        except BaseException:
            _end_all(ctx, readers_ + [rt for regs in dreg.values() for rt in regs if rt[1] is not None])
            raise
        results = jobs.run_all(readers(ctx), reads, deadline)
        _raise_first([r for r in results if isinstance(r, BaseException)])
        changes: Optional[Dict[int, Optional[List[np.ndarray]]]] = {} if chains and len(chains) == len(ranks) \
            else None
        for (rank, _), out in zip(plan.reads, results):
            if not out.held:
                raise register.gone(by_rank[rank], "the producer updated it while this load read it (its fence gave "
                                    "up waiting, or a newer version superseded it); the targets may hold torn bytes")
            landed = out.landed
            report.paths[rank] = landed.label
            report.read_bytes += landed.moved
            report.verified_bytes += out.checked
            report.verify_seconds += out.seconds
            if landed.covered:
                report.covered[rank] = landed.covered
            if out.delta is not None:
                report.delta[rank] = out.delta
                report.changed_elements += out.changed
                report.delta_elements += out.elements
            if out.repaired:
                report.repaired[rank] = out.repaired
            if changes is not None:
                if out.changes is None:
                    changes = None
                else:
                    for t, pos in out.changes.items():
                        if pos is None or changes.get(t, []) is None:
                            changes[t] = None
                        else:
                            changes.setdefault(t, []).append(pos)
        for w in wants:
            if w.landing is not None:
                w.target.copy_(w.landing)
        self._held = manifest.version
        self._lineage = {(kind, s.rank): (s.lineage, s.version) for s in manifest.shards if s.lineage is not None}
        self._changes = None
        if changes is not None and held_before is not None:  # sorted and made unique if share() asks
            self._changes = (held_before, changes)
        report.seconds = time.monotonic() - start
        return plan, report

    def _fence_shared(self, deadline: float) -> None:
        """Once every source let this load in, before it lands a byte: the targets no longer hold a whole version,
        and the one share() offered is closed to new readers, its readers in flight waited for at most half the
        time left (one still in flight after that fails at its end, told its bytes may be torn)."""
        self._held = None
        self._lineage, self._changes = {}, None
        shared, self._shared = self._shared, None
        if shared is None:
            return
        try:
            shared.shards.fence(timeout=max((deadline - time.monotonic()) / 2, 1e-3))
        except FenceTimeoutError as e:
            logger.warning("rdt: %s; loading the next version anyway", e)


def _register(ctx: Any, sources: List[Shards], deadline: float, optional: Sequence[int] = ()) -> List[Optional[bytes]]:
    """Register a read with every source at once (a version gone or a rank dead fails here, before any byte moves);
    per source the reader's token, None for an ``optional`` one that refused (its version gone: the caller reads
    otherwise). After any other failure, or a caller that stops waiting, every registration made, or made later,
    is ended, so that no fence waits for it."""
    made: Dict[int, bytes] = {}
    lock = threading.Lock()
    gave_up = threading.Event()
    maybe = set(optional)

    def one(i: int) -> None:
        try:
            token = register.begin(ctx, sources[i], deadline)
        except (VersionGoneError, ObjectFreedError):
            if i in maybe:
                return
            raise
        with lock:
            if not gave_up.is_set():
                made[i] = token
                return
        register.end_quietly(ctx, sources[i], token)

    try:
        results = jobs.run_all(readers(ctx), [jobs.Job(ctx, functools.partial(one, i), (), "a registration")
                                              for i in range(len(sources))], deadline)
        _raise_first([r for r in results if isinstance(r, BaseException)])
    except BaseException as e:
        with lock:
            gave_up.set()
            begun = [(sources[i], t) for i, t in made.items()]
        if isinstance(e, Exception):
            _end_all(ctx, begun)
        else:  # an interrupt: leave at once, the ends run behind
            readers(ctx).submit(_end_all, ctx, begun)
        raise
    return [made.get(i) for i in range(len(sources))]


def _end_all(ctx: Any, begun: List[Tuple[Shards, bytes]]) -> None:
    """End registrations after a failure (bounded: half a second in all)."""
    by = time.monotonic() + 0.5
    for shards, token in begun:
        register.end_quietly(ctx, shards, token, max(by - time.monotonic(), 1e-3))


@dataclass
class _Rank:
    """What one rank's read did: what landed, bytes checked and the check's seconds, whether the version held;
    for a delta load the versions of changes applied, the elements they wrote and the wanted elements, the
    positions written per target (None: all of them), and why verify reloaded it in full."""

    landed: Landed
    checked: int
    seconds: float
    held: bool
    delta: Optional[int] = None
    changed: int = 0
    elements: int = 0
    changes: Optional[Dict[int, Optional[np.ndarray]]] = None
    repaired: str = ""


def _read_rank(ctx: Any, shards: Shards, rr: RangeRead, reader: bytes, keep: List[torch.Tensor], addrs: Any,
               names: Optional[List[str]], deadline: float) -> _Rank:
    """(a reading thread) Land one rank's runs, check them when asked, end the registration. A failure ends the
    registration and names the rank."""
    try:
        landed = fetch_ranges(ctx, shards.meta, rr, keep, addrs, deadline)
        checked, seconds = 0, 0.0
        if names is not None and landed.label != "whole:inline":  # inline: the bytes are the manifest's own
            t0 = time.monotonic()
            checked = _verify.check(ctx, shards, rr.runs, landed, keep, names, deadline)
            seconds = time.monotonic() - t0
    except BaseException as e:
        register.end_quietly(ctx, shards, reader)
        named = register.named(shards, e)
        if named is e:
            raise
        raise named from e
    return _Rank(landed, checked, seconds, register.end(ctx, shards, reader, max(deadline, time.monotonic() + 1.0)))


def _delta_rank(ctx: Any, shards: Shards, rr: RangeRead, reader: bytes, dreg: List[Tuple[Shards, bytes]],
                chain: List[_delta.Delta], dread: _delta.DeltaRead, keep: List[torch.Tensor], addrs: Any,
                names: Optional[List[str]], deadline: float) -> _Rank:
    """(a reading thread) Land one rank's changes since the version the targets hold: each delta's records that
    its runs meet, scattered into the targets in order, and the parameters read whole from the full publication.
    With ``names`` (verify), every target byte of the rank is then checked against the producer's current slices;
    a mismatch (a target changed behind the loader's back) is repaired by a full read of the rank's runs, checked
    again. Ends every registration; a failure names the rank."""
    try:
        itemsizes = _itemsizes(shards)
        moved = written = 0
        label = ""
        written_at: Dict[int, Optional[List[np.ndarray]]] = {}  # per target: positions written (None: all)
        stage = np.array([dread.staging.data_ptr()], np.uint64)
        for spans in dread.spans:
            got = fetch_ranges(ctx, spans.delta.meta, RangeRead(spans.runs), [dread.staging], stage, deadline)
            moved += got.moved
            label = label or got.label
            parts: Dict[int, List[np.ndarray]] = {}
            written += _delta.apply(dread, spans, keep, itemsizes, parts)
            for t, ps in parts.items():
                if written_at.get(t, []) is not None:
                    written_at.setdefault(t, []).extend(ps)
        whole = _delta.whole_runs(rr.runs, dread)
        if whole is not None:
            got = fetch_ranges(ctx, shards.meta, RangeRead(whole), keep, addrs, deadline)
            moved += got.moved
            label = label or got.label
            for t in np.unique(whole.target).tolist():
                written_at[t] = None
        changes: Optional[Dict[int, Optional[np.ndarray]]] = {
            t: None if ps is None else np.concatenate(ps) for t, ps in written_at.items()}
        buf, off = sources(rr, shards.meta)
        landed = Landed(label or "delta", moved, 0, buf, off)
        checked, seconds, repaired = 0, 0.0, ""
        if names is not None:
            t0 = time.monotonic()
            try:
                checked = _verify.check(ctx, shards, rr.runs, landed, keep, names, deadline)
            except ChecksumMismatchError as e:  # a target changed behind the loader's back: load the rank in full
                repaired = e.message
                full = fetch_ranges(ctx, shards.meta, rr, keep, addrs, deadline)
                landed = Landed(full.label, moved + full.moved, full.covered, buf, off)
                changes = None
                checked = _verify.check(ctx, shards, rr.runs, landed, keep, names, deadline)
            seconds = time.monotonic() - t0
        wanted = sum(lr.wanted for lr in dread.leaves.values())
        changed = _delta.changed_estimate(chain, dread, written)
    except BaseException as e:
        _end_all(ctx, [(shards, reader)] + dreg)
        named = register.named(shards, e)
        if named is e:
            raise
        raise named from e
    held = register.end(ctx, shards, reader, max(deadline, time.monotonic() + 1.0))
    for d, token in dreg:
        held = register.end(ctx, d, token, max(deadline, time.monotonic() + 1.0)) and held
    return _Rank(landed, checked, seconds, held, None if repaired else len(chain), changed, wanted, changes,
                 repaired)


def _chains(kind: str, lineage: Dict[Tuple[str, int], Tuple[bytes, int]], plan: Plan,
            by_rank: Dict[int, Shards]) -> Dict[int, List[_delta.Delta]]:
    """Per rank whose stream the targets hold an older version of, with every change since still kept: the
    changes to apply, oldest first."""
    out: Dict[int, List[_delta.Delta]] = {}
    for rank, _ in plan.reads:
        held = lineage.get((kind, rank))
        s = by_rank[rank]
        if held is None or s.lineage is None or held[0] != s.lineage or not s.deltas or held[1] >= s.version:
            continue
        ds = list(s.deltas)
        first = next((i for i, d in enumerate(ds) if d.base == held[1]), None)
        if first is None:
            continue
        chain = ds[first:]
        if chain[-1].version == s.version and all(a.version == b.base for a, b in zip(chain, chain[1:])) and \
                all(len(d.kinds) == len(s.params) for d in chain):
            out[rank] = chain
    return out


def _delta_shards(shards: Shards, d: _delta.Delta) -> Shards:
    """The records object of one delta, as a registration sees it (its version, named after the rank)."""
    return Shards(shards.rank, d.version, (), d.meta,
                  source=f"{shards.source} (its changes from version {d.base} to {d.version})")


_ITEMSIZE: Dict[str, int] = {}


def _itemsizes(shards: Shards) -> List[int]:
    out = []
    for p in shards.params:
        size = _ITEMSIZE.get(p.dtype)
        if size is None:
            size = _ITEMSIZE[p.dtype] = torch.empty((), dtype=getattr(torch, p.dtype)).element_size()
        out.append(size)
    return out


def _raise_first(errors: List[BaseException]) -> None:
    """Raise a rank's own failure first: a group aborted by a sibling's timeout is its consequence."""
    if errors:
        raise next((e for e in errors if not isinstance(e, GroupDestroyedError)), errors[0])


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous CPU tensors share any byte."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


__all__: List[str] = ["LoadReport", "WeightLoader"]
