"""What an rdt ObjectRef's value really is: metadata. Unpickling it in a consumer fetches the tensors.

``ObjectMeta.__reduce__`` makes Ray's deserializer call :func:`_rebuild` in whichever process receives the value
(a consumer actor's argument, the driver's ``ray.get``). That is how consumers need no decorator and no class
option: the fetch happens while Ray deserializes the task's arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ._specs import BufferTable, SpecTable


@dataclass(frozen=True)
class ProducerInfo:
    """How to reach the process that holds the object."""

    instance: bytes  # random per process context: "is this me?"
    pid: int
    node_id: str
    control_address: str  # host:port of the producer's control server
    process_key: bytes  # authenticates control requests about this producer's objects
    actor: Any  # the producer's ActorHandle (object-store fallback), or None
    actor_id: str
    nixl: bool  # NIXL usable in the producer
    started: Optional[int] = None  # the producer's start time: with the pid, names the process for good (_proc)


@dataclass(frozen=True)
class GroupRef:
    """A collective group the producer belongs to."""

    uid: str
    name: str
    backend: str
    rank: int


@dataclass(frozen=True)
class ObjectMeta:
    """The ref's value: where the tensors are and how to rebuild the user's value around them."""

    obj_id: bytes
    transport: str  # what the producer asked for: a transport's name or "auto"
    producer: ProducerInfo
    skeleton: bytes
    specs: SpecTable  # a sequence of TensorSpec (any sequence given is turned into the table)
    buffers: BufferTable  # a sequence of BufferSpec (likewise)
    groups: Tuple[GroupRef, ...]
    token: Any  # ObjectRef owned by the producer; keeps the object alive while any holder exists
    exports: Tuple[Tuple[str, Any], ...] = ()  # (transport name, descriptor) for each transport that exported
    timeout: Optional[float] = None  # producer-chosen transfer timeout

    def __post_init__(self) -> None:
        object.__setattr__(self, "specs", SpecTable.of(self.specs))
        object.__setattr__(self, "buffers", BufferTable.of(self.buffers))

    def export(self, name: str) -> Optional[Any]:
        """The descriptor transport ``name`` attached at return time, or None."""
        for n, desc in self.exports:
            if n == name:
                return desc
        return None

    @property
    def id_hex(self) -> str:
        return self.obj_id.hex()

    @property
    def nbytes(self) -> int:
        return self.buffers.total

    def __reduce__(self) -> Any:
        return (_rebuild, (self.__dict__.copy(),))

    def describe(self) -> str:
        return f"rdt object {self.id_hex[:16]} ({len(self.specs)} tensors, {self.nbytes} bytes, {self.transport})"


def _rebuild(state: dict) -> Any:
    """Runs in the receiving process during deserialization: fetch the tensors and rebuild the value."""
    meta = ObjectMeta.__new__(ObjectMeta)
    object.__setattr__(meta, "__dict__", state)
    from .transports.base import context

    ctx = context()
    if getattr(ctx.deferring, "on", False):  # rdt.get asked Ray for the metadata itself (it fetches afterwards)
        return meta
    deferral = getattr(getattr(ctx, "batching", None), "deferral", None)
    if deferral is not None:  # an async method's argument: fetched on a pool, awaited off the loop (_async_args)
        return deferral.defer(ctx, meta)
    batch = getattr(getattr(ctx, "batching", None), "batch", None)
    if batch is not None:  # one of several objects Ray deserializes at once: start now, wait after (_batch)
        return batch.defer(ctx, meta)
    return resolve_or_error(ctx, meta)


def resolve_or_error(ctx: Any, meta: ObjectMeta, **where: Any) -> Any:
    """The value ``meta`` stands for, or (for rdt's typed errors) a RayTaskError value Ray raises as such."""
    from .errors import RdtError

    try:
        return ctx.resolve(meta, **where)
    except RdtError as err:
        import logging

        ctx.metrics.transfer_error(meta.transport, type(err).__name__)
        logging.getLogger("rdt").warning(
            "rdt: fetching object=%s producer=%s (pid %d) transport=%s failed: %s: %s", meta.id_hex,
            meta.producer.actor_id[:12] or "driver", meta.producer.pid, meta.transport, type(err).__name__, err)
        # Raised here, Ray would hide it inside a RaySystemError. Returned as a RayTaskError value, Ray raises it
        # (task argument or ray.get alike) and the caller can catch our typed error itself.
        return _as_ray_error(err)


def _as_ray_error(err: BaseException) -> Any:
    import os
    import traceback

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
