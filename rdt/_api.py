"""Driver-side helpers: groups for collective transports, stats, and per-process configuration."""

from __future__ import annotations

import uuid
from typing import Any, Dict, Optional, Sequence

import rdt_transports
from rdt_transports import GroupHandle

from .errors import InvalidArgumentError


def create_collective_group(actors: Sequence[Any], backend: str = "gloo", name: Optional[str] = None, *,
                            timeout: float = rdt_transports.DEFAULT_TIMEOUT_S) -> GroupHandle:
    """Put ``actors`` in a collective group so refs between them move over ``backend``; returns its handle."""
    return rdt_transports.create_collective_group(
        actors, backend=backend, group_name=name or f"rdt-{uuid.uuid4().hex[:12]}", timeout=timeout
    )


def destroy_collective_group(group: GroupHandle, *, timeout: float = rdt_transports.DEFAULT_TIMEOUT_S) -> None:
    """Destroy a group made by :func:`create_collective_group` on all its live members."""
    if not isinstance(group, GroupHandle):
        raise InvalidArgumentError(f"expected the handle create_collective_group returned, got {group!r}",
                                   hint="pass the GroupHandle that rdt.create_collective_group returned")
    group.destroy(timeout=timeout)


def _local_stats(_actor: Any = None) -> Dict[str, Any]:
    from . import _shm
    from ._context import get_context
    import os

    ctx = get_context()
    return {
        "objects": len(ctx.table),
        "bytes": ctx.table.nbytes(),
        "freed": ctx.table.freed,
        "transfers": ctx.stats.snapshot(),
        "paths": ctx.stats.paths_snapshot(),  # fetches into this process, by the path that served them
        "shm_segments": len(set(_shm.segments_of(os.getpid())) - set(ctx.shm_pool.names())),
        "shm_pool": {"segments": len(ctx.shm_pool.names()), "bytes": ctx.shm_pool.nbytes(),
                     "hits": ctx.shm_pool.hits, "misses": ctx.shm_pool.misses},
        "recv_pool": {"bytes": ctx.buffers.idle_bytes(), "hits": ctx.buffers.hits, "misses": ctx.buffers.misses},
        "control_rejected": ctx._server.rejected if ctx._server is not None else 0,
    }


def stats(actor: Any = None, *, timeout: float = 30.0) -> Dict[str, Any]:
    """Objects and bytes held, objects freed, transfers in/out per transport: of ``actor``, or of this process."""
    if actor is None:
        return _local_stats()
    import ray

    if not isinstance(actor, ray.actor.ActorHandle):
        raise InvalidArgumentError(f"stats() takes an actor handle or None, got {type(actor).__name__}",
                                   hint="pass a handle returned by Cls.remote(), or nothing for this process")
    return ray.get(actor.__ray_call__.remote(_local_stats), timeout=timeout)


def configure(*, transfer_timeout: Optional[float] = None, inline_threshold: Optional[int] = None,
              pool_bytes: Optional[int] = None, shm_cma: Optional[bool] = None) -> None:
    """Change this process's settings (call inside an actor for that actor; env vars set them cluster-wide)."""
    from ._context import get_context

    ctx = get_context()
    changes: Dict[str, Any] = {}
    if transfer_timeout is not None:
        if isinstance(transfer_timeout, bool) or not isinstance(transfer_timeout, (int, float)) \
                or not transfer_timeout > 0:
            raise InvalidArgumentError(f"transfer_timeout must be a number of seconds > 0, got {transfer_timeout!r}",
                                       hint="pass e.g. rdt.configure(transfer_timeout=120.0)")
        changes["transfer_timeout"] = float(transfer_timeout)
    if inline_threshold is not None:
        if isinstance(inline_threshold, bool) or not isinstance(inline_threshold, int) or inline_threshold < 0:
            raise InvalidArgumentError(f"inline_threshold must be an int >= 0 (bytes), got {inline_threshold!r}",
                                       hint="pass e.g. rdt.configure(inline_threshold=0) to never inline")
        changes["inline_threshold"] = int(inline_threshold)
    if pool_bytes is not None:
        if isinstance(pool_bytes, bool) or not isinstance(pool_bytes, int) or pool_bytes < 0:
            raise InvalidArgumentError(f"pool_bytes must be an int >= 0 (bytes), got {pool_bytes!r}",
                                       hint="pass e.g. rdt.configure(pool_bytes=0) to keep no idle memory for reuse")
        changes["pool_bytes"] = int(pool_bytes)
        for pool in (ctx.shm_pool, ctx.buffers):
            pool.max_bytes = int(pool_bytes)
            if pool_bytes == 0:
                pool.close()
    if shm_cma is not None:
        if not isinstance(shm_cma, bool):
            raise InvalidArgumentError(f"shm_cma must be True or False, got {shm_cma!r}",
                                       hint="pass rdt.configure(shm_cma=False) to move shm objects through segments")
        changes["shm_cma"] = shm_cma
    ctx.config = ctx.config.updated(**changes)
