"""Per-process rdt state: the object table, the control server, lifetime tokens, stats, and the two roles.

Producer role (:meth:`RdtContext.produce`): flatten a returned value, keep its tensors in the table, attach a
lifetime token and return an :class:`ObjectMeta`. Consumer role (:meth:`RdtContext.resolve`, in ``_consumer``):
turn an ObjectMeta back into the value. One RdtContext per process, created on first use.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

import ray

from rdt_transports import _lifecycle
from rdt_transports._context import get_context as get_transport_context

from . import _cma, _consumer, _control, _producer, _shm, transports
from ._alloc import BufferPool
from ._shm_pool import SegmentPool
from ._config import RdtConfig
from ._meta import GroupRef, ObjectMeta, ProducerInfo
from ._table import Entry, ObjectTable

logger = logging.getLogger("rdt")


class _TokenPool:
    """Lifetime tokens (tiny producer-owned ObjectRefs) made by a background thread, off the critical path."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._tokens: "collections.deque[Any]" = collections.deque()
        self._need = threading.Event()
        self._need.set()
        self._stop = threading.Event()
        self._thread = _lifecycle.spawn(self._fill, "rdt-tokens")

    def _fill(self) -> None:
        while True:
            self._need.wait()
            if self._stop.is_set():
                return
            try:
                while len(self._tokens) < self._size and not self._stop.is_set():
                    self._tokens.append(ray.put(b""))
            except Exception:  # Ray shutting down
                return
            self._need.clear()

    def close(self) -> None:
        """Stop the filler thread (bounded) and drop the spare tokens."""
        self._stop.set()
        self._need.set()
        self._thread.join(_lifecycle.JOIN_TIMEOUT_S)
        self._tokens.clear()

    def take(self) -> Any:
        try:
            token = self._tokens.popleft()
        except IndexError:
            token = ray.put(b"")
        if len(self._tokens) < self._size // 2:
            self._need.set()
        return token


class Stats:
    """Counters per transport: transfers in/out and bytes (thread-safe), mirrored to Ray metrics."""

    def __init__(self, metrics: Any) -> None:
        self._lock = threading.Lock()
        self._metrics = metrics
        self.data: Dict[str, Dict[str, int]] = collections.defaultdict(
            lambda: {"in": 0, "in_bytes": 0, "out": 0, "out_bytes": 0})
        self.paths: Dict[str, int] = collections.defaultdict(int)  # fetches by the path that served them

    def add(self, transport: str, direction: str, nbytes: int, seconds: Optional[float] = None,
            path: Optional[str] = None) -> None:
        with self._lock:
            d = self.data[transport]
            d[direction] += 1
            d[direction + "_bytes"] += nbytes
            if path is not None:
                self.paths[path] += 1
        self._metrics.transfer(transport, direction, nbytes, seconds)

    def snapshot(self) -> Dict[str, Dict[str, int]]:
        with self._lock:
            return {k: dict(v) for k, v in self.data.items()}

    def paths_snapshot(self) -> Dict[str, int]:
        with self._lock:
            return dict(self.paths)


class RdtContext:
    """Everything rdt keeps in one process."""

    def __init__(self) -> None:
        self.config = RdtConfig.from_env()
        self.instance = secrets.token_bytes(8)
        self.process_key = secrets.token_bytes(32)
        self.metrics = get_transport_context().metrics
        self.table = ObjectTable(self._release)
        self.table.on_change = self.metrics.held
        self.stats = Stats(self.metrics)
        self.client = _control.ControlClient()
        self._lock = threading.Lock()
        self._server: Optional[_control.ControlServer] = None
        self._producer: Optional[ProducerInfo] = None
        self._producer_light: Optional[ProducerInfo] = None  # the same without the actor handle (inline objects)
        self._tokens: Optional[_TokenPool] = None
        self._tag_counters: Dict[str, int] = {}
        self.nixl: Optional[Any] = None  # _nixl_objects.NixlAgent, made on first use
        self.fetch_cache: Dict[Any, Any] = {}
        self.shm_pool = SegmentPool(self.config.pool_bytes, self.config.pool_ttl)
        self.buffers = BufferPool(self.config.pool_bytes, self.config.pool_ttl)
        self.cma = _cma.CmaReader()
        self._cma_ok: Optional[bool] = None
        self.unmapper = _shm.DeferredUnmapper()
        self.waiters = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rdt-fetch-wait")
        _shm.reap_dead_owners()
        self._stopped = threading.Event()
        # Before exit: stop every rdt thread, unlink our shm segments, deregister NIXL memory.
        _lifecycle.at_exit(self.shutdown)
        self._reaper = _lifecycle.spawn(self._reap_loop, "rdt-reaper")

    def _reap_loop(self, period: float = 30.0) -> None:
        """Unlink shm segments left by processes on this node that died (killed before they could clean up), and
        our own pooled segments that waited too long for reuse."""
        import time

        last_reap = time.monotonic()
        while not self._stopped.wait(min(period, max(self.shm_pool.ttl / 2, 1.0))):
            try:
                self.shm_pool.trim()
                self.buffers.trim()
                if time.monotonic() - last_reap >= period:
                    last_reap = time.monotonic()
                    _shm.reap_dead_owners()
            except Exception:  # never let the reaper die on a transient error
                logger.debug("rdt: shm reaper failed", exc_info=True)

    # ------------------------------------------------------------------ identity
    def producer_info(self) -> ProducerInfo:
        """This process as a producer (starts the control server on first use)."""
        if self._producer is None:
            with self._lock:
                if self._producer is None:
                    self._producer = self._make_producer_info()
        return self._producer

    def _make_producer_info(self) -> ProducerInfo:
        ctx = ray.get_runtime_context()
        try:
            actor = ctx.current_actor
            actor_id = ctx.get_actor_id() or ""
        except Exception:  # not an actor (driver, task)
            actor, actor_id = None, ""
        host = ray.util.get_node_ip_address()
        self._server = _control.ControlServer(host, self._key_for, self.control_handlers())
        from . import _nixl_objects

        return ProducerInfo(self.instance, os.getpid(), ctx.get_node_id(), self._server.address,
                            self.process_key, actor, actor_id, _nixl_objects.available())

    def control_handlers(self) -> Dict[int, Any]:
        """What this process's control server answers: a ping, and every transport's own requests."""
        handlers: Dict[int, Any] = {_control.REQ_PING: lambda _k, _p: (_control.RESP_OK, b"")}
        for name in transports.names():
            if name != "auto":
                for msg, handler in transports.get(name).handlers().items():
                    handlers[msg] = lambda k, p, h=handler: h(self, k, p)
        return handlers

    def inline_producer(self, info: ProducerInfo) -> ProducerInfo:
        """``info`` without the actor handle (inline objects are never served through the actor)."""
        light = self._producer_light
        if light is None:  # noqa: SIM108
            light = self._producer_light = dataclasses.replace(info, actor=None)
        return light

    def is_me(self, info: ProducerInfo) -> bool:
        return info.instance == self.instance

    def tokens(self) -> _TokenPool:
        if self._tokens is None:
            with self._lock:
                if self._tokens is None:
                    self._tokens = _TokenPool(self.config.token_pool_size)
        return self._tokens

    def groups(self) -> List[GroupRef]:
        return [GroupRef(g.uid, g.name, g.backend_name, g.rank) for g in get_transport_context().groups()
                if g is not None]

    def next_tags(self, group_uid: str, n: int) -> int:
        with self._lock:
            base = self._tag_counters.get(group_uid, 0)
            self._tag_counters[group_uid] = (base + max(n, 1)) % (1 << 28)
            return base

    # ------------------------------------------------------------------ the two roles
    def produce(self, value: Any, transport: str, *, snapshot: bool = False, timeout: Optional[float] = None,
                ipc_map: bool = False) -> Any:
        """Keep ``value``'s tensors here and return the metadata that stands for it (see ``_producer``)."""
        return _producer.produce(self, value, transport, snapshot=snapshot, timeout=timeout, ipc_map=ipc_map)

    def resolve(self, meta: ObjectMeta) -> Any:
        """Rebuild the value ``meta`` stands for in this process (see ``_consumer``)."""
        return _consumer.resolve(self, meta)

    def cma_readable(self) -> bool:
        """Whether same-node consumers can likely read this process's memory (else "shm" writes a segment)."""
        if self._cma_ok is None:
            self._cma_ok = _cma.supported() and _cma.yama_allows_siblings()
        return self.config.shm_cma and self._cma_ok

    def on_out_of_scope(self, obj_id: bytes) -> None:
        """Runs on Ray's callback thread when an object's last reference died: must be quick, never raise."""
        try:
            self.table.free(obj_id)
        except Exception:  # never let an exception reach Ray's thread
            logger.exception("rdt: freeing %s failed", obj_id.hex())

    def _release(self, entry: Entry) -> None:
        for t in transports.loaded():
            try:
                t.release(self, entry)
            except Exception:  # noqa: BLE001 - freeing must never fail
                logger.debug("rdt: %s could not release %s", t.name, entry.obj_id.hex(), exc_info=True)

    # ------------------------------------------------------------------ control-plane handlers
    def _key_for(self, key_id: int, payload: bytes) -> Optional[bytes]:
        if key_id == _control.KEY_PROCESS:
            return self.process_key
        if key_id == _control.KEY_GROUP and len(payload) >= 32:
            uid = payload[16:32].hex()
            for g in get_transport_context().groups():
                if g is not None and g.uid == uid:
                    return g.backend.config.secret
        return None

    def shutdown(self) -> None:
        """Stop this process's rdt threads and free everything it holds (at exit, or explicitly); idempotent."""
        self._stopped.set()
        if self._tokens is not None:
            self._tokens.close()
        if self._server is not None:
            self._server.close()  # no new requests from here on
        self.waiters.shutdown(wait=False, cancel_futures=True)
        try:
            self.table.clear()
        except Exception:
            pass
        if self.nixl is not None:
            # after the table: releasing objects deregisters their memory through the agent
            self.nixl.stop(_lifecycle.JOIN_TIMEOUT_S)
        self.shm_pool.close()
        self.buffers.close()
        self.unmapper.stop(_lifecycle.JOIN_TIMEOUT_S)
        self.cma.close()
        for name in _shm.segments_of(os.getpid()) + _shm.semaphores_of(os.getpid()):
            _shm.unlink(name)
        self.client.close()
        self._reaper.join(_lifecycle.JOIN_TIMEOUT_S)


_context: Optional[RdtContext] = None
_context_lock = threading.Lock()


def get_context() -> RdtContext:
    """This process's RdtContext (created on first use)."""
    global _context
    if _context is None:
        with _context_lock:
            if _context is None:
                _context = RdtContext()
    return _context


def _forget_after_fork() -> None:
    """A forked child holds none of its parent's objects: it starts with a fresh, empty context (made on use)."""
    global _context
    _context = None


_lifecycle.at_fork_child(_forget_after_fork)
transports.base.install_context(get_context)
