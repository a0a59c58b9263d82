"""Ref arguments of an ``async def`` actor method are fetched off the actor's event loop.

Ray deserializes an asyncio actor's task arguments on the event loop's own thread (ray #7799), so a fetch made
there would stop every coroutine of the actor for the whole transfer. While Ray deserializes such arguments, rdt
starts each object's fetch on a small pool and hands Ray a :class:`DeferredArg`; rdt's wrapper of Ray's
actor-method executor then awaits those fetches without blocking the loop and calls the method with the values.
Sync methods (and Ray's own ``__ray_*`` methods) get their values on the calling thread, as before.

The executor wrapper is installed when rdt is imported, so it covers actor classes loaded after that (a class
whose module or methods use rdt, or one Ray's ``worker_process_setup_hook`` prepares by importing rdt); the
arguments of a method whose executor Ray made before that are fetched during deserialization, as they always were.
"""

from __future__ import annotations

import asyncio
import inspect
from concurrent.futures import Future
from typing import Any, AsyncIterator, Callable, Dict, Optional, Tuple

from .._objects.meta import ObjectMeta


class DeferredArg:
    """Stands, in a task's arguments, for an rdt object whose fetch runs on rdt's pool."""

    __slots__ = ("future",)

    def __init__(self, future: "Future[Any]") -> None:
        self.future = future


class Deferral:
    """The fetches started while Ray deserializes one async method's arguments (one per distinct object)."""

    def __init__(self, task: Optional[str]) -> None:
        self.task = task
        self.made = 0  # placeholders handed out (to tell whether all were found at top level)
        self._args: Dict[bytes, DeferredArg] = {}

    def defer(self, ctx: Any, meta: ObjectMeta) -> DeferredArg:
        """Start fetching ``meta`` now (the same ref passed twice is fetched once)."""
        from .unpickle import resolve_or_error

        self.made += 1
        arg = self._args.get(meta.obj_id)
        if arg is None:
            arg = self._args[meta.obj_id] = DeferredArg(
                ctx.arg_fetchers.submit(resolve_or_error, ctx, meta, task=self.task, task_argument=True))
        return arg


def applies(caller: Any) -> bool:
    """Whether a ``deserialize_objects`` call reached from ``caller`` (a code object, or None) is Ray
    deserializing the arguments of an actor method whose executor rdt wrapped, on the actor's event loop."""
    from .._ray.hooks import current_actor_method, executors_of
    from .._ray.runtime import is_get_objects

    if caller is not None and is_get_objects(caller):
        return False  # a ray.get (also one a coroutine calls, blocking the loop by its own choice)
    if asyncio._get_running_loop() is None:
        return False  # not on an event loop: sync actors, and ``await ref`` (Ray's own thread)
    method = current_actor_method()
    if method is None:
        return False
    # Every executor Ray made for this method must be rdt's: one made before rdt was imported here would hand
    # the method a DeferredArg.
    executors = executors_of(method)
    return bool(executors) and all(getattr(e, "_rdt_defers_args", False) for e in executors)


def _has_deferred(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    return any(type(a) is DeferredArg for a in args) or any(type(v) is DeferredArg for v in kwargs.values())


def _value(result: Any) -> Any:
    """``result`` of a DeferredArg's fetch as the method's argument; a failed fetch is raised (typed)."""
    import ray.exceptions

    if isinstance(result, ray.exceptions.RayError):  # resolve_or_error's wrapping of rdt's typed error
        cause = getattr(result, "cause", None)
        raise cause if isinstance(cause, BaseException) else result
    return result


def _resolve_now(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The arguments with every DeferredArg replaced by its value, waiting on this thread. Bounded: each fetch
    ends within ``transfer_timeout`` of its start (a ``TransferTimeoutError`` then fails the call)."""
    out = tuple(_value(a.future.result()) if type(a) is DeferredArg else a for a in args)
    kw = {k: (_value(v.future.result()) if type(v) is DeferredArg else v) for k, v in kwargs.items()}
    return out, kw


async def _resolve_async(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The arguments with every DeferredArg replaced by its value, awaited without blocking the loop."""
    pending = [a for a in args if type(a) is DeferredArg] + [v for v in kwargs.values() if type(v) is DeferredArg]
    await asyncio.wait([asyncio.wrap_future(p.future) for p in pending])
    return _resolve_now(args, kwargs)


def wrap_executor(executor: Callable[..., Any], method: Any) -> Callable[..., Any]:
    """Ray's executor of one actor method, resolving DeferredArg arguments first (see the module's docstring)."""
    is_coroutine = inspect.iscoroutinefunction(method)
    is_async_gen = inspect.isasyncgenfunction(method)

    def actor_method_executor(__ray_actor: Any, *args: Any, **kwargs: Any) -> Any:
        if not _has_deferred(args, kwargs):
            return executor(__ray_actor, *args, **kwargs)
        if is_coroutine:
            return _call(executor, __ray_actor, args, kwargs)
        if is_async_gen:
            return _stream(executor, __ray_actor, args, kwargs)
        args, kwargs = _resolve_now(args, kwargs)
        return executor(__ray_actor, *args, **kwargs)

    for attr in ("name", "method"):  # what Ray's task loop reads off an executor
        if hasattr(executor, attr):
            setattr(actor_method_executor, attr, getattr(executor, attr))
    actor_method_executor._rdt_defers_args = True  # type: ignore[attr-defined]
    return actor_method_executor


async def _call(executor: Callable[..., Any], actor: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    args, kwargs = await _resolve_async(args, kwargs)
    return await executor(actor, *args, **kwargs)


async def _stream(executor: Callable[..., Any], actor: Any, args: Tuple[Any, ...],
                  kwargs: Dict[str, Any]) -> AsyncIterator[Any]:
    args, kwargs = await _resolve_async(args, kwargs)
    async for item in executor(actor, *args, **kwargs):
        yield item


def _wrap_make(original: Callable[..., Any]) -> Callable[..., Any]:
    def _make_actor_method_executor(self: Any, method_name: str, method: Callable[..., Any]) -> Any:
        return wrap_executor(original(self, method_name, method), method)

    _make_actor_method_executor._rdt_async_args = True  # type: ignore[attr-defined]
    _make_actor_method_executor.__wrapped__ = original  # type: ignore[attr-defined]
    return _make_actor_method_executor


def install() -> None:
    """Wrap Ray's actor-method executor factory in this process (once)."""
    from .._ray.hooks import wrap_actor_method_executor

    wrap_actor_method_executor(_wrap_make)
