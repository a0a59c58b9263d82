"""Start the fetches of every rdt object of one Ray deserialization before waiting on any.

Ray deserializes the objects of one ``ray.get([...])``, or of one task's arguments, one after another. rdt wraps
the worker's ``deserialize_objects``: during the call rdt's rebuild starts each object's fetch on a small pool and
hands back a placeholder; after it, every placeholder is waited on and replaced, at top level (an rdt object is
the whole value of its Ray object), by its value or by the error Ray would have given that object alone.
"""

from __future__ import annotations

import sys
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional

from .._objects.meta import ObjectMeta

MAX_PARALLEL = 8  # fetches of one deserialization that run at once (as rdt.get)


class Pending:
    """Stands for an rdt object whose fetch was started during a batched deserialization."""

    __slots__ = ("future", "meta")

    def __init__(self, meta: ObjectMeta) -> None:
        self.meta = meta
        self.future: Optional["Future[Any]"] = None  # set when the fetch is started on the pool


class Batch:
    """The fetches started during one ``deserialize_objects`` call (one per distinct object).

    One object alone is fetched on the caller's thread when the call ends (nothing to overlap it with, and a
    thread hop costs more than a small object's fetch); from the second distinct object on, every fetch is
    started on a pool at once."""

    def __init__(self, task: Optional[str], task_argument: bool) -> None:
        self.task = task
        self.task_argument = task_argument
        self.made = 0  # placeholders handed out (to tell whether all were found at top level)
        self._objects: Dict[bytes, Pending] = {}
        self._pool: Optional[ThreadPoolExecutor] = None
        self._ctx: Any = None

    def defer(self, ctx: Any, meta: ObjectMeta) -> Pending:
        """Start fetching ``meta`` (once per object: the same ref passed twice is fetched once)."""
        self.made += 1
        self._ctx = ctx
        pending = self._objects.get(meta.obj_id)
        if pending is None:
            pending = self._objects[meta.obj_id] = Pending(meta)
            if len(self._objects) > 1:
                for p in self._objects.values():
                    if p.future is None:
                        p.future = self._start(ctx, p.meta)
        return pending

    def _start(self, ctx: Any, meta: ObjectMeta) -> "Future[Any]":
        from .unpickle import resolve_or_error

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=MAX_PARALLEL, thread_name_prefix="rdt-deser")
        return self._pool.submit(resolve_or_error, self._ctx, meta, task=self.task, task_argument=self.task_argument)

    def _run_here(self, pending: Pending) -> None:
        """Fetch a lone object on this thread (as a completed future, so errors are handed back alike)."""
        from .unpickle import resolve_or_error

        future: "Future[Any]" = Future()
        try:
            future.set_result(resolve_or_error(self._ctx, pending.meta, task=self.task,
                                               task_argument=self.task_argument))
        except Exception as e:  # handed back as that object's error, as from the pool
            future.set_exception(e)
        pending.future = future

    def finish(self, values: List[Any]) -> List[Any]:
        """``values`` with each top-level placeholder replaced by its object's value, or its own error."""
        try:
            for p in self._objects.values():
                if p.future is None:
                    self._run_here(p)
            return [_outcome(v.future) if isinstance(v, Pending) else v for v in values]  # type: ignore[arg-type]
        finally:
            for p in self._objects.values():  # placeholders nested deeper are re-resolved by the caller
                if p.future is not None:
                    p.future.exception()
            if self._pool is not None:
                self._pool.shutdown(wait=True)


def _outcome(future: "Future[Any]") -> Any:
    """The future's value, or an exception Ray hands back as that object's error (never raised here)."""
    try:
        return future.result()
    except Exception as e:  # what Ray makes of an exception raised while deserializing one object
        import ray.exceptions

        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        return ray.exceptions.RaySystemError(e, tb)


def _wrap(original: Callable[..., List[Any]]) -> Callable[..., List[Any]]:
    def deserialize_objects(self: Any, serialized_objects: Any, object_refs: Any, *args: Any,
                            **kwargs: Any) -> List[Any]:
        from .async_args import DeferredArg, Deferral, applies
        from .._process.context import get_context
        from .._ray.runtime import in_actor, is_get_objects, task_id

        try:
            caller = sys._getframe(1).f_code
        except ValueError:  # called straight from Ray's compiled code (a task's arguments): no Python caller
            caller = None
        if applies(caller):  # an async method's arguments, on its event loop: fetched off the loop (async_args)
            ctx = get_context()
            if getattr(ctx.deferring, "on", False) or getattr(ctx.batching, "deferral", None) is not None:
                return original(self, serialized_objects, object_refs, *args, **kwargs)
            deferral = ctx.batching.deferral = Deferral(task_id())
            try:
                values = original(self, serialized_objects, object_refs, *args, **kwargs)
            finally:
                ctx.batching.deferral = None
            return _redo_nested(deferral.made, values, lambda v: type(v) is DeferredArg, original, self,
                                serialized_objects, object_refs, *args, **kwargs)
        if len(object_refs) < 2:
            return original(self, serialized_objects, object_refs, *args, **kwargs)
        ctx = get_context()
        if getattr(ctx.deferring, "on", False) or getattr(ctx.batching, "batch", None) is not None:
            return original(self, serialized_objects, object_refs, *args, **kwargs)
        batch = Batch(task_id(), in_actor() and not (caller is not None and is_get_objects(caller)))
        ctx.batching.batch = batch
        try:
            values = original(self, serialized_objects, object_refs, *args, **kwargs)
        finally:
            ctx.batching.batch = None
        out = batch.finish(values)
        return _redo_nested(batch.made, values, lambda v: isinstance(v, Pending), original, self,
                            serialized_objects, object_refs, *args, **kwargs, _out=out)

    deserialize_objects._rdt_batched = True  # type: ignore[attr-defined]
    deserialize_objects.__doc__ = original.__doc__
    deserialize_objects.__wrapped__ = original  # type: ignore[attr-defined]
    return deserialize_objects


def _redo_nested(made: int, values: List[Any], is_placeholder: Callable[[Any], bool], original: Callable[..., Any],
                 worker: Any, serialized_objects: Any, object_refs: Any, *args: Any, _out: Optional[List[Any]] = None,
                 **kwargs: Any) -> List[Any]:
    """``values`` (or ``_out``), with every value that is not a top-level placeholder deserialized again without
    rdt's batching when fewer than ``made`` placeholders were found at top level: an rdt object nested inside
    another value must never reach the caller as a placeholder."""
    out = list(values if _out is None else _out)
    if sum(1 for v in values if is_placeholder(v)) >= made:
        return out
    redo = [i for i, v in enumerate(values) if not is_placeholder(v)]
    again = original(worker, [serialized_objects[i] for i in redo], [object_refs[i] for i in redo], *args, **kwargs)
    for i, v in zip(redo, again):
        out[i] = v
    return out


def install() -> None:
    """Wrap Ray's ``Worker.deserialize_objects`` in this process (once)."""
    from .._ray.hooks import wrap_deserialize_objects

    wrap_deserialize_objects(_wrap)
