"""Collectives built from point-to-point transfers, usable on any backend.

``run(op, algorithm, p2p, **kwargs)`` executes one collective in place. ``p2p`` is a :class:`P2P` view of the
group for this one call: ``isend``/``irecv`` take a *step* number (unique within the call, 0 <= step < 16384)
which the group maps to a unique wire tag, and ``wait`` waits on works under the call's deadline.

Keyword arguments per op (all torch tensors, contiguous, same dtype/device; lists have world_size entries):
  broadcast(tensor, root)            allreduce(tensor, op)            reduce(tensor, root, op)
  allgather(outputs, tensor)         gather(outputs|None, tensor, root)   scatter(inputs|None, tensor, root)
  reducescatter(tensor, inputs, op)  alltoall(outputs, inputs)        barrier()
"""

from __future__ import annotations

from typing import Tuple

from ._common import P2P
from ._impl import ALGORITHMS, choose, prefers_p2p, run


def algorithms_for(op: str) -> Tuple[str, ...]:
    """Algorithm names accepted for ``op`` (besides 'auto' and 'native')."""
    return ALGORITHMS.get(op, ())


__all__ = ["P2P", "run", "choose", "prefers_p2p", "algorithms_for", "ALGORITHMS"]
