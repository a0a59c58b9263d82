"""Dispatch for p2p collectives: the algorithm table, what 'auto' picks, and ``run``.

Algorithms live in ``_ring`` (ring / pipelined chain), ``_bde`` (bidirectional exchange: recursive
halving/doubling, Bruck, dissemination) and ``_tree`` (binomial tree). A world of one rank never talks to a
peer: ``run`` handles it locally for every op and algorithm.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from ..errors import InvalidArgumentError
from . import _bde, _ring, _tree
from ._common import P2P, flat

ALGORITHMS: Dict[str, Tuple[str, ...]] = {
    "broadcast": ("tree", "ring"),
    "allreduce": ("ring", "bde", "tree"),
    "reduce": ("tree", "ring"),
    "allgather": ("ring", "bde", "tree"),
    "gather": ("tree", "ring"),
    "scatter": ("tree", "ring"),
    "reducescatter": ("ring", "bde", "tree"),
    "alltoall": ("ring", "bde"),
    "barrier": ("bde", "tree", "ring"),
}

_TABLE: Mapping[Tuple[str, str], Callable[..., None]] = MappingProxyType({
    ("broadcast", "tree"): _tree.broadcast,
    ("broadcast", "ring"): _ring.broadcast,
    ("allreduce", "ring"): _ring.allreduce,
    ("allreduce", "bde"): _bde.allreduce,
    ("allreduce", "tree"): _tree.allreduce,
    ("reduce", "tree"): _tree.reduce,
    ("reduce", "ring"): _ring.reduce,
    ("allgather", "ring"): _ring.allgather,
    ("allgather", "bde"): _bde.allgather,
    ("allgather", "tree"): _tree.allgather,
    ("gather", "tree"): _tree.gather,
    ("gather", "ring"): _ring.gather,
    ("scatter", "tree"): _tree.scatter,
    ("scatter", "ring"): _ring.scatter,
    ("reducescatter", "ring"): _ring.reducescatter,
    ("reducescatter", "bde"): _bde.reducescatter,
    ("reducescatter", "tree"): _tree.reducescatter,
    ("alltoall", "ring"): _ring.alltoall,
    ("alltoall", "bde"): _bde.alltoall,
    ("barrier", "bde"): _bde.barrier,
    ("barrier", "tree"): _tree.barrier,
    ("barrier", "ring"): _ring.barrier,
})

# ---- 'auto' thresholds. They come from benchmarks/ measurements (message size in bytes as the group passes it:
# ---- the per-rank tensor for broadcast/allreduce/reduce/gather/scatter, tensor * world_size for
# ---- allgather/reducescatter/alltoall). Latency-bound below, bandwidth-bound above; to be tuned per backend.
ALLREDUCE_SMALL_BYTES = 64 * 1024  # below: bde (log2 n rounds); above: ring (bandwidth-optimal)
BROADCAST_SMALL_BYTES = 256 * 1024  # below: tree; above: pipelined chain
REDUCE_SMALL_BYTES = 256 * 1024  # below: tree; above: pipelined chain
ALLGATHER_SMALL_BYTES = 64 * 1024  # below: bde (Bruck); above: ring
REDUCESCATTER_SMALL_BYTES = 64 * 1024  # below: bde (recursive halving); above: ring
ALLTOALL_SMALL_BYTES = 32 * 1024  # below: bde (Bruck, log2 n rounds); above: ring (pairwise, 1x data)
SMALL_WORLD = 2  # with two ranks every algorithm is one exchange; the simplest wins
# At and above this size a broadcast runs the pipelined chain even where the backend has a native one: native
# broadcasts (Gloo's) are trees in which the root sends the whole tensor log2(n) times; on the chain the root's
# link carries it once and every rank forwards chunk k while chunk k+1 arrives (issue 15).
BROADCAST_PIPELINE_BYTES = 1 << 20

_SIZE_RULES: Mapping[str, Tuple[int, str, str]] = MappingProxyType({
    "allreduce": (ALLREDUCE_SMALL_BYTES, "bde", "ring"),
    "broadcast": (BROADCAST_SMALL_BYTES, "tree", "ring"),
    "reduce": (REDUCE_SMALL_BYTES, "tree", "ring"),
    "allgather": (ALLGATHER_SMALL_BYTES, "bde", "ring"),
    "reducescatter": (REDUCESCATTER_SMALL_BYTES, "bde", "ring"),
    "alltoall": (ALLTOALL_SMALL_BYTES, "bde", "ring"),
})
_FIXED_CHOICE: Mapping[str, str] = MappingProxyType({"gather": "tree", "scatter": "tree", "barrier": "bde"})


def choose(op: str, nbytes: int, world_size: int, backend_name: str) -> str:
    """The algorithm 'auto' runs for ``op``: latency-optimal below a size threshold, bandwidth-optimal above.

    ``backend_name`` is accepted so per-backend tuning can be added without changing callers.
    """
    del backend_name  # same thresholds for every backend until benchmarks say otherwise
    if op not in ALGORITHMS:
        raise InvalidArgumentError(f"no p2p algorithm for op {op!r}", op=op)
    if op in _FIXED_CHOICE:
        return _FIXED_CHOICE[op]
    small, latency_algo, bandwidth_algo = _SIZE_RULES[op]
    if world_size <= SMALL_WORLD:
        return latency_algo
    return latency_algo if nbytes < small else bandwidth_algo


def prefers_p2p(op: str, nbytes: int) -> bool:
    """Whether 'auto' runs a p2p algorithm for ``op`` even on a backend with a native one (large broadcasts)."""
    return op == "broadcast" and nbytes >= BROADCAST_PIPELINE_BYTES


def run(op: str, algorithm: str, p2p: "P2P", /, **kwargs: Any) -> None:
    """Run collective ``op`` with ``algorithm`` over ``p2p``, in place (kwargs as documented in the package).

    The first three parameters are positional-only because the reducing ops pass their ReduceOp as ``op=``.
    """
    fn = _TABLE.get((op, algorithm))
    if fn is None:
        raise InvalidArgumentError(
            f"unknown algorithm {algorithm!r} for {op!r}", op=op,
            hint="choose one of " + ", ".join(ALGORITHMS.get(op, ())) if op in ALGORITHMS else None,
        )
    if p2p.world_size == 1:
        _local(op, **kwargs)
        return
    fn(p2p, **kwargs)


def _local(op: str, /, **kw: Any) -> None:
    """A one-rank world: every collective is a local copy (or nothing)."""
    if op in ("allgather", "gather"):
        outputs: Optional[List[torch.Tensor]] = kw["outputs"]
        if outputs is not None:
            flat(outputs[0]).copy_(flat(kw["tensor"]))
    elif op == "scatter":
        if kw["inputs"] is not None:
            flat(kw["tensor"]).copy_(flat(kw["inputs"][0]))
    elif op == "reducescatter":
        flat(kw["tensor"]).copy_(flat(kw["inputs"][0]))
    elif op == "alltoall":
        flat(kw["outputs"][0]).copy_(flat(kw["inputs"][0]))
    # broadcast, allreduce, reduce (every ReduceOp over one rank is the identity, AVG included) and barrier:
    # nothing to do.
