"""rdt's tunables: defaults, environment overrides, and a per-process copy that ``rdt.configure`` changes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Mapping, Tuple

def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


@dataclass(frozen=True)
class RdtConfig:
    """Settings read by the process that fetches (timeouts) or produces (inlining) an object."""

    transfer_timeout: float = 60.0  # seconds a consumer waits for an object's tensors (env RDT_TRANSFER_TIMEOUT_S)
    inline_threshold: int = 64 * 1024  # objects up to this many bytes travel inside the metadata (RDT_INLINE_BYTES)
    token_pool_size: int = 32  # lifetime tokens made ahead of time off the critical path
    # Idle memory kept for reuse, per process and per pool (a producer's freed shm segments, a consumer's receive
    # buffers): at most pool_bytes (RDT_POOL_BYTES), each for pool_ttl seconds (RDT_POOL_TTL_S).
    pool_bytes: int = 1 << 30
    pool_ttl: float = 30.0
    # Same-node "shm"/"auto" objects: consumers read the producer's memory directly (process_vm_readv) where the
    # kernel allows it; off (RDT_SHM_CMA=0), producers write a shared-memory segment instead.
    shm_cma: bool = True
    # Where the producer's tensors already live in shared memory (torch's share_memory_()), consumers that may read
    # it directly map those storages instead, keep them mapped across syncs and copy from them on every core
    # (RDT_SHM_MAP=0: a direct read as above). Needs shm_cma. At most shm_map_bytes (RDT_SHM_MAP_BYTES) stay mapped.
    shm_map: bool = True
    shm_map_bytes: int = 8 << 30
    # Fan-out over gloo: consumers of one object that ask while another still receives are chained behind it, so the
    # producer sends the object about once (RDT_RELAY=0: every consumer is served by the producer). Objects under
    # relay_min_bytes (RDT_RELAY_MIN_BYTES) are always served directly. A chained consumer whose source sent nothing
    # for relay_stall_timeout seconds times its position in the chain asks the producer instead.
    relay: bool = True
    relay_min_bytes: int = 16 << 20
    relay_stall_timeout: float = 5.0
    # Sharded loads: per transport name, (seconds per range, bytes per second) of its range reads, overriding what
    # the transport declares (rdt-bench's sharded-sync suite measures them); decides exact runs vs covering reads.
    range_costs: Mapping[str, Tuple[float, float]] = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> "RdtConfig":
        return cls(
            transfer_timeout=_env_float("RDT_TRANSFER_TIMEOUT_S", cls.transfer_timeout),
            inline_threshold=int(_env_float("RDT_INLINE_BYTES", cls.inline_threshold)),
            pool_bytes=int(_env_float("RDT_POOL_BYTES", cls.pool_bytes)),
            pool_ttl=_env_float("RDT_POOL_TTL_S", cls.pool_ttl),
            shm_cma=os.environ.get("RDT_SHM_CMA", "1") != "0",
            shm_map=os.environ.get("RDT_SHM_MAP", "1") != "0",
            shm_map_bytes=int(_env_float("RDT_SHM_MAP_BYTES", cls.shm_map_bytes)),
            relay=os.environ.get("RDT_RELAY", "1") != "0",
            relay_min_bytes=int(_env_float("RDT_RELAY_MIN_BYTES", cls.relay_min_bytes)),
            relay_stall_timeout=_env_float("RDT_RELAY_STALL_S", cls.relay_stall_timeout),
        )

    def updated(self, **changes: object) -> "RdtConfig":
        return replace(self, **changes)  # type: ignore[arg-type]
