"""What the shm transport keeps per process: the producer's segment pool, the consumer's direct reader, its
mappings of producers' shared storages and the unmapper of segments; and this node's /dev/shm hygiene.

Made when the process's context starts (it unlinks the segments of processes on this node that died before they
could), trimmed by the context's reaper, closed at shutdown after every object was released.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional

from rdt_transports import _lifecycle

from ..base import TransportState
from . import cma as _cma, segments as _shm
from .segment_pool import SegmentPool
from .shared_maps import MapReader

REAP_PERIOD_S = 30.0  # how often segments of dead processes on this node are looked for


class ShmState(TransportState):
    """The shm transport's per-process state (see the module's docstring)."""

    def __init__(self, config: Any) -> None:
        self.pool = SegmentPool(config.pool_bytes, config.pool_ttl)  # a producer's freed segments, for reuse
        self.cma = _cma.CmaReader()
        # producers' shared storages this consumer maps, at most shm_map_bytes of them
        self.maps = MapReader(self.cma.spread, config.pool_ttl, max_bytes=config.shm_map_bytes)
        self.unmapper = _shm.DeferredUnmapper()
        self._cma_ok: Optional[bool] = None
        _shm.reap_dead_owners()
        self._last_reap = time.monotonic()

    def readable(self, config: Any) -> bool:
        """Whether same-node consumers can likely read this process's memory (else "shm" writes a segment)."""
        if self._cma_ok is None:
            self._cma_ok = _cma.supported() and _cma.yama_allows_siblings()
        return config.shm_cma and self._cma_ok

    def trim(self) -> None:
        """Pooled segments and mappings unused for pool_ttl go; every REAP_PERIOD_S, dead processes' segments."""
        self.pool.trim()
        self.maps.trim()  # mappings of producers' shared storages unused for pool_ttl
        if time.monotonic() - self._last_reap >= REAP_PERIOD_S:
            self._last_reap = time.monotonic()
            _shm.reap_dead_owners()

    def close(self) -> None:
        """Unlink the pooled segments, stop the unmapper, unmap the shared storages, then unlink whatever segment
        (or rdt_transports semaphore) of this process is left."""
        self.pool.close()
        self.unmapper.stop(_lifecycle.JOIN_TIMEOUT_S)
        self.maps.close()
        self.cma.close()
        for name in _shm.segments_of(os.getpid()) + _shm.semaphores_of(os.getpid()):
            _shm.unlink(name)

    def configure(self, config: Any) -> None:
        self.pool.max_bytes = config.pool_bytes
        if config.pool_bytes == 0:
            self.pool.close()

    def stats(self) -> Dict[str, Any]:
        """This process's entries of rdt.stats()."""
        return {
            "shm_segments": len(set(_shm.segments_of(os.getpid())) - set(self.pool.names())),
            "shm_pool": {"segments": len(self.pool.names()), "bytes": self.pool.nbytes(), "hits": self.pool.hits,
                         "misses": self.pool.misses},
            # producers' shared storages this consumer keeps mapped (path shm-map); unmapped after pool_ttl idle
            "shm_maps": {"files": len(self.maps), "bytes": self.maps.mapped_bytes()},
        }


def state(ctx: Any) -> ShmState:
    """This process's shm state (made when the context starts, or on first use)."""
    return ctx.transport_state("shm", lambda: ShmState(ctx.config))
