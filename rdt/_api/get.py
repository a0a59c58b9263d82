"""``rdt.get``, ``rdt.get_async`` and ``rdt.wait_tensor_freed``: explicit fetches, optionally into given tensors.

``rdt.get`` asks Ray for the refs' values with rdt's resolution deferred, so it holds the metadata and fetches
itself: every ref's transfer starts before any is waited on, each may land in the caller's tensors, and it works
the same in an actor, a task or the driver.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Sequence

import torch

from .._objects.meta import ObjectMeta
from .._consumer.jobs import Job, run_async, tensors_of
from ..errors import IntoMismatchError, InvalidArgumentError, TensorInUseError, TransferTimeoutError

MAX_PARALLEL = 8  # fetches of one rdt.get([...]) that run at once


def _context() -> Any:
    from .._process.context import get_context

    return get_context()


def _metas(refs: Sequence[Any], timeout: float) -> List[Any]:
    """The refs' values with rdt objects left as their ObjectMeta (nothing fetched)."""
    import ray

    ctx = _context()
    ctx.deferring.on = True
    try:
        return ray.get(list(refs), timeout=timeout)
    except ray.exceptions.GetTimeoutError as e:
        raise TransferTimeoutError(f"the refs' metadata did not arrive within {timeout:.1f}s",
                                   hint="the producing task may still be running; raise timeout=") from e
    finally:
        ctx.deferring.on = False


def _one(meta: Any, into: Any, deadline: float) -> Any:
    if not isinstance(meta, ObjectMeta):
        if into is not None:
            raise InvalidArgumentError(f"into= was given for a ref whose value is a {type(meta).__name__}, not an "
                                       "rdt object", hint="pass into= only for refs made by rdt.tensor_method/put")
        return meta
    ctx = _context()
    left = max(deadline - time.monotonic(), 1e-3)
    from .._consumer.resolve import resolve, resolve_into

    if into is None:
        return resolve(ctx, meta, timeout=left)
    return resolve_into(ctx, meta, into, left)


def get(refs: Any, *, into: Any = None, timeout: float = 60.0) -> Any:
    """The value of ``refs`` (one ObjectRef, or a list of them), fetched in this process.

    ``into``: for one ref, tensors to receive into, shaped like the value (or a flat list of its tensor leaves);
    for a list of refs, a list with one such entry (or None) per ref. The returned value's tensor leaves are then
    those very tensors. Every check runs before any byte moves (``IntoMismatchError`` names the leaf); all refs'
    transfers start before any is waited on.
    """
    single = not isinstance(refs, (list, tuple))
    ref_list = [refs] if single else list(refs)
    if single:
        intos: List[Any] = [into]
    elif into is None:
        intos = [None] * len(ref_list)
    elif isinstance(into, (list, tuple)) and len(into) == len(ref_list):
        intos = list(into)
    else:
        raise InvalidArgumentError(f"rdt.get of {len(ref_list)} refs needs into= as a list of {len(ref_list)} "
                                   f"entries (or None), got {type(into).__name__}",
                                   hint="pass into=[into_for_ref0, into_for_ref1, ...]")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidArgumentError(f"timeout must be a number of seconds > 0, got {timeout!r}",
                                   hint="pass e.g. timeout=60.0")
    deadline = time.monotonic() + timeout
    if sum(i is not None for i in intos) > 1:
        _refuse_shared_across(intos)
    metas = _metas(ref_list, timeout)
    if len(metas) == 1:
        out = [_one(metas[0], intos[0], deadline)]
    else:
        with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(metas)), thread_name_prefix="rdt-get") as pool:
            futures = [pool.submit(_one, m, i, deadline) for m, i in zip(metas, intos)]
            out = [f.result() for f in futures]
    return out[0] if single else out


async def get_async(refs: Any, *, into: Any = None, timeout: float = 60.0) -> Any:
    """``rdt.get`` for async actors: the fetch runs on a worker thread, so the event loop keeps serving.

    Cancelling the awaiting task cannot stop a fetch already running: it goes on until it ends (at most
    ``timeout``), so its ``into`` targets stay marked busy until then and a later fetch into them waits for it.
    """
    return await run_async(Job(_context(), functools.partial(get, refs, into=into, timeout=timeout),
                               _tensors_in(into), "an rdt.get_async"))


def _refuse_shared_across(intos: Sequence[Any]) -> None:
    """IntoMismatchError when the ``into`` entries of two refs share bytes: both objects would land in them at once
    (the refs are fetched in parallel), leaving a mix of the two."""
    from .._consumer.receive_into import overlaps

    spans = [((t.device.type, t.device.index or 0), t.data_ptr(), t.data_ptr() + t.nbytes, k)
             for k, into in enumerate(intos) for t in _tensors_in(into) if t.numel()]
    for reach, span in overlaps(spans):
        if span[3] != reach[3]:
            a, b = sorted((reach[3], span[3]))
            raise IntoMismatchError(f"into[{a}] and into[{b}] share bytes: the two refs would land in them at once",
                                    hint="give each ref its own tensors, or fetch the refs one after another")


def _tensors_in(value: Any) -> List[torch.Tensor]:
    """Every target in ``value`` (an ``into`` argument: tensors or numpy arrays, or dicts, lists and tuples of
    them), as tensors over the same memory."""
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return tensors_of([value])


def wait_tensor_freed(tensor: Any, *, timeout: float = 60.0, poll: float = 0.005) -> None:
    """In the producer: wait until no live rdt object holds any byte of ``tensor``'s storage.

    Matched by storage, so the fresh tensor objects of ``model.state_dict()`` work: after this a trainer may
    update its weights in place without a ``snapshot=True`` copy. Raises ``TensorInUseError`` naming the objects
    still alive when ``timeout`` passes.
    """
    t = tensor if isinstance(tensor, torch.Tensor) else torch.as_tensor(tensor)
    storage = t.untyped_storage()
    lo = storage.data_ptr()
    hi = lo + storage.nbytes()
    ctx = _context()
    deadline = time.monotonic() + timeout
    while True:
        holders = [e for e in ctx.table.entries()
                   if any(b.device == t.device and lo < b.data_ptr() + b.numel() and b.data_ptr() < hi
                          for b in e.buffers)]
        if not holders:
            return
        if time.monotonic() >= deadline:
            names = ", ".join(e.obj_id.hex()[:16] for e in holders[:5])
            raise TensorInUseError(
                f"{len(holders)} live rdt object(s) still hold bytes of this tensor's storage after "
                f"{timeout:.1f}s: {names}", object_id=holders[0].obj_id.hex(),
                hint="drop every ObjectRef of those objects (and let their consumers finish), or return a copy "
                "(snapshot=True) instead of updating in place")
        time.sleep(poll)


__all__ = ["get", "get_async", "wait_tensor_freed"]
