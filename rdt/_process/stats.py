"""This process's ``rdt.stats()``: transfer counters, what each transport reports, and where other processes ask.

An actor publishes its control address and a stats-only key in the GCS (namespace "rdt", key ``stats:<actor id>``),
so that ``rdt.stats(actor)`` asks its control server and never waits in the actor's task queue.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
from typing import Any, Dict, Optional

import ray

from .. import transports
from .._ray.hooks import worker_mode  # a private Ray API, checked when rdt is imported

logger = logging.getLogger("rdt")

KV_NAMESPACE = "rdt"


class Stats:
    """Counters per transport: transfers in/out and bytes (thread-safe), mirrored to Ray metrics."""

    def __init__(self, metrics: Any) -> None:
        self._lock = threading.Lock()
        self._metrics = metrics
        self.data: Dict[str, Dict[str, int]] = collections.defaultdict(
            lambda: {"in": 0, "in_bytes": 0, "out": 0, "out_bytes": 0})
        self.paths: Dict[str, int] = collections.defaultdict(int)  # fetches by the path that served them

    def add(self, transport: str, direction: str, nbytes: int, seconds: Optional[float] = None,
            path: Optional[str] = None) -> None:
        with self._lock:
            d = self.data[transport]
            d[direction] += 1
            d[direction + "_bytes"] += nbytes
            if path is not None:
                self.paths[path] += 1
        self._metrics.transfer(transport, direction, nbytes, seconds)

    def snapshot(self) -> Dict[str, Dict[str, int]]:
        with self._lock:
            return {k: dict(v) for k, v in self.data.items()}

    def paths_snapshot(self) -> Dict[str, int]:
        with self._lock:
            return dict(self.paths)


def local_stats(ctx: Any) -> Dict[str, Any]:
    """This process's rdt.stats(): the context's counters, then each transport's own entries."""
    out: Dict[str, Any] = {
        "objects": len(ctx.table),
        "bytes": ctx.table.nbytes(),
        "freed": ctx.table.freed,
        "transfers": ctx.stats.snapshot(),
        "paths": ctx.stats.paths_snapshot(),  # fetches into this process, by the path that served them
        "recv_pool": {"bytes": ctx.buffers.idle_bytes(), "hits": ctx.buffers.hits, "misses": ctx.buffers.misses},
        "control_rejected": ctx.control_rejected(),
        # storages kept exported for live objects (NIXL registrations, CUDA IPC shares), per transport
        "exported_storages": {t.name: t.exported(ctx) for t in transports.known()},
        # rdt.put_shards publications held here, reads in flight on them, bytes of kept copies (keep_versions)
        "sharded": ctx.versions.stats(),
    }
    for t in transports.known():
        out.update(t.stats(ctx))
    return out


def stats_kv_key(actor_id: str) -> str:
    """The GCS key under which an actor's rdt process publishes its control address and stats key."""
    return f"stats:{actor_id}"


def current_actor_id() -> Optional[str]:
    """This process's actor id (hex), or None outside an actor (driver, task, no Ray)."""
    try:
        if worker_mode() != ray.WORKER_MODE:
            return None
        return ray.get_runtime_context().get_actor_id()
    except Exception:  # noqa: BLE001
        return None


def publish(ctx: Any) -> Optional[bytes]:
    """In an actor: start the control server and publish its address and stats key; the record written, or None."""
    actor_id = current_actor_id()
    if actor_id is None:
        return None
    try:
        info = ctx.producer_info()
        record = json.dumps({"address": info.control_address, "key": ctx.stats_key.hex(),
                             "pid": os.getpid()}).encode()
        import ray.experimental.internal_kv as kv

        kv._internal_kv_put(stats_kv_key(actor_id), record, True, namespace=KV_NAMESPACE)
        return record
    except Exception:  # noqa: BLE001 - stats are best effort; objects still move
        logger.warning("rdt: could not publish this actor's control address; rdt.stats(actor) will report "
                       "nothing for it", exc_info=True)
        return None


def unpublish(record: Optional[bytes]) -> None:
    """Remove our GCS record (at exit) if it is still ours (a restarted actor overwrote it otherwise)."""
    actor_id = current_actor_id()
    if record is None or actor_id is None:
        return
    try:
        import ray.experimental.internal_kv as kv

        key = stats_kv_key(actor_id)
        if kv._internal_kv_initialized() and kv._internal_kv_get(key, namespace=KV_NAMESPACE) == record:
            kv._internal_kv_del(key, namespace=KV_NAMESPACE)
    except Exception:  # noqa: BLE001 - the GCS may be gone at exit
        pass
