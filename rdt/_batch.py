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

from ._meta import ObjectMeta

MAX_PARALLEL = 8  # fetches of one deserialization that run at once (as rdt.get)


class Pending:
    """Stands for an rdt object whose fetch was started during a batched deserialization."""

    __slots__ = ("future",)

    def __init__(self, future: "Future[Any]") -> None:
        self.future = future


class Batch:
    """The fetches started during one ``deserialize_objects`` call (one per distinct object)."""

    def __init__(self, task: Optional[str], task_argument: bool) -> None:
        self.task = task
        self.task_argument = task_argument
        self.made = 0  # placeholders handed out (to tell whether all were found at top level)
        self._futures: Dict[bytes, "Future[Any]"] = {}
        self._pool: Optional[ThreadPoolExecutor] = None

    def defer(self, ctx: Any, meta: ObjectMeta) -> Pending:
        """Start fetching ``meta`` (once per object: the same ref passed twice is fetched once)."""
        from ._meta import resolve_or_error

        self.made += 1
        future = self._futures.get(meta.obj_id)
        if future is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=MAX_PARALLEL, thread_name_prefix="rdt-deser")
            future = self._futures[meta.obj_id] = self._pool.submit(
                resolve_or_error, ctx, meta, task=self.task, task_argument=self.task_argument)
        return Pending(future)

    def finish(self, values: List[Any]) -> List[Any]:
        """``values`` with each top-level placeholder replaced by its object's value, or its own error."""
        try:
            return [_outcome(v.future) if isinstance(v, Pending) else v for v in values]
        finally:
            for f in self._futures.values():  # placeholders nested deeper are re-resolved by the caller
                f.exception()
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
        from ._context import get_context
        from ._runtime import in_actor, is_get_objects, task_id

        if len(object_refs) < 2:
            return original(self, serialized_objects, object_refs, *args, **kwargs)
        ctx = get_context()
        if getattr(ctx.deferring, "on", False) or getattr(ctx.batching, "batch", None) is not None:
            return original(self, serialized_objects, object_refs, *args, **kwargs)
        try:
            caller = sys._getframe(1).f_code
        except ValueError:  # called straight from Ray's compiled code (a task's arguments): no Python caller
            caller = None
        batch = Batch(task_id(), in_actor() and not (caller is not None and is_get_objects(caller)))
        ctx.batching.batch = batch
        try:
            values = original(self, serialized_objects, object_refs, *args, **kwargs)
        finally:
            ctx.batching.batch = None
        found = sum(isinstance(v, Pending) for v in values)
        out = batch.finish(values)
        if found < batch.made:  # an rdt object nested inside another value: deserialize those again, unbatched
            redo = [i for i, v in enumerate(values) if not isinstance(v, Pending)]
            again = original(self, [serialized_objects[i] for i in redo], [object_refs[i] for i in redo],
                             *args, **kwargs)
            for i, v in zip(redo, again):
                out[i] = v
        return out

    deserialize_objects._rdt_batched = True  # type: ignore[attr-defined]
    deserialize_objects.__doc__ = original.__doc__
    deserialize_objects.__wrapped__ = original  # type: ignore[attr-defined]
    return deserialize_objects


def install() -> None:
    """Wrap Ray's ``Worker.deserialize_objects`` in this process (once)."""
    from ._ray_hooks import wrap_deserialize_objects

    wrap_deserialize_objects(_wrap)


def is_wrapper(code: Any) -> bool:
    """Whether ``code`` is the wrapper's (so frame walks can look through it)."""
    return code is _WRAPPER_CODE


_WRAPPER_CODE = _wrap(lambda *a, **k: []).__code__
