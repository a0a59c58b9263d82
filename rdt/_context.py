"""Per-process rdt state: the object table, the control server, lifetime tokens, stats, and the two roles.

Producer role (:meth:`RdtContext.produce`): flatten a returned value, keep its tensors in the table, attach a
lifetime token and return an :class:`ObjectMeta`. Consumer role (:meth:`RdtContext.resolve`, in ``_fetch``):
turn an ObjectMeta back into the value. One RdtContext per process, created on first use.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import secrets
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

import ray
import torch

from rdt_transports import _lifecycle
from rdt_transports._context import get_context as get_transport_context
from rdt_transports.errors import CollectiveTimeoutError, CommunicationError, GroupDestroyedError
from rdt_transports.group import TAG_OBJECT, make_tag

from . import _cma, _control, _shm
from ._alloc import BufferPool
from ._shm_pool import SegmentPool
from ._config import RdtConfig
from ._flatten import flatten, leaf_from_buffer
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

    def add(self, transport: str, direction: str, nbytes: int, seconds: Optional[float] = None) -> None:
        with self._lock:
            d = self.data[transport]
            d[direction] += 1
            d[direction + "_bytes"] += nbytes
        self._metrics.transfer(transport, direction, nbytes, seconds)

    def snapshot(self) -> Dict[str, Dict[str, int]]:
        with self._lock:
            return {k: dict(v) for k, v in self.data.items()}


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
        self._publish()

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
        group, process = (_control.KEY_GROUP,), (_control.KEY_PROCESS,)
        stats = (_control.KEY_PROCESS, _control.KEY_STATS)
        self._server = _control.ControlServer(host, self._key_for, {
            _control.REQ_FETCH_GROUP: _keyed(group, self._serve_fetch_group),
            _control.REQ_PREPARE_SHM: _keyed(process, self._serve_prepare_shm),
            _control.REQ_PREPARE_NIXL: _keyed(process, self._serve_prepare_nixl),
            _control.REQ_FETCH_BYTES: _keyed(process, self._serve_fetch_bytes),
            _control.REQ_STATS: _keyed(stats, self._serve_stats),
            _control.REQ_PING: lambda _k, _p: (_control.RESP_OK, b""),
        })
        from . import _nixl_objects

        return ProducerInfo(self.instance, os.getpid(), ctx.get_node_id(), self._server.address,
                            self.process_key, actor, actor_id, _nixl_objects.available())

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
            "shm_segments": len(set(_shm.segments_of(os.getpid())) - set(self.shm_pool.names())),
            "shm_pool": {"segments": len(self.shm_pool.names()), "bytes": self.shm_pool.nbytes(),
                         "hits": self.shm_pool.hits, "misses": self.shm_pool.misses},
            "recv_pool": {"bytes": self.buffers.idle_bytes(), "hits": self.buffers.hits,
                          "misses": self.buffers.misses},
            "control_rejected": self._server.rejected if self._server is not None else 0,
        }

    def _inline_producer(self, info: ProducerInfo) -> ProducerInfo:
        light = self._producer_light
        if light is None:
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

    # ------------------------------------------------------------------ producer role
    def produce(self, value: Any, transport: str, *, snapshot: bool = False, timeout: Optional[float] = None,
                ipc_map: bool = False) -> Any:
        """Keep ``value``'s tensors here and return the metadata that stands for it."""
        flat = flatten(value)
        if not flat.specs:
            return value  # nothing to keep out of band
        if snapshot:
            flat.buffers = [b.clone() for b in flat.buffers]
            flat.leaves = [leaf_from_buffer(s, flat.buffers) for s in flat.specs]
        _check_transport_devices(flat, transport)
        info = self.producer_info()
        obj_id = secrets.token_bytes(16)
        if flat.nbytes <= self.config.inline_threshold and all(b.device.type == "cpu" for b in flat.buffers):
            # Small: the bytes travel inside the metadata, so nothing is held here and no lifetime token is
            # needed (a nested token costs ~2 ms per round trip in Ray's borrower protocol).
            self.table.add_weak(obj_id, flat.leaves)
            inline = tuple(b.numpy().tobytes() for b in flat.buffers)
            # No actor handle inside: an inline object is never served through the actor, and pickling a handle
            # costs ~0.1 ms on each side of every round trip.
            return ObjectMeta(obj_id, transport, self._inline_producer(info), flat.skeleton, tuple(flat.specs),
                              tuple(flat.buffer_specs()), (), None, inline, timeout=timeout)
        entry = Entry(obj_id, flat, transport)
        shm = nixl = store_ref = cma = None
        if transport in ("shm", "auto") and self._cma_readable() and all(b.device.type == "cpu" for b in flat.buffers):
            entry.guard = _cma.guard_for(obj_id)
            cma = _cma.CmaInfo(entry.guard.ctypes.data, tuple((b.data_ptr(), b.numel()) for b in flat.buffers))
        elif transport == "shm":
            shm = entry.shm = self.shm_pool.write(flat.buffers, obj_id)
        elif transport == "nixl":
            from . import _nixl_objects

            nixl = _nixl_objects.register(self, entry)
        elif transport == "object_store":
            store_ref = ray.put([b.cpu() for b in flat.buffers])
        cuda_ipc = _export_cuda_ipc(entry, transport, ipc_map)
        self.table.add(entry)
        token = self.tokens().take()
        from ._ray_hooks import add_out_of_scope_callback  # a private Ray API, checked when rdt is imported
        if not add_out_of_scope_callback(token, lambda _id, oid=obj_id: self._on_out_of_scope(oid)):
            logger.warning("rdt: could not watch the lifetime of %s; it will be freed at exit", obj_id.hex())
        return ObjectMeta(obj_id, transport, info, flat.skeleton, tuple(flat.specs), tuple(flat.buffer_specs()),
                          tuple(self.groups()), token, None, shm, nixl, store_ref, timeout, cuda_ipc, cma)

    def _cma_readable(self) -> bool:
        """Whether same-node consumers can likely read this process's memory (else "shm" writes a segment)."""
        if self._cma_ok is None:
            self._cma_ok = _cma.supported() and _cma.yama_allows_siblings()
        return self.config.shm_cma and self._cma_ok

    def _on_out_of_scope(self, obj_id: bytes) -> None:
        # Runs on Ray's callback thread: must be quick. Dropping the entry releases the tensors.
        try:
            self.table.free(obj_id)
        except Exception:  # never let an exception reach Ray's thread
            logger.exception("rdt: freeing %s failed", obj_id.hex())

    def _release(self, entry: Entry) -> None:
        if entry.guard is not None:
            _cma.clear(entry.guard)  # first: a direct read that ends after this sees the object gone
        if entry.shm is not None:
            self.shm_pool.release(entry.shm)
        if entry.nixl is not None:
            from . import _nixl_objects

            _nixl_objects.release(self, entry)
        if getattr(entry, "cuda_ipc", None) is not None:
            from . import _cuda_ipc

            _cuda_ipc.release(entry.cuda_ipc)

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

    def _lookup(self, payload: bytes) -> Optional[Entry]:
        return self.table.get(payload[:16]) if len(payload) >= 16 else None

    def _serve_fetch_group(self, _key_id: int, payload: bytes) -> Any:
        if len(payload) != 44:
            return _err(_control.ERR_BAD_REQUEST, "malformed fetch request")
        entry = self._lookup(payload)
        if entry is None:
            return _err(_control.ERR_NOT_FOUND, "object was freed or never existed here")
        uid = payload[16:32].hex()
        rank, tag_base, wait_ms = struct.unpack("!III", payload[32:44])
        group = next((g for g in get_transport_context().groups() if g is not None and g.uid == uid), None)
        if group is None:
            return _err(_control.ERR_NO_GROUP, "the producer is no longer in that group")
        if not 0 <= rank < group.world_size or rank == group.rank:
            return _err(_control.ERR_BAD_REQUEST, f"bad consumer rank {rank}")
        self.stats.add(group.backend_name, "out", entry.nbytes)
        # Wait exactly as long as the consumer does (its time left, relative): a shorter wait would kill a
        # transfer the consumer still waits for, a longer one would hold the buffers after it gave up.
        deadline = time.monotonic() + wait_ms / 1000.0
        if _control.waits_for_go(group.backend_name, entry.nbytes):
            go = group.backend.irecv(torch.zeros(1, dtype=torch.uint8), rank,
                                     make_tag(TAG_OBJECT, tag_base + len(entry.buffers)))
            _SEND_WAITERS.submit(_send_after_go, go, group, entry.buffers, rank, tag_base, deadline, entry.obj_id)
            return _control.RESP_OK, b""
        works = [group.backend.isend(buf, rank, make_tag(TAG_OBJECT, tag_base + i))
                 for i, buf in enumerate(entry.buffers)]
        # Posted sends move without a waiter (the backend progresses them); a queued wait only learns the outcome.
        _SEND_WAITERS.submit(_finish_sends, works, group, entry.buffers, deadline, entry.obj_id, rank)
        return _control.RESP_OK, b""

    def _serve_fetch_bytes(self, _key_id: int, payload: bytes) -> Any:
        """The object's bytes streamed on this connection (the fallback path: the driver, actors outside a group).

        Runs on a control worker thread, never in the actor's queue. GPU buffers are copied to host memory here.
        """
        if len(payload) != 20:
            return _err(_control.ERR_BAD_REQUEST, "malformed fetch request")
        entry = self._lookup(payload)
        if entry is None:
            return _err(_control.ERR_NOT_FOUND, "object was freed or never existed here")
        (timeout_ms,) = struct.unpack_from("!I", payload, 16)
        views = [memoryview(b.cpu().numpy()) for b in entry.buffers]
        self.stats.add("object_store", "out", entry.nbytes)
        header = struct.pack("!I", len(views)) + b"".join(struct.pack("!Q", v.nbytes) for v in views)
        deadline = time.monotonic() + min(max(timeout_ms / 1000.0, 0.001), MAX_STREAM_S)  # the consumer's deadline
        return _control.RESP_OK, header, _control.Stream(views, deadline)

    def _serve_stats(self, _key_id: int, _payload: bytes) -> Any:
        return _control.RESP_OK, json.dumps(self.local_stats()).encode()

    def _serve_prepare_shm(self, _key_id: int, payload: bytes) -> Any:
        entry = self._lookup(payload)
        if entry is None:
            return _err(_control.ERR_NOT_FOUND, "object was freed or never existed here")
        with entry.lock:
            if entry.shm is None:
                entry.shm = self.shm_pool.write([b.cpu() for b in entry.buffers], entry.obj_id)
        self.stats.add("shm", "out", entry.nbytes)
        seg = entry.shm
        body = struct.pack("!I", len(seg.layout)) + b"".join(struct.pack("!QQ", o, n) for o, n in seg.layout)
        return _control.RESP_OK, seg.name.encode() + b"\0" + body

    def _serve_prepare_nixl(self, _key_id: int, payload: bytes) -> Any:
        entry = self._lookup(payload)
        if entry is None:
            return _err(_control.ERR_NOT_FOUND, "object was freed or never existed here")
        from . import _nixl_objects

        with entry.lock:
            info = _nixl_objects.register(self, entry)
        self.stats.add("nixl", "out", entry.nbytes)
        return _control.RESP_OK, _nixl_objects.encode_info(info)

    # ------------------------------------------------------------------ consumer role
    def resolve(self, meta: ObjectMeta) -> Any:
        from ._fetch import resolve

        return resolve(self, meta)

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
        self._unpublish()
        self.client.close()
        self._reaper.join(_lifecycle.JOIN_TIMEOUT_S)


# Waits on object sends, shared by every group of this process and bounded whatever the number of fetches: a
# slow consumer holds one thread until its deadline; more slow consumers queue (a large object's sends, posted
# only after the consumer's "receives posted" message, then start late). Stop: _SEND_WAITERS.shutdown(wait=False).
_SEND_WAITERS = ThreadPoolExecutor(max_workers=16, thread_name_prefix="rdt-send-wait")


def _err(code: int, message: str) -> Any:
    return _control.RESP_ERR, struct.pack("!H", code) + message.encode()


KV_NAMESPACE = "rdt"
MAX_STREAM_S = 3600.0  # cap on the time a consumer may ask the producer to keep streaming one object


def stats_kv_key(actor_id: str) -> str:
    """The GCS key under which an actor's rdt process publishes its control address and stats key."""
    return f"stats:{actor_id}"


def _current_actor_id() -> Optional[str]:
    """This process's actor id (hex), or None outside an actor (driver, task, no Ray)."""
    try:
        if ray._private.worker.global_worker.mode != ray.WORKER_MODE:
            return None
        return ray.get_runtime_context().get_actor_id()
    except Exception:  # noqa: BLE001
        return None


def _keyed(key_ids: Tuple[int, ...], handler: Any) -> Any:
    """``handler``, answering only requests signed with one of ``key_ids`` (a stats key cannot fetch objects)."""
    def run(key_id: int, payload: bytes) -> Any:
        if key_id not in key_ids:
            return _err(_control.ERR_BAD_REQUEST, "this key does not authorize that request")
        return handler(key_id, payload)

    return run


def _send_after_go(go: Any, group: Any, buffers: List[torch.Tensor], rank: int, tag_base: int, deadline: float,
                   obj_id: bytes) -> None:
    """Post the object's sends once the consumer says its receives are posted (or give up at its deadline)."""
    try:
        go.wait(max(deadline - time.monotonic(), 1e-3))
        works = [group.backend.isend(buf, rank, make_tag(TAG_OBJECT, tag_base + i)) for i, buf in enumerate(buffers)]
    except Exception as e:  # noqa: BLE001 - the consumer timed out or died, or the group was aborted meanwhile
        _send_failed(group, obj_id, rank, deadline, e)
        return
    _finish_sends(works, group, buffers, deadline, obj_id, rank)


def _finish_sends(works: List[Any], group: Any, keepalive: List[torch.Tensor], deadline: float, obj_id: bytes,
                  rank: int) -> None:
    """Wait for posted sends off the control thread; buffers stay referenced until then.

    A failed send leaves the group ERRORED here as well (after a timeout the backend is aborted too, so the
    group's other members fail fast): the backend's state is unknown, the next collective must not use it.
    """
    for w in works:
        try:
            w.wait(max(deadline - time.monotonic(), 1e-3))
        except Exception as e:  # noqa: BLE001 - the consumer sees its own error; ours errors the group
            _send_failed(group, obj_id, rank, deadline, e)
            return
    del keepalive


def _send_failed(group: Any, obj_id: bytes, rank: int, deadline: float, cause: BaseException) -> None:
    """Log a failed object send with its context and mark the group ERRORED (not after an abort or destroy)."""
    logger.warning("rdt: group=%s rank=%d: sending object %s to rank %d failed: %s", group.name, group.rank,
                   obj_id.hex(), rank, cause)
    if isinstance(cause, GroupDestroyedError):
        return
    cls = CollectiveTimeoutError if isinstance(cause, TimeoutError) else CommunicationError
    group.fail(cls(f"sending object {obj_id.hex()[:16]} to rank {rank} failed: {cause}", group=group.name,
                   rank=group.rank, peer=rank, op="object send", object_id=obj_id.hex(),
                   hint="the consumer did not receive in time or died; destroy the group on every member and "
                   "create it again"))


def _export_cuda_ipc(entry: Entry, transport: str, ipc_map: bool) -> Optional[Any]:
    """CUDA IPC handles for an object's GPU buffers: always for "cuda_ipc", and for "auto" when all are CUDA."""
    bufs = entry.buffers
    if transport not in ("cuda_ipc", "auto") or not bufs or any(b.device.type != "cuda" for b in bufs):
        return None
    from . import _cuda_ipc

    if transport == "cuda_ipc":
        return _cuda_ipc.export(entry, ipc_map)
    try:  # auto: an extra path, never a reason to fail the return
        return _cuda_ipc.export(entry, ipc_map)
    except Exception as e:  # noqa: BLE001
        logger.debug("rdt: no CUDA IPC export for %s: %s", entry.obj_id.hex(), e)
        return None


def _check_transport_devices(flat: Any, transport: str) -> None:
    from .errors import UnsupportedError

    devices = {b.device.type for b in flat.buffers}
    cpu_only = {"gloo": "cpu", "shm": "cpu"}
    gpu_only = {"nccl": "cuda", "cuda_ipc": "cuda"}
    if transport in cpu_only and devices - {"cpu"}:
        raise UnsupportedError(
            f"transport {transport!r} moves CPU tensors only, but the value holds {sorted(devices)} tensors",
            hint="use tensor_transport='nccl', 'cuda_ipc' or 'nixl' for GPU tensors, or move them with .cpu()",
        )
    if transport == "nixl" and len(devices) > 1:
        raise UnsupportedError(
            f"transport 'nixl' registers one memory type per object, but the value holds {sorted(devices)} tensors",
            hint="use tensor_transport='auto' (a mixed value keeps each tensor's device) or return tensors of one "
            "device",
        )
    if transport in gpu_only and devices - {"cuda"}:
        raise UnsupportedError(
            f"transport {transport!r} moves CUDA tensors only, but the value holds {sorted(devices)} tensors",
            hint="use tensor_transport='gloo', 'shm' or 'nixl' for CPU tensors, or move them with .cuda()",
        )


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
