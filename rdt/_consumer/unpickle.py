"""What happens when an rdt object's metadata is unpickled in a process: fetch now, later, or not at all.

``rdt._objects.meta`` hands every arriving :class:`ObjectMeta` to :func:`rebuild` (installed when rdt is imported).
In ``rdt.get`` the metadata itself is returned (it fetches afterwards); an async method's argument is fetched on a
pool (``async_args``); one of several objects Ray deserializes at once starts now and is waited on after
(``parallel_fetch``); anything else is fetched here. A failed fetch becomes a value Ray raises as the typed error.
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any

from .._objects import meta as _meta
from .._objects.meta import ObjectMeta
from .._process.context import get_context
from ..errors import RdtError
from .resolve import resolve

logger = logging.getLogger("rdt")


def rebuild(meta: ObjectMeta) -> Any:
    """Runs in the receiving process during deserialization: fetch the tensors and rebuild the value."""
    ctx = get_context()
    if getattr(ctx.deferring, "on", False):  # rdt.get asked Ray for the metadata itself (it fetches afterwards)
        return meta
    deferral = getattr(getattr(ctx, "batching", None), "deferral", None)
    if deferral is not None:  # an async method's argument: fetched on a pool, awaited off the loop (async_args)
        return deferral.defer(ctx, meta)
    batch = getattr(getattr(ctx, "batching", None), "batch", None)
    if batch is not None:  # one of several objects Ray deserializes at once: start now, wait after (parallel_fetch)
        return batch.defer(ctx, meta)
    return resolve_or_error(ctx, meta)


def resolve_or_error(ctx: Any, meta: ObjectMeta, **where: Any) -> Any:
    """The value ``meta`` stands for, or (for rdt's typed errors) a RayTaskError value Ray raises as such."""
    try:
        return resolve(ctx, meta, **where)
    except RdtError as err:
        ctx.metrics.transfer_error(meta.transport, type(err).__name__)
        logger.warning(
            "rdt: fetching object=%s producer=%s (pid %d) transport=%s failed: %s: %s", meta.id_hex,
            meta.producer.actor_id[:12] or "driver", meta.producer.pid, meta.transport, type(err).__name__, err)
        # Raised here, Ray would hide it inside a RaySystemError. Returned as a RayTaskError value, Ray raises it
        # (task argument or ray.get alike) and the caller can catch our typed error itself.
        return _as_ray_error(err)


def _as_ray_error(err: BaseException) -> Any:
    import ray.exceptions

    tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    # The tracebacks hold this frame, whose locals hold the object's lifetime token: drop them (the text above
    # keeps the information) so that a failed fetch cannot keep the object alive until a GC cycle.
    seen = set()
    e: Any = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return ray.exceptions.RayTaskError("rdt: fetching an object's tensors", tb, err, pid=os.getpid())


def install() -> None:
    """Make unpickled metadata fetch through this module (once per process, when rdt is imported)."""
    _meta.install_unpickler(rebuild)
