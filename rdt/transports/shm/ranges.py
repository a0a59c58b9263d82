"""Byte ranges of a same-node object read straight from the producer's memory (``process_vm_readv``), each landing
at its local address: sharded weight sync's path over shm. The object's guard is checked after the read, as for a
whole object, so bytes of a freed object are never reported as read."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from . import cma as _cma
from .state import state
from ..._control.peer import died, freed, producer_alive
from ..base import Ranges


def read_ranges(ctx: Any, meta: Any, ranges: Ranges) -> Optional[str]:
    """"shm-direct" once every range landed (the producer is on this node: the capabilities say so); None where
    a direct read is not possible here (no cross-memory attach, the kernel refused this producer).
    ObjectFreedError / ProducerDiedError otherwise."""
    desc = meta.export("shm")
    info = desc.cma if desc is not None else None
    shm = state(ctx)
    if info is None or not ctx.config.shm_cma or shm.cma.denied(meta.producer.pid):
        return None
    bases = np.array([a for a, _ in info.ranges], dtype=np.uint64)
    remote = np.empty((len(ranges.n), 2), dtype=np.uint64)
    remote[:, 0] = bases[ranges.buf] + ranges.off.astype(np.uint64)
    remote[:, 1] = ranges.n
    try:
        shm.cma.read(meta.producer.pid, _cma.CmaInfo(info.guard, remote.tobytes()), ranges.dst, meta.obj_id)
    except _cma.CmaDenied:
        return None
    except _cma.CmaError as e:
        if producer_alive(ctx, meta):
            raise freed(meta, "was freed while its ranges were read") from e
        raise died(meta, e) from e
    return "shm-direct"
