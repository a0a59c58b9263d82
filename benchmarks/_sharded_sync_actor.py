"""The sharded-sync suite's actor: a trainer rank holding ``Shard(0)`` of every parameter, or an engine rank holding
its tensor-parallel slices in vLLM's Qwen2 layout. One class plays both roles so that all eight can share a group.

Every row's step is the same contract: the trainer ranks' (untimed) in-place update adds 1 to every element; the
timed step ends when every engine rank's targets hold the new values. Each step checks three elements of every
region each engine wants; the last step of a row compares every byte (:func:`_sharded_sync_model.pattern`).
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import ray
import torch

import rdt

from ._sharded_sync_model import MAX_STEPS, Want, narrow_into, pattern, region_views, value_at
from ._weight_sync_actor import MemorySampler, WrongMarkerError, _malloc_trim, read_memory

Shape = Tuple[int, ...]
SOAK_CYCLE = MAX_STEPS - 1  # the soak's values: step 0's + (step % SOAK_CYCLE), below 256 (exact in bf16)


class _IoClock:
    """In an engine: the intervals its threads spend inside rdt's transports moving bytes during a load, so that
    the load's own cost (checks, the plan's replay, address rebasing, threads) is its time outside them. It wraps
    ``rdt.transports.get``, the range road's whole-fetch fallback and its covering reads' local narrow, and times
    the version registrations apart; ``ok`` is False where this build lacks the road."""

    def __init__(self) -> None:
        self.spans: List[Tuple[float, float]] = []
        self.control: List[Tuple[float, float]] = []  # the version begin/end round trips to the trainer ranks
        self._lock = threading.Lock()
        self.ok = False
        try:
            import rdt._consumer.cover as cover_mod
            import rdt._consumer.ranges as ranges_mod
            import rdt._consumer.versions as versions_mod
            import rdt.transports as transports_mod
        except ImportError:
            return
        get, whole, narrow = transports_mod.get, ranges_mod._whole, cover_mod.narrow
        begin, end = versions_mod.begin, versions_mod.end
        clock = self

        class Timed:
            def __init__(self, inner: Any) -> None:
                self._inner = inner

            def read_ranges(self, *a: Any, **k: Any) -> Any:
                return clock.timed(self._inner.read_ranges, *a, **k)

            def __getattr__(self, name: str) -> Any:
                return getattr(self._inner, name)

        transports_mod.get = lambda name: Timed(get(name))  # type: ignore[assignment]
        ranges_mod._whole = lambda *a, **k: clock.timed(whole, *a, **k)  # type: ignore[attr-defined]
        cover_mod.narrow = lambda *a, **k: clock.timed(narrow, *a, **k)  # a covering read's narrow: bytes moving
        versions_mod.begin = lambda *a, **k: clock.timed_control(begin, *a, **k)
        versions_mod.end = lambda *a, **k: clock.timed_control(end, *a, **k)
        self.ok = True

    def timed(self, fn: Any, *a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            with self._lock:
                self.spans.append((t0, time.perf_counter()))

    def timed_control(self, fn: Any, *a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            with self._lock:
                self.control.append((t0, time.perf_counter()))

    def take(self) -> Tuple[float, float, float]:
        """Seconds covered by the reads, by the control round trips, and by either (unions), then forget them."""
        with self._lock:
            spans, control, self.spans, self.control = self.spans, self.control, [], []
        return _union(spans), _union(control), _union(spans + control)


_CLOCK: Optional[_IoClock] = None


def io_clock() -> _IoClock:
    """This process's one _IoClock (it wraps rdt's modules: a second would wrap them again, when rows share the
    actors)."""
    global _CLOCK
    if _CLOCK is None:
        _CLOCK = _IoClock()
    return _CLOCK


def _union(spans: List[Tuple[float, float]]) -> float:
    """Seconds covered by the intervals together."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


class ShardedActor:
    """Trainer rank or engine rank of the sharded-sync suite (see the module docstring)."""

    def __init__(self) -> None:
        self._empty()

    def _empty(self) -> None:
        """Every field at its value before a row's set-up."""
        self.rank = -1
        self.step = 0
        self.shards: Dict[str, torch.Tensor] = {}
        self.layouts: Dict[str, Any] = {}
        self.starts: Dict[str, int] = {}
        self.full: Dict[str, torch.Tensor] = {}
        self.scratch: Optional[torch.Tensor] = None
        self.shapes: Dict[str, Shape] = {}
        self.wants: List[Want] = []
        self.targets: Dict[str, torch.Tensor] = {}
        self.loader: Any = None
        self.io: Optional[_IoClock] = None
        self.sampler: Optional[MemorySampler] = None
        self.published: Any = None  # the soak's last publication (a trainer rank)
        self.soak_ref: Optional[Dict[str, torch.Tensor]] = None  # the soak's step-0 values (an engine rank)
        self.last: Dict[str, Any] = {}  # the last load's report (a replicas row's first replica)

    # ------------------------------------------------------------------ set-up
    def setup_trainer(self, rank: int, rows: Dict[str, Tuple[Shape, int, int]], gather: bool) -> Dict[str, int]:
        """Hold rows [start, start + n) of every parameter at step 0; ``gather``: also the whole model (rank 0 of
        the rows that gather it)."""
        self.rank = rank
        for name, (gshape, start, n) in rows.items():
            box = ((start, start + n),) + tuple((0, d) for d in gshape[1:])
            self.shards[name] = pattern(box, gshape, 0)
            self.layouts[name] = rdt.Layout(tuple(gshape), (start,) + (0,) * (len(gshape) - 1))
            self.starts[name] = start
            self.shapes[name] = tuple(gshape)
        if gather:
            self.full = {name: torch.empty(gshape, dtype=torch.bfloat16) for name, (gshape, _, _) in rows.items()}
            for t in self.full.values():
                t.view(-1)[::1024] = 0  # every page written: the gather's memory counts from the start
        return {"pid": os.getpid(), "shard_bytes": sum(t.numel() * 2 for t in self.shards.values())}

    def setup_engine(self, wants: List[Want], shapes: Dict[str, Shape], staging: bool,
                     loader: bool) -> Dict[str, int]:
        """Allocate the targets; ``staging``: also the whole model (the rows that receive all of it and narrow);
        ``loader``: an rdt.WeightLoader with the wants."""
        self.wants, self.shapes = wants, dict(shapes)
        self.targets = {name: torch.zeros(tshape, dtype=torch.bfloat16) for name, tshape, _ in wants}
        if staging:
            self.full = {name: torch.zeros(s, dtype=torch.bfloat16) for name, s in shapes.items()}
        if loader:
            self.loader = rdt.WeightLoader()
            for name, _, regions in wants:
                self.loader.want(self.targets[name], list(regions), name=name)
            self.io = io_clock()
            self.io.take()
        return {"pid": os.getpid(), "target_bytes": sum(t.numel() * 2 for t in self.targets.values())}

    def release(self, pool_bytes: int) -> Dict[str, int]:
        """Between two rows that share this actor: drop everything the last row held (shards, whole model, targets,
        loader, scratch, the soak's state), rdt's idle reuse pools (emptied, then ``pool_bytes`` again), collect and
        trim glibc's freed heap, so that the next row's set-up and memory step start from an idle process. The
        groups stay (the rows' groups coexist: the same ranks on the same torch default group). Returns
        read_memory() after."""
        self._empty()
        rdt.configure(pool_bytes=0)
        rdt.configure(pool_bytes=pool_bytes)
        gc.collect()
        _malloc_trim()
        return read_memory()

    def configure(self, **kwargs: Any) -> None:
        """rdt.configure in this actor (pool sizes)."""
        rdt.configure(**kwargs)

    def col_join(self, world_size: int, rank: int, group: str, timeout_ms: int) -> int:
        """Join the hand-written row's ray.util.collective Gloo group."""
        import ray.util.collective as col

        col.init_collective_group(world_size, rank, backend="gloo", group_name=group, gloo_timeout=timeout_ms)
        return rank

    # ------------------------------------------------------------------ trainer
    def update(self, wait_freed: bool, timeout: float) -> int:
        """The optimizer's in-place update: +1 on every element (after rdt let go of the tensors, for rdt rows)."""
        if self.step + 1 >= MAX_STEPS:
            raise ValueError(f"the sharded-sync pattern stays exact in bf16 for {MAX_STEPS} steps; lower --iters")
        for t in list(self.shards.values()) + list(self.full.values()):
            if wait_freed:
                rdt.wait_tensor_freed(t, timeout=timeout)
        for t in self.shards.values():
            t.add_(1)
        self.step += 1
        return self.step

    def publish_shards(self, version: int, transport: str) -> Any:
        """rdt sharded: this rank's shards with their global layout."""
        return rdt.put_shards(self.shards, version=version, layouts=self.layouts, rank=self.rank,
                              tensor_transport=transport)

    def put_shard(self, transport: str) -> List[Any]:
        """rdt whole-model, ranks 1..: the local shards as one rdt object, for rank 0's gather."""
        return [rdt.put(self.shards, tensor_transport=transport)]

    def gather_put(self, refs: List[Any], rows: List[Dict[str, Tuple[int, int]]], transport: str,
                   timeout: float) -> List[Any]:
        """rdt whole-model, rank 0: fetch every other rank's shards straight into its rows of the whole model
        (``rdt.get(into=)``; ``rows``: each rank's {name: (first row, rows)}), copy its own in, publish the whole."""
        into = [{name: self.full[name].narrow(0, s, n) for name, (s, n) in r.items()} for r in rows]
        rdt.get(refs, into=into, timeout=timeout)
        self._own_rows()
        return [rdt.put(self.full, tensor_transport=transport)]

    def _own_rows(self) -> None:
        for name, t in self.shards.items():
            self.full[name].narrow(0, self.starts[name], t.shape[0]).copy_(t)

    @ray.method(tensor_transport="gloo")
    def ray_rdt_shard(self) -> Dict[str, torch.Tensor]:
        """Ray's RDT, ranks 1..: the local shards over Ray's Gloo group, for rank 0's gather."""
        return self.shards

    def ray_rdt_gather(self, rows: List[Dict[str, Tuple[int, int]]], *parts: Dict[str, torch.Tensor]) -> int:
        """Ray's RDT, rank 0: copy every other rank's shards (received by Ray as this task's arguments) into the
        whole model, then its own."""
        for r, part in zip(rows, parts):
            for name, t in part.items():
                self.full[name].narrow(0, r[name][0], t.shape[0]).copy_(t)
        self._own_rows()
        return len(parts)

    @ray.method(tensor_transport="gloo")
    def ray_rdt_full(self) -> Dict[str, torch.Tensor]:
        """Ray's RDT, rank 0: the whole model over Ray's Gloo group."""
        return self.full

    def bcast_trainer(self, group: str, trainers: int, order: List[Tuple[str, List[Tuple[int, int, int]]]]) -> int:
        """Hand-written, a trainer rank: in ``order``, every trainer rank broadcasts its rows of every parameter to
        the whole group; this rank sends its own and receives the others' into a scratch buffer."""
        import ray.util.collective as col

        biggest = max((n * max(1, _row_elems(self.shapes[name])) for name, per in order for _, _, n in per), default=1)
        if self.scratch is None or self.scratch.numel() < biggest:
            self.scratch = torch.empty(biggest, dtype=torch.bfloat16)
        for name, per in order:
            row = _row_elems(self.shapes[name])
            for src, _, n in per:
                if src == self.rank:
                    col.broadcast(self.shards[name], src, group)
                else:
                    col.broadcast(self.scratch[:n * row].view((n,) + self.shapes[name][1:]), src, group)
        return trainers

    # ------------------------------------------------------------------ engine
    def bcast_engine(self, group: str, order: List[Tuple[str, List[Tuple[int, int, int]]]], step: int) -> float:
        """Hand-written, an engine rank: receive every trainer rank's rows of every parameter into the whole model,
        then narrow each target out of it."""
        import ray.util.collective as col

        for name, per in order:
            for src, start, n in per:
                col.broadcast(self.full[name].narrow(0, start, n), src, group)
        return self._narrow_check(step)

    def ray_rdt_load(self, full: Dict[str, torch.Tensor], step: int) -> float:
        """Ray's RDT, an engine rank: the whole model arrived as this task's argument; narrow the targets out."""
        for name, _, regions in self.wants:
            narrow_into(self.targets[name], regions, full, name)
        return self.check(step)

    def whole_load(self, refs: List[Any], step: int, timeout: float) -> float:
        """rdt whole-model, an engine rank: ``rdt.get(into=)`` the whole model, then narrow the targets out."""
        rdt.get(refs[0], into=self.full, timeout=timeout)
        return self._narrow_check(step)

    def _narrow_check(self, step: int) -> float:
        for name, _, regions in self.wants:
            narrow_into(self.targets[name], regions, self.full, name)
        return self.check(step)

    def sharded_load_share(self, manifest: Any, step: int, timeout: float, transport: str) -> Any:
        """rdt sharded with replicas, the first replica: load from the trainers, then offer the version to the
        same rank of the other engines (its report kept for ``last_report``)."""
        self.last = self.sharded_load(manifest, step, timeout)
        return self.loader.share(tensor_transport=transport)

    def last_report(self) -> Dict[str, Any]:
        return self.last

    def sharded_load(self, manifest: Any, step: int, timeout: float) -> Dict[str, Any]:
        """rdt sharded: ``loader.load(manifest)`` (or a replica's offer); the report, the bytes received (rdt's
        counters) and the load's own cost outside the transports' reads."""
        before = _in_bytes()
        if self.io is not None:
            self.io.take()
        t0 = time.perf_counter()
        report = self.loader.load(manifest, timeout=timeout)
        total = time.perf_counter() - t0
        io, control, either = self.io.take() if self.io is not None and self.io.ok else (None, None, None)
        self.check(step)
        return {"planned": report.planned, "nbytes": report.nbytes, "paths": dict(report.paths),
                "from": "replica" if isinstance(manifest, rdt.Replica) else "trainers",
                "covering_excess": max(getattr(report, "read_bytes", 0) - report.nbytes, 0)
                if getattr(report, "covered", None) else 0,
                "received": _in_bytes() - before, "seconds": total,
                "overhead_s": None if either is None else max(total - either, 0.0),
                "control_s": control, "mode": _read_mode(report)}

    # ------------------------------------------------------------------ the verify soak
    def soak_publish(self, version: int, transport: str) -> Any:
        """The soak, a trainer rank: publish this rank's live shards as ``version`` (kept here, to fence it)."""
        self.published = rdt.put_shards(self.shards, version=version, layouts=self.layouts, rank=self.rank,
                                        tensor_transport=transport)
        return self.published

    def soak_update(self, delay: float, timeout: float) -> float:
        """The soak, a trainer rank: after ``delay`` s of "backward pass", fence the published version, then the
        optimizer's in-place update: every element moves to the next step's value (+1; back by SOAK_CYCLE - 1 at
        the end of a cycle, so that values stay exact in bf16 over any number of steps). Seconds the fence took."""
        time.sleep(delay)
        t0 = time.perf_counter()
        self.published.fence(timeout=timeout)
        fenced = time.perf_counter() - t0
        self.published = None
        self.step += 1
        for t in self.shards.values():
            if self.step % SOAK_CYCLE:
                t.add_(1)
            else:
                t.sub_(SOAK_CYCLE - 1)
        return fenced

    def soak_load(self, manifest: Any, step: int, timeout: float) -> Tuple[str, str, float]:
        """The soak, an engine rank: ``load(manifest, verify=True)`` while the trainers may be updating in place;
        ("ok", "", s) when every target byte equals ``step``'s values, ("torn", what, s) when a load that returned
        holds other bytes, (the error's class, its message, s) when it raised."""
        t0 = time.perf_counter()
        try:
            self.loader.load(manifest, timeout=timeout, verify=True)
        except rdt.RdtError as e:
            return type(e).__name__, str(e)[:300], time.perf_counter() - t0
        seconds = time.perf_counter() - t0
        wrong = self._soak_wrong(step)
        return ("torn", wrong, seconds) if wrong else ("ok", "", seconds)

    def _soak_wrong(self, step: int) -> str:
        """The first target whose bytes differ from ``step``'s values ("" when none do)."""
        if self.soak_ref is None:
            self.soak_ref = {name: torch.cat([pattern(box, self.shapes[reg.param], 0) for _, reg, box in
                                              region_views(self.targets[name], regions, self.shapes, name)])
                             for name, _, regions in self.wants}
        for name, ref in self.soak_ref.items():
            if not torch.equal(self.targets[name], ref + step % SOAK_CYCLE):
                return f"{name} differs from step {step}'s values"
        return ""

    def check(self, step: int) -> float:
        """The first, middle and last element of every region this rank wants hold their value at ``step``."""
        for name, _, regions in self.wants:
            for view, reg, box in region_views(self.targets[name], regions, self.shapes, name):
                extent = [hi - lo for lo, hi in box]
                for local in ([0] * len(extent), [e // 2 for e in extent], [e - 1 for e in extent]):
                    got = float(view[tuple(local)])
                    want = value_at([lo + i for (lo, _), i in zip(box, local)], self.shapes[reg.param], step)
                    if got != want:
                        raise WrongMarkerError(f"engine pid {os.getpid()}: {name} ({reg.param} at global "
                                               f"{[lo + i for (lo, _), i in zip(box, local)]}) holds {got}, step "
                                               f"{step} wrote {want}")
        return float(step)

    def check_all(self, step: int) -> int:
        """Every byte of every target against the values of ``step``; returns the bytes compared."""
        n = 0
        for name, _, regions in self.wants:
            for view, reg, box in region_views(self.targets[name], regions, self.shapes, name):
                if not torch.equal(view, pattern(box, self.shapes[reg.param], step)):
                    raise WrongMarkerError(f"engine pid {os.getpid()}: {name} ({reg.param} {list(box)}) differs "
                                           f"from step {step}'s values")
                n += view.numel() * 2
        return n

    # ------------------------------------------------------------------ memory
    def memory_start(self, uss: bool = True) -> Dict[str, int]:
        """Trim glibc's freed heap, then keep peak RSS and (``uss``) sample private memory (USS) until
        memory_stop."""
        _malloc_trim()
        self.sampler = MemorySampler(uss=uss)
        return read_memory()

    def memory_stop(self) -> Dict[str, int]:
        """Idle and peak RSS / USS during the sampled step."""
        sampler, self.sampler = self.sampler, None
        if sampler is None:
            raise RuntimeError("memory_stop without memory_start")
        return sampler.stop()


def _read_mode(report: Any) -> str:
    """How a load read: 'exact runs' (range reads), 'whole fetch' (every rank's shards fetched whole and narrowed
    here), or both; the report's own ``mode`` where this build's loader gives one."""
    if getattr(report, "mode", None):
        return str(report.mode)
    whole = {str(p).startswith("whole:") for p in report.paths.values()}
    return {frozenset({False}): "exact runs", frozenset({True}): "whole fetch"}.get(frozenset(whole),
                                                                                  "exact runs + whole fetch")


def _row_elems(shape: Sequence[int]) -> int:
    n = 1
    for d in shape[1:]:
        n *= d
    return n


def _in_bytes() -> int:
    """Bytes this process has received through rdt, every transport."""
    return sum(int(v.get("in_bytes", 0)) for v in (rdt.stats().get("transfers") or {}).values())


def actor_class() -> Any:
    """No CPU reserved (the ranks wait on I/O and copy), Ray's RDT enabled, no restarts."""
    return ray.remote(num_cpus=0, max_restarts=0, enable_tensor_transport=True)(ShardedActor)
