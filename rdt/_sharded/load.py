"""The consumer's side of sharded sync: a :class:`WeightLoader` states what each target tensor wants (regions of
global parameters, concatenated for fused targets), plans once per layout which byte runs come from which producer
rank (``plan``), and on every ``load(manifest)`` registers its read with every rank, then reads every rank's runs at
once through the consumer's range road (``rdt._consumer.ranges``), straight into the targets."""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .._consumer import jobs
from .._consumer.ranges import readers
from .._consumer.versions import who
from .._objects import device_order
from .._process.context import get_context
from ..errors import FenceTimeoutError, InvalidArgumentError, TransferTimeoutError
from . import delta as _delta, rank_reads as _reads, register, replica as _replica
from .devices import check_target
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
        check_target(label, target, [w.target for w in self._wants])  # contiguous, CPU or CUDA, one device
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
        targets = [t for w in self._wants for t in (w.target, w.landing) if t is not None]
        return await jobs.run_async(jobs.Job(
            get_context(), functools.partial(self.load, source, timeout=timeout, verify=verify),
            targets + (self._plan.stagings() if self._plan is not None else []), "a WeightLoader.load_async"))

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
        after = device_order.current().mark(plan.device)  # device copies follow the caller's stream from here
        chains = {} if planned or plan.moved or plan.device.type != "cpu" else _reads.chains(kind, self._lineage, plan, by_rank)
        held_before = self._held
        ranks = [r for r, _ in plan.reads]
        delta_srcs = [(r, _reads.delta_shards(by_rank[r], d)) for r in ranks for d in chains.get(r, ()) if d.meta is not None]
        tokens = _reads.register_all(ctx, [by_rank[r] for r in ranks] + [d for _, d in delta_srcs], deadline,
                           optional=range(len(ranks), len(ranks) + len(delta_srcs)))
        readers_ = list(zip([by_rank[r] for r in ranks], tokens[:len(ranks)]))
        dreg: Dict[int, List[Tuple[Shards, bytes]]] = {}
        for (r, d), token in zip(delta_srcs, tokens[len(ranks):]):
            if token is None:
                chains.pop(r, None)  # its changes are no longer kept: this rank loads in full
            dreg.setdefault(r, []).append((d, token))
        for r, regs in dreg.items():
            if r not in chains:
                _reads.end_all(ctx, [(d, t) for d, t in regs if t is not None])
                dreg[r] = []
        try:
            self._fence_shared(deadline)
            reads = []
            for (rank, rr), (_, reader) in zip(plan.reads, readers_):
                shards = by_rank[rank]
                if rank in chains:
                    sizes = _reads.itemsizes(shards)
                    made = plan.delta_runs.get(rank)
                    if made is None:
                        made = plan.delta_runs[rank] = _delta.rank_runs(rr.runs, sizes)
                    dread = _delta.read_plan(chains[rank], rr.runs, sizes, made)
                    reads.append(jobs.Job(
                        ctx, functools.partial(_reads.delta_rank, ctx, shards, rr, reader, dreg.get(rank, []),
                                               chains[rank], dread, plan.keep, addrs, [w.name for w in wants]
                                               if verify else None, deadline),
                        [plan.keep[i] for i in rr.runs.used] + rr.stagings() + [dread.staging],
                        f"a sharded delta load's read of {shards.source} (version {manifest.version})",
                        instead=functools.partial(_reads.end_all, ctx, [(shards, reader)] + dreg.get(rank, []))))
                else:
                    reads.append(jobs.Job(
                        ctx, functools.partial(_reads.read_rank, ctx, shards, rr, reader, plan.keep, addrs,
                                               [w.name for w in wants] if verify else None, deadline, after),
                        [plan.keep[i] for i in rr.runs.used] + rr.stagings(),
                        f"a sharded load's read of {shards.source} (version {manifest.version})",
                        instead=functools.partial(register.end_quietly, ctx, shards, reader)))
        except BaseException:
            _reads.end_all(ctx, readers_ + [rt for regs in dreg.values() for rt in regs if rt[1] is not None])
            raise
        results = jobs.run_all(readers(ctx), reads, deadline)
        _reads.raise_first([r for r in results if isinstance(r, BaseException)])
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
                changes = _reads.merge_changes(changes, out.changes)
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


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte (tensors on different devices never do)."""
    if a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


__all__: List[str] = ["LoadReport", "WeightLoader"]
