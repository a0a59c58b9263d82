"""Per-process rdt state: the object table, the control server, lifetime tokens, stats, and the two roles.

Producer role (:meth:`RdtContext.produce`): flatten a returned value, keep its tensors in the table, attach a
lifetime token and return an :class:`ObjectMeta`. Consumer role (:meth:`RdtContext.resolve`, in ``_consumer``):
turn an ObjectMeta back into the value. One RdtContext per process, created on first use.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

import ray

from rdt_transports import _lifecycle
from rdt_transports._context import get_context as get_transport_context
from rdt_transports._proc import identity

from . import _cma, _consumer, _control, _producer, _ready, _shm, _shm_map, transports
from ._alloc import BufferPool
from ._busy import BusyTargets
from ._shm_pool import SegmentPool
from ._config import RdtConfig
from ._meta import GroupRef, ObjectMeta, ProducerInfo
from ._peer import err
from ._ray_hooks import worker_mode  # a private Ray API, checked when rdt is imported
from ._table import Entry, ObjectTable
from .transports import _relay

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
        self.stats_key = secrets.token_bytes(32)
        self._published: Optional[bytes] = None  # our GCS record of the control address, removed at exit
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
        self._transport_states: Dict[str, Any] = {}
        # How objects' ready events are made (CUDA events on the stream current at return; see _ready)
        self.stream_discipline = _ready.Discipline()
        self.nixl: Optional[Any] = None  # _nixl_objects.NixlAgent, made on first use
        # into= target bytes that a failed transfer may still write (a parked NIXL READ); rdt.get(into=) waits
        self.busy_targets = BusyTargets()
        self.fetch_cache: Dict[Any, Any] = {}
        self.deferring = threading.local()  # .on: ray.get in this thread returns ObjectMeta unresolved (rdt.get)
        self.batching = threading.local()  # .batch: Ray deserializes several objects here; fetches start at once
        self.shm_pool = SegmentPool(self.config.pool_bytes, self.config.pool_ttl)
        self.buffers = BufferPool(self.config.pool_bytes, self.config.pool_ttl)
        self.cma = _cma.CmaReader()
        self.shm_maps = _shm_map.MapReader(self.cma.spread, self.config.pool_ttl, max_bytes=self.config.shm_map_bytes)
        self._cma_ok: Optional[bool] = None
        self.unmapper = _shm.DeferredUnmapper()
        self.waiters = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rdt-fetch-wait")
        # fetches of async actor methods' ref arguments (_async_args); apart from the waiters they may use
        self.arg_fetchers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rdt-arg-fetch")
        # Waits on object sends, shared by every group of this process and bounded whatever the number of fetches:
        # a slow consumer holds one thread until its deadline; more slow consumers queue (a large object's sends,
        # posted only after the consumer's "receives posted" message, then start late).
        self.send_waiters = ThreadPoolExecutor(max_workers=SEND_WAITERS, thread_name_prefix="rdt-send-wait")
        _shm.reap_dead_owners()
        self._stopped = threading.Event()
        # Before exit: stop every rdt thread, unlink our shm segments, deregister NIXL memory.
        _lifecycle.at_exit(self.shutdown)
        self._reaper = _lifecycle.spawn(self._reap_loop, "rdt-reaper")
        self._publish()

    def _reap_loop(self, period: float = 30.0) -> None:
        """Unlink shm segments left by processes on this node that died (killed before they could clean up), and
        our own pooled segments that waited too long for reuse."""
        last_reap = time.monotonic()
        while not self._stopped.wait(min(period, max(self.shm_pool.ttl / 2, 1.0))):
            try:
                self.shm_pool.trim()
                self.buffers.trim()
                self.shm_maps.trim()  # mappings of producers' shared storages unused for pool_ttl
                if self.nixl is not None:
                    self.nixl.registrations.sweep()  # registrations of storages that died since
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

        pid, started = identity()
        return ProducerInfo(self.instance, pid, ctx.get_node_id(), self._server.address, self.process_key, actor,
                            actor_id, _nixl_objects.available(), started)

    def _publish(self) -> None:
        """In an actor: start the control server and publish its address and stats key in the GCS (namespace
        "rdt", key ``stats:<actor id>``), so that ``rdt.stats(actor)`` never waits in the actor's queue."""
        actor_id = _current_actor_id()
        if actor_id is None:
            return
        try:
            info = self.producer_info()
            record = json.dumps({"address": info.control_address, "key": self.stats_key.hex(),
                                 "pid": os.getpid()}).encode()
            import ray.experimental.internal_kv as kv

            kv._internal_kv_put(stats_kv_key(actor_id), record, True, namespace=KV_NAMESPACE)
            self._published = record
        except Exception:  # noqa: BLE001 - stats are best effort; objects still move
            logger.warning("rdt: could not publish this actor's control address; rdt.stats(actor) will report "
                           "nothing for it", exc_info=True)

    def _unpublish(self) -> None:
        """Remove our GCS record (at exit) if it is still ours (a restarted actor overwrote it otherwise)."""
        record, self._published = self._published, None
        actor_id = _current_actor_id()
        if record is None or actor_id is None:
            return
        try:
            import ray.experimental.internal_kv as kv

            key = stats_kv_key(actor_id)
            if kv._internal_kv_initialized() and kv._internal_kv_get(key, namespace=KV_NAMESPACE) == record:
                kv._internal_kv_del(key, namespace=KV_NAMESPACE)
        except Exception:  # noqa: BLE001 - the GCS may be gone at exit
            pass

    def local_stats(self) -> Dict[str, Any]:
        """This process's rdt.stats()."""
        return {
            "objects": len(self.table),
            "bytes": self.table.nbytes(),
            "freed": self.table.freed,
            "transfers": self.stats.snapshot(),
            "paths": self.stats.paths_snapshot(),  # fetches into this process, by the path that served them
            "shm_segments": len(set(_shm.segments_of(os.getpid())) - set(self.shm_pool.names())),
            "shm_pool": {"segments": len(self.shm_pool.names()), "bytes": self.shm_pool.nbytes(),
                         "hits": self.shm_pool.hits, "misses": self.shm_pool.misses},
            "recv_pool": {"bytes": self.buffers.idle_bytes(), "hits": self.buffers.hits,
                          "misses": self.buffers.misses},
            # producers' shared storages this consumer keeps mapped (path shm-map); unmapped after pool_ttl idle
            "shm_maps": {"files": len(self.shm_maps), "bytes": self.shm_maps.mapped_bytes()},
            "control_rejected": self._server.rejected if self._server is not None else 0,
            "exported_storages": self.exported_storages(),
            "relay": self._relay_stats(),
        }

    def _relay_stats(self) -> Dict[str, int]:
        """Fan-out over groups: bytes served as producer and forwarded as relay, live chains (see transports._relay)."""
        state = self.peek_transport_state("relay")
        return state.snapshot() if state is not None else dict(_relay.EMPTY_STATS)

    def exported_storages(self) -> Dict[str, int]:
        """Storages this process keeps exported for live objects (NIXL registrations, CUDA IPC shares), per
        transport that exports any; every transport in use is asked through the registry."""
        return {t.name: t.exported(self) for t in transports.loaded()}

    def peek_transport_state(self, name: str) -> Any:
        """A transport's process-wide state if it was ever made (never creates it)."""
        with self._lock:
            return self._transport_states.get(name)

    def control_handlers(self) -> Dict[int, Any]:
        """What this process's control server answers: a ping, its stats (to the stats key), and every
        transport's own requests, each only when signed with a key that transport accepts for it."""
        handlers: Dict[int, Any] = {
            _control.REQ_PING: lambda _k, _p: (_control.RESP_OK, b""),
            _control.REQ_STATS: _keyed((_control.KEY_PROCESS, _control.KEY_STATS),
                                       lambda _k, _p: (_control.RESP_OK, json.dumps(self.local_stats()).encode())),
        }
        for name in transports.names():
            if name != "auto":
                for msg, (handler, keys) in transports.get(name).handlers().items():
                    handlers[msg] = _keyed(keys, lambda k, p, h=handler: h(self, k, p))
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

    def resolve(self, meta: ObjectMeta, **where: Any) -> Any:
        """Rebuild the value ``meta`` stands for in this process (see ``_consumer``; ``where``: task and
        task_argument when another thread fetches for the deserializing one)."""
        return _consumer.resolve(self, meta, **where)

    def transport_state(self, name: str, factory: Callable[[], Any]) -> Any:
        """Process-wide state a transport keeps (a registration or share cache), made on first use; it lives as
        long as this context (a forked child, which gets a new context, starts without it)."""
        with self._lock:
            state = self._transport_states.get(name)
            if state is None:
                state = self._transport_states[name] = factory()
            return state

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
        if key_id == _control.KEY_STATS:
            return self.stats_key
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
        self.send_waiters.shutdown(wait=False, cancel_futures=True)
        self.arg_fetchers.shutdown(wait=False, cancel_futures=True)
        relay = self.peek_transport_state("relay")
        if relay is not None:
            relay.close()  # answers held polls (ours as producer) and stops the next-hop pollers
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
        self.shm_maps.close()
        self.cma.close()
        for name in _shm.segments_of(os.getpid()) + _shm.semaphores_of(os.getpid()):
            _shm.unlink(name)
        self._unpublish()
        self.client.close()
        self._reaper.join(_lifecycle.JOIN_TIMEOUT_S)


KV_NAMESPACE = "rdt"
SEND_WAITERS = 16  # threads a producer waits on object sends with, at most


def stats_kv_key(actor_id: str) -> str:
    """The GCS key under which an actor's rdt process publishes its control address and stats key."""
    return f"stats:{actor_id}"


def _current_actor_id() -> Optional[str]:
    """This process's actor id (hex), or None outside an actor (driver, task, no Ray)."""
    try:
        if worker_mode() != ray.WORKER_MODE:
            return None
        return ray.get_runtime_context().get_actor_id()
    except Exception:  # noqa: BLE001
        return None


def _keyed(key_ids: Tuple[int, ...], handler: Any) -> Any:
    """``handler``, answering only requests signed with one of ``key_ids`` (a stats key cannot fetch objects)."""
    def run(key_id: int, payload: bytes) -> Any:
        if key_id not in key_ids:
            return err(_control.ERR_BAD_REQUEST, "this key does not authorize that request")
        return handler(key_id, payload)

    return run


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
