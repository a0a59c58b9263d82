"""The measurement core (in-actor timing loop, result rows, case runner) and the rdt_transports implementations."""

from __future__ import annotations

import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import ray
import torch

from ._cluster import ActorPool, log
from ._mechanism import rdt_collective_mechanism
from ._progress import Progress
from ._units import fmt_size

ALGORITHMS: Tuple[str, ...] = ("ring", "bde", "tree")
ROOT_CHECK_TOL = 1e-3
# Rough costs for rdt-bench's estimate of the time left, in seconds of the 2-core reference machine when quiet
# (the run's own pace rescales them): a group formed among running actors, a fresh actor (a worker process that
# imports torch, Ray and rdt), one operation (times ranks squared: they share two cores), a byte a rank moves,
# and a byte copied in memory (weight sync's in-process copy: 100 ms for 988 MB, the 2026-11-27 10:03 run).
EST_SETUP_S = 2.0
EST_ACTOR_S = 2.0
EST_CALL_S = 0.0005
EST_BYTES_PER_S = 2e9
EST_COPY_BYTES_PER_S = 1e10


# ---------------------------------------------------------------------- configuration and context
@dataclass
class BenchConfig:
    """What to measure and how often."""

    sizes: List[int]
    world_sizes: List[int]
    backends: List[str]
    quick: bool = False
    iters: Optional[int] = None
    warmup: Optional[int] = None
    bytes_budget: int = 256 << 20  # per (impl, size): iterations = budget / size, clamped
    min_iters: int = 11  # large sizes: fewer than this and one slow iteration on 2 shared cores moves the median
    max_iters: int = 50
    group_timeout: float = 30.0
    weight_sync_scale: float = 1.0  # the weight-sync suite's model: 1 = Qwen2.5-0.5B's shapes
    weight_sync_scale_set: bool = False  # given on the command line (the sharded-delta suite's default is its own)
    weight_sync_workers: List[int] = field(default_factory=lambda: [1, 2, 4])
    sharded_sync_rows: Optional[List[str]] = None  # the sharded-sync rows to run (None: all)
    # What rdt-bench's default run (no --suites, no --full) leaves out of a suite; the defaults here run it whole.
    p2p_alone: bool = True  # the p2p baselines that run as their own cases (torch.distributed, the object store)
    object_impls: Optional[List[str]] = None  # the objects suite's rows (None: all)
    object_rounds: float = 1.0  # the objects suite's warm-up and timed round trips per size, scaled
    weight_sync_cases: Optional[List[str]] = None  # the weight-sync rows (None: all)
    weight_sync_steps: Optional[int] = None  # weight-sync timed steps per row (None: --iters, else 5)
    sharded_sync_calibrate: bool = True  # measure the range costs (else the transports' declared ones, as a user gets)
    sharded_sync_shared: bool = False  # the sharded-sync rows share one set of 8 actors (else fresh ones per row)

    def iterations(self, nbytes: int) -> Tuple[int, int]:
        """(warmup, timed iterations) for a message of ``nbytes``: fewer for big messages."""
        if self.quick:
            return (self.warmup if self.warmup is not None else 1), (self.iters or 3)
        iters = self.iters or max(self.min_iters, min(self.max_iters, self.bytes_budget // max(nbytes, 1)))
        warmup = self.warmup if self.warmup is not None else (2 if nbytes >= (16 << 20) else 3)
        return warmup, iters

    def op_timeout(self, nbytes: int) -> float:
        """Per-operation timeout inside the actors (generous: 10 MB/s worst case)."""
        return (10.0 if self.quick else 20.0) + nbytes / 10e6

    def call_timeout(self, nbytes: int) -> float:
        """Driver-side ray.get timeout for one measurement call (all iterations)."""
        warmup, iters = self.iterations(nbytes)
        return 60.0 + (2 + warmup + iters) * self.op_timeout(nbytes)


@dataclass
class BenchContext:
    """Shared per run: config, actor pool, and which backends turned out unavailable (per world size)."""

    config: BenchConfig
    pool: ActorPool
    unavailable: Dict[Tuple[str, int], str] = field(default_factory=dict)
    progress: Progress = field(default_factory=lambda: Progress(()))  # the run's report; silent without a plan

    def group_name(self, impl: str) -> str:
        """A fresh group name for one case."""
        return f"bench-{impl.replace('/', '-')}-{uuid.uuid4().hex[:8]}"


class Impl:
    """One implementation under test: setup once per (op, world size), measure per size, teardown."""

    name = "impl"
    family = "rdt"
    backend = ""
    algorithm = ""
    ops: Tuple[str, ...] = ("p2p", "allreduce")
    static_mechanism = ""  # the mechanism when it cannot change at run time (baselines); "" = ask mechanism()

    def setup(self, ctx: BenchContext, world_size: int) -> None:
        """Prepare actors/groups for ``world_size``; raise to mark the implementation unavailable."""

    def measure(self, ctx: BenchContext, op: str, nbytes: int, warmup: int, iters: int) -> List[List[float]]:
        """Per-rank lists of per-iteration seconds."""
        raise NotImplementedError

    def teardown(self, ctx: BenchContext) -> None:
        """Release what setup made (groups); actors stay for the next case."""

    def mechanism(self, ctx: BenchContext, op: str, nbytes: int) -> str:
        """The mechanism that served ``op`` of ``nbytes`` (asked after measuring; the static one by default)."""
        return self.static_mechanism or "?"


# ---------------------------------------------------------------------- in-actor helpers
def make_tensor(state: Dict[str, Any], nbytes: int) -> torch.Tensor:
    """A float32 tensor of ``nbytes`` (cached per size in the actor's state)."""
    key = ("buf", nbytes)
    if key not in state:
        state.clear()  # keep one buffer per actor: 128 MiB x several sizes adds up
        state[key] = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32)
    return state[key]


def prime(t: torch.Tensor, op: str, rank: int) -> None:
    """Fill the tensor so that the first (untimed) run can be checked."""
    t.fill_(float(rank + 1) if op == "allreduce" or rank == 0 else 0.0)


def check(t: torch.Tensor, op: str, rank: int, world_size: int) -> None:
    """Verify the untimed first run moved the right data (p2p: receiver got 1.0; allreduce: sum of rank+1)."""
    if op == "p2p":
        if rank != 1:
            return
        expected = 1.0
    else:
        expected = world_size * (world_size + 1) / 2
    got = (float(t[0]), float(t[-1]))
    if any(abs(g - expected) > ROOT_CHECK_TOL for g in got):
        raise AssertionError(f"wrong result on rank {rank}: {got} != {expected}")


def timed_loop(barrier: Callable[[], None], run: Callable[[], None], t: torch.Tensor, op: str, rank: int,
               world_size: int, warmup: int, iters: int) -> List[float]:
    """Check run, warmup, then ``iters`` timed runs, each after a barrier; returns per-iteration seconds."""
    prime(t, op, rank)
    barrier()
    run()
    check(t, op, rank, world_size)
    t.zero_()  # zeros stay zeros under SUM: no inf/denormal effects in the timed runs
    times: List[float] = []
    for i in range(warmup + iters):
        barrier()
        t0 = time.perf_counter()
        run()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    barrier()
    return times


def _rdt_measure(self: Any, group: str, rank: int, world_size: int, op: str, nbytes: int, algorithm: str,
                 warmup: int, iters: int, timeout: float) -> List[float]:
    """In an actor: time rdt_transports p2p (rank 0 -> 1) or allreduce."""
    import rdt_transports as rt

    t = make_tensor(self.state, nbytes)
    if op == "p2p":
        if rank == 0:
            run = lambda: rt.send(t, 1, group, timeout=timeout)  # noqa: E731
        elif rank == 1:
            run = lambda: rt.recv(t, 0, group, timeout=timeout)  # noqa: E731
        else:
            run = lambda: None  # noqa: E731
    else:
        run = lambda: rt.allreduce(t, group, algorithm=algorithm, timeout=timeout)  # noqa: E731
    return timed_loop(lambda: rt.barrier(group, timeout=timeout), run, t, op, rank, world_size, warmup, iters)


def _rdt_mechanism(self: Any, group: str, op: str, nbytes: int, algorithm: str) -> str:
    """In an actor: :func:`rdt_collective_mechanism` (a module function, so that Ray ships it by reference)."""
    return rdt_collective_mechanism(group, op, nbytes, algorithm)


def gather_times(ctx: BenchContext, refs: List[Any], nbytes: int, timeout: Optional[float] = None) -> List[Any]:
    """ray.get every rank's timings with a timeout; a hang resets the actor pool; raises the root-cause error."""
    timeout = timeout or ctx.config.call_timeout(nbytes)
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    errors: List[BaseException] = []
    out: List[List[float]] = []
    for ref in refs:
        if ref in pending:
            continue
        try:
            out.append(ray.get(ref))
        except Exception as e:  # noqa: BLE001 - fetch every rank's error so none goes unhandled
            errors.append(getattr(e, "cause", None) or e)
    if pending:
        for r in pending:
            ray.cancel(r, force=True)
        ctx.pool.reset()
        raise TimeoutError(f"no result within {timeout:.0f}s; actors were restarted")
    if errors:  # the first error that is not a consequence of another rank's failure
        root = [e for e in errors if type(e).__name__ not in ("GroupErroredError", "GroupDestroyedError")]
        raise (root or errors)[0]
    return out


# ---------------------------------------------------------------------- rdt_transports
class RdtImpl(Impl):
    """rdt_transports over ``backend`` with ``algorithm`` (native/auto/ring/bde/tree)."""

    family = "rdt"

    def __init__(self, backend: str, algorithm: str) -> None:
        self.backend = backend
        self.algorithm = algorithm
        default = "native" if backend == "gloo" else "auto"
        self.name = f"rdt-{backend}" + ("" if algorithm == default else f"/{algorithm}")
        self.ops = ("p2p", "allreduce") if algorithm == default else ("allreduce",)
        self._handle: Any = None
        self._world_size = 0

    def setup(self, ctx: BenchContext, world_size: int) -> None:
        """Create a fresh group on the pool's actors (or fail fast if the backend was unavailable before)."""
        import rdt_transports as rt

        known = ctx.unavailable.get((self.backend, world_size))
        if known is not None:
            raise RuntimeError(known)
        try:
            rt.backend_class(self.backend)
            actors = ctx.pool.get(world_size)
            self._handle = rt.create_collective_group(actors, backend=self.backend,
                                                      group_name=ctx.group_name(self.name),
                                                      timeout=ctx.config.group_timeout)
        except Exception as e:  # noqa: BLE001 - any failure here means "not usable in this run"
            reason = f"unavailable: {type(e).__name__}: {_first_line(e)}"
            ctx.unavailable[(self.backend, world_size)] = reason
            if "did not join" in str(e):
                ctx.pool.reset()  # an actor may still be stuck in the backend's init
            raise RuntimeError(reason) from e
        self._world_size = world_size

    def measure(self, ctx: BenchContext, op: str, nbytes: int, warmup: int, iters: int) -> List[List[float]]:
        """Run the timed loop on every member."""
        h = self._handle
        timeout = ctx.config.op_timeout(nbytes)
        refs = [a.__ray_call__.remote(_rdt_measure, h.name, r, h.world_size, op, nbytes, self.algorithm, warmup,
                                      iters, timeout) for a, r in zip(h.actors, h.ranks)]
        by_rank = gather_times(ctx, refs, nbytes)
        return [t for _, t in sorted(zip(h.ranks, by_rank))]

    def mechanism(self, ctx: BenchContext, op: str, nbytes: int) -> str:
        """Asked of rank 0's group: the backend, the shared-memory allreduce, or the p2p algorithm that ran."""
        h = self._handle
        return ray.get(h.actors[0].__ray_call__.remote(_rdt_mechanism, h.name, op, nbytes, self.algorithm),
                       timeout=30)

    def teardown(self, ctx: BenchContext) -> None:
        """Destroy the group on every member."""
        if self._handle is not None:
            try:
                self._handle.destroy(timeout=10)
            finally:
                self._handle = None


def rdt_impls(backends: Sequence[str], op: str) -> List[Impl]:
    """rdt_transports implementations for ``op``: each backend's default and (allreduce) each p2p algorithm."""
    out: List[Impl] = []
    for b in backends:
        algos = ["native" if b == "gloo" else "auto"] + (list(ALGORITHMS) if op == "allreduce" else [])
        out.extend(RdtImpl(b, a) for a in algos)
    return out


# ---------------------------------------------------------------------- progress estimates
def estimate_s(calls: int, nbytes: int, ranks: int) -> float:
    """A rough cost of ``calls`` operations on ``nbytes`` among ``ranks`` ranks, for the time-left estimate."""
    return calls * (EST_CALL_S * ranks * ranks + nbytes * ranks / EST_BYTES_PER_S)


def case_plan(config: BenchConfig, suite: str, impl: str, world_size: int) -> List[Tuple[Any, float]]:
    """The progress keys and estimated costs of one :func:`run_case`: one per size."""
    out: List[Tuple[Any, float]] = []
    for i, nbytes in enumerate(config.sizes):
        warmup, iters = config.iterations(nbytes)
        out.append(((suite, impl, world_size, nbytes),
                    (EST_SETUP_S if i == 0 else 0.0) + estimate_s(warmup + iters, nbytes, world_size)))
    return out


# ---------------------------------------------------------------------- rows and the case runner
def summarize(op: str, times: List[List[float]], world_size: int) -> Dict[str, float]:
    """Reduce per-rank timings: p2p uses the receiver's clock; allreduce the slowest rank per iteration."""
    per_iter = times[1] if op == "p2p" else [max(ts) for ts in zip(*times)]
    return {"seconds": statistics.median(per_iter), "seconds_min": min(per_iter),
            "seconds_all": [round(s, 9) for s in per_iter]}


def make_row(suite: str, op: str, impl: Impl, nbytes: int, world_size: int, warmup: int, iters: int,
             stats: Dict[str, Any], mechanism: str, mode: str = "barrier") -> Dict[str, Any]:
    """One measurement as a JSON-able dict; ``mechanism`` is what served it, ``mode`` how it was timed."""
    sec, best = stats["seconds"], stats["seconds_min"]
    row = {"suite": suite, "op": op, "impl": impl.name, "family": impl.family, "backend": impl.backend,
           "algorithm": impl.algorithm, "mechanism": mechanism, "mode": mode, "size": nbytes,
           "world_size": world_size, "warmup": warmup,
           "iters": iters, **stats, "latency_us": sec * 1e6, "gbps": nbytes / sec / 1e9,
           "gbps_best": nbytes / best / 1e9}
    if op == "allreduce":
        row["busbw_gbps"] = row["gbps"] * 2 * (world_size - 1) / world_size
    return row


def error_row(suite: str, op: str, impl: Impl, world_size: int, error: str, nbytes: Optional[int] = None,
              mode: str = "barrier") -> Dict:
    """A failed/unavailable implementation (the run goes on)."""
    return {"suite": suite, "op": op, "impl": impl.name, "family": impl.family, "backend": impl.backend,
            "algorithm": impl.algorithm, "mechanism": impl.static_mechanism or "?", "mode": mode, "size": nbytes,
            "world_size": world_size, "error": error}


def run_case(ctx: BenchContext, suite: str, op: str, impl: Impl, world_size: int) -> List[Dict[str, Any]]:
    """Set ``impl`` up once for ``world_size``, measure every size, tear down; failures become error rows."""
    rows: List[Dict[str, Any]] = []
    label = f"{suite:<9} {impl.name:<22} n={world_size}"
    try:
        impl.setup(ctx, world_size)
    except Exception as e:  # noqa: BLE001
        msg = _first_line(e)
        log(f"{label} {'-':>9}  {msg if msg.startswith('unavailable') else 'setup failed: ' + msg}")
        return [error_row(suite, op, impl, world_size, msg)]
    try:
        for nbytes in ctx.config.sizes:
            warmup, iters = ctx.config.iterations(nbytes)
            try:
                times = impl.measure(ctx, op, nbytes, warmup, iters)
            except Exception as e:  # noqa: BLE001
                msg = f"{type(e).__name__}: {_first_line(e)}"
                log(f"{label} {fmt_size(nbytes):>9}  FAILED {msg}")
                rows.append(error_row(suite, op, impl, world_size, msg, nbytes))
                ctx.progress.done((suite, impl.name, world_size, nbytes))  # the sizes after it are skipped
                if impl.family == "rdt" and ("Timeout" in msg or "Unavailable" in msg):
                    ctx.unavailable[(impl.backend, world_size)] = f"skipped: {impl.name} failed with {msg[:200]}"
                break  # the group (or process set) is unusable after a failure
            mech = _ask_mechanism(ctx, impl, op, nbytes)
            row = make_row(suite, op, impl, nbytes, world_size, warmup, iters, summarize(op, times, world_size),
                           mech)
            rows.append(row)
            extra = f"  busbw {row['busbw_gbps']:7.3f} GB/s" if op == "allreduce" else ""
            log(f"{label} {fmt_size(nbytes):>9}  {row['latency_us']:12.1f} us  {row['gbps']:7.3f} GB/s{extra}"
                f"  (x{iters}) [{mech}]")
            ctx.progress.done((suite, impl.name, world_size, nbytes))
    finally:
        try:
            impl.teardown(ctx)
        except Exception as e:  # noqa: BLE001
            log(f"{label} teardown failed: {_first_line(e)}")
        _trim_workers(ctx, label)
    return rows


WORKER_RSS_RESTART_BYTES = 2 << 30  # a worker holding more after a case (and a heap trim) is replaced


def _trim_workers(ctx: BenchContext, label: str) -> None:
    """Between cases: give the workers' freed heap back to the OS (BenchWorker.trim), and replace the workers when
    one still holds more than WORKER_RSS_RESTART_BYTES. A UCX group's create/destroy left 0.6-3.6 GiB per worker
    behind (2026-11-26, n=4 128 MiB), which took the README's default run out of memory."""
    import ray

    if not ctx.pool.actors:
        return
    try:
        rss = ray.get([a.trim.remote() for a in ctx.pool.actors], timeout=60)
    except Exception as e:  # noqa: BLE001 - a dead worker is replaced by the next pool.get
        log(f"{label} trimming the workers' heap failed: {_first_line(e)}")
        return
    if max(rss) > WORKER_RSS_RESTART_BYTES:
        log(f"{label} workers hold {[round(r / 2**30, 2) for r in rss]} GiB after the case: replaced")
        ctx.pool.reset()


def _ask_mechanism(ctx: BenchContext, impl: Impl, op: str, nbytes: int) -> str:
    """impl.mechanism(), or '?' (logged) when it cannot be told: a label is never guessed."""
    try:
        return impl.mechanism(ctx, op, nbytes)
    except Exception as e:  # noqa: BLE001
        log(f"{impl.name}: could not tell the mechanism: {_first_line(e)}")
        return "?"


def _first_line(e: BaseException) -> str:
    e = getattr(e, "cause", None) or e
    text = str(e).strip() or type(e).__name__
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return (lines[-1] if "Traceback" in text else lines[0])[:400]
