"""This process's NIXL agent: made on first use, held by the context as the "nixl" transport's state. It knows
which remote agents it loaded (bounded), holds the producer's registrations (one per storage), registered blocks
for packed objects and for fresh READ destinations, and parks timed-out READs until NIXL says they finished.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

from rdt_transports import _lifecycle

from ..base import Context, TransportState
from ..busy_targets import BusyTargets
from ..storage_cache import StorageCache
from .descriptors import mem_type_of
from .landing import LandingPool
from .targets import TargetRegistrations

logger = logging.getLogger("rdt")

WAKE = b"rdt-read"  # the notification a consumer sends its producer when it posts a READ (NixlAgent.wake_remote)

_available: Optional[bool] = None


def _module() -> Any:
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("no NIXL package: pip install 'ray-direct-transport[nixl]' (nixl-cu13)")


def available() -> bool:
    """Whether NIXL imports in this process (cached)."""
    global _available
    if _available is None:
        try:
            _module()
            _available = True
        except Exception:
            _available = False
    return _available


@dataclass
class _Remote:
    """What this agent loaded of one remote agent: partial-metadata loads since the last reset, and READs that
    may still use its descriptors (a remote agent is only removed while none is)."""

    loads: int = 0
    inflight: int = 0


RegKey = Tuple[str, int, int, int]  # (memory type, device id, storage address, storage bytes)


@dataclass
class ParkedRead:
    """A READ that timed out but may still move data: its handles, local registrations and memory (the caller's
    targets among it, marked busy under ``hold``) stay until NIXL says it is no longer in progress."""

    handles: List[Any]
    regs: List[Any]
    keep: List[Any]  # the tensors the READ lands in, and their storages
    agent: str
    hold: Optional[int]


def storage_key(buf: torch.Tensor) -> RegKey:
    """The registration that covers ``buf``: its whole untyped storage (weights returned every step map to one)."""
    storage = buf.untyped_storage()
    return mem_type_of(buf), max(buf.get_device(), 0), storage.data_ptr(), storage.nbytes()


class NixlAgent(TransportState):
    """This process's NIXL agent, which remote agents it has loaded, and its producer-side registrations: the
    "nixl" transport's per-process state (trimmed and closed by the context through its hooks).

    Producer side: one registration per storage (:attr:`registrations`, keyed by :func:`storage_key`), made when the
    first object using the storage is registered and deregistered with the last one; a GPUDirect registration costs
    milliseconds, and the same weights returned every step would otherwise be registered at every return.

    Each fetch loads the producer's partial metadata (connection info plus that object's registrations), which
    NIXL keeps until the remote agent is removed. So that this stays bounded over a long job, a remote agent
    whose loads reach ``MAX_LOADS_PER_REMOTE`` is removed and loaded afresh from the current object's metadata,
    and beyond ``MAX_REMOTES`` agents the least recently used idle one (e.g. a producer that died) is removed;
    both only while no READ from that agent is in flight.

    A READ that times out cannot be cancelled (releasing its handle leaves UCX landing the bytes, and loses the only
    signal that they have landed), so it is parked with its memory until NIXL reports it over, its into= targets
    marked in ``busy``. At most ``max_parked`` READs are parked: beyond that no new READ starts
    (:class:`~rdt.transports.nixl.read.ParkedLimit`).
    """

    MAX_LOADS_PER_REMOTE = 256
    MAX_REMOTES = 64
    MAX_PARKED = 64
    HOT_S = 2.0  # the progress thread polls every 2 ms this long after a consumer's wake-up, else IDLE_PERIOD
    IDLE_PERIOD = 0.05

    def __init__(self, name: str, busy: Optional[BusyTargets] = None) -> None:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        api = _module()
        self.name = name
        # NIXL's own progress thread busy-polls (~0.8 core while idle); ours polls every 2 ms instead, which is
        # enough for a passive producer on transports that need target-side progress (TCP), and cma/RDMA READs
        # complete without it.
        self.agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.lock = threading.Lock()
        self._remotes: "OrderedDict[str, _Remote]" = OrderedDict()  # least recently used first
        # Transfers that timed out but may still be moving data: their destination buffers and registrations
        # stay alive until NIXL says they finished (freeing them earlier would let a late READ write into freed
        # memory), and the caller's targets among them stay marked busy (a later fetch into them would be
        # overwritten).
        self.parked: List[ParkedRead] = []
        self.max_parked = self.MAX_PARKED
        self.busy = busy if busy is not None else BusyTargets()
        # Kept while the storage lives, not only while an object uses it: the same weights are returned every step.
        self.registrations: StorageCache[RegKey, Any] = StorageCache(self._register_storage, self._deregister,
                                                                     keep_while_alive=True)
        # (keys, registration objects, partial metadata) of the last object registered (see register())
        self.last_md: Optional[Tuple[List[Any], List[Any], List[bytes]]] = None
        self.targets = TargetRegistrations(self, storage_key)  # consumer side: rdt.get(into=...) targets, per storage
        self.blocks = BlockPool(self)  # producer side: registered blocks that packed objects are copied into
        self.landing = LandingPool(self)  # consumer side: registered blocks that fresh READ destinations lie in
        self._stop = threading.Event()
        # Stopped at exit even when its owner never closes it (a thread inside NIXL at finalization aborts the
        # process); the stopper holds the event, not the agent.
        self._stop_at_exit = _lifecycle.at_exit(self._stop.set)
        self._thread = _lifecycle.spawn(self._progress, "rdt-nixl-progress")

    def _register_storage(self, key: RegKey, _storage: Any) -> Any:
        mem, dev, addr, nbytes = key
        with self.lock:  # the agent is not thread-safe: frees (Ray's callback thread) race with registrations
            return self.agent.register_memory([(addr, nbytes, dev, "")], mem)

    def _deregister(self, reg: Any) -> None:
        with self.lock:
            self.agent.deregister_memory(reg)

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the progress thread (before the interpreter finalizes: it calls into NIXL); True if it ended."""
        self._stop.set()
        _lifecycle.cancel(self._stop_at_exit)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def trim(self) -> None:
        """The context's reaper (its own thread, no agent lock held): drop the registrations of storages that died
        since, and free the VRAM of landing blocks given up since (a device sync, which must not run under the
        agent's lock or on the progress thread; without this it waited for the next fetch)."""
        self.registrations.sweep()
        self.landing.retire()

    def close(self) -> None:
        """At shutdown, after every object was released (and its memory deregistered): stop the progress thread,
        then deregister the idle landing blocks."""
        self.stop(_lifecycle.JOIN_TIMEOUT_S)
        if self.lock.acquire(timeout=_lifecycle.JOIN_TIMEOUT_S):  # a thread stuck in NIXL must not hang the exit
            try:
                self.landing.close()
            finally:
                self.lock.release()

    def _progress(self, period: float = 0.002) -> None:
        """Progress the agent, reap parked READs and give back landing blocks until stopped: every ``period``
        seconds while there is work (a READ parked here, or a consumer's wake-up notification within ``HOT_S``:
        a producer on a transport that needs target-side progress serves its READs at that pace), every
        ``IDLE_PERIOD`` otherwise (polling every 2 ms cost an idle actor 6 % of a core here). An error does not
        end it (parked READs would never be reaped, their targets busy for good): it is logged once and the loop
        goes on, every 100 ms while it lasts."""
        failing = False
        hot_until = time.monotonic() + self.HOT_S
        while True:
            now = time.monotonic()
            wait = period * 50 if failing else period if self.parked or now < hot_until else self.IDLE_PERIOD
            if self._stop.wait(wait):
                return
            try:
                with self.lock:
                    if self._stop.is_set():  # stopped while waiting for the lock: no more calls into NIXL
                        return
                    if self.agent.get_new_notifs():  # a consumer is reading (see wake_remote)
                        hot_until = time.monotonic() + self.HOT_S
                    if self.parked:
                        self._reap_parked()
                    self.targets.drain()
                    self.landing.drain()
                failing = False
            except Exception:  # noqa: BLE001 - see above
                if self._stop.is_set():  # torn down at exit
                    return
                if not failing:
                    logger.warning("rdt: the NIXL progress thread of %s failed; it goes on", self.name,
                                   exc_info=True)
                failing = True

    def wake_remote(self, name: str) -> None:
        """Tell the producer agent ``name`` that a READ of its memory is posted (call with the lock held, its
        metadata loaded): its progress thread polls at full pace for ``HOT_S`` (a hint: a failure is ignored)."""
        try:
            self.agent.send_notif(name, WAKE)
        except Exception:  # noqa: BLE001 - a hint: the READ itself reports a dead or unknown producer
            pass

    def _reap_parked(self) -> None:
        """Release parked transfers that are no longer in progress (called with the lock held)."""
        still = []
        for read in self.parked:
            states = []
            for handle in read.handles:
                try:
                    states.append(self.agent.check_xfer_state(handle))
                except Exception:
                    states.append("ERR")
            if "PROC" in states:
                still.append(read)
                continue
            release_all(self.agent, read.handles, read.regs)
            self._done_locked(read.agent)
            self.busy.clear(read.hold)  # its bytes have landed (or never will): the targets are free
        self.parked = still

    def ensure_remote(self, name: str, md: bytes, *extra_md: bytes) -> None:
        """Load (or extend) what we know of a remote agent for one READ; loading partial metadata again is cheap
        (~1 µs). Each call must be paired with :meth:`done_remote` once that READ no longer runs."""
        with self.lock:
            rem = self._remotes.pop(name, None)
            if rem is not None and rem.loads >= self.MAX_LOADS_PER_REMOTE and not rem.inflight:
                self._remove_locked(name)  # forget every stale registration of it; md below reloads connection info
                rem = None
            rem = rem or _Remote()
            self._remotes[name] = rem  # most recently used last
            self._evict_idle_locked()
            for blob in (md,) + extra_md:
                self.agent.add_remote_agent(blob)
            rem.loads += 1
            rem.inflight += 1

    def done_remote(self, name: str) -> None:
        """A READ from ``name`` is over (finished, failed, or its parked transfer was reaped)."""
        with self.lock:
            self._done_locked(name)

    def remote_loads(self, name: str) -> int:
        """Partial-metadata loads of ``name`` since it was last (re)loaded afresh (for tests and stats)."""
        with self.lock:
            rem = self._remotes.get(name)
            return rem.loads if rem is not None else 0

    def _done_locked(self, name: str) -> None:
        rem = self._remotes.get(name)
        if rem is not None and rem.inflight > 0:
            rem.inflight -= 1

    def _evict_idle_locked(self) -> None:
        """Remove least recently used idle remote agents beyond ``MAX_REMOTES`` (caller holds the lock)."""
        excess = len(self._remotes) - self.MAX_REMOTES
        for name in [n for n, r in self._remotes.items() if not r.inflight][:max(excess, 0)]:
            del self._remotes[name]
            self._remove_locked(name)

    def _remove_locked(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception:  # not loaded (any more): nothing to forget
            pass


def agent(ctx: "Context") -> NixlAgent:
    """The context's agent, created on first use (creation takes ~0.4 s)."""
    # the context's table of busy targets, which rdt.get(into=) checks (a bare context in tests has none)
    return ctx.transport_state("nixl", lambda: NixlAgent(f"rdt-{ctx.instance.hex()}",
                                                         getattr(ctx, "busy_targets", None)))


class _Block:
    """A registered CPU block of the pool, and the partial metadata that describes its registration."""

    __slots__ = ("tensor", "addr", "size", "reg", "md")

    def __init__(self, tensor: torch.Tensor, reg: Any, md: bytes) -> None:
        self.tensor, self.addr, self.size, self.reg, self.md = tensor, tensor.data_ptr(), tensor.numel(), reg, md


class BlockPool:
    """Registered blocks for packed objects, reused: a registration and its metadata cost far more than the copy.
    Keeps at most ``max_idle`` idle blocks of ``max_idle_bytes`` in all; the rest are deregistered when given back."""

    UNIT = 1 << 20

    def __init__(self, ag: NixlAgent, max_idle: int = 8, max_idle_bytes: int = 256 << 20) -> None:
        self._ag = ag
        self._idle: List[_Block] = []
        self._lock = threading.Lock()
        self.max_idle, self.max_idle_bytes = max_idle, max_idle_bytes

    def take(self, nbytes: int) -> _Block:
        with self._lock:
            fits = [b for b in self._idle if nbytes <= b.size <= 2 * max(nbytes, self.UNIT)]
            if fits:
                best = min(fits, key=lambda b: b.size)
                self._idle.remove(best)
                return best
        size = -(-max(nbytes, 1) // self.UNIT) * self.UNIT
        tensor = torch.empty(size, dtype=torch.uint8)
        with self._ag.lock:
            reg = self._ag.agent.register_memory([(tensor.data_ptr(), size, 0, "")], "DRAM")
            try:
                md = self._ag.agent.get_partial_agent_metadata(
                    self._ag.agent.get_reg_descs([(tensor.data_ptr(), size, 0, "")], "DRAM"), True)
            except BaseException:
                self._ag.agent.deregister_memory(reg)
                raise
        return _Block(tensor, reg, md)

    def give(self, block: _Block) -> None:
        with self._lock:
            self._idle.append(block)
            drop = []
            while len(self._idle) > self.max_idle or sum(b.size for b in self._idle) > self.max_idle_bytes:
                drop.append(self._idle.pop(0))
        for b in drop:
            with self._ag.lock:
                try:
                    self._ag.agent.deregister_memory(b.reg)
                except Exception:  # the agent is gone: nothing left to deregister
                    pass

    def __len__(self) -> int:
        with self._lock:
            return len(self._idle)


def release_all(nixl_agent: Any, handles: List[Any], regs: List[Any]) -> None:
    """Release transfer handles, then deregister memory (caller holds the agent's lock); never raises."""
    for handle in handles:
        try:
            handle.release()
        except Exception:
            pass
    for reg in regs:
        try:
            nixl_agent.deregister_memory(reg)
        except Exception:
            pass
