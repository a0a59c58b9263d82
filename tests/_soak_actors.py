"""Actors for the data-integrity soak (tests/test_soak.py): producers of random-shaped state dicts and consumers
that fetch them over every CPU path and check every byte.

A producer keeps a few *models* (state dicts of 1-1 000 tensors of mixed dtypes, with views and tied storages).
Each object it returns carries, in a second return value, the per-tensor digests taken at return: whatever a
consumer receives without an error must match them. *Snapshot models* are only ever returned with
``snapshot=True``, and a background thread changes or frees them at any time; *live models* are returned without
it and changed or freed only after ``rdt.wait_tensor_freed`` says no object holds them. A consumer keeps its
``into=`` targets across fetches and checks that their bytes change only during a successful fetch into them
(after a failed one: never, re-checked after twice its timeout, except where docs/fault-model.md says a path
may still write them). Only rdt's public API is used.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import ray
import torch

import rdt
import rdt_transports

Digests = List[Tuple[str, str]]
Layout = List[Tuple[str, Tuple[int, ...], str]]

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64)
INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
DTYPES = FLOATS + INTS + (torch.bool,)
TRANSPORTS = ("shm", "gloo", "nixl", "object_store", "auto")
# What a timed-out NIXL READ into targets says (docs/fault-model.md): it may still write them until it ends.
IN_FLIGHT = "may write into"


# ------------------------------------------------------------------------------------------------ digests
def tensor_digest(t: torch.Tensor) -> str:
    """dtype, shape and a hash of the tensor's bytes in logical order."""
    flat = t.detach().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # strided, or one element with any stride
        flat = torch.empty(flat.shape, dtype=flat.dtype).copy_(flat)
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    h = hashlib.blake2b(raw.numpy(), digest_size=16)
    return f"{str(t.dtype)[6:]}{tuple(t.shape)}:{h.hexdigest()}"


def value_digests(value: Dict[str, Any]) -> Digests:
    """Per key, in order: the tensor's digest, or the repr of a non-tensor leaf."""
    return [(k, tensor_digest(v) if isinstance(v, torch.Tensor) else repr(v)) for k, v in value.items()]


def value_bytes(value: Dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in value.values() if isinstance(v, torch.Tensor))


# ------------------------------------------------------------------------------------------------ models
@dataclass
class Base:
    """A tensor that owns its storage; ``key`` is None when only views of it are in the state dict."""

    key: Optional[str]
    dtype: torch.dtype
    shape: Tuple[int, ...]


@dataclass
class View:
    """A key that is a view of base ``base``: ``kind`` "slice", "strided", "t" (transposed) or "tied" (the base
    tensor itself under a second key)."""

    key: str
    base: int
    kind: str
    args: Tuple[int, ...] = ()


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))) if hi > lo else lo


def _shape(rng: random.Random, numel: int, empty: bool) -> Tuple[int, ...]:
    r = rng.random()
    if r < 0.04:
        return ()
    if r < 0.08 and empty:
        return (0,) if rng.random() < 0.5 else (0, 3)
    if r < 0.6 or numel < 4:
        return (numel,)
    for rows in (rng.randint(2, 64), 8, 4, 2):
        if numel % rows == 0:
            return (rows, numel // rows)
    return (numel,)


def plan_structure(seed: int, big: bool, min_bytes: int = 0,
                   plain: Optional[bool] = None) -> Tuple[List[Base], List[View], List[str]]:
    """The structure of a model (bases, views, key order), deterministic in ``seed``; re-drawn (seed + 1, ...)
    until its bases hold at least ``min_bytes``. ``plain``: a state dict of 16 or more tensors each alone on its
    storage and none empty (what rdt's many-tensor pass takes), or one with views, tied storages and empty
    tensors; None: either."""
    for attempt in range(1000):
        rng = random.Random(seed + attempt)
        style = rng.random() < 0.5 if plain is None else plain
        bases, views, order = _plan(rng, big, style)
        nbytes = sum(math.prod(b.shape) * torch.empty(0, dtype=b.dtype).element_size() for b in bases)
        if nbytes >= min_bytes and (not style or len(order) >= 16) and (style or views):
            break
    return bases, views, order


def _plan(rng: random.Random, big: bool, plain: bool) -> Tuple[List[Base], List[View], List[str]]:
    if big:  # weight-sync-like: a few large tensors (several relay chunks) and small ones
        n, budget = rng.randint(6, 40), rng.randint(9, 14) << 20
    else:
        n, budget = _log_uniform(rng, 1, 1000), _log_uniform(rng, 16 << 10, 4 << 20)
    bases: List[Base] = []
    views: List[View] = []
    order: List[str] = []
    large = set(rng.sample(range(n), min(3, n))) if big else set()
    for i in range(n):
        key = f"layer.{i}.{rng.choice(['weight', 'bias', 'scale', 'ids', 'mask'])}"
        order.append(key)
        r = 1.0 if plain else rng.random()
        usable = [j for j, b in enumerate(bases) if len(b.shape) >= 1 and math.prod(b.shape) >= 4]
        if usable and r < 0.06:
            views.append(View(key, rng.choice(usable), "tied"))
            continue
        if usable and r < 0.22:
            j = rng.choice(usable)
            numel = math.prod(bases[j].shape)
            kind = rng.choice(["slice", "strided", "t"])
            if kind == "slice":
                a = rng.randrange(numel)
                args: Tuple[int, ...] = (a, rng.randint(a, numel))
            elif kind == "strided":
                args = (rng.randrange(min(numel, 8)), rng.randint(2, 5))
            else:
                args = (next((r_ for r_ in (rng.randint(2, 16), 4, 2) if numel % r_ == 0), 1),)
            views.append(View(key, j, kind, args))
            continue
        dtype = rng.choice(DTYPES)
        es = torch.empty(0, dtype=dtype).element_size()
        if i in large:
            numel = budget // (4 * es)
        else:
            cap = (64 << 10) if big else budget // n
            numel = _log_uniform(rng, 1, max(1, cap // es))
        if not plain and rng.random() < 0.05:  # only a view of this storage is returned
            bases.append(Base(None, dtype, (numel,)))
            views.append(View(key, len(bases) - 1, "slice", (0, max(1, numel // 2))))
        else:
            bases.append(Base(key, dtype, _shape(rng, numel, empty=not plain)))
    return bases, views, order


def _fill(g: torch.Generator, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
    """Random values (no NaN: copies of every kind must keep every bit)."""
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype in INTS:
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, shape, dtype=torch.int64, generator=g).to(dtype)
    if dtype is torch.complex64:
        return torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)


def _view(base: torch.Tensor, v: View) -> torch.Tensor:
    flat = base.view(-1)
    if v.kind == "tied":
        return base
    if v.kind == "slice":
        return flat[v.args[0]:v.args[1]]
    if v.kind == "strided":
        return flat[v.args[0]::v.args[1]]
    return flat.view(v.args[0], -1).t()


class Model:
    """A state dict a producer returns again and again (changed or freed in between where that is allowed)."""

    def __init__(self, mid: int, seed: int, values: int, snap: bool, shared: bool, big: bool,
                 plain: Optional[bool]) -> None:
        """Structure from ``seed`` (every producer of a soak has the same models), values from ``values``."""
        self.mid, self.snap, self.shared, self.big = mid, snap, shared, big
        # shared models stay out of band (above the inline threshold), or no shm-map fetch would happen
        self.bases_plan, self.views_plan, self.keys = plan_structure(seed, big, 256 << 10 if shared else 0, plain)
        self.lock = threading.Lock()
        self.version = 0
        self.step = seed % 1000 if seed % 3 == 0 else None  # a non-tensor leaf in some models
        self.scratch: List[torch.Tensor] = []
        self.build(values)

    def build(self, seed: int) -> None:
        """New storages with new values (the old ones are dropped and their memory reused by garbage)."""
        g = torch.Generator().manual_seed(seed)
        self.bases = [_fill(g, b.dtype, b.shape) for b in self.bases_plan]
        if self.shared:
            for t in self.bases:
                t.share_memory_()
        self.value = self._assemble()

    def _assemble(self) -> Dict[str, Any]:
        named = {b.key: t for b, t in zip(self.bases_plan, self.bases) if b.key}
        named.update({v.key: _view(self.bases[v.base], v) for v in self.views_plan})
        out: Dict[str, Any] = {k: named[k] for k in self.keys}
        if self.step is not None:
            out["step"] = self.step + self.version
        return out

    def layout(self) -> Layout:
        return [(k, tuple(v.shape), str(v.dtype)[6:]) for k, v in self.value.items() if isinstance(v, torch.Tensor)]

    def mutate(self, rng: random.Random) -> None:
        """Change some storages in place (every view of them changes too)."""
        for t in rng.sample(self.bases, max(1, len(self.bases) // rng.randint(1, 4))):
            if t.numel() == 0:
                continue
            if t.dtype is torch.bool:
                t.logical_not_()
            elif t.dtype in INTS:
                t.bitwise_not_()
            else:
                t.add_(rng.randint(1, 7))
        self.version += 1
        if self.step is not None:  # a new dict: objects already returned keep their own structure
            self.value = {**self.value, "step": self.step + self.version}

    def free(self, rng: random.Random) -> None:
        """Drop every storage, fill memory of the same sizes with garbage, then build new ones."""
        sizes = [t.numel() * t.element_size() for t in self.bases]
        self.bases, self.value = [], {}  # the last references: freed here (no cycles)
        self.scratch = [torch.full((max(n, 1),), 0x5A, dtype=torch.uint8) for n in sizes]
        self.version += 1
        self.build(rng.randrange(1 << 30))


# ------------------------------------------------------------------------------------------------ producer
def _tm(transport: str, snap: bool):
    """An actor method returning (state dict, info) as two objects through a tensor_method; info holds the
    digests taken at return. A snapshot model's lock is held until rdt copied it (inside the decorated call)."""

    @rdt.tensor_method(tensor_transport=transport, snapshot=snap, num_returns=2)
    def produce(self: "SoakProducer", model: Model) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        return model.value, self._info(model)

    def make(self: "SoakProducer", mid: int) -> Any:
        model = self.models[mid]
        assert model.snap == snap
        with model.lock:
            return produce(self, model)

    make.__ray_num_returns__ = 2  # what produce's options say, on the method Ray calls
    return make


@ray.remote(num_cpus=0)
class SoakProducer:
    """Keeps models, returns them over every transport, and changes or frees them where allowed."""

    for _t in TRANSPORTS:
        for _s in (False, True):
            locals()[f"tm_{_t}_{int(_s)}"] = _tm(_t, _s)
    del _t, _s

    def __init__(self, seed: int, values: int, config: Dict[str, Any]) -> None:
        """Models of structures drawn from ``seed`` (the same in every producer: a consumer's targets for model i
        take any producer's model i) and values from ``values``."""
        rdt.configure(**config)
        rng, vals = random.Random(seed), random.Random(values)
        # (snapshot, shared memory, big, plain state dict): every combination the paths treat differently
        kinds = [(True, False, False, True), (True, False, False, False), (True, False, True, None),
                 (False, False, False, True), (False, False, False, False), (False, True, False, None),
                 (False, True, True, None), (False, False, True, None)]
        self.models = [Model(i, rng.randrange(1 << 30), vals.randrange(1 << 30), *kind) for i, kind in enumerate(kinds)]
        self.counts = {"mutations": 0, "frees": 0, "in_use": 0, "wait_freed_ok": 0}
        self._rng = random.Random(values + 1)
        self._stop = threading.Event()
        self._churner = threading.Thread(target=self._churn_snapshots, name="soak-churn", daemon=True)
        self._churner.start()

    def where(self) -> str:
        return rdt.__file__

    def pid(self) -> int:
        return os.getpid()

    def catalog(self) -> List[Tuple[int, bool, bool, bool, Layout]]:
        """(model id, snapshot, shared, big, layout) of every model (layouts never change)."""
        return [(m.mid, m.snap, m.shared, m.big, m.layout()) for m in self.models]

    def _info(self, model: Model) -> Dict[str, Any]:
        return {"digests": value_digests(model.value), "nbytes": value_bytes(model.value), "mid": model.mid}

    def put(self, mid: int, transport: str) -> Tuple[List[Any], Dict[str, Any]]:
        """rdt.put of a model (snapshot=True for snapshot models), its digests taken under the model's lock."""
        model = self.models[mid]
        with model.lock:
            info = self._info(model)
            ref = rdt.put(model.value, tensor_transport=transport, snapshot=model.snap)
        return [ref], info

    def _churn_snapshots(self) -> None:
        """Background thread: change or free snapshot models at any time (never while one is being returned)."""
        rng = random.Random(self._rng.randrange(1 << 30))
        snaps = [m for m in self.models if m.snap]
        while not self._stop.wait(rng.uniform(0.005, 0.04)):
            model = rng.choice(snaps)
            if not model.lock.acquire(blocking=False):
                continue
            try:
                if rng.random() < 0.05:
                    model.free(rng)
                    self.counts["frees"] += 1
                else:
                    model.mutate(rng)
                    self.counts["mutations"] += 1
            finally:
                model.lock.release()

    def churn_live(self, seed: int, wait_s: float) -> int:
        """Change or free a live model once rdt.wait_tensor_freed says no object holds any of its storages (a
        bounded wait: a model still in use is left alone). Returns how many were changed."""
        rng = random.Random(seed)
        changed = 0
        for model in rng.sample([m for m in self.models if not m.snap], 2):
            try:
                for t in model.bases:
                    rdt.wait_tensor_freed(t, timeout=wait_s)
            except rdt.TensorInUseError:
                self.counts["in_use"] += 1
                continue
            self.counts["wait_freed_ok"] += 1
            if rng.random() < 0.25:
                model.free(rng)
                self.counts["frees"] += 1
            else:
                model.mutate(rng)
                self.counts["mutations"] += 1
            changed += 1
        return changed

    def group_state(self, name: str) -> str:
        return rdt_transports.get_group(name).state.value if rdt_transports.is_group_initialized(name) else "none"

    def report(self) -> Dict[str, Any]:
        return {"counts": dict(self.counts), "stats": rdt.stats()}

    def stop(self) -> None:
        self._stop.set()
        self._churner.join(timeout=5)


# ------------------------------------------------------------------------------------------------ consumer
@dataclass
class TargetSet:
    """into= targets kept across fetches; ``known``: the digests their bytes must have (None: undefined, a
    timed-out NIXL READ may still write them); not used again before ``ready_at``."""

    tensors: Dict[str, torch.Tensor]
    known: Optional[Digests] = None
    ready_at: float = 0.0
    check_at_ready: bool = False
    why: str = ""


@dataclass
class Job:
    """One fetch: ``mode`` "get", "into" or "arg"; per-fetch settings of the consumer."""

    jid: int
    key: Tuple[int, int]  # (producer, model): which kept targets to use
    mode: str
    timeout: float
    shm_cma: bool = True
    shm_map: bool = True
    relay: bool = True
    start_at: float = 0.0


@dataclass
class Kept:
    """A received value (fetch without into) kept a while: its bytes must not change under the caller."""

    value: Dict[str, Any]
    digests: Digests
    jid: int


@ray.remote(num_cpus=0)
class SoakConsumer:
    """Fetches over every path and checks that bytes change only where and when they may."""

    def __init__(self, config: Dict[str, Any], normal_timeout: float) -> None:
        rdt.configure(transfer_timeout=normal_timeout, **config)
        self.config = config
        self.sets: Dict[Tuple[int, int], List[TargetSet]] = {}
        self.kept: List[Kept] = []
        self.violations: List[str] = []
        self.layouts: Dict[Tuple[int, int], Layout] = {}
        self._paths = dict(rdt.stats()["paths"])
        self.normal_timeout = normal_timeout
        self.counts: Dict[str, int] = {"into_failed": 0, "into_failed_rechecked": 0, "into_in_flight": 0,
                                       "sets_checked": 0, "kept_checked": 0, "retries": 0, "rechecked_after_retry": 0}
        self._reported: Dict[str, int] = {}
        self._calls = 0

    def where(self) -> str:
        return rdt.__file__

    def learn(self, producer: int, catalog: List[Tuple[int, bool, bool, bool, Layout]]) -> None:
        for mid, _, _, _, layout in catalog:
            self.layouts[(producer, mid)] = layout

    def group_state(self, name: str) -> str:
        return rdt_transports.get_group(name).state.value if rdt_transports.is_group_initialized(name) else "none"

    # ---- checks
    def _violation(self, what: str) -> None:
        self.violations.append(what)

    def _verify_set(self, key: Tuple[int, int], s: TargetSet, when: str) -> None:
        if s.known is not None:
            self.counts["sets_checked"] += 1
            now = value_digests(s.tensors)
            if now != s.known:
                bad = [k for (k, a), (_, b) in zip(now, s.known) if a != b]
                self._violation(f"into targets {key} changed {when} ({s.why}): {len(bad)} leaves, e.g. {bad[:3]}")
                s.known = now  # report each change once

    def sweep(self, final: bool = False) -> None:
        """Re-check kept values and every target set whose hold ended (all of them when ``final``)."""
        now = time.monotonic()
        self._calls += 1
        for k in self.kept if final or self._calls % 4 == 0 else ():
            self.counts["kept_checked"] += 1
            if value_digests(k.value) != k.digests:
                self._violation(f"received value of job {k.jid} changed after the fetch returned")
                k.digests = value_digests(k.value)
        for key, sets in self.sets.items():
            for s in sets:
                if final or (s.check_at_ready and s.ready_at <= now):
                    if s.check_at_ready:
                        self.counts["rechecked_after_retry" if "retry" in s.why else "into_failed_rechecked"] += 1
                    self._verify_set(key, s, "after the failed fetch raised" if s.check_at_ready
                                     else "between fetches")
                    s.check_at_ready = False

    def _targets(self, key: Tuple[int, int], rng: random.Random) -> TargetSet:
        """A kept target set whose hold ended (checked unchanged first), or a new one (sets beyond 3 per key are
        dropped once their hold ended and they were checked)."""
        now = time.monotonic()
        sets = self.sets.setdefault(key, [])
        free = [s for s in sets if s.ready_at <= now]
        for s in free:
            self._verify_set(key, s, "between fetches")
        while len(free) > 1 and len(sets) > 3:
            dropped = free.pop()
            sets.remove(dropped)
        if free:
            return rng.choice(free)
        s = TargetSet({k: torch.full(shape, 7, dtype=getattr(torch, d)) if d != "bool"
                       else torch.zeros(shape, dtype=torch.bool) for k, shape, d in self.layouts[key]})
        s.known, s.why = value_digests(s.tensors), "fresh"
        sets.append(s)
        return s

    def _path(self) -> str:
        paths = rdt.stats()["paths"]
        delta = [k for k, n in paths.items() if n != self._paths.get(k, 0)]
        self._paths = dict(paths)
        return "+".join(sorted(delta)) or "none"

    # ---- fetches
    def fetch(self, refs: List[Any], job: Job) -> Tuple[List[Tuple[Any, ...]], List[str], Dict[str, int]]:
        """rdt.get of ``refs[0]`` per ``job``; after a failed fetch into targets (re-checked twice its timeout
        later, except a NIXL READ still in flight: at once), ``refs[1]`` (the model's next object, when given) into
        the same targets with the normal timeout, as a trainer retries a weight sync. Per fetch ("ok", path, digests, bytes) or ("err", type name, message, path); the violations found
        meanwhile; this consumer's counters since the last call."""
        self.sweep()
        if job.start_at:
            time.sleep(max(0.0, job.start_at - time.time()))
        rng = random.Random(job.jid)
        s = self._targets(job.key, rng) if job.mode == "into" else None
        out = [self._one(refs[0], s, job, job.timeout, rng)]
        if s is not None and out[0][0] == "err" and len(refs) > 1:
            if s.check_at_ready:  # twice its timeout later, unchanged (else: when the set is next used, or at the end)
                time.sleep(max(0.0, s.ready_at - time.monotonic()))
                self.sweep()
            self.counts["retries"] += 1
            out.append(self._one(refs[1], s, job, self.normal_timeout, rng, after=job.timeout))
        return out, self._take_violations(), self._counts()

    def _one(self, ref: Any, s: Optional[TargetSet], job: Job, timeout: float, rng: random.Random,
             after: float = 0.0) -> Tuple[Any, ...]:
        """One rdt.get (into ``s`` when given); a successful retry ``after`` a failed fetch of that timeout is
        re-checked later: the failed fetch must never write over it."""
        rdt.configure(shm_cma=job.shm_cma, shm_map=job.shm_map, relay=job.relay)
        self._path()
        try:
            try:
                value = rdt.get(ref, into=s.tensors if s else None, timeout=timeout)
            finally:
                rdt.configure(shm_cma=True, shm_map=True, relay=self.config.get("relay", True))
        except Exception as e:  # noqa: BLE001 - the driver counts every error type
            raised = time.monotonic()
            path = self._path()
            if s is not None:
                self._failed_into(s, e, job, raised + 2 * timeout)
            return ("err", type(e).__name__, str(e)[:400], path)
        path = self._path()
        digests = value_digests(value)
        if s is not None:
            if not all(value[k] is t for k, t in s.tensors.items()):
                self._violation(f"job {job.jid}: into= leaves are not the targets")
            s.known, s.check_at_ready = value_digests(s.tensors), after > 0
            s.ready_at = time.monotonic() + 2 * after + 0.5 if after else 0.0
            s.why = f"job {job.jid}: retry after a failed fetch" if after else f"job {job.jid}: ok"
        elif rng.random() < 0.2:
            self.kept.append(Kept(value, digests, job.jid))
            del self.kept[:-3]
        return ("ok", path, digests, value_bytes(value))

    def _failed_into(self, s: TargetSet, e: Exception, job: Job, ready_at: float) -> None:
        """After a fetch into ``s`` raised: what its bytes must stay, and until when it is not used again."""
        self.counts["into_failed"] += 1
        s.ready_at = ready_at
        if IN_FLIGHT in str(e):  # documented: a timed-out NIXL READ may still land in these targets
            self.counts["into_in_flight"] += 1
            s.known, s.check_at_ready, s.why = None, False, f"job {job.jid}: NIXL READ in flight"
        elif isinstance(e, rdt.IntoBusyError):  # moved nothing; an earlier READ may still land
            s.check_at_ready = s.known is not None
            s.why = f"job {job.jid}: IntoBusyError"
        else:  # rdt waited for any earlier READ before this fetch: nothing may land from now on
            s.known, s.check_at_ready = value_digests(s.tensors), True
            s.why = f"job {job.jid}: {type(e).__name__}"

    def fetch_arg(self, value: Dict[str, Any], job: Job) -> Tuple[List[Tuple[Any, ...]], List[str], Dict[str, int]]:
        """The same for a ref passed as an argument (Ray resolves it through rdt before this runs)."""
        path = self._path()
        self.sweep()
        digests = value_digests(value)
        if random.Random(job.jid).random() < 0.2:
            self.kept.append(Kept(value, digests, job.jid))
            del self.kept[:-3]
        return [("ok", path, digests, value_bytes(value))], self._take_violations(), self._counts()

    def _counts(self) -> Dict[str, int]:
        out = {k: v - self._reported.get(k, 0) for k, v in self.counts.items()}
        self._reported = dict(self.counts)
        return out

    def _take_violations(self) -> List[str]:
        out, self.violations = self.violations, []
        return out

    def final(self, wait_s: float) -> Tuple[List[str], Dict[str, Any]]:
        """After every hold ended (at most ``wait_s``), re-check everything; the violations and rdt's stats."""
        end = time.monotonic() + wait_s
        due = max([s.ready_at for sets in self.sets.values() for s in sets] + [0.0])
        time.sleep(max(0.0, min(due, end) - time.monotonic()))
        self.sweep(final=True)
        return self._take_violations(), {"stats": rdt.stats(), "counts": self._counts()}

    def pid(self) -> int:
        return os.getpid()
