"""The object-layer suite: actor->actor ``ray.get(b.f.remote(a.g.remote()))`` for every rdt transport, Ray's
built-in RDT (Gloo, NIXL) and Ray's object store, plus peak resident memory on both sides during the largest size.

The producer returns a tensor it keeps (so no producer-side allocation is timed); the consumer touches one float
per 4 KiB page (so lazily mapped data is really read) and returns a checksum that the driver verifies.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any, Callable, Dict, List, Tuple

import psutil
import ray
import torch

import rdt

from ._cluster import log
from ._collectives import EST_ACTOR_S, EST_BYTES_PER_S, EST_SETUP_S
from ._mechanism import comparable, describe_pair, object_mechanism

PAGE_FLOATS = 1024


def _touch(t: torch.Tensor) -> float:
    return float(t.view(-1)[::PAGE_FLOATS].sum())


class _Producer:
    """Shared body of the benchmark actor: one producing method per implementation."""

    def __init__(self) -> None:
        self.t = torch.zeros(1)

    def prepare(self, nbytes: int) -> int:
        self.t = torch.ones(max(nbytes // 4, 1))
        import os

        return os.getpid()

    def set_inline(self, nbytes: int) -> None:
        rdt.configure(inline_threshold=nbytes)

    def set_pool(self, nbytes: int) -> None:
        """Turn rdt's reuse pools off (0) for the memory measurement, so fresh allocations are counted."""
        rdt.configure(pool_bytes=nbytes)

    def plain(self) -> torch.Tensor:
        return self.t

    @rdt.tensor_method(tensor_transport="gloo")
    def rdt_gloo(self) -> torch.Tensor:
        return self.t

    @rdt.tensor_method(tensor_transport="shm")
    def rdt_shm(self) -> torch.Tensor:
        return self.t

    @rdt.tensor_method(tensor_transport="nixl")
    def rdt_nixl(self) -> torch.Tensor:
        return self.t

    @rdt.tensor_method(tensor_transport="auto")
    def rdt_auto(self) -> torch.Tensor:
        return self.t

    @ray.method(tensor_transport="gloo")
    def ray_rdt_gloo(self) -> torch.Tensor:
        return self.t

    @ray.method(tensor_transport="nixl")
    def ray_rdt_nixl(self) -> torch.Tensor:
        return self.t

    def consume(self, t: torch.Tensor) -> float:
        return _touch(t)


ObjActor = ray.remote(num_cpus=0)(_Producer)

# impl name -> producing method; the first is the baseline the others are compared with
IMPLS: Tuple[Tuple[str, str], ...] = (
    ("ray-objstore", "plain"),
    ("ray-rdt-gloo", "ray_rdt_gloo"),
    ("ray-rdt-nixl", "ray_rdt_nixl"),
    ("rdt-gloo", "rdt_gloo"),
    ("rdt-gloo-noinline", "rdt_gloo"),
    ("rdt-shm", "rdt_shm"),
    ("rdt-nixl", "rdt_nixl"),
    ("rdt-auto", "rdt_auto"),
)


# Ray's own paths (no rdt counters to read): impl -> mechanism
RAY_MECHANISMS: Dict[str, str] = {"ray-objstore": "object_store", "ray-rdt-gloo": "ray-rdt (gloo)",
                                  "ray-rdt-nixl": "ray-rdt (nixl)"}


def _iterations(nbytes: int, quick: bool, scale: float = 1.0) -> Tuple[int, int]:
    """(warm-up, timed) round trips per implementation at ``nbytes``; ``scale`` shrinks both (rdt-bench's default
    run), keeping at least 2 warm-ups (the first fills pools) and 5 timed."""
    if quick:
        return 1, 3
    if nbytes <= 64 << 10:
        warmup, iters = 20, 200
    elif nbytes <= 1 << 20:
        warmup, iters = 5, 30
    elif nbytes <= 16 << 20:
        warmup, iters = 3, 15
    else:
        warmup, iters = 4, 13  # the first uses fill pools (shm segments, huge pages); the median is the steady state
    if scale >= 1:
        return warmup, iters
    return max(2, round(warmup * scale)), max(5, round(iters * scale))


def selected(config: Any) -> Tuple[Tuple[str, str], ...]:
    """The implementations this run measures: IMPLS, or those named in ``config.object_impls``."""
    chosen = getattr(config, "object_impls", None)
    return IMPLS if chosen is None else tuple((impl, m) for impl, m in IMPLS if impl in chosen)


class _RssSampler:
    """Peak resident memory of some pids, sampled every 2 ms while active."""

    def __init__(self, pids: List[int]) -> None:
        self.procs = [psutil.Process(p) for p in pids]
        self.peak = [p.memory_info().rss for p in self.procs]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for i, p in enumerate(self.procs):
                try:
                    self.peak[i] = max(self.peak[i], p.memory_info().rss)
                except psutil.Error:
                    pass
            time.sleep(0.002)

    def __enter__(self) -> "_RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _rdt_stats(producer: Any, consumer: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """rdt.stats() of both actors: which paths served the fetches (consumer) and segments written (producer)."""
    return rdt.stats(producer, timeout=30), rdt.stats(consumer, timeout=30)


def _round_trip(a: Any, b: Any, method: str, expect: float, timeout: float) -> float:
    t0 = time.perf_counter()
    got = ray.get(b.consume.remote(getattr(a, method).remote()), timeout=timeout)
    dt = time.perf_counter() - t0
    if abs(got - expect) > 1e-3 * max(expect, 1.0):
        raise AssertionError(f"{method}: consumer checksum {got} != {expect}")
    return dt


# For the time-left estimate (the 2026-11-27 10:03 run, 2-core reference machine): a round trip's fixed cost, the
# driver's calls around each implementation and size (rdt.stats of both sides, the inline threshold), and the bytes
# each implementation moves per byte of the object, against EST_BYTES_PER_S (Ray's object store: 590 ms at 128 MiB).
EST_TRIP_S = 0.002
EST_CASE_S = 0.3
EST_COPIES: Dict[str, float] = {"ray-objstore": 9.0, "ray-rdt-gloo": 1.8, "ray-rdt-nixl": 1.0}
EST_RDT_COPIES = 0.6


def objects_plan(config: Any) -> List[Tuple[Any, float]]:
    """The progress keys and estimated costs of :func:`objects_suite`: one per implementation and size."""
    out: List[Tuple[Any, float]] = []
    for nbytes in config.sizes:
        warmup, iters = _iterations(nbytes, config.quick, config.object_rounds)
        memory = 1 if nbytes == max(config.sizes) and not config.quick else 0  # the peak-RSS round trip
        out += [(("objects", impl, nbytes), EST_CASE_S + (warmup + iters + memory) * (
            EST_TRIP_S + nbytes * EST_COPIES.get(impl, EST_RDT_COPIES) / EST_BYTES_PER_S))
            for impl, _ in selected(config)]
    if out:  # the first case also pays for the two actors and their two groups
        out[0] = (out[0][0], out[0][1] + 2 * EST_ACTOR_S + EST_SETUP_S)
    return out


def objects_suite(ctx: Any) -> List[Dict[str, Any]]:
    """Round trips per implementation and size, and peak RSS at the largest size."""
    from ray.experimental.collective import create_collective_group as ray_rdt_group

    quick = ctx.config.quick
    a, b = ObjActor.remote(), ObjActor.remote()
    rows: List[Dict[str, Any]] = []
    try:
        ray.get([a.prepare.remote(4), b.prepare.remote(4)], timeout=120)
        group = rdt.create_collective_group([a, b], backend="gloo")
        ray_rdt_group([a, b], backend="torch_gloo")
        largest = max(ctx.config.sizes)
        for nbytes in ctx.config.sizes:
            pid_a = ray.get(a.prepare.remote(nbytes), timeout=120)
            pid_b = ray.get(b.prepare.remote(4), timeout=120)
            expect = float(len(range(0, max(nbytes // 4, 1), PAGE_FLOATS)))
            warmup, iters = _iterations(nbytes, quick, ctx.config.object_rounds)
            timeout = 60.0 + nbytes / 20e6
            for impl, method in selected(ctx.config):
                ray.get(a.set_inline.remote(0 if impl.endswith("noinline") else 64 << 10), timeout=60)
                row: Dict[str, Any] = {"suite": "objects", "impl": impl, "size": nbytes, "world_size": 2,
                                       "mode": "round-trip", "mechanism": RAY_MECHANISMS.get(impl, "?")}
                try:
                    before = _rdt_stats(a, b) if impl not in RAY_MECHANISMS else None
                    for _ in range(warmup):
                        _round_trip(a, b, method, expect, timeout)
                    times = [_round_trip(a, b, method, expect, timeout) for _ in range(iters)]
                    if before is not None:
                        after = _rdt_stats(a, b)
                        row["mechanism"] = object_mechanism(method.removeprefix("rdt_"), before[1], after[1],
                                                            before[0], after[0])
                    med, best = statistics.median(times), min(times)
                    row.update(seconds=med, seconds_best=best, gbps=nbytes / med / 1e9, gbps_best=nbytes / best / 1e9,
                               latency_us=med * 1e6, iters=iters, times_s=[round(t, 6) for t in times])
                    if nbytes == largest and not quick:
                        # Worst case: rdt's pools emptied and off, so every buffer is a fresh allocation.
                        ray.get([x.set_pool.remote(0) for x in (a, b)], timeout=60)
                        try:
                            with _RssSampler([pid_a, pid_b]) as s:
                                idle = [p.memory_info().rss for p in s.procs]
                                _round_trip(a, b, method, expect, timeout)
                        finally:
                            ray.get([x.set_pool.remote(1 << 30) for x in (a, b)], timeout=60)
                        row["rss_peak_over_idle_bytes"] = [pk - i for pk, i in zip(s.peak, idle)]
                    log(f"objects {impl:<18} {nbytes:>10} B  median {med * 1e3:9.3f} ms  {row['gbps']:.3f} GB/s"
                        f"  [{row['mechanism']}]")
                except Exception as e:  # noqa: BLE001 - record and go on
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    log(f"objects {impl:<18} {nbytes:>10} B  ERROR {row['error']}")
                rows.append(row)
                ctx.progress.done(("objects", impl, nbytes))
        rdt.destroy_collective_group(group)
    finally:
        for actor in (a, b):
            ray.kill(actor)
    return rows


def object_targets(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The object-layer targets of the project, where both sides were measured."""
    idx = {(r["impl"], r["size"]): r for r in rows if r.get("suite") == "objects" and "error" not in r}
    out: List[Dict[str, Any]] = []

    def ratio(desc: str, impl: str, base: str, size: int, need: float, inverse: bool = False) -> None:
        x, y = idx.get((impl, size)), idx.get((base, size))
        if x is None or y is None:
            return
        r = (x["seconds"] / y["seconds"]) if inverse else (y["seconds"] / x["seconds"])
        rb = (x["seconds_best"] / y["seconds_best"]) if inverse else (y["seconds_best"] / x["seconds_best"])
        met: Callable[[float], bool] = (lambda v: v <= need) if inverse else (lambda v: v >= need)
        out.append({"target": desc, "ratio": round(r, 3), "ratio_best": round(rb, 3), "required": need,
                    "met": met(r), "met_best": met(rb), "inverse": inverse, "unit": "x",
                    "mechanisms": describe_pair(x.get("mechanism"), y.get("mechanism")),
                    "cross_mechanism": not comparable(x.get("mechanism"), y.get("mechanism"))})

    big, small = 128 << 20, 4 << 10
    ratio("objects 128 MiB rdt-gloo >= 2x Ray RDT gloo", "rdt-gloo", "ray-rdt-gloo", big, 2.0)
    ratio("objects 128 MiB rdt-shm >= 5x Ray RDT gloo", "rdt-shm", "ray-rdt-gloo", big, 5.0)
    ratio("objects 4 KiB rdt-gloo round trip <= 1.3x object store", "rdt-gloo", "ray-objstore", small, 1.3, True)
    for impl in ("rdt-gloo", "rdt-shm", "rdt-nixl"):
        r = idx.get((impl, big))
        if r is not None and "rss_peak_over_idle_bytes" in r:
            worst = max(r["rss_peak_over_idle_bytes"]) / big
            out.append({"target": f"objects 128 MiB {impl} peak RSS over idle <= 2x tensor (each side)",
                        "ratio": round(worst, 3), "ratio_best": round(worst, 3), "required": 2.0,
                        "met": worst <= 2.0, "met_best": worst <= 2.0, "inverse": True, "unit": "x",
                        "mechanisms": str(r.get("mechanism", "?")), "cross_mechanism": False})
    return out
