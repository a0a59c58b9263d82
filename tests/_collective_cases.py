"""Shared helpers for the Ray-cluster collective tests: a worker actor, deterministic inputs and case batches.

Imported by the test modules on the driver and by the Ray workers (``/work/main`` is on their ``sys.path``),
so it only depends on numpy, torch and rdt_transports. Every input is derived from ``(rank, case id, slot)``
with small values (no overflow of uint8 / int32 products, exact sums in float16), so the driver can rebuild
every rank's inputs and compute the expected result with torch.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import ray
import torch

DTYPES: Dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}
FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")
NUMPY_NAMES = tuple(n for n in DTYPES if n != "bfloat16")  # numpy has no bfloat16
SHAPES: Tuple[Tuple[int, ...], ...] = ((), (5,), (3, 4), (1000,))
REDUCE_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG")
FILL = 77  # output buffers start with this value, which no expected result can take

TOL = {
    "float16": dict(rtol=1e-2, atol=2e-2),
    "bfloat16": dict(rtol=2e-2, atol=1e-1),
    "float32": dict(rtol=1e-5, atol=1e-5),
    "float64": dict(rtol=1e-12, atol=1e-12),
}

REDUCING_OPS = ("allreduce", "reduce", "reducescatter")
ROOTED_OPS = ("broadcast", "reduce", "gather", "scatter")


# ---------------------------------------------------------------------------------------------- inputs
def make_tensor(dtype: str, shape: Sequence[int], rank: int, case: int, slot: int = 0) -> torch.Tensor:
    """Deterministic small values: floats in {-1.25 .. 1.75} (never 0), signed ints in -3..3, uint8 in 1..3."""
    numel = int(np.prod(shape)) if len(shape) else 1
    seed = rank * 1009 + case * 31 + slot * 7
    idx = torch.arange(numel, dtype=torch.int64)
    if dtype == "uint8":
        base = (idx * 5 + seed) % 3 + 1
    else:
        base = (idx * 5 + seed) % 7 - 3
    if dtype in FLOAT_NAMES:
        values = base.to(torch.float64) * 0.5 + 0.25
    else:
        values = base
    return values.to(DTYPES[dtype]).reshape(tuple(shape))


def to_lib(t: torch.Tensor, lib: str) -> Any:
    if lib == "numpy":
        return t.numpy().copy()  # C-contiguous, writeable, keeps 0-d shapes
    return t.clone()


def filled(dtype: str, shape: Sequence[int], lib: str) -> Any:
    return to_lib(torch.full(tuple(shape), FILL, dtype=DTYPES[dtype]), lib)


def as_tensor(x: Any) -> torch.Tensor:
    return torch.from_numpy(np.array(x)) if isinstance(x, np.ndarray) else x


def reduce_ref(tensors: List[torch.Tensor], rop: str) -> torch.Tensor:
    """Reference reduction, computed in float64 / int64 and cast back to the inputs' dtype."""
    dtype = tensors[0].dtype
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    stack = torch.stack([t.to(wide) for t in tensors])
    if rop == "SUM":
        out = stack.sum(0)
    elif rop == "PRODUCT":
        out = stack.prod(0)
    elif rop == "MIN":
        out = stack.min(0).values
    elif rop == "MAX":
        out = stack.max(0).values
    elif rop == "AVG":
        out = stack.mean(0)
    else:  # pragma: no cover
        raise ValueError(rop)
    return out.to(dtype)


def assert_close(actual: Any, expected: torch.Tensor, dtype: str, what: str) -> None:
    a = as_tensor(actual)
    assert a.dtype == expected.dtype, f"{what}: dtype {a.dtype} != {expected.dtype}"
    assert tuple(a.shape) == tuple(expected.shape), f"{what}: shape {tuple(a.shape)} != {tuple(expected.shape)}"
    if dtype in TOL:
        torch.testing.assert_close(a, expected, **TOL[dtype], msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(a, expected), f"{what}: {a.flatten()[:8]} != {expected.flatten()[:8]}"


# ---------------------------------------------------------------------------------------------- case batches
def build_cases(op: str, world_size: int) -> List[Dict[str, Any]]:
    """The batch of cases (without algorithm) for ``op``: every dtype, torch and numpy, every shape, every
    applicable ReduceOp, roots rotating (mostly non-zero), every ordered (src, dst) pair for send/recv."""
    cases: List[Dict[str, Any]] = []
    if op == "barrier":
        return [dict(op=op, late=i % world_size) for i in range(4)]
    combos: List[Tuple[str, str, Optional[str]]] = []
    if op in REDUCING_OPS:
        for dt in DTYPES:
            for rop in REDUCE_OPS:
                if rop == "AVG" and dt not in FLOAT_NAMES:
                    continue
                combos.append((dt, "", rop))
    else:
        for dt in DTYPES:
            for lib in (("torch", "numpy") if dt in NUMPY_NAMES else ("torch",)):
                combos.append((dt, lib, None))
                combos.append((dt, lib, None))  # a second shape for each (dtype, lib)
    pairs = [(s, d) for s in range(world_size) for d in range(world_size) if s != d]
    for i, (dt, lib, rop) in enumerate(combos):
        if not lib:
            lib = "numpy" if (dt in NUMPY_NAMES and (i + i // len(SHAPES)) % 2) else "torch"
        case = dict(op=op, dtype=dt, shape=SHAPES[i % len(SHAPES)], lib=lib, rop=rop,
                    root=(i + 1) % world_size)
        if op == "send":
            case["src"], case["dst"] = pairs[i % len(pairs)]
        cases.append(case)
    return cases


def with_algorithms(cases: List[Dict[str, Any]], algos: Sequence[str], full: bool) -> List[Dict[str, Any]]:
    """Give every case an id and an algorithm: every case x every algorithm when ``full``, otherwise the
    algorithms rotate over the cases (each algorithm still sees several dtypes, shapes and reduce ops)."""
    out = []
    for i, c in enumerate(cases):
        chosen = list(algos) if full else [algos[i % len(algos)]]
        for a in chosen:
            out.append(dict(c, algorithm=a, base=i))
    for j, c in enumerate(out):
        c["id"] = j
    return out


def expected(c: Dict[str, Any], world_size: int) -> List[Any]:
    """Per rank, what ``_run_case`` must return for case ``c`` (None: nothing to check on that rank)."""
    op = c["op"]
    if op == "barrier":
        return [None] * world_size
    dt, shape, base, root, rop = c["dtype"], c["shape"], c["base"], c["root"], c.get("rop")
    inp = [make_tensor(dt, shape, r, base) for r in range(world_size)]
    slot = [[make_tensor(dt, shape, r, base, slot=j) for j in range(world_size)] for r in range(world_size)]
    if op == "send":
        return [inp[c["src"]] if r == c["dst"] else None for r in range(world_size)]
    if op == "broadcast":
        return [inp[root]] * world_size
    if op == "allreduce":
        return [reduce_ref(inp, rop)] * world_size
    if op == "reduce":
        return [reduce_ref(inp, rop) if r == root else None for r in range(world_size)]
    if op == "allgather":
        return [list(inp)] * world_size
    if op == "gather":
        return [list(inp) if r == root else None for r in range(world_size)]
    if op == "scatter":
        return [slot[root][r] for r in range(world_size)]
    if op == "reducescatter":
        return [reduce_ref([slot[k][r] for k in range(world_size)], rop) for r in range(world_size)]
    if op == "alltoall":
        return [[slot[i][j] for i in range(world_size)] for j in range(world_size)]
    raise ValueError(op)


def check_output(c: Dict[str, Any], rank: int, actual: Any, want: Any, label: str) -> None:
    """Compare one rank's output of case ``c`` with ``want`` (a tensor, a list of tensors or None)."""
    if want is None:
        return
    what = (f"{label} rank {rank} case {c['id']} ({c['op']} {c['algorithm']} {c['dtype']}{list(c['shape'])} "
            f"{c['lib']} rop={c.get('rop')} root={c.get('root')})")
    wants = want if isinstance(want, list) else [want]
    actuals = actual if isinstance(want, list) else [actual]
    assert isinstance(actuals, list) and len(actuals) == len(wants), f"{what}: got {actual!r}"
    for k, (a, w) in enumerate(zip(actuals, wants)):
        if c["lib"] == "numpy":
            # the caller's numpy array itself carries the result (written in place, never replaced)
            assert isinstance(a, np.ndarray), f"{what}[{k}]: expected the numpy array back, got {type(a)}"
        else:
            assert isinstance(a, torch.Tensor), f"{what}[{k}]: expected a torch tensor, got {type(a)}"
        assert_close(a, w, c["dtype"], f"{what}[{k}]")


# ---------------------------------------------------------------------------------------------- worker side
class Caught:
    """An exception caught in a worker, carried to the driver as its class and message.

    The exception object itself is not returned: whether rdt errors survive pickling is tested on its own
    (test_collective_errors.py::test_errors_cross_the_ray_boundary_typed), and must not hide other results.
    """

    def __init__(self, exc: BaseException) -> None:
        self.cls = type(exc)
        self.message = str(exc)
        self.attrs = {k: getattr(exc, k, None) for k in ("group", "rank", "peer", "op", "hint")}

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{self.cls.__name__}({self.message!r})"


def _run_case(rank: int, world_size: int, group: str, c: Dict[str, Any], timeout: float) -> Any:
    import rdt_transports as rt

    op = c["op"]
    algo = c["algorithm"]
    if op == "barrier":
        if c["late"] == rank:
            time.sleep(0.02)
        entered = time.time()
        rt.barrier(group, algorithm=algo, timeout=timeout)
        return (entered, time.time())
    dt, shape, lib, base = c["dtype"], c["shape"], c["lib"], c["base"]
    mine = to_lib(make_tensor(dt, shape, rank, base), lib)
    root = c["root"]
    rop = getattr(rt.ReduceOp, c["rop"]) if c.get("rop") else None
    if op == "send":
        if rank == c["src"]:
            rt.send(mine, c["dst"], group, timeout=timeout)
            return None
        if rank == c["dst"]:
            buf = filled(dt, shape, lib)
            rt.recv(buf, c["src"], group, timeout=timeout)
            return buf
        return None
    if op == "broadcast":
        rt.broadcast(mine, root, group, algorithm=algo, timeout=timeout)
        return mine
    if op == "allreduce":
        rt.allreduce(mine, group, rop, algorithm=algo, timeout=timeout)
        return mine
    if op == "reduce":
        rt.reduce(mine, root, group, rop, algorithm=algo, timeout=timeout)
        return mine if rank == root else None
    if op == "allgather":
        outs = [filled(dt, shape, lib) for _ in range(world_size)]
        rt.allgather(outs, mine, group, algorithm=algo, timeout=timeout)
        return outs
    if op == "gather":
        outs = [filled(dt, shape, lib) for _ in range(world_size)] if rank == root else None
        rt.gather(mine, outs, root, group, algorithm=algo, timeout=timeout)
        return outs
    if op == "scatter":
        ins = ([to_lib(make_tensor(dt, shape, rank, base, slot=j), lib) for j in range(world_size)]
               if rank == root else None)
        buf = filled(dt, shape, lib)
        rt.scatter(buf, ins, root, group, algorithm=algo, timeout=timeout)
        return buf
    if op == "reducescatter":
        ins = [to_lib(make_tensor(dt, shape, rank, base, slot=j), lib) for j in range(world_size)]
        buf = filled(dt, shape, lib)
        rt.reducescatter(buf, ins, group, rop, algorithm=algo, timeout=timeout)
        return buf
    if op == "alltoall":
        ins = [to_lib(make_tensor(dt, shape, rank, base, slot=j), lib) for j in range(world_size)]
        outs = [filled(dt, shape, lib) for _ in range(world_size)]
        rt.alltoall(outs, ins, group, algorithm=algo, timeout=timeout)
        return outs
    raise ValueError(op)


@ray.remote(num_cpus=0)
class CollectiveWorker:
    """A plain actor; tests run module functions in it with ``__ray_call__`` or ``run_cases``."""

    def ping(self) -> int:
        import os

        return os.getpid()

    def run_cases(self, group: str, cases: List[Dict[str, Any]], timeout: float = 30.0) -> Dict[str, Any]:
        """Run every case in order; stop at the first failure and return it (with the failing case)."""
        import rdt_transports as rt

        rank = rt.get_rank(group)
        world_size = rt.get_collective_group_size(group)
        results: List[Any] = []
        for c in cases:
            try:
                results.append(_run_case(rank, world_size, group, c, timeout))
            except Exception as e:  # noqa: BLE001 - reported to the driver with the case
                return dict(rank=rank, results=results, error=Caught(e), case=c)
        return dict(rank=rank, results=results, error=None, case=None)

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Tuple[Optional[Caught], Any, float]:
        """Run ``fn(*args, **kwargs)`` here; return (Caught exception or None, result, seconds it took)."""
        t0 = time.monotonic()
        try:
            value = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            return Caught(e), None, time.monotonic() - t0
        return None, value, time.monotonic() - t0


def call_all(actors: Sequence[Any], fn: Any, *args_per_actor: Sequence[Any], timeout: float = 120.0) -> List[Any]:
    """Run ``fn`` on every actor concurrently (argument i of each list goes to actor i); return the triples."""
    refs = [a.call.remote(fn, *[arg[i] for arg in args_per_actor]) for i, a in enumerate(actors)]
    return ray.get(refs, timeout=timeout)


def group_state(name: str) -> Optional[str]:
    """(worker side) the state of group ``name`` in this process, or None when not a member."""
    import rdt_transports as rt

    return rt.get_group(name).state.value if rt.is_group_initialized(name) else None


def raise_error(cls: type, message: str, **ctx: Any) -> None:
    """(worker side) raise ``cls(message, **ctx)``, to test errors crossing the Ray task boundary."""
    raise cls(message, **ctx)


def destroy_local(name: str) -> bool:
    """(worker side) destroy group ``name`` here if this process is in it."""
    import rdt_transports as rt

    if rt.is_group_initialized(name):
        rt.destroy_collective_group(name)
        return True
    return False


def allreduce_sum(name: str, value: float, n: int = 4, timeout: float = 20.0, algorithm: str = "auto") -> List[float]:
    """(worker side) allreduce a float32 tensor filled with ``value`` over ``name``; return the result."""
    import rdt_transports as rt

    t = torch.full((n,), float(value), dtype=torch.float32)
    rt.allreduce(t, name, rt.ReduceOp.SUM, algorithm=algorithm, timeout=timeout)
    return t.tolist()
