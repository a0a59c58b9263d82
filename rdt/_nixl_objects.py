"""NIXL for the object layer: one-sided READ of a producer's registered buffers, no group needed.

The producer registers an object's buffers with its process's NIXL agent when the object is made (transport
"nixl") or when a consumer first asks (transport "auto"); the descriptors and the agent's metadata travel in
the object's metadata (through Ray) or, for "auto", in a binary control reply. The consumer READs them into
fresh tensors with its own agent. NIXL's pickle-based descriptor serialization is never used.
"""

from __future__ import annotations

import importlib
import os
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import torch

if TYPE_CHECKING:
    from ._context import RdtContext
    from ._table import Entry

_available: Optional[bool] = None


def _module() -> Any:
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("no NIXL package: pip install 'rdt[nixl]' (nixl-cu13)")


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


@dataclass(frozen=True)
class NixlInfo:
    """What a consumer needs to READ an object: agent name, agent metadata, descriptors."""

    agent: str
    agent_md: bytes
    mem_type: str  # "DRAM" or "VRAM"
    descs: Tuple[Tuple[int, int, int], ...]  # (address, length, device id) per buffer


@dataclass
class _Remote:
    """What this agent loaded of one remote agent: partial-metadata loads since the last reset, and READs that
    may still use its descriptors (a remote agent is only removed while none is)."""

    loads: int = 0
    inflight: int = 0
    last: float = field(default_factory=time.monotonic)


class NixlAgent:
    """This process's NIXL agent, and which remote agents it has loaded.

    Each fetch loads the producer's partial metadata (connection info plus that object's registrations), which
    NIXL keeps until the remote agent is removed. So that this stays bounded over a long job, a remote agent
    whose loads reach ``MAX_LOADS_PER_REMOTE`` is removed and loaded afresh from the current object's metadata,
    and beyond ``MAX_REMOTES`` agents the least recently used idle one (e.g. a producer that died) is removed;
    both only while no READ from that agent is in flight.
    """

    MAX_LOADS_PER_REMOTE = 256
    MAX_REMOTES = 64

    def __init__(self, name: str) -> None:
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
        # memory).
        self.parked: List[Tuple[Any, Any, List[torch.Tensor], str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._progress, name="rdt-nixl-progress", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the progress thread (before the interpreter finalizes: it calls into NIXL); True if it ended."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _progress(self, period: float = 0.002) -> None:
        while not self._stop.wait(period):
            try:
                with self.lock:
                    self.agent.get_new_notifs()
                    if self.parked:
                        self._reap_parked()
            except Exception:  # agent torn down at exit
                return

    def _reap_parked(self) -> None:
        """Release parked transfers that are no longer in progress (called with the lock held)."""
        still = []
        for handle, reg, dst, name in self.parked:
            try:
                state = self.agent.check_xfer_state(handle)
            except Exception:
                state = "ERR"
            if state == "PROC":
                still.append((handle, reg, dst, name))
                continue
            for release in (handle.release, lambda: self.agent.deregister_memory(reg)):
                try:
                    release()
                except Exception:
                    pass
            self._done_locked(name)
        self.parked = still

    def ensure_remote(self, name: str, md: bytes) -> None:
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
            self.agent.add_remote_agent(md)
            rem.loads += 1
            rem.inflight += 1
            rem.last = time.monotonic()

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


def agent(ctx: "RdtContext") -> NixlAgent:
    """The context's agent, created on first use (creation takes ~0.4 s)."""
    if ctx.nixl is None:
        with ctx._lock:
            if ctx.nixl is None:
                ctx.nixl = NixlAgent(f"rdt-{ctx.instance.hex()}")
    return ctx.nixl


def _mem_type(buffers: List[torch.Tensor]) -> str:
    return "VRAM" if buffers and buffers[0].device.type == "cuda" else "DRAM"


def _sync_cuda(bufs: List[torch.Tensor]) -> None:
    """Wait for the current stream of every CUDA device the buffers are on (NIXL moves VRAM outside streams)."""
    for dev in {b.device for b in bufs if b.device.type == "cuda"}:
        torch.cuda.current_stream(dev).synchronize()


def register(ctx: "RdtContext", entry: "Entry") -> NixlInfo:
    """Register an object's buffers (once) and describe them for consumers."""
    if entry.nixl is not None:
        return entry.nixl[1]
    ag = agent(ctx)
    bufs = entry.buffers
    _sync_cuda(bufs)  # a one-sided READ does not follow the producer's stream: finish pending writes first
    with ag.lock:  # the agent is not thread-safe: frees (Ray's callback thread) race with registrations
        reg = ag.agent.register_memory(bufs)
        # Partial metadata: connection info plus just this object's registrations, so it stays small however
        # many objects are alive, and is never stale (full metadata fetched once would miss later registrations).
        md = ag.agent.get_partial_agent_metadata(reg, True)
    descs = tuple((b.data_ptr(), b.numel(), max(b.get_device(), 0)) for b in bufs)
    info = NixlInfo(ag.name, md, _mem_type(bufs), descs)
    entry.nixl = (reg, info)
    return info


def release(ctx: "RdtContext", entry: "Entry") -> None:
    """Deregister an object's buffers when it is freed."""
    if entry.nixl is None or ctx.nixl is None:
        return
    reg, _ = entry.nixl
    entry.nixl = None
    try:
        with ctx.nixl.lock:
            ctx.nixl.agent.deregister_memory(reg)
    except Exception:  # deregistration failure must not break freeing
        pass


def encode_info(info: NixlInfo) -> bytes:
    """Binary form for control replies (no pickle)."""
    name = info.agent.encode()
    out = [struct.pack("!H", len(name)), name, struct.pack("!I", len(info.agent_md)), info.agent_md,
           info.mem_type.encode()[:4].ljust(4, b" "), struct.pack("!I", len(info.descs))]
    out += [struct.pack("!QQI", a, n, d) for a, n, d in info.descs]
    return b"".join(out)


def decode_info(data: bytes) -> NixlInfo:
    """Parse :func:`encode_info`; raises ValueError on malformed input."""
    try:
        off = 0
        (n,) = struct.unpack_from("!H", data, off)
        off += 2
        name = data[off:off + n].decode()
        off += n
        (m,) = struct.unpack_from("!I", data, off)
        off += 4
        md = data[off:off + m]
        off += m
        mem = data[off:off + 4].decode().strip()
        off += 4
        (k,) = struct.unpack_from("!I", data, off)
        off += 4
        descs = []
        for _ in range(k):
            descs.append(struct.unpack_from("!QQI", data, off))
            off += 20
    except (struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"malformed NIXL info: {e}") from e
    if mem not in ("DRAM", "VRAM") or len(md) != m:
        raise ValueError("malformed NIXL info")
    return NixlInfo(name, md, mem, tuple(descs))


def fetch(ctx: "RdtContext", info: NixlInfo, device: torch.device, timeout: float) -> List[torch.Tensor]:
    """READ every buffer into fresh tensors on ``device``; raises TimeoutError/RuntimeError.

    ``device`` may be a CUDA device for VRAM or DRAM sources (NIXL registers the destination as VRAM) or the CPU
    (the consumer has no GPU: a VRAM source is read into DRAM).
    """
    ag = agent(ctx)
    ag.ensure_remote(info.agent, info.agent_md)
    parked = False
    try:
        return _read(ctx, ag, info, device, timeout)
    except _Parked:
        parked = True  # it stays counted as in flight until the progress thread reaps it
        raise
    finally:
        if not parked:
            ag.done_remote(info.agent)


class _Parked(TimeoutError):
    """A READ timed out but may still be moving data: its memory was parked on the agent."""


def _read(ctx: "RdtContext", ag: NixlAgent, info: NixlInfo, device: torch.device,
          timeout: float) -> List[torch.Tensor]:
    """The READ itself, into fresh tensors on ``device``."""
    dst = [ctx.buffers.empty(n) if device.type == "cpu" else torch.empty(n, dtype=torch.uint8, device=device)
           for _, n, _ in info.descs]
    _sync_cuda(dst)  # fresh VRAM blocks may still be in use, in stream order, by kernels of the current stream
    with ag.lock:
        reg = ag.agent.register_memory(dst)
    handle = None
    try:
        with ag.lock:
            local = ag.agent.get_xfer_descs(dst)
            remote = ag.agent.get_xfer_descs(list(info.descs), info.mem_type)
            handle = ag.agent.initialize_xfer("READ", local, remote, info.agent)
        try:
            with ag.lock:
                state = ag.agent.transfer(handle)
            deadline = time.monotonic() + timeout
            delay = 1e-5
            while state == "PROC":
                if time.monotonic() > deadline:
                    with ag.lock:  # may still complete later: keep its memory until it does
                        ag.parked.append((handle, reg, dst, info.agent))
                    handle = reg = None
                    raise _Parked(f"NIXL READ from {info.agent} not done within {timeout:.1f}s")
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)
                with ag.lock:
                    state = ag.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL READ from {info.agent} failed (state {state}); the producer may have died")
        finally:
            if handle is not None:
                try:
                    with ag.lock:
                        handle.release()
                except Exception:
                    pass
    finally:
        if reg is not None:
            with ag.lock:
                ag.agent.deregister_memory(reg)
    return dst
