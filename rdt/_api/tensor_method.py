"""``@rdt.tensor_method`` and ``rdt.put``: the producer side of the API."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional, TypeVar

from ..errors import InvalidArgumentError
from .._producer.produce import check_timeout, check_transport

F = TypeVar("F", bound=Callable[..., Any])


def _transport(name: str) -> Any:
    from .. import transports

    return transports.get(name)


def _produce(value: Any, transport: str, snapshot: bool, timeout: Optional[float], num_returns: int,
             ipc_map: bool = False) -> Any:
    from .._process.context import get_context
    from .._producer.produce import produce

    ctx = get_context()
    extra = {"ipc_map": True} if ipc_map else {}
    if num_returns > 1 and isinstance(value, (tuple, list)) and len(value) == num_returns:
        return type(value)(produce(ctx, v, transport, snapshot=snapshot, timeout=timeout, **extra) for v in value)
    return produce(ctx, value, transport, snapshot=snapshot, timeout=timeout, **extra)


def tensor_method(
    tensor_transport: str = "auto",
    *,
    snapshot: bool = False,
    timeout: Optional[float] = None,
    num_returns: Optional[int] = None,
    ipc_map: bool = False,
) -> Callable[[F], F]:
    """Keep the tensors an actor method returns in the actor; the ObjectRef's value becomes metadata.

    ``tensor_transport``: "gloo" | "nccl" | "nixl" | "shm" | "cuda_ipc" | "object_store" | "auto".
    ``snapshot=True`` copies the tensors at return, so later in-place changes by the producer are not seen by
    consumers (without it, consumers see the tensor as it is when they fetch it).
    ``timeout``: seconds consumers wait for this object's tensors (default: rdt.configure / 60 s).
    ``ipc_map=True`` (transport "cuda_ipc", or "auto" when CUDA IPC is picked): consumers on the same node get
    zero-copy views of the producer's GPU memory instead of copies; treat them as read-only (see docs/gpu.md).
    """
    if callable(tensor_transport):  # used as @rdt.tensor_method without parentheses
        raise InvalidArgumentError("tensor_method needs arguments", hint='write @rdt.tensor_method(tensor_transport="gloo")')
    transport = check_transport(tensor_transport)
    seconds = check_timeout(timeout)
    if not isinstance(ipc_map, bool):
        raise InvalidArgumentError(f"ipc_map must be True or False, got {ipc_map!r}", hint="pass ipc_map=True")
    if ipc_map and transport != "auto" and not _transport(transport).capabilities.can_map:
        raise InvalidArgumentError(
            f"ipc_map=True maps GPU memory over CUDA IPC, but tensor_transport is {transport!r}",
            hint="use tensor_transport='cuda_ipc' (or 'auto') with ipc_map=True, or drop ipc_map",
        )
    if not isinstance(snapshot, bool):
        raise InvalidArgumentError(f"snapshot must be True or False, got {snapshot!r}", hint="pass snapshot=True")
    if num_returns is not None and (isinstance(num_returns, bool) or not isinstance(num_returns, int)
                                    or num_returns < 1):
        raise InvalidArgumentError(
            f"num_returns must be a positive int, got {num_returns!r}",
            hint="tensor_method supports a fixed number of returns, e.g. num_returns=2 (not 'dynamic'/'streaming')",
        )

    def decorate(fn: F) -> F:
        if not callable(fn):
            raise InvalidArgumentError(f"tensor_method decorates methods, got {fn!r}",
                                       hint="put @rdt.tensor_method(...) right above an actor method's def")

        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                value = await fn(*args, **kwargs)
                return _produce(value, transport, snapshot, seconds, getattr(async_wrapper, "__ray_num_returns__", 1),
                                ipc_map)

            wrapper: Any = async_wrapper
        else:
            @functools.wraps(fn)
            def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
                value = fn(*args, **kwargs)
                return _produce(value, transport, snapshot, seconds, getattr(sync_wrapper, "__ray_num_returns__", 1),
                                ipc_map)

            wrapper = sync_wrapper
        # Ray inspect.unwrap()s methods before reading options such as __ray_num_returns__, so keep Ray on
        # this wrapper (where @ray.method and num_returns= put them) while showing it fn's signature.
        wrapper.__signature__ = inspect.signature(fn)
        del wrapper.__wrapped__
        if num_returns is not None:
            wrapper.__ray_num_returns__ = num_returns
        wrapper.__rdt_tensor_transport__ = transport
        return wrapper  # type: ignore[return-value]

    return decorate


def put(value: Any, tensor_transport: str = "auto", *, snapshot: bool = False, timeout: Optional[float] = None) -> Any:
    """Inside an actor: an ObjectRef whose tensors stay in this actor (like ray.put, out of band)."""
    import ray

    transport = check_transport(tensor_transport)
    seconds = check_timeout(timeout)
    try:
        in_actor = ray.get_runtime_context().get_actor_id() is not None
    except Exception:
        in_actor = False
    if not in_actor:
        raise InvalidArgumentError(
            "rdt.put must be called inside an actor (the tensors stay in the calling actor)",
            hint="call it in an actor method, or use ray.put on the driver",
        )
    from .._process.context import get_context
    from .._producer.produce import produce

    return ray.put(produce(get_context(), value, transport, snapshot=snapshot, timeout=seconds))
