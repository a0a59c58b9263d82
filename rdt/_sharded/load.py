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
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from .._consumer import jobs
from .._consumer.ranges import Landed, RangeRead, fetch_ranges, readers
from .._consumer.versions import who
from .._objects import device_order
from .._process.context import get_context
from ..errors import FenceTimeoutError, GroupDestroyedError, InvalidArgumentError, TransferTimeoutError
from . import register, replica as _replica, verify as _verify
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

    @property
    def mode(self) -> str:
        """How the bytes were read: "exact runs", "covering reads", "whole fetch", or several joined by " + "."""
        kinds = {"whole fetch" if p.startswith("whole:") else "covering reads" if self.covered.get(r) else
                 "exact runs" for r, p in self.paths.items()}
        return " + ".join(k for k in ("exact runs", "covering reads", "whole fetch") if k in kinds) or "none"


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
            if isinstance(source, Replica):
                return self._load_replica(source, deadline, verify)
            self._plan, report = self._run(self._wants, self._plan, source, deadline, verify)
            return report

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
                self._shared = _replica.offer(self._wants, self._held, tensor_transport, self._stream, who())
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
        plan, report = self._run(wants, plan, source.manifest, deadline, verify)
        self._mirror = (wants, plan, sig)
        return report

    def _run(self, wants: List[Want], plan: Optional[Plan], manifest: Manifest, deadline: float,
             verify: bool) -> Tuple[Plan, LoadReport]:
        """Plan (or replay) ``wants`` against ``manifest`` and land its bytes; (the plan, what the load did)."""
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
        if verify:
            _verify_on_host(plan, [by_rank[r] for r, _ in plan.reads])
        after = device_order.current().mark(plan.device)  # device copies follow the caller's stream from here
        readers_ = _register(ctx, [by_rank[r] for r, _ in plan.reads], deadline)
        try:
            self._fence_shared(deadline)
        except BaseException:
            _end_all(ctx, readers_)
            raise
        names = [w.name for w in wants]
        reads = [jobs.Job(ctx, functools.partial(_read_rank, ctx, by_rank[rank], rr, reader, plan.keep, addrs,
                                                 names if verify else None, deadline, after),
                          [plan.keep[i] for i in rr.runs.used] + rr.stagings(),
                          f"a sharded load's read of {by_rank[rank].source} (version {manifest.version})",
                          instead=functools.partial(register.end_quietly, ctx, by_rank[rank], reader))
                 for (rank, rr), (_, reader) in zip(plan.reads, readers_)]
        results = jobs.run_all(readers(ctx), reads, deadline)
        _raise_first([r for r in results if isinstance(r, BaseException)])
        for (rank, _), (landed, checked, seconds, held) in zip(plan.reads, results):
            if not held:
                raise register.gone(by_rank[rank], "the producer updated it while this load read it (its fence gave "
                                    "up waiting, or a newer version superseded it); the targets may hold torn bytes")
            report.paths[rank] = landed.label
            report.read_bytes += landed.moved
            report.verified_bytes += checked
            report.verify_seconds += seconds
            if landed.covered:
                report.covered[rank] = landed.covered
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


def _register(ctx: Any, sources: List[Shards], deadline: float) -> List[Tuple[Shards, bytes]]:
    """Register a read with every rank at once (a version gone or a rank dead fails here, before any byte moves);
    per rank (its shards, the reader's token). After any failure, or a caller that stops waiting, every
    registration made, or made later, is ended, so that no fence waits for it."""
    made: Dict[int, bytes] = {}
    lock = threading.Lock()
    gave_up = threading.Event()

    def one(i: int) -> None:
        token = register.begin(ctx, sources[i], deadline)
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
    return [(s, made[i]) for i, s in enumerate(sources)]


def _end_all(ctx: Any, begun: List[Tuple[Shards, bytes]]) -> None:
    """End registrations after a failure (bounded: half a second in all)."""
    by = time.monotonic() + 0.5
    for shards, token in begun:
        register.end_quietly(ctx, shards, token, max(by - time.monotonic(), 1e-3))


def _read_rank(ctx: Any, shards: Shards, rr: RangeRead, reader: bytes, keep: List[torch.Tensor], addrs: Any,
               names: Optional[List[str]], deadline: float, after: Any = None) -> Tuple[Landed, int, float, bool]:
    """(a reading thread) Land one rank's runs, check them when asked, end the registration: (what landed, bytes
    checked, seconds the check took, whether the version held). A failure ends the registration and names the
    rank. The registration ends only once the road returned, which for device copies is once they finished on the
    device (``device_order``): the producer's fence, which waits for it, cannot race a copy still reading."""
    try:
        landed = fetch_ranges(ctx, shards.meta, rr, keep, addrs, deadline, after)
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
    return landed, checked, seconds, register.end(ctx, shards, reader, max(deadline, time.monotonic() + 1.0))


def _verify_on_host(plan: Plan, sources: List[Shards]) -> None:
    """``verify=True`` checksums CPU bytes for now: refused, before anything moves, for device targets or shards."""
    where = [f"the targets ({plan.device})"] if plan.device.type != "cpu" else []
    where += [s.source for s in sources if s.meta is not None and s.meta.buffers.device_types != {"cpu"}][:3]
    if where:
        raise InvalidArgumentError(
            f"verify=True checksums bytes in CPU memory, and {', '.join(where)} hold them on a GPU",
            hint="load without verify=True (device checksums are not available yet), or compare the targets "
                 "yourself")


def _raise_first(errors: List[BaseException]) -> None:
    """Raise a rank's own failure first: a group aborted by a sibling's timeout is its consequence."""
    if errors:
        raise next((e for e in errors if not isinstance(e, GroupDestroyedError)), errors[0])


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte (tensors on different devices never do)."""
    if a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


__all__: List[str] = ["LoadReport", "WeightLoader"]
