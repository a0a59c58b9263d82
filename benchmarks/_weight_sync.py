"""The weight-sync suite (issue 11 §4): a trainer actor holds a state dict with the shapes of Qwen2.5-0.5B in bf16
and publishes it every step; 1, 2 and 4 worker actors load it into their own preallocated parameters and check a
marker value. Side by side: Ray's object store, Ray's built-in RDT over Gloo, a hand-written per-tensor
``ray.util.collective.broadcast``, rdt per transport with ``copy_`` and with ``rdt.get(..., into=)``, rdt's shm
with the trainer's weights in shared memory (last: that cannot be undone), and a warm in-process copy on one
thread and on every core as the references; plus one object of 1, 100 and 1 000 tensors of 4 MiB in all per rdt
transport.

A step is timed on the driver from the publish call until every worker has loaded and checked the marker; the
trainer's in-place update between steps is not timed. After the timed steps one more step runs with every
worker sampling its own RSS and private memory (rdt's reuse pools off and glibc's freed heap trimmed first, so
fresh buffers are counted); its growth over the idle value before that step is the row's ``uss_growth_bytes``.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import ray

import rdt

from ._cluster import log
from ._collectives import EST_ACTOR_S, EST_COPY_BYTES_PER_S, EST_SETUP_S
from ._mechanism import object_mechanism
from ._weight_sync_actor import PAGE_FLOATS, Shape, actor_class

SUITE = "weight-sync"
MiB = 1 << 20
COUNT_BYTES = 4 * MiB
COUNTS = (1, 100, 1000)
COUNT_TRANSPORTS = ("gloo", "shm", "nixl")
RDT_TRANSPORTS = ("gloo", "shm", "nixl")
DEFAULT_POOL_BYTES = 1 << 30
UNAVAILABLE = "not available in this build: rdt.get(..., into=) is missing"


# ---------------------------------------------------------------------- the model
@dataclass(frozen=True)
class ModelShape:
    """Qwen2.5-0.5B's parameter shapes (tied embedding, so no lm_head), optionally shrunk by ``scale``."""

    vocab: int = 151936
    hidden: int = 896
    kv: int = 128
    inter: int = 4864
    layers: int = 24
    scale: float = 1.0

    def shapes(self) -> List[Tuple[str, Shape]]:
        """(name, shape) of every tensor, in state-dict order."""
        h, kv, ff = self.hidden, self.kv, self.inter
        out: List[Tuple[str, Shape]] = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.q_proj.bias", (h,)),
                    (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
                    (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
                    (p + "self_attn.o_proj.weight", (h, h)),
                    (p + "mlp.gate_proj.weight", (ff, h)), (p + "mlp.up_proj.weight", (ff, h)),
                    (p + "mlp.down_proj.weight", (h, ff)),
                    (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        return out + [("model.norm.weight", (h,))]

    @property
    def params(self) -> int:
        """Number of parameters."""
        total = 0
        for _, shape in self.shapes():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    @property
    def nbytes(self) -> int:
        """Bytes in bf16."""
        return 2 * self.params

    def describe(self) -> str:
        """'290 tensors, 494.0 M parameters, 988.1 MB bf16 (scale 1)'."""
        return (f"{len(self.shapes())} tensors, {self.params / 1e6:.1f} M parameters, {self.nbytes / 1e6:.1f} MB "
                f"bf16 (scale {self.scale:g}: {self.layers} layers, vocab {self.vocab}, hidden {self.hidden})")


def model_shape(scale: float = 1.0) -> ModelShape:
    """The model at ``scale`` (0 < scale <= 1): layers and vocabulary shrink in proportion; below one layer's
    worth (scale < 1/24) the widths shrink too, so that a test can run the suite in seconds."""
    if not 0 < scale <= 1:
        raise ValueError(f"--weight-sync-scale must be in (0, 1], got {scale}")
    full = ModelShape()
    layers = max(1, round(full.layers * scale))
    width = min(1.0, full.layers * scale)

    def shrink(x: int, step: int) -> int:
        return max(step, round(x * width / step) * step)

    return ModelShape(vocab=max(64, round(full.vocab * scale)), hidden=shrink(full.hidden, 16),
                      kv=shrink(full.kv, 8), inter=shrink(full.inter, 16), layers=layers, scale=scale)


# ---------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One row kind: how the trainer publishes and how the workers load."""

    impl: str
    publish: str  # trainer method; "" for the hand-written broadcast
    consume: str  # "copy_", "into" or "broadcast"
    mechanism: str = ""  # static label (baselines); "" = read from rdt.stats()
    shared: bool = False  # the trainer's weights moved into shared memory first (irreversible: such cases run last)

    @property
    def is_rdt(self) -> bool:
        return self.impl.startswith("rdt-")


CASES: Tuple[Case, ...] = (
    Case("ray-objstore", "publish_plain", "copy_", "object_store"),
    Case("ray-rdt-gloo", "publish_ray_rdt_gloo", "copy_", "ray-rdt (gloo)"),
    Case("ray.collective-broadcast", "", "broadcast", "gloo"),
    *(Case(f"rdt-{t}+copy", f"publish_rdt_{t}", "copy_") for t in RDT_TRANSPORTS),
    *(Case(f"rdt-{t}+into", f"publish_rdt_{t}", "into") for t in RDT_TRANSPORTS),
    Case("rdt-shm-shared+into", "publish_rdt_shm", "into", shared=True),
)


def has_into() -> bool:
    """Whether this build of rdt has ``rdt.get(ref, into=...)``."""
    return hasattr(rdt, "get")


def marker(step: int) -> float:
    """The marker value of a step: integers 1..250, exact in bf16."""
    return float(step % 250 + 1)


def iterations(config: Any) -> Tuple[int, int]:
    """(warmup, timed steps): few, since a full-size step moves about 1 GB per worker."""
    warmup = config.warmup if config.warmup is not None else 1
    return warmup, getattr(config, "weight_sync_steps", None) or config.iters or (3 if config.quick else 5)


def selected(config: Any) -> Tuple[Case, ...]:
    """The cases this run measures: CASES, or those named in ``config.weight_sync_cases``."""
    chosen = getattr(config, "weight_sync_cases", None)
    return CASES if chosen is None else tuple(c for c in CASES if c.impl in chosen)


# ---------------------------------------------------------------------- one world size
class World:
    """A trainer and ``n`` workers with Ray's RDT group, the hand-written broadcast group and an rdt Gloo group,
    all with the trainer as rank 0 (Ray's torch groups share one process-wide default group, so the rank layout
    must be the same in all of them)."""

    def __init__(self, shape: ModelShape, n: int, group_timeout: float,
                 nodes: Optional[List[str]] = None) -> None:
        """``nodes``: a custom resource per actor (trainer first) to pin each to a node (the cross-node suite)."""
        self.shape, self.n = shape, n
        cls = actor_class()
        place = [cls.options(resources={r: 1}) for r in nodes] if nodes else [cls] * (n + 1)
        self.trainer = place[0].remote()
        self.workers = [place[1 + i].remote() for i in range(n)]
        self.everyone = [self.trainer, *self.workers]
        self.timeout = 60.0 + shape.nbytes * n / 20e6  # 20 MB/s per worker in the worst case
        self.errors: Dict[str, str] = {}
        self.bcast_group = ""
        self.rdt_group: Any = None
        shapes = shape.shapes()
        t0 = time.monotonic()
        try:
            infos = ray.get([self.trainer.setup_model.remote(shapes, 0.5)]
                            + [w.setup_model.remote(shapes, 0.0) for w in self.workers], timeout=120 + self.timeout)
            self._groups(group_timeout)
        except BaseException:
            self.close()  # the caller never gets this world to close
            raise
        self.pids = [i["pid"] for i in infos]
        log(f"weight-sync n={n}: {n + 1} actors with the model allocated and groups formed in "
            f"{time.monotonic() - t0:.1f} s")

    def _groups(self, group_timeout: float) -> None:
        from ray.experimental.collective import create_collective_group as ray_rdt_group

        try:  # first: it creates the torch default process group the hand-written group then builds on
            ray_rdt_group(self.everyone, backend="torch_gloo")
        except Exception as e:  # noqa: BLE001 - recorded on the rows that need it
            self.errors["ray-rdt"] = _error(e)
        if "ray-rdt" not in self.errors:
            group = f"wsync-bcast-{uuid.uuid4().hex[:8]}"
            try:
                ray.get([a.bcast_join.remote(self.n + 1, r, group, int(group_timeout * 1000))
                         for r, a in enumerate(self.everyone)], timeout=group_timeout + 30)
                self.bcast_group = group
            except Exception as e:  # noqa: BLE001
                self.errors["broadcast"] = _error(e)
        else:
            self.errors["broadcast"] = "skipped: Ray's torch Gloo group could not be formed: " + self.errors["ray-rdt"]
        try:
            self.rdt_group = rdt.create_collective_group(self.everyone, backend="gloo", timeout=group_timeout)
        except Exception as e:  # noqa: BLE001
            self.errors["rdt-gloo"] = _error(e)

    def setup_error(self, case: Case) -> Optional[str]:
        """Why ``case`` cannot run in this world, or None."""
        if case.consume == "into" and not has_into():
            return UNAVAILABLE
        if case.impl == "ray-rdt-gloo":
            return self.errors.get("ray-rdt")
        if case.consume == "broadcast":
            return self.errors.get("broadcast")
        if case.impl.startswith("rdt-gloo"):
            return self.errors.get("rdt-gloo")
        return None

    def step(self, case: Case, k: int) -> float:
        """One timed sync of step ``k``: the trainer's (untimed) in-place update, then publish and load."""
        v = marker(k)
        ray.get(self.trainer.update.remote(v, case.is_rdt, self.timeout), timeout=self.timeout)
        t0 = time.perf_counter()
        if case.consume == "broadcast":
            refs = [self.trainer.bcast.remote(self.bcast_group, None)]
            refs += [w.bcast.remote(self.bcast_group, v) for w in self.workers]
        else:
            ref = getattr(self.trainer, case.publish).remote()
            if case.consume == "into":
                refs = [w.load_into.remote([ref], v, self.timeout) for w in self.workers]
            else:
                refs = [w.load.remote(ref, v) for w in self.workers]
            del ref
        ray.get(refs, timeout=self.timeout)
        return time.perf_counter() - t0

    def stats(self) -> List[Dict[str, Any]]:
        """rdt.stats() of the trainer and every worker."""
        return [rdt.stats(a, timeout=30) for a in self.everyone]

    def memory_step(self, case: Case, k: int) -> Dict[str, Any]:
        """One more sync with every worker sampling its RSS and USS (rdt's pools off: fresh buffers count)."""
        ray.get([w.configure.remote(pool_bytes=0) for w in self.workers], timeout=60)
        try:
            idle = ray.get([w.memory_start.remote() for w in self.workers], timeout=60)
            try:
                self.step(case, k)
            finally:
                mem = ray.get([w.memory_stop.remote() for w in self.workers], timeout=60)
        finally:
            ray.get([w.configure.remote(pool_bytes=DEFAULT_POOL_BYTES) for w in self.workers], timeout=60)
        return {"rss_peak_bytes": [m["rss_peak"] for m in mem],
                "rss_before_bytes": [m["rss_before"] for m in mem],
                "uss_growth_bytes": [m["uss_peak"] - m["uss_before"] for m in mem],
                "uss_idle_over_params_bytes": [i["uss_idle_over_params"] for i in idle],
                "uss_peak_over_params_bytes": [m["uss_peak"] - i["uss_params"] for m, i in zip(mem, idle)],
                "torch_threads": idle[0]["torch_threads"]}

    def close(self) -> None:
        """Destroy the groups and kill the actors."""
        close_actors(self.rdt_group, self.everyone, f"weight-sync n={self.n}")
        self.rdt_group = None


def close_actors(group: Any, actors: List[Any], label: str) -> None:
    """Destroy rdt's group ``group`` (if any), logging a failure under ``label``, then kill ``actors``."""
    if group is not None:
        try:
            rdt.destroy_collective_group(group, timeout=30)
        except Exception as e:  # noqa: BLE001 - the actors are killed next anyway
            log(f"{label}: destroying the rdt group failed: {_error(e)}")
    for a in actors:
        try:
            ray.kill(a)
        except Exception:  # noqa: BLE001 - already dead is fine
            pass


def _error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1][:200] if text else ''}"


def _base_row(shape: ModelShape, impl: str, n: int, mode: str, **extra: Any) -> Dict[str, Any]:
    return {"suite": SUITE, "impl": impl, "mode": mode, "world_size": n, "workers": n, "size": shape.nbytes,
            "tensors": len(shape.shapes()), "params": shape.params, "scale": shape.scale,
            "family": "rdt" if impl.startswith("rdt-") else "baseline", **extra}


def _timing(nbytes: int, times: List[float]) -> Dict[str, Any]:
    med, best = statistics.median(times), min(times)
    return {"seconds": med, "seconds_best": best, "seconds_min": best, "gbps": nbytes / med / 1e9,
            "gbps_best": nbytes / best / 1e9, "latency_us": med * 1e6, "iters": len(times),
            "times_s": [round(t, 6) for t in times]}


def _rdt_mechanism(case: Case, before: List[Dict[str, Any]], after: List[Dict[str, Any]]) -> str:
    """The path(s) that served every worker, from rdt.stats() around the case (one label when they agree)."""
    transport = case.publish.removeprefix("publish_rdt_")
    labels = {object_mechanism(transport, b, a, before[0], after[0]) for b, a in zip(before[1:], after[1:])}
    return "/".join(sorted(labels))


def run_case(world: World, case: Case, warmup: int, iters: int, step0: int) -> Dict[str, Any]:
    """Warm-up, timed steps and the memory step of one case; an error row when it cannot run or fails."""
    row = _base_row(world.shape, case.impl, world.n, "sync", consume=case.consume,
                    mechanism=case.mechanism or "?")
    why = world.setup_error(case)
    if why is not None:
        row["error"] = why
        log(f"weight-sync n={world.n} {case.impl:<26} {why}")
        return row
    try:
        if case.shared and not ray.get(world.trainer.share_params.remote(), timeout=world.timeout):
            raise RuntimeError("the trainer's parameters could not be moved into shared memory")
        before = world.stats() if case.is_rdt else None
        k = step0
        times = []
        for i in range(warmup + iters):
            dt = world.step(case, k)
            k += 1
            if i >= warmup:
                times.append(dt)
        if before is not None:
            row["mechanism"] = _rdt_mechanism(case, before, world.stats())
        row.update(_timing(world.shape.nbytes, times))
        row.update(world.memory_step(case, k))
        log(f"weight-sync n={world.n} {case.impl:<26} median {row['seconds'] * 1e3:9.1f} ms  "
            f"{row['gbps']:.3f} GB/s/worker  USS growth max {max(row['uss_growth_bytes']) / 1e6:.0f} MB  "
            f"[{row['mechanism']}]")
    except Exception as e:  # noqa: BLE001 - record and go on (a wrong marker lands here)
        row["error"] = _error(e)
        log(f"weight-sync n={world.n} {case.impl:<26} ERROR {row['error']}")
    return row


def copy_reference(world: World, warmup: int, iters: int, threads: int = 0) -> Dict[str, Any]:
    """The in-process reference: a warm ``dst.copy_(src)`` of the whole model inside one worker, on the actor's
    torch threads (one by default) or, with ``threads``, on that many (every core of the machine)."""
    impl = f"inproc-copy-{threads}t" if threads else "inproc-copy"
    row = _base_row(world.shape, impl, 1, "reference", consume="copy_", mechanism="memcpy")
    try:
        times = ray.get(world.workers[0].copy_reference.remote(warmup + 1, iters, threads), timeout=world.timeout)
        row.update(_timing(world.shape.nbytes, times))
        log(f"weight-sync {impl:<26} median {row['seconds'] * 1e3:9.1f} ms")
    except Exception as e:  # noqa: BLE001
        row["error"] = _error(e)
    return row


# ---------------------------------------------------------------------- tensor count
def count_rows(world: World, quick: bool) -> List[Dict[str, Any]]:
    """One object of 1, 100 and 1 000 float32 tensors of COUNT_BYTES in all, trainer -> one worker, plain
    consumption (the worker touches one float per page), per rdt transport. A row's time is the round trip minus
    the consumer's own check (a few torch ops per tensor, the same for every transport); both are kept."""
    rows = []
    trainer, worker = world.trainer, world.workers[0]
    warmup, iters = (1, 5) if quick else (3, 15)
    for count in COUNTS:
        numel = ray.get(trainer.make_count.remote(count, COUNT_BYTES), timeout=60)
        expect = float(count * len(range(0, numel // count, PAGE_FLOATS)))
        for t in COUNT_TRANSPORTS:
            impl = f"rdt-{t}"
            row = {"suite": SUITE, "impl": impl, "mode": f"tensors={count}", "tensors": count, "world_size": 1,
                   "workers": 1, "size": COUNT_BYTES, "consume": "plain", "family": "rdt", "mechanism": "?"}
            if t == "gloo" and "rdt-gloo" in world.errors:
                row["error"] = world.errors["rdt-gloo"]
                rows.append(row)
                continue
            try:
                before = world.stats()
                trips = [_count_trip(trainer, worker, f"count_rdt_{t}", expect, world.timeout)
                         for _ in range(warmup + iters)][warmup:]
                after = world.stats()
                row["mechanism"] = object_mechanism(t, before[1], after[1], before[0], after[0])
                row.update(_timing(COUNT_BYTES, [trip - check for trip, check in trips]))
                row["round_trip_seconds"] = statistics.median(trip for trip, _ in trips)
                row["check_seconds"] = statistics.median(check for _, check in trips)
                log(f"weight-sync {impl:<9} {count:>5} tensors of 4 MiB in all: median "
                    f"{row['seconds'] * 1e3:8.2f} ms  (round trip {row['round_trip_seconds'] * 1e3:.2f} ms, "
                    f"of which the consumer's check {row['check_seconds'] * 1e3:.2f} ms)  [{row['mechanism']}]")
            except Exception as e:  # noqa: BLE001
                row["error"] = _error(e)
                log(f"weight-sync {impl:<9} {count:>5} tensors  ERROR {row['error']}")
            rows.append(row)
    ray.get(trainer.make_count.remote(1, 4), timeout=60)
    return rows


def _count_trip(trainer: Any, worker: Any, method: str, expect: float, timeout: float) -> Tuple[float, float]:
    """(round trip, the consumer's own check inside it): the object's cost is the difference."""
    t0 = time.perf_counter()
    got, check = ray.get(worker.consume_count.remote(getattr(trainer, method).remote()), timeout=timeout)
    dt = time.perf_counter() - t0
    if abs(got - expect) > 1e-3 * max(expect, 1.0):
        raise AssertionError(f"{method}: consumer checksum {got} != {expect}")
    return dt, check


# ---------------------------------------------------------------------- the suite
def weight_sync_suite(ctx: Any) -> List[Dict[str, Any]]:
    """Every case at every worker count, the in-process reference and the tensor-count objects."""
    config = ctx.config
    shape = model_shape(config.weight_sync_scale)
    warmup, iters = iterations(config)
    log(f"weight-sync: {shape.describe()}; workers {config.weight_sync_workers}; {warmup} warm-up + {iters} timed "
        f"steps; rdt.get(into=) {'available' if has_into() else 'NOT available in this build'}")
    rows: List[Dict[str, Any]] = []
    step = 0
    for n in config.weight_sync_workers:
        try:
            world = World(shape, n, config.group_timeout)
        except Exception as e:  # noqa: BLE001 - every case of this world size gets the error
            rows += [dict(_base_row(shape, c.impl, n, "sync", consume=c.consume, mechanism=c.mechanism or "?"),
                          error=f"setup: {_error(e)}") for c in selected(config)]
            continue
        try:
            if n == 1:
                rows.append(copy_reference(world, warmup, iters))
                rows.append(copy_reference(world, warmup, iters, threads=os.cpu_count() or 1))
                ctx.progress.done((SUITE, "reference"))
            for case in selected(config):
                rows.append(run_case(world, case, warmup, iters, step))
                step += warmup + iters + 1
                ctx.progress.done((SUITE, case.impl, n))
            if n == min(config.weight_sync_workers):
                rows += count_rows(world, config.quick)
                ctx.progress.done((SUITE, "tensor-count"))
        finally:
            world.close()
    return rows


# For the time-left estimate: a step of each case at n workers, in in-process copies of the model (a + b * n),
# fitted to the 2026-11-27 10:03 run at full scale (2-core reference machine); the driver's calls around a case
# (rdt.stats, the pools turned off and on for the memory step); a step's per-tensor cost.
EST_STEP_COPIES: Dict[str, Tuple[float, float]] = {
    "ray-objstore": (28.5, 1.5), "ray-rdt-gloo": (1.3, 5.1), "ray.collective-broadcast": (2.4, 2.2),
    "rdt-gloo+copy": (0.7, 2.5), "rdt-shm+copy": (0.8, 1.2), "rdt-nixl+copy": (1.7, 1.1),
    "rdt-gloo+into": (1.2, 1.8), "rdt-shm+into": (0.3, 0.8), "rdt-nixl+into": (1.1, 0.7),
    "rdt-shm-shared+into": (0.2, 0.4)}
EST_CASE_S = 0.5
EST_TENSOR_S = 0.0002


def weight_sync_plan(config: Any) -> List[Tuple[Any, float]]:
    """The progress keys and estimated costs of :func:`weight_sync_suite`: the references, each case at each
    worker count (the first of a worker count also pays for its actors, model and groups) and the tensor counts."""
    shape = model_shape(config.weight_sync_scale)
    copy_s = shape.nbytes / EST_COPY_BYTES_PER_S
    tensors = len(shape.shapes())
    warmup, iters = iterations(config)
    out: List[Tuple[Any, float]] = []
    for n in config.weight_sync_workers:
        # the actors (started together), the model written in each, three groups formed: 5-6 s with 2 actors and
        # 18-27 s with 5 in default runs on the 2-core machine, relative to their other cases (2026-11-29)
        world = EST_ACTOR_S + (n + 1) * copy_s + 0.4 * EST_SETUP_S * (n + 1) ** 2
        if n == 1:
            out.append(((SUITE, "reference"), world + 2 * (warmup + 1 + iters) * copy_s))
            world = 0.0
        for i, case in enumerate(selected(config)):
            a, b = EST_STEP_COPIES.get(case.impl, (1.0, 1.0))
            step = (a + b * n) * copy_s + tensors * n * EST_TENSOR_S
            out.append(((SUITE, case.impl, n), (world if i == 0 else 0.0) + EST_CASE_S
                        + (warmup + iters + 1) * step))
        if n == min(config.weight_sync_workers):
            # per tensor count: the trainer makes the object, then per transport rdt.stats of every actor before and
            # after its round trips (4-5 ms with 1 tensor, 7-10 with 1 000)
            trips = 6 if config.quick else 18
            out.append(((SUITE, "tensor-count"), sum(
                EST_CASE_S + len(COUNT_TRANSPORTS) * (0.05 * (n + 1) + trips * (
                    0.004 + count * 5e-6 + COUNT_BYTES / EST_COPY_BYTES_PER_S)) for count in COUNTS)))
    return out
