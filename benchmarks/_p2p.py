"""p2p measured two ways, in interleaved rounds in the same two actors.

Every library (each rdt_transports backend and ``ray.util.collective`` Gloo) has a group on the same two actors.
Each round runs, for every library in turn (the order rotates per round), one *barrier* sample (barrier, then one
send on rank 0 and recv on rank 1, timed on the receiver: how a pipeline stage runs it) and one *back-to-back*
sample (barrier, then ``burst`` transfers in a row, timed on the receiver, divided by ``burst``). Machine noise
therefore hits every library alike, instead of whichever case happened to run during a noisy minute.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Tuple

from ._baselines import RayCollectiveImpl
from ._cluster import log
from ._collectives import (EST_SETUP_S, BenchContext, Impl, RdtImpl, _ask_mechanism, _first_line, check, error_row,
                           fmt_size, gather_times, make_row, make_tensor, prime)

MODES: Tuple[str, ...] = ("back-to-back", "barrier")
WORLD_SIZE = 2
BURST_BYTES = 32 << 20  # a back-to-back sample moves about this much (2 to 8 transfers)
MAX_ROUNDS = 200  # small sizes: a round takes milliseconds, and 50 rounds left medians ~5 % apart between runs
MIN_ROUNDS = 24  # large sizes: with 11 to 16 rounds the Gloo-vs-Gloo ratio at 16/128 MiB ran 0.80-1.21x by run
BUDGET_SCALE = 4  # p2p rounds move 4x the suite's byte budget per size: 64 rounds at 16 MiB, where 16 were too few


@dataclass(frozen=True)
class Lib:
    """One library in the interleaved rounds: its key in the results, kind ('rdt' / 'rayc') and group name."""

    key: str
    kind: str
    group: str


class LibFailed(RuntimeError):
    """A library's operation failed in the interleaved rounds (the other rank then fails in the same library)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(key, message)
        self.key = key
        self.message = message

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


def burst_for(nbytes: int, quick: bool) -> int:
    """Transfers per back-to-back sample."""
    return 2 if quick else max(2, min(8, BURST_BYTES // max(nbytes, 1)))


def rounds_for(config: Any, nbytes: int) -> Tuple[int, int]:
    """(warmup, timed rounds): the suite's iterations, raised to at least MIN_ROUNDS and up to MAX_ROUNDS where
    BUDGET_SCALE x its byte budget allows. A ratio of two medians of a bimodal sample (Gloo here: ~3.5 and ~5 ms
    at 16 MiB) needs tens of rounds to stop flipping between runs."""
    warmup, iters = config.iterations(nbytes)
    if config.quick or config.iters:
        return warmup, iters
    return warmup, max(iters, MIN_ROUNDS, min(MAX_ROUNDS, BUDGET_SCALE * config.bytes_budget // max(nbytes, 1)))


def _ops(lib: Lib, rank: int, t: Any, timeout: float) -> Tuple[Callable[[], None], Callable[[], None]]:
    """(barrier, transfer) for ``lib`` on ``rank``: rank 0 sends, rank 1 receives."""
    if lib.kind == "rdt":
        import rdt_transports as rt

        def barrier() -> None:
            rt.barrier(lib.group, timeout=timeout)
        move = (lambda: rt.send(t, 1, lib.group, timeout=timeout)) if rank == 0 else \
            (lambda: rt.recv(t, 0, lib.group, timeout=timeout))
        return barrier, move
    import ray.util.collective as col

    move = (lambda: col.send(t, 1, lib.group)) if rank == 0 else (lambda: col.recv(t, 0, lib.group))
    return (lambda: col.barrier(lib.group)), move


def _rounds(self: Any, libs: List[Lib], rank: int, nbytes: int, warmup: int, iters: int, burst: int,
            timeout: float) -> Dict[str, Dict[str, List[float]]]:
    """In an actor: check each library once, then ``warmup + iters`` interleaved rounds of both modes."""
    t = make_tensor(self.state, nbytes)
    ops = {lib.key: _ops(lib, rank, t, timeout) for lib in libs}
    for lib in libs:  # the data really moves: the receiver checks the first transfer of every library
        barrier, move = ops[lib.key]
        with _failing_as(lib):
            prime(t, "p2p", rank)
            barrier()
            move()
            check(t, "p2p", rank, WORLD_SIZE)
    t.zero_()
    out: Dict[str, Dict[str, List[float]]] = {lib.key: {m: [] for m in MODES} for lib in libs}
    for r in range(warmup + iters):
        k = r % len(libs)
        for lib in libs[k:] + libs[:k]:
            with _failing_as(lib):
                one, many = _samples(*ops[lib.key], burst)
            if r >= warmup:
                out[lib.key]["barrier"].append(one)
                out[lib.key]["back-to-back"].append(many)
    for lib in libs:
        with _failing_as(lib):
            ops[lib.key][0]()
    return out


def _samples(barrier: Callable[[], None], move: Callable[[], None], burst: int) -> Tuple[float, float]:
    """(one transfer after a barrier, mean of ``burst`` transfers back to back after a barrier), in seconds."""
    barrier()
    t0 = time.perf_counter()
    move()
    one = time.perf_counter() - t0
    barrier()
    t0 = time.perf_counter()
    for _ in range(burst):
        move()
    return one, (time.perf_counter() - t0) / burst


@contextlib.contextmanager
def _failing_as(lib: Lib) -> Iterator[None]:
    """Re-raise any failure as :class:`LibFailed` naming ``lib``, so that the driver can drop just that one."""
    try:
        yield
    except Exception as e:  # noqa: BLE001
        raise LibFailed(lib.key, f"{type(e).__name__}: {_first_line(e)}") from e


def _stats(times: List[float]) -> Dict[str, Any]:
    return {"seconds": statistics.median(times), "seconds_min": min(times),
            "seconds_all": [round(s, 9) for s in times]}


def interleaved_p2p(ctx: BenchContext, impls: List[Impl]) -> List[Dict[str, Any]]:
    """Set every library up on the same two actors, then measure each size in interleaved rounds."""
    rows: List[Dict[str, Any]] = []
    ready: List[Tuple[Impl, Lib]] = []
    for impl in impls:
        actors = ctx.pool.get(WORLD_SIZE)
        if _setup(ctx, impl, rows):
            ready.append((impl, _lib(impl)))
        elif ctx.pool.actors is not actors:  # the failed setup restarted the actors: the earlier groups are gone
            ready = _setup_again(ctx, ready, rows)
    try:
        if ready:
            rows += _measure_sizes(ctx, ready)
    finally:
        for impl, _ in ready:
            try:
                impl.teardown(ctx)
            except Exception as e:  # noqa: BLE001
                log(f"p2p       {impl.name} teardown failed: {_first_line(e)}")
    return rows


def _setup(ctx: BenchContext, impl: Impl, rows: List[Dict[str, Any]]) -> bool:
    """Set ``impl`` up on the pool's two actors; False (and error rows) when it is unavailable."""
    try:
        impl.setup(ctx, WORLD_SIZE)
        return True
    except Exception as e:  # noqa: BLE001 - unavailable: error rows, the others go on
        msg = _first_line(e)
        log(f"p2p       {impl.name:<22} n={WORLD_SIZE} {'-':>9}  {msg}")
        rows.extend(error_row("p2p", "p2p", impl, WORLD_SIZE, msg, mode=m) for m in MODES)
        return False


def _setup_again(ctx: BenchContext, ready: List[Tuple[Impl, Lib]],
                 rows: List[Dict[str, Any]]) -> List[Tuple[Impl, Lib]]:
    """Set the already-ready libraries up again on the pool's new actors (bounded: once per restart)."""
    again: List[Tuple[Impl, Lib]] = []
    for impl, _ in ready:
        try:
            impl.teardown(ctx)
        except Exception as e:  # noqa: BLE001 - its actors are gone; the handle is dropped either way
            log(f"p2p       {impl.name} teardown after a restart: {_first_line(e)}")
        if _setup(ctx, impl, rows):
            again.append((impl, _lib(impl)))
    return again


def _lib(impl: Impl) -> Lib:
    if isinstance(impl, RdtImpl):
        return Lib(impl.name, "rdt", impl._handle.name)
    if isinstance(impl, RayCollectiveImpl):
        return Lib(impl.name, "rayc", impl._group or "")
    raise TypeError(f"{impl.name} cannot run in interleaved p2p rounds")


def _measure_sizes(ctx: BenchContext, ready: List[Tuple[Impl, Lib]]) -> List[Dict[str, Any]]:
    """Every size in interleaved rounds; a library that fails is dropped (error rows) and the size re-run
    without it; any other failure (a hang, after which the actors were restarted) ends the case."""
    rows: List[Dict[str, Any]] = []
    live = list(ready)
    for nbytes in ctx.config.sizes:
        times = None
        while live and times is None:  # bounded: each pass either measures or drops one library
            try:
                times = _one_size(ctx, [lib for _, lib in live], nbytes)
            except LibFailed as e:
                failed = [(i, lib) for i, lib in live if lib.key == e.key]
                log(f"p2p       {e.key:<22} {fmt_size(nbytes):>9}  FAILED {e.message}; dropped, size re-run")
                rows += [error_row("p2p", "p2p", i, WORLD_SIZE, e.message, nbytes, mode=m) for i, _ in failed
                         for m in MODES]
                live = [x for x in live if x not in failed] if failed else []
            except Exception as e:  # noqa: BLE001 - the actors (and every group) are gone: stop here
                msg = f"{type(e).__name__}: {_first_line(e)}"
                log(f"p2p interleaved {fmt_size(nbytes):>9}  FAILED {msg}")
                rows += [error_row("p2p", "p2p", i, WORLD_SIZE, msg, nbytes, mode=m) for i, _ in live for m in MODES]
                return rows
        if times is None:
            break
        rows += _rows_of(ctx, live, nbytes, times)
        ctx.progress.done(("p2p", "interleaved", nbytes))
    return rows


EST_CALL_S = 0.0003  # one barrier or small transfer between the two actors (4 KiB rounds of the 10:03 run)
EST_BYTES_PER_S = 5e9  # one large transfer (128 MiB rounds of the same run: 25 ms a transfer, the libraries' mean)


def interleaved_plan(config: Any, nlibs: int) -> List[Tuple[Any, float]]:
    """The progress keys and estimated costs of :func:`interleaved_p2p` over ``nlibs`` libraries: one per size
    (the first also forms every library's group)."""
    out: List[Tuple[Any, float]] = []
    for i, nbytes in enumerate(config.sizes):
        warmup, iters = rounds_for(config, nbytes)
        burst = burst_for(nbytes, config.quick)
        per_round = (3 + burst) * EST_CALL_S + (1 + burst) * nbytes / EST_BYTES_PER_S  # two barriers, 1 + burst
        out.append((("p2p", "interleaved", nbytes), (nlibs * EST_SETUP_S if i == 0 else 0.0)
                    + nlibs * (1 + warmup + iters) * per_round))
    return out


def _one_size(ctx: BenchContext, libs: List[Lib], nbytes: int) -> Dict[str, Dict[str, List[float]]]:
    """The receiver's samples per library and mode for one size."""
    warmup, iters = rounds_for(ctx.config, nbytes)
    burst = burst_for(nbytes, ctx.config.quick)
    op_timeout = ctx.config.op_timeout(nbytes)
    call_timeout = _call_timeout(len(libs), nbytes, warmup + iters, burst, op_timeout)
    refs = [a.__ray_call__.remote(_rounds, libs, r, nbytes, warmup, iters, burst, op_timeout)
            for r, a in enumerate(ctx.pool.get(WORLD_SIZE))]
    return gather_times(ctx, refs, nbytes, call_timeout)[1]  # the receiver's clock


def _call_timeout(nlibs: int, nbytes: int, rounds: int, burst: int, op_timeout: float) -> float:
    """Driver-side bound for one size: every transfer at 10 MB/s and 50 ms per operation, plus one operation
    timing out (the first failure in the rounds raises on both ranks)."""
    ops = nlibs * (1 + rounds * (3 + burst))  # the check, then per round: two barriers and 1 + burst transfers
    moved = nlibs * (1 + rounds * (1 + burst)) * nbytes
    return 60.0 + 2 * op_timeout + 0.05 * ops + moved / 10e6


def _rows_of(ctx: BenchContext, ready: List[Tuple[Impl, Lib]], nbytes: int,
             times: Dict[str, Dict[str, List[float]]]) -> List[Dict[str, Any]]:
    """Result rows (both modes) of one size."""
    rows: List[Dict[str, Any]] = []
    warmup, iters = rounds_for(ctx.config, nbytes)
    burst = burst_for(nbytes, ctx.config.quick)
    for impl, lib in ready:
        mech = _ask_mechanism(ctx, impl, "p2p", nbytes)
        for mode in MODES:
            row = make_row("p2p", "p2p", impl, nbytes, WORLD_SIZE, warmup, iters, _stats(times[lib.key][mode]),
                           mech, mode)
            row.update(interleaved=True, burst=burst if mode == "back-to-back" else 1)
            rows.append(row)
            log(f"p2p       {impl.name:<22} {mode:<12} {fmt_size(nbytes):>9}  {row['latency_us']:12.1f} us  "
                f"{row['gbps']:7.3f} GB/s  (x{iters}) [{mech}]")
    return rows
