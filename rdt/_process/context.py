"""Per-process rdt state: the object table, the control server, lifetime tokens, stats, and each transport's state.

The roles (``rdt._producer``, ``rdt._consumer``) act on it. It names no transport: it reaches them through the
registry, holds what each keeps per process by the transport's name (:meth:`RdtContext.transport_state`), trims
those states periodically and shuts them down through their hooks. One RdtContext per process, made on first use.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

import ray

import rdt_transports
from rdt_transports import _lifecycle
from rdt_transports._proc import identity

from .. import transports
from .._control import wire as _control
from .._control.client import ControlClient
from .._control.server import ControlServer
from .._control.wire import err
from .._objects import stream_ready as _ready
from .._objects.meta import GroupRef, ProducerInfo
from .._objects.table import Entry, ObjectTable
from ..transports.base import TransportState
from ..transports.busy_targets import BusyTargets
from ..transports.recv_buffers import BufferPool
from .config import RdtConfig
from .stats import Stats, local_stats, publish, unpublish
from .tokens import TokenPool
from .versions import Versions

State = TransportState  # what the context holds by name: each transport's state, and the roles' (see transport_state)

logger = logging.getLogger("rdt")

SEND_WAITERS = 16  # threads a producer waits on object sends with, at most
TRIM_PERIOD_S = 30.0  # the reaper trims every transport's state at least this often (more often for short pool_ttl)


class RdtContext:
    """Everything rdt keeps in one process."""

    def __init__(self) -> None:
        self.config = RdtConfig.from_env()
        self.instance = secrets.token_bytes(8)
        self.process_key = secrets.token_bytes(32)
        self.stats_key = secrets.token_bytes(32)
        self.metrics = rdt_transports.metrics()
        self.table = ObjectTable(self._release)
        self.table.on_change = self.metrics.held
        self.stats = Stats(self.metrics)
        self.client = ControlClient()
        self._lock = threading.Lock()
        self._server: Optional[ControlServer] = None
        self._producer: Optional[ProducerInfo] = None
        self._producer_light: Optional[ProducerInfo] = None  # the same without the actor handle (inline objects)
        self._tokens: Optional[TokenPool] = None
        self._tag_counters: Dict[str, int] = {}
        self._transport_states: Dict[str, Any] = {}
        # How objects' ready events are made (CUDA events on the stream current at return; see stream_ready)
        self.stream_discipline = _ready.Discipline()
        # into= target bytes that a failed transfer may still write (a parked NIXL READ); rdt.get(into=) waits
        self.busy_targets = BusyTargets()
        # rdt.put_shards publications and the sharded reads in flight on them (fences, kept copies, checksums)
        self.versions = Versions(self._held_buffers, self.table.free)
        self.fetch_cache: Dict[Any, Any] = {}
        self.deferring = threading.local()  # .on: ray.get in this thread returns ObjectMeta unresolved (rdt.get)
        self.batching = threading.local()  # .batch: Ray deserializes several objects here; fetches start at once
        self.buffers = BufferPool(self.config.pool_bytes, self.config.pool_ttl)  # where fetched CPU bytes land
        self.waiters = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rdt-fetch-wait")
        # fetches of async actor methods' ref arguments (async_args); apart from the waiters they may use
        self.arg_fetchers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rdt-arg-fetch")
        # Waits on object sends, shared by every group of this process and bounded whatever the number of fetches:
        # a slow consumer holds one thread until its deadline; more slow consumers queue (a large object's sends,
        # posted only after the consumer's "receives posted" message, then start late).
        self.send_waiters = ThreadPoolExecutor(max_workers=SEND_WAITERS, thread_name_prefix="rdt-send-wait")
        for t in transports.known():
            t.start(self)  # e.g. shm's state, which unlinks the segments of dead processes on this node
        self._stopped = threading.Event()
        # Before exit: stop every rdt thread, unlink our shm segments, deregister NIXL memory.
        _lifecycle.at_exit(self.shutdown)
        self._reaper = _lifecycle.spawn(self._reap_loop, "rdt-reaper")
        self._published = publish(self)  # our GCS record of the control address (an actor's), removed at exit

    def _reap_loop(self) -> None:
        """Trim what waited too long for reuse: receive buffers, and every transport's state (shm: pooled segments,
        idle mappings, segments of dead processes; NIXL: registrations of storages that died)."""
        while not self._stopped.wait(min(TRIM_PERIOD_S, max(self.config.pool_ttl / 2, 1.0))):
            try:
                self.buffers.trim()
            except Exception:  # never let the reaper die on a transient error
                logger.debug("rdt: trimming the receive buffers failed", exc_info=True)
            for state in self._states():
                _quietly(state.trim, "trimming")

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
        self._server = ControlServer(host, self._key_for, self.control_handlers())
        missing = frozenset(t.name for t in transports.known() if not t.available())
        pid, started = identity()
        return ProducerInfo(self.instance, pid, ctx.get_node_id(), self._server.address, self.process_key, actor,
                            actor_id, missing, started)

    def control_rejected(self) -> int:
        """Connections and frames this process's control server refused (0 before it started)."""
        return self._server.rejected if self._server is not None else 0

    def control_handlers(self) -> Dict[int, Any]:
        """What this process's control server answers: a ping, its stats (to the stats key), and every
        transport's own requests, each only when signed with a key that transport accepts for it."""
        handlers: Dict[int, Any] = {
            _control.REQ_PING: lambda _k, _p: (_control.RESP_OK, b""),
            _control.REQ_STATS: _keyed((_control.KEY_PROCESS, _control.KEY_STATS),
                                       lambda _k, _p: (_control.RESP_OK, json.dumps(local_stats(self)).encode())),
        }
        for msg, handle in ((_control.REQ_READ_BEGIN, self.versions.handle_begin),
                            (_control.REQ_READ_END, self.versions.handle_end),
                            (_control.REQ_RANGE_SUMS, self.versions.handle_sums)):
            handlers[msg] = _keyed((_control.KEY_PROCESS,), lambda _k, p, h=handle: h(p))
        for msg, (_name, (handler, keys)) in transports.served().items():  # two handlers for one number: refused
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

    def tokens(self) -> TokenPool:
        if self._tokens is None:
            with self._lock:
                if self._tokens is None:
                    self._tokens = TokenPool(self.config.token_pool_size)
        return self._tokens

    def groups(self) -> List[GroupRef]:
        return [GroupRef(g.uid, g.name, g.backend_name, g.rank) for g in rdt_transports.local_groups()
                if g is not None]

    def next_tags(self, group_uid: str, n: int) -> int:
        with self._lock:
            base = self._tag_counters.get(group_uid, 0)
            self._tag_counters[group_uid] = (base + max(n, 1)) % (1 << 28)
            return base

    # ------------------------------------------------------------------ transports' state
    def transport_state(self, name: str, factory: Callable[[], Any]) -> Any:
        """Transport ``name``'s process-wide state (an agent, pools, a share cache), made on first use; it lives as
        long as this context (a forked child, which gets a new context, starts without it)."""
        with self._lock:
            state = self._transport_states.get(name)
            if state is None:
                state = self._transport_states[name] = factory()
            return state

    def peek_transport_state(self, name: str) -> Any:
        """A transport's process-wide state if it was ever made (never creates it)."""
        with self._lock:
            return self._transport_states.get(name)

    def _states(self) -> List[TransportState]:
        """The states with hooks, in the registry's order of their transports."""
        order = {n: i for i, n in enumerate(transports.names())}
        with self._lock:
            held = sorted(self._transport_states.items(), key=lambda kv: order.get(kv[0], len(order)))
        return [s for _, s in held if isinstance(s, TransportState)]

    def configure(self, config: RdtConfig) -> None:
        """Take new settings (rdt.configure): the receive buffers' bound, then every transport's state."""
        self.buffers.max_bytes = config.pool_bytes
        if config.pool_bytes == 0:
            self.buffers.close()
        for state in self._states():
            state.configure(config)
        self.config = config

    # ------------------------------------------------------------------ objects
    def on_out_of_scope(self, obj_id: bytes) -> None:
        """Runs on Ray's callback thread when an object's last reference died: must be quick, never raise."""
        try:
            self.table.free(obj_id)
        except Exception:  # never let an exception reach Ray's thread
            logger.exception("rdt: freeing %s failed", obj_id.hex())

    def _held_buffers(self, obj_id: bytes) -> Optional[List[Any]]:
        entry = self.table.get(obj_id)
        return None if entry is None else entry.buffers

    def _release(self, entry: Entry) -> None:
        self.versions.forget(entry.obj_id)
        for t in transports.loaded():
            try:
                t.release(self, entry)
            except Exception:  # noqa: BLE001 - freeing must never fail
                logger.debug("rdt: %s could not release %s", t.name, entry.obj_id.hex(), exc_info=True)

    # ------------------------------------------------------------------ control-plane keys
    def _key_for(self, key_id: int, payload: bytes) -> Optional[bytes]:
        if key_id == _control.KEY_PROCESS:
            return self.process_key
        if key_id == _control.KEY_STATS:
            return self.stats_key
        if key_id == _control.KEY_GROUP and len(payload) >= 32:
            uid = payload[16:32].hex()
            for g in rdt_transports.local_groups():
                if g is not None and g.uid == uid:
                    return g.backend.config.secret
        return None

    def shutdown(self) -> None:
        """Stop this process's rdt threads and free everything it holds (at exit, or explicitly); idempotent.

        In order: no new requests, no new waits; the transports stop serving (the relay answers held polls);
        the objects are released; the transports' states close (NIXL's agent, then shm's pool, mappings and
        segments); the receive buffers go; the GCS record and the client's connections last."""
        self._stopped.set()
        if self._tokens is not None:
            self._tokens.close()
        if self._server is not None:
            self._server.close()  # no new requests from here on
        self.waiters.shutdown(wait=False, cancel_futures=True)
        self.send_waiters.shutdown(wait=False, cancel_futures=True)
        self.arg_fetchers.shutdown(wait=False, cancel_futures=True)
        for state in self._states():
            _quietly(state.stop, "stopping")
        try:
            self.table.clear()
        except Exception:
            pass
        for state in self._states():  # after the table: releasing objects deregistered their memory through them
            _quietly(state.close, "closing")
        self.buffers.close()
        unpublish(self._published)
        self._published = None
        self.client.close()
        self._reaper.join(_lifecycle.JOIN_TIMEOUT_S)


def _quietly(hook: Callable[[], None], what: str) -> None:
    """Run a state's hook; a failure is logged, never raised (the reaper and shutdown go on)."""
    try:
        hook()
    except Exception:  # noqa: BLE001
        logger.debug("rdt: %s a transport's state failed", what, exc_info=True)


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
    """A forked child holds none of its parent's objects: it starts with a fresh, empty context (made on use),
    and a fresh lock (another thread of the parent may have held it, building the context, at the fork)."""
    global _context, _context_lock
    parent, _context, _context_lock = _context, None, threading.Lock()
    if parent is not None:  # its sockets are the parent's: close our copies (a dead parent's port then refuses)
        if parent._server is not None:
            parent._server.forget_in_child()
        parent.client.forget_in_child()


_lifecycle.at_fork_child(_forget_after_fork)
