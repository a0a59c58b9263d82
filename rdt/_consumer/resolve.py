"""The consumer role: turn an ObjectMeta back into the producer's value, by the best path available.

The producer itself gets its very own tensors. Anywhere else the consumer builds a :class:`~rdt.transports.Site`
(same node? in an actor? which groups in common?), picks the object's transport (or walks ``auto``'s chain:
the first transport that carries the object's devices, fits the site and sets up), fetches, and rebuilds the value.
A transport that does not fit falls back to the object store unless it refuses with a typed error. Within one
task, the same object passed twice is fetched once. Transports are reached only through the registry.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

import rdt_transports

from . import receive_into as _into
from .jobs import wait_free
from .. import transports
from .._objects.flatten import unflatten
from .._objects.meta import ObjectMeta
from .._control.peer import died, freed, probe, unreachable
from .._ray.runtime import called_by_ray_get, in_actor, node_id, task_id
from ..errors import (NoCollectiveGroupError, ObjectFetchError, ObjectFreedError, TransferTimeoutError,
                      UnsupportedError)
from ..transports import Fetched, SetupFailed, Site, Transport
from ..transports import receive

logger = logging.getLogger("rdt")

_HERE: Any = object()  # resolve's task default: the task running in this thread


def resolve(ctx: Any, meta: ObjectMeta, *, timeout: Optional[float] = None, task: Any = _HERE,
            task_argument: Optional[bool] = None) -> Any:
    """Rebuild the value ``meta`` stands for in this process (``timeout``: an explicit rdt.get's time left;
    ``task``/``task_argument``: given when a helper thread fetches for the thread Ray deserializes in)."""
    if ctx.is_me(meta.producer):
        entry = ctx.table.get(meta.obj_id)
        if entry is not None:
            return unflatten(meta.skeleton, entry.flat.leaves)
        carried = _self_contained(meta) is not None
        leaves = ctx.table.get_weak(meta.obj_id) if carried else None
        if leaves is not None:
            return unflatten(meta.skeleton, leaves)
        if not carried:
            raise freed(meta, "was already freed in its producer")
    if task is _HERE:
        task = task_id()
    key = (task, meta.obj_id)
    if task is not None:
        cached = ctx.fetch_cache.get(key)
        if cached is not None:
            leaves = [r() for r in cached]
            if all(x is not None for x in leaves):
                return unflatten(meta.skeleton, leaves)
    start = time.monotonic()
    fetched, name = fetch_buffers(ctx, meta, timeout=timeout, task_argument=task_argument)
    elapsed = time.monotonic() - start
    ctx.stats.add(name, "in", meta.nbytes, elapsed, path=fetched.label)
    logger.debug("rdt: fetched object=%s producer=%s path=%s bytes=%d in %.4fs", meta.id_hex,
                 meta.producer.actor_id[:12], fetched.label, meta.nbytes, elapsed)
    if fetched.keepalive is not None:
        keep_alive(fetched.buffers, fetched.keepalive)
    leaves = meta.specs.rebuild(fetched.buffers)
    if task is not None and len(meta.specs):
        _remember(ctx, key, leaves)
    return unflatten(meta.skeleton, leaves)


def resolve_into(ctx: Any, meta: ObjectMeta, into: Any, timeout: float) -> Any:
    """Rebuild the value with its tensor leaves being ``into``'s tensors, filled with the object's bytes.

    Everything is checked before a byte moves; transports that receive into given buffers land the bytes straight
    in the targets, the rest (and cross-device or shared-storage leaves) are copied in. Nothing moves either while
    an earlier failed fetch may still write into the targets (``jobs.wait_free``).
    """
    value, tensors, _paths = _into.targets_for(meta, into)
    timeout = wait_free(ctx, (t for ts in tensors for t in ts), timeout, meta.describe(), meta.id_hex)
    if ctx.is_me(meta.producer):
        entry = ctx.table.get(meta.obj_id)
        leaves = entry.flat.leaves if entry is not None else ctx.table.get_weak(meta.obj_id)
        if leaves is None:
            raise freed(meta, "was already freed in its producer")
        _into.copy_leaves(leaves, tensors)
        return value
    plan = _into.landing_plan(meta, tensors)
    start = time.monotonic()
    fetched, name = fetch_buffers(ctx, meta, into=plan, timeout=timeout)
    _into.fill(meta, fetched.buffers, tensors, plan)
    ctx.stats.add(name, "in", meta.nbytes, time.monotonic() - start, path=fetched.label)
    return value


_NOWHERE = Site(same_node=False, in_actor=False, task_argument=False)  # for self-contained objects: no lookups


def site_for(meta: ObjectMeta, *, task_argument: Optional[bool] = None,
             into: Tuple[Optional[torch.Tensor], ...] = ()) -> Site:
    """Where this process stands relative to ``meta``'s producer."""
    groups: Dict[str, Tuple[Any, Any]] = {}
    mine = {g.uid: g for g in rdt_transports.local_groups() if g is not None}
    for ref in meta.groups:
        g = mine.get(ref.uid)
        if g is not None and g.state.value == "healthy":
            groups.setdefault(ref.backend, (g, ref))
    cuda = receive.target_device() if "cuda" in meta.buffers.device_types else None
    actor = in_actor()
    if task_argument is None:
        task_argument = actor and not called_by_ray_get()
    return Site(same_node=meta.producer.node_id == node_id(), in_actor=actor, task_argument=task_argument,
                groups=groups, cuda_device=cuda, into=into)


def candidates(meta: ObjectMeta, site: Site, ctx: Any = None) -> List[Transport]:
    """The transports to try for ``meta`` here, in order (explicit: the one named, or the fallback it allows)."""
    devices = transports.device_types(meta)
    if meta.transport != "auto":
        chosen = transports.get(meta.transport)
        why = _unfit(ctx, chosen, meta, site, devices)
        if why is None:
            return [chosen]
        if why.error is not None:
            raise why.error
        return [transports.fallback()]
    chain = [t for t in transports.auto_chain() if _unfit(ctx, t, meta, site, devices) is None]
    return chain or [transports.fallback()]


def choose(meta: ObjectMeta, site: Optional[Site] = None, ctx: Any = None) -> str:
    """The name of the transport a fetch of ``meta`` would try first here (for tests and diagnostics)."""
    return candidates(meta, site or site_for(meta), ctx)[0].name


def _unfit(ctx: Any, t: Transport, meta: ObjectMeta, site: Site,
           devices: frozenset) -> Optional[transports.Unusable]:
    """Why ``t`` cannot serve ``meta`` here (its own verdict first: it decides whether that is an error)."""
    caps = t.capabilities
    if not caps.carries(devices):
        return transports.Unusable(f"{caps.name} does not carry {sorted(devices)} buffers")
    own = t.unusable(ctx, meta, site)
    if own is not None:
        return own
    if caps.same_node and not site.same_node:
        return transports.Unusable("the producer is on another node")
    if caps.group_backend is not None and caps.group_backend not in site.groups:
        return transports.Unusable(f"no common {caps.group_backend} group")
    return None


TYPED = (ObjectFetchError, ObjectFreedError, NoCollectiveGroupError, UnsupportedError)  # rdt's: passed through


def fetch_buffers(ctx: Any, meta: ObjectMeta, *, into: Tuple[Optional[torch.Tensor], ...] = (),
          timeout: Optional[float] = None, task_argument: Optional[bool] = None) -> Tuple[Fetched, str]:
    """The object's buffers in this process, and the name of the transport that served them."""
    carrier = _self_contained(meta)
    if carrier is not None:
        return carrier.fetch(ctx, meta, _NOWHERE, time.monotonic()), carrier.name  # the bytes are in meta
    explicit = bool(into) or timeout is not None  # rdt.get: never a task argument
    timeout = min(timeout, meta.timeout or ctx.config.transfer_timeout) if timeout is not None \
        else meta.timeout or ctx.config.transfer_timeout
    deadline = time.monotonic() + timeout
    site = site_for(meta, task_argument=False, into=into) if explicit else site_for(meta, task_argument=task_argument)
    chain = candidates(meta, site, ctx)
    for i, t in enumerate(chain):
        try:
            return t.fetch(ctx, meta, site, deadline), t.name
        except SetupFailed as e:
            if i + 1 < len(chain):
                logger.debug("rdt: %s could not set up for %s (%s); trying %s", t.name, meta.id_hex, e,
                             chain[i + 1].name)
                continue
            raise ObjectFetchError(f"fetching {meta.describe()} over {t.name} could not set up: {e}",
                                   object_id=meta.id_hex) from e
        except TYPED:
            raise
        except Exception as e:  # anything a transport library raised (NIXL, Gloo, sockets), or its own timeout
            raise relabel(ctx, meta, t.name, site, e, timeout, "fetching") from e
    raise AssertionError("unreachable: the chain is never empty")


def relabel(ctx: Any, meta: ObjectMeta, name: str, site: Site, e: BaseException, timeout: float,
            what: str) -> Exception:
    """The typed error for transport ``name``'s failure ``e`` while ``what`` (e.g. "fetching") ``meta``: a timeout
    names the group and the time, otherwise the producer is probed (dead, silent, or the failure as it was)."""
    if isinstance(e, TimeoutError):
        via = site.groups.get(name)
        where = f" in group {via[1].name!r}" if via is not None else ""
        return TransferTimeoutError(
            f"{what} {meta.describe()} over {name}{where} did not finish within {timeout:.1f}s: {e}",
            object_id=meta.id_hex,
            hint="the producer (or its link) may be dead or stuck: destroy the group and re-form it once the "
                 "producer is reachable; raise rdt.configure(transfer_timeout=...) or timeout= for huge objects. A "
                 "transfer that timed out may still land: its targets stay busy until it ends, and the next fetch "
                 "into them waits for it")
    state, why = probe(ctx, meta)
    if state == "dead":
        return died(meta, e)
    if state == "silent":
        return unreachable(meta, f"the {name} fetch", e, why)
    return ObjectFetchError(f"{what} {meta.describe()} over {name} failed: {type(e).__name__}: {e}",
                            object_id=meta.id_hex)


def _self_contained(meta: ObjectMeta) -> Optional[Transport]:
    """The transport whose descriptor in ``meta`` carries the bytes themselves, if any."""
    for name, _ in meta.exports:
        t = transports.get(name)
        if t.capabilities.self_contained:
            return t
    return None


def _remember(ctx: Any, key: Tuple[Any, bytes], leaves: List[Any]) -> None:
    """Weakly remember what a task received so the same ref in the same task maps to the same tensors."""
    def drop(_ref: Any, key: Tuple[Any, bytes] = key) -> None:
        ctx.fetch_cache.pop(key, None)

    try:
        refs = list(map(weakref.ref, leaves))  # a hit needs every leaf alive; the first leaf's death drops the entry
        refs[0] = weakref.ref(leaves[0], drop)
    except TypeError:  # a leaf kind without weakref support: just don't cache
        return
    ctx.fetch_cache[key] = refs


def keep_alive(buffers: List[torch.Tensor], holder: Any) -> None:
    """The storage of each buffer holds ``holder`` (e.g. the lifetime token of the producer memory it maps), so every
    tensor on that storage keeps it: the leaves, views derived from them, numpy and cupy leaves (which hold their
    tensor). torch keeps a storage's Python object, and its attributes, for as long as the storage lives."""
    if isinstance(buffers, transports.BlockViews):
        buffers = [buffers.block]
    for buf in buffers:
        try:
            buf.untyped_storage()._rdt_keepalive = holder
        except (AttributeError, TypeError):  # a storage kind without attributes: nothing to hang it on
            pass
