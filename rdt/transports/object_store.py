"""Ray's object store: the path every process can take (the driver, tasks, actors outside a group).

Export: an explicit "object_store" object puts its buffers in the object store at return. Otherwise the
consumer asks the producer actor for a copy of the buffers through Ray.
"""

from __future__ import annotations

import time
from typing import Any, List, Optional

import ray
import torch

from .._meta import ObjectMeta
from .._peer import died, freed
from ..errors import ObjectFetchError, ObjectFreedError
from .base import Capabilities, Fetched, Site, Transport, context


class ObjectStoreTransport(Transport):
    capabilities = Capabilities(name="object_store", devices=frozenset({"cpu", "cuda"}), mixed_devices=True,
                                universal=True, auto_priority=100)

    def export(self, ctx: Any, entry: Any, chosen: str) -> Optional[Any]:
        if chosen != "object_store":
            return None
        return ray.put([b.cpu() for b in entry.buffers])

    def fetch(self, ctx: Any, meta: ObjectMeta, site: Site, deadline: float) -> Fetched:
        timeout = max(deadline - time.monotonic(), 1e-3)
        store_ref = meta.export("object_store")
        if store_ref is not None:
            bufs = _get(meta, [store_ref], timeout)[0]
        else:
            bufs = _from_producer(meta, timeout)
        bufs = [b if b.is_contiguous() else b.contiguous() for b in bufs]
        device = site.cuda_device  # GPU objects: onto this process's GPU if it has one, else they stay on CPU
        if device is not None and any(b.device.startswith("cuda") for b in meta.buffers):
            bufs = [b.to(device) for b in bufs]
        return Fetched(bufs, "object_store")


def _serve_buffers(_actor: Any, obj_id: bytes) -> List[torch.Tensor]:
    """Runs in the producer (via __ray_call__): the object's buffers, for the object-store path."""
    ctx = context()
    entry = ctx.table.get(obj_id)
    if entry is None:
        raise ObjectFreedError("the object was freed in its producer", object_id=obj_id.hex())
    ctx.stats.add("object_store", "out", entry.nbytes)
    return [b.cpu() for b in entry.buffers]


def _get(meta: ObjectMeta, refs: List[Any], timeout: float) -> List[Any]:
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError as e:
        raise TimeoutError(str(e)) from e
    except ray.exceptions.RayActorError as e:
        raise died(meta, e) from e


def _from_producer(meta: ObjectMeta, timeout: float) -> List[torch.Tensor]:
    actor = meta.producer.actor
    if actor is None:
        raise ObjectFetchError(f"{meta.describe()} was made outside an actor and cannot be served through Ray",
                               object_id=meta.id_hex, hint="produce objects inside actors")
    try:
        return _get(meta, [actor.__ray_call__.remote(_serve_buffers, meta.obj_id)], timeout)[0]
    except ray.exceptions.RayTaskError as e:
        cause = e.as_instanceof_cause() if hasattr(e, "as_instanceof_cause") else e
        if isinstance(cause, ObjectFreedError) or "ObjectFreedError" in str(e):
            raise freed(meta) from e
        raise ObjectFetchError(f"fetching {meta.describe()} through the object store failed: {e}",
                               object_id=meta.id_hex) from e
