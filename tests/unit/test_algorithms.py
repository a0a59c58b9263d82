"""Every p2p collective algorithm against a plain torch reference, on a threaded in-process P2P.

World sizes 1-6 (powers of two and not), shapes from 0-d to larger than the chunking thresholds, tensors
smaller than the world (empty chunks), every ReduceOp and the usual dtypes. Ranks run as threads; the harness
fails on deadlock (timeout), reused steps, unmatched or mismatched transfers.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import List, Sequence, Tuple

import pytest
import torch

from rdt_transports import algorithms
from rdt_transports.algorithms import _bde, _impl, _ring
from rdt_transports.errors import InvalidArgumentError
from rdt_transports.types import ReduceOp

from ._threaded_p2p import run_ranks

WORLD_SIZES = (1, 2, 3, 4, 5, 6)
SHAPES: Tuple[Tuple[int, ...], ...] = ((), (0,), (7,), (3, 5), (1000,))  # 0-d, empty, < world, uneven, larger
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64, torch.uint8)
ALL_DTYPES = FLOATS + INTS
OPS = tuple(ReduceOp)
TOL = {
    torch.float16: dict(rtol=1e-2, atol=2e-2),
    torch.bfloat16: dict(rtol=2e-2, atol=1e-1),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float64: dict(rtol=1e-12, atol=1e-12),
}


# ---------------------------------------------------------------------------------------------- helpers
def make(shape: Sequence[int], dtype: torch.dtype, op: ReduceOp, seed: int) -> torch.Tensor:
    """Deterministic test data that cannot overflow any dtype when reduced over 6 ranks."""
    g = torch.Generator().manual_seed(seed)
    if op is ReduceOp.PRODUCT:
        if dtype.is_floating_point:
            x = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
        else:
            x = torch.randint(1, 3, shape, generator=g, dtype=torch.int64)
    elif dtype.is_floating_point:
        x = torch.rand(shape, generator=g, dtype=torch.float64) * 4 - 2
    else:
        x = torch.randint(0, 10, shape, generator=g, dtype=torch.int64)
    return x.to(dtype)


def reference(tensors: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """The reduction computed plainly, in float64 / int64, cast back to the inputs' dtype."""
    wide = torch.float64 if tensors[0].dtype.is_floating_point else torch.int64
    stacked = torch.stack([t.to(wide) for t in tensors])
    if op is ReduceOp.SUM:
        out = stacked.sum(0)
    elif op is ReduceOp.AVG:
        out = stacked.sum(0) / len(tensors)
    elif op is ReduceOp.PRODUCT:
        out = stacked.prod(0)
    elif op is ReduceOp.MIN:
        out = stacked.amin(0)
    else:
        out = stacked.amax(0)
    return out.to(tensors[0].dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Exact for integers, dtype-dependent tolerance for floats."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if actual.dtype.is_floating_point:
        torch.testing.assert_close(actual, expected, **TOL[actual.dtype])
    else:
        assert torch.equal(actual, expected), f"{actual} != {expected}"


def shapes_for(dtype: torch.dtype) -> Tuple[Tuple[int, ...], ...]:
    """Every shape for the main dtypes; the small ones for the rest (keeps the suite fast)."""
    return SHAPES if dtype in (torch.float32, torch.int64) else ((), (7,), (3, 5))


def ops_for(dtype: torch.dtype) -> Tuple[ReduceOp, ...]:
    """AVG is only defined for floating dtypes."""
    return OPS if dtype.is_floating_point else tuple(o for o in OPS if o is not ReduceOp.AVG)


def reduce_cases(op_name: str) -> List[tuple]:
    """algorithm x world size x dtype x reduce op for the reducing collectives."""
    return [
        pytest.param(algo, ws, dtype, op, id=f"{algo}-ws{ws}-{str(dtype)[6:]}-{op.value}")
        for algo in algorithms.algorithms_for(op_name)
        for ws in WORLD_SIZES
        for dtype in ALL_DTYPES
        for op in ops_for(dtype)
    ]


def roots(ws: int) -> Tuple[int, ...]:
    """First, middle and last rank (deduplicated)."""
    return tuple(sorted({0, ws // 2, ws - 1}))


# ---------------------------------------------------------------------------------------------- reducing ops
@pytest.mark.parametrize("algo,ws,dtype,op", reduce_cases("allreduce"))
def test_allreduce(algo: str, ws: int, dtype: torch.dtype, op: ReduceOp) -> None:
    for shape in shapes_for(dtype):
        inputs = [make(shape, dtype, op, seed=r) for r in range(ws)]

        def body(p2p):
            t = inputs[p2p.rank].clone()
            algorithms.run("allreduce", algo, p2p, tensor=t, op=op)
            return t

        outs, _ = run_ranks(ws, body)
        assert_close(outs[0], reference(inputs, op))
        for r in range(1, ws):  # every rank must hold the very same bits
            assert torch.equal(outs[r], outs[0]), f"rank {r} differs from rank 0"


@pytest.mark.parametrize("algo", algorithms.algorithms_for("allreduce"))
@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("dtype,op", [(torch.float32, ReduceOp.SUM), (torch.float32, ReduceOp.AVG),
                                      (torch.int32, ReduceOp.PRODUCT), (torch.float16, ReduceOp.MAX)])
def test_allreduce_large(algo: str, ws: int, dtype: torch.dtype, op: ReduceOp) -> None:
    """Above RECURSIVE_DOUBLING_MAX_BYTES, so bde takes the Rabenseifner (halving + doubling) path."""
    numel = _bde.RECURSIVE_DOUBLING_MAX_BYTES // torch.empty((), dtype=dtype).element_size() + 13
    inputs = [make((numel,), dtype, op, seed=10 + r) for r in range(ws)]

    def body(p2p):
        t = inputs[p2p.rank].clone()
        algorithms.run("allreduce", algo, p2p, tensor=t, op=op)
        return t

    outs, _ = run_ranks(ws, body)
    assert_close(outs[0], reference(inputs, op))
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("algo,ws,dtype,op", reduce_cases("reducescatter"))
def test_reducescatter(algo: str, ws: int, dtype: torch.dtype, op: ReduceOp) -> None:
    for shape in shapes_for(dtype):
        inputs = [[make(shape, dtype, op, seed=100 * r + j) for j in range(ws)] for r in range(ws)]

        def body(p2p):
            ins = [t.clone() for t in inputs[p2p.rank]]
            out = torch.full(shape, 7, dtype=dtype)
            algorithms.run("reducescatter", algo, p2p, tensor=out, inputs=ins, op=op)
            assert all(torch.equal(a, b) for a, b in zip(ins, inputs[p2p.rank])), "inputs were modified"
            return out

        outs, _ = run_ranks(ws, body)
        for r in range(ws):
            assert_close(outs[r], reference([inputs[j][r] for j in range(ws)], op))


@pytest.mark.parametrize("algo", algorithms.algorithms_for("reduce"))
@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.int64, torch.bfloat16))
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.value)
def test_reduce(algo: str, ws: int, dtype: torch.dtype, op: ReduceOp) -> None:
    if op is ReduceOp.AVG and not dtype.is_floating_point:
        pytest.skip("AVG needs a float dtype")
    for root in roots(ws):
        for shape in shapes_for(dtype):
            inputs = [make(shape, dtype, op, seed=r + 7) for r in range(ws)]

            def body(p2p):
                t = inputs[p2p.rank].clone()
                algorithms.run("reduce", algo, p2p, tensor=t, root=root, op=op)
                return t

            outs, _ = run_ranks(ws, body)
            assert_close(outs[root], reference(inputs, op))
            for r in range(ws):
                if r != root:
                    assert torch.equal(outs[r], inputs[r]), f"non-root rank {r}'s input was modified"


# ---------------------------------------------------------------------------------------------- data movement
MOVE_DTYPES = (torch.float32, torch.int64, torch.uint8, torch.bfloat16)


def move_cases(op_name: str) -> List[tuple]:
    """algorithm x world size x dtype for the data-movement collectives."""
    return [
        pytest.param(algo, ws, dtype, id=f"{algo}-ws{ws}-{str(dtype)[6:]}")
        for algo in algorithms.algorithms_for(op_name)
        for ws in WORLD_SIZES
        for dtype in MOVE_DTYPES
    ]


@pytest.mark.parametrize("algo,ws,dtype", move_cases("broadcast"))
def test_broadcast(algo: str, ws: int, dtype: torch.dtype) -> None:
    for root in roots(ws):
        for shape in SHAPES:
            data = make(shape, dtype, ReduceOp.SUM, seed=root)

            def body(p2p):
                t = data.clone() if p2p.rank == root else torch.zeros(shape, dtype=dtype)
                algorithms.run("broadcast", algo, p2p, tensor=t, root=root)
                return t

            outs, _ = run_ranks(ws, body)
            assert all(torch.equal(o, data) for o in outs)


@pytest.mark.parametrize("algo,ws,dtype", move_cases("allgather"))
def test_allgather(algo: str, ws: int, dtype: torch.dtype) -> None:
    for shape in SHAPES:
        inputs = [make(shape, dtype, ReduceOp.SUM, seed=r) for r in range(ws)]

        def body(p2p):
            outputs = [torch.zeros(shape, dtype=dtype) for _ in range(ws)]
            algorithms.run("allgather", algo, p2p, outputs=outputs, tensor=inputs[p2p.rank].clone())
            return outputs

        outs, _ = run_ranks(ws, body)
        for r in range(ws):
            assert all(torch.equal(outs[r][j], inputs[j]) for j in range(ws)), f"rank {r}"


@pytest.mark.parametrize("algo,ws,dtype", move_cases("gather"))
def test_gather(algo: str, ws: int, dtype: torch.dtype) -> None:
    for root in roots(ws):
        for shape in SHAPES:
            inputs = [make(shape, dtype, ReduceOp.SUM, seed=r + 3) for r in range(ws)]

            def body(p2p):
                outputs = [torch.zeros(shape, dtype=dtype) for _ in range(ws)] if p2p.rank == root else None
                algorithms.run("gather", algo, p2p, outputs=outputs, tensor=inputs[p2p.rank].clone(), root=root)
                return outputs

            outs, _ = run_ranks(ws, body)
            assert all(torch.equal(outs[root][j], inputs[j]) for j in range(ws))


@pytest.mark.parametrize("algo,ws,dtype", move_cases("scatter"))
def test_scatter(algo: str, ws: int, dtype: torch.dtype) -> None:
    for root in roots(ws):
        for shape in SHAPES:
            chunks = [make(shape, dtype, ReduceOp.SUM, seed=j + 5) for j in range(ws)]

            def body(p2p):
                ins = [c.clone() for c in chunks] if p2p.rank == root else None
                t = torch.zeros(shape, dtype=dtype)
                algorithms.run("scatter", algo, p2p, inputs=ins, tensor=t, root=root)
                if ins is not None:
                    assert all(torch.equal(a, b) for a, b in zip(ins, chunks)), "inputs were modified"
                return t

            outs, _ = run_ranks(ws, body)
            assert all(torch.equal(outs[r], chunks[r]) for r in range(ws))


@pytest.mark.parametrize("algo,ws,dtype", move_cases("alltoall"))
def test_alltoall(algo: str, ws: int, dtype: torch.dtype) -> None:
    for shape in SHAPES:
        inputs = [[make(shape, dtype, ReduceOp.SUM, seed=100 * i + j) for j in range(ws)] for i in range(ws)]

        def body(p2p):
            ins = [t.clone() for t in inputs[p2p.rank]]
            outputs = [torch.zeros(shape, dtype=dtype) for _ in range(ws)]
            algorithms.run("alltoall", algo, p2p, outputs=outputs, inputs=ins)
            assert all(torch.equal(a, b) for a, b in zip(ins, inputs[p2p.rank])), "inputs were modified"
            return outputs

        outs, _ = run_ranks(ws, body)
        for i in range(ws):
            assert all(torch.equal(outs[i][j], inputs[j][i]) for j in range(ws)), f"rank {i}"


@pytest.mark.parametrize("fn_name", ["broadcast", "reduce"])
@pytest.mark.parametrize("ws", (2, 3, 5))
def test_ring_pipelining(fn_name: str, ws: int) -> None:
    """Tiny pipeline chunks so the chained broadcast/reduce really run many chunks through the chain."""
    numel = 103
    inputs = [make((numel,), torch.float64, ReduceOp.SUM, seed=r) for r in range(ws)]
    root = ws - 1

    def body(p2p):
        t = inputs[p2p.rank].clone()
        if fn_name == "broadcast":
            _ring.broadcast(p2p, t, root, chunk_bytes=64)
        else:
            _ring.reduce(p2p, t, root, ReduceOp.SUM, chunk_bytes=64)
        return t

    outs, hub = run_ranks(ws, body)
    expected = inputs[root] if fn_name == "broadcast" else reference(inputs, ReduceOp.SUM)
    if fn_name == "broadcast":
        assert all(torch.equal(o, expected) for o in outs)
    else:
        assert_close(outs[root], expected)
    assert hub.messages == (ws - 1) * len(_ring.pipeline_bounds(inputs[0], 64)) > ws - 1


# ---------------------------------------------------------------------------------------------- barrier
@pytest.mark.parametrize("algo", algorithms.algorithms_for("barrier"))
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_barrier(algo: str, ws: int) -> None:
    """No rank leaves the barrier before the last one entered it."""
    late = ws - 1
    entered = {}
    lock = threading.Lock()

    def body(p2p):
        if p2p.rank == late:
            time.sleep(0.05)
        with lock:
            entered[p2p.rank] = time.monotonic()
        algorithms.run("barrier", algo, p2p)
        return time.monotonic()

    left, _ = run_ranks(ws, body)
    assert min(left) >= max(entered.values())


# ---------------------------------------------------------------------------------------------- dispatch
def test_algorithm_table() -> None:
    assert set(algorithms.algorithms_for("allreduce")) == {"ring", "bde", "tree"}
    assert algorithms.algorithms_for("nonsense") == ()


def test_unknown_algorithm_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError):
        algorithms.run("allreduce", "butterfly", None, tensor=torch.zeros(1), op=ReduceOp.SUM)  # type: ignore[arg-type]


@pytest.mark.parametrize("op", sorted(algorithms.ALGORITHMS))
@pytest.mark.parametrize("ws", (1, 2, 3, 8, 64))
@pytest.mark.parametrize("nbytes", (0, 1, 4096, 1 << 20, 1 << 30))
def test_choose_returns_a_listed_algorithm(op: str, ws: int, nbytes: int) -> None:
    assert algorithms.choose(op, nbytes, ws, "gloo") in algorithms.algorithms_for(op)


def test_choose_small_vs_large_allreduce() -> None:
    assert algorithms.choose("allreduce", 1024, 8, "ucx") == "bde"
    assert algorithms.choose("allreduce", 64 << 20, 8, "ucx") == "ring"


def test_large_broadcast_prefers_the_pipelined_chain() -> None:
    """Large broadcasts leave native trees for the chain (root sends once); small ones and other ops do not."""
    big = _impl.BROADCAST_PIPELINE_BYTES
    assert algorithms.prefers_p2p("broadcast", big) and not algorithms.prefers_p2p("broadcast", big - 1)
    assert not algorithms.prefers_p2p("allreduce", 1 << 30)
    assert algorithms.choose("broadcast", big, 4, "gloo") == "ring"


@functools.lru_cache(maxsize=None)
def _steps_used(op: str, algo: str, ws: int) -> int:
    """Number of transfers one small call makes (used to sanity-check message counts)."""
    kw = _kwargs_for(op, ws)

    def body(p2p):
        algorithms.run(op, algo, p2p, **kw(p2p.rank))

    _, hub = run_ranks(ws, body)
    return hub.messages


def _kwargs_for(op: str, ws: int):
    """Per-rank kwargs for a small float32 call of ``op``."""
    def kw(rank: int) -> dict:
        t = torch.ones(4)
        lst = [torch.ones(4) for _ in range(ws)]
        return {
            "broadcast": dict(tensor=t, root=0), "allreduce": dict(tensor=t, op=ReduceOp.SUM),
            "reduce": dict(tensor=t, root=0, op=ReduceOp.SUM), "allgather": dict(outputs=lst, tensor=t),
            "gather": dict(outputs=lst if rank == 0 else None, tensor=t, root=0),
            "scatter": dict(inputs=lst if rank == 0 else None, tensor=t, root=0),
            "reducescatter": dict(tensor=t, inputs=lst, op=ReduceOp.SUM), "alltoall": dict(outputs=lst, inputs=lst),
            "barrier": {},
        }[op]
    return kw


@pytest.mark.parametrize("op", sorted(algorithms.ALGORITHMS))
def test_world_of_one_sends_nothing(op: str) -> None:
    for algo in algorithms.algorithms_for(op):
        assert _steps_used(op, algo, 1) == 0


def test_tree_broadcast_uses_n_minus_1_messages() -> None:
    assert _steps_used("broadcast", "tree", 6) == 5
