"""Transfer and collective metrics through ``ray.util.metrics``, so they show on the Ray dashboard and Prometheus.

One :class:`Metrics` per process (held by the process context). Metric objects are made on first use; outside a
Ray worker every call is a no-op. Collective and p2p calls are queued and handed to Ray by a background thread every
``OP_FLUSH_S`` (0.5 s), off the calls' critical path. The same thread re-reports the held gauges on every pass: Ray's
metrics agent drops a gauge series two export intervals after its last report, so a gauge set only on change would
vanish from Prometheus while the objects are still held. Names (Prometheus adds Ray's ``ray_`` prefix):

==================================  =========  ======================================================
rdt_transfers_total                 counter    object transfers, by transport and direction (in/out)
rdt_transfer_bytes_total            counter    bytes of object transfers, by transport and direction
rdt_transfer_latency_seconds        histogram  consumer-side fetch time, by transport
rdt_transfer_errors_total           counter    failed fetches, by transport and error type
rdt_objects_held / rdt_bytes_held   gauge      objects and bytes in this process's object table (re-reported)
rdt_collective_ops_total            counter    collective / p2p calls, by backend, op and status
rdt_collective_bytes_total          counter    bytes per call, by backend and op
rdt_collective_latency_seconds      histogram  call duration, by backend and op
==================================  =========  ======================================================
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Deque, Dict, Optional, Tuple

from . import _lifecycle

logger = logging.getLogger("rdt_transports")

_BOUNDARIES = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0]
OP_FLUSH_S = 0.5  # calls' metrics reach Ray this often (Ray itself exports every few seconds)
OP_BACKLOG = 1 << 16  # calls queued between flushes at most; past it the oldest go unrecorded
_Op = Tuple[str, str, int, float, bool]  # backend, op, nbytes, seconds, ok


class Metrics:
    """Lazily created Ray metrics; thread-safe; never raises into the caller."""

    def __init__(self) -> None:
        self._m: Optional[Dict[str, Any]] = None
        self._lock = threading.Lock()
        self._disabled = False
        # Calls' metrics wait here for the flusher thread: three Ray metric calls cost ~30 us of a p2p call's
        # critical path (measured at 64 KiB), a deque append well under 1 us.
        self._ops: Deque[_Op] = collections.deque(maxlen=OP_BACKLOG)
        self._flusher: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._held: Optional[Tuple[int, int]] = None  # (objects, bytes) last reported by the table

    def _get(self) -> Optional[Dict[str, Any]]:
        if self._m is not None or self._disabled:
            return self._m
        with self._lock:
            if self._m is not None or self._disabled:
                return self._m
            try:
                import ray
                from ray.util.metrics import Counter, Gauge, Histogram

                if not ray.is_initialized():
                    return None
                t, td, b = ("transport",), ("transport", "direction"), ("backend", "op")
                self._m = {
                    "transfers": Counter("rdt_transfers_total", "rdt object transfers", tag_keys=td),
                    "transfer_bytes": Counter("rdt_transfer_bytes_total", "bytes of rdt object transfers",
                                              tag_keys=td),
                    "transfer_latency": Histogram("rdt_transfer_latency_seconds", "rdt fetch time",
                                                  boundaries=_BOUNDARIES, tag_keys=t),
                    "transfer_errors": Counter("rdt_transfer_errors_total", "failed rdt fetches",
                                               tag_keys=("transport", "error")),
                    "objects": Gauge("rdt_objects_held", "objects in this process's rdt object table"),
                    "bytes": Gauge("rdt_bytes_held", "bytes in this process's rdt object table"),
                    "ops": Counter("rdt_collective_ops_total", "rdt_transports calls",
                                   tag_keys=("backend", "op", "status")),
                    "op_bytes": Counter("rdt_collective_bytes_total", "bytes per rdt_transports call", tag_keys=b),
                    "op_latency": Histogram("rdt_collective_latency_seconds", "rdt_transports call time",
                                            boundaries=_BOUNDARIES, tag_keys=b),
                }
            except Exception:  # metrics must never break data movement
                logger.debug("rdt metrics unavailable", exc_info=True)
                self._disabled = True
        return self._m

    def transfer(self, transport: str, direction: str, nbytes: int, seconds: Optional[float] = None) -> None:
        m = self._get()
        if m is None:
            return
        try:
            tags = {"transport": transport, "direction": direction}
            m["transfers"].inc(1, tags=tags)
            m["transfer_bytes"].inc(max(nbytes, 0), tags=tags)
            if seconds is not None:
                m["transfer_latency"].observe(seconds, tags={"transport": transport})
        except Exception:
            logger.debug("rdt metrics: transfer not recorded", exc_info=True)

    def transfer_error(self, transport: str, error: str) -> None:
        m = self._get()
        if m is not None:
            try:
                m["transfer_errors"].inc(1, tags={"transport": transport, "error": error})
            except Exception:
                logger.debug("rdt metrics: error not recorded", exc_info=True)

    def held(self, objects: int, nbytes: int) -> None:
        """Note the object table's size; the flusher thread reports it to Ray within OP_FLUSH_S, then every pass."""
        self._held = (objects, nbytes)
        if self._flusher is None and self._get() is not None:
            self._start_flusher()

    def _report_held(self) -> None:
        held = self._held
        if held is None:
            return
        m = self._get()
        if m is not None:
            try:
                m["objects"].set(held[0])
                m["bytes"].set(held[1])
            except Exception:
                logger.debug("rdt metrics: gauge not set", exc_info=True)

    def op(self, backend: str, op: str, nbytes: int, seconds: float, ok: bool) -> None:
        """Queue one collective/p2p call's metrics; a background thread hands them to Ray every OP_FLUSH_S."""
        self._ops.append((backend, op, nbytes, seconds, ok))
        if self._flusher is None:
            self._start_flusher()

    def _start_flusher(self) -> None:
        with self._lock:
            if self._flusher is not None or self._stop.is_set() or _lifecycle.exiting():
                return
            self._flusher = _lifecycle.spawn(self._flush_loop, "rdt-metrics-flush")
        _lifecycle.at_exit(self._stop.set)

    def _flush_loop(self) -> None:
        while not self._stop.wait(OP_FLUSH_S):
            self.flush_ops()
            self._report_held()

    def flush_ops(self) -> None:
        """Hand the queued calls to Ray now: counters summed per label set, one histogram point per call."""
        ops = self._ops
        batch = []
        while ops:
            try:
                batch.append(ops.popleft())
            except IndexError:
                break
        if not batch:
            return
        m = self._get()
        if m is None:
            return
        calls: Dict[Tuple[str, str, str], int] = collections.Counter()
        nbytes: Dict[Tuple[str, str], int] = collections.Counter()
        try:
            for backend, op, n, seconds, ok in batch:
                calls[(backend, op, "ok" if ok else "error")] += 1
                if ok:
                    nbytes[(backend, op)] += max(n, 0)
                    m["op_latency"].observe(seconds, tags={"backend": backend, "op": op})
            for (backend, op, status), count in calls.items():
                m["ops"].inc(count, tags={"backend": backend, "op": op, "status": status})
            for (backend, op), total in nbytes.items():
                if total > 0:
                    m["op_bytes"].inc(total, tags={"backend": backend, "op": op})
        except Exception:
            logger.debug("rdt metrics: calls not recorded", exc_info=True)
