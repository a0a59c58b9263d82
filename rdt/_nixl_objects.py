"""NIXL for the object layer: one-sided READ of a producer's registered buffers, no group needed.

The producer registers an object's buffers with its process's NIXL agent when the object is made (transport
"nixl") or when a consumer first asks (transport "auto"); the descriptors and the agent's metadata travel in
the object's metadata (through Ray) or, for "auto", in a binary control reply. The consumer READs them into
fresh tensors with its own agent. NIXL's pickle-based descriptor serialization is never used.
"""

from __future__ import annotations

import importlib
from array import array
from itertools import chain
import os
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, Dict, Hashable, Iterator, List, Optional, Sequence, Tuple, TypeVar,
                    Union)

import torch

from rdt_transports import _lifecycle
from rdt_transports._memcopy import copy_parts

from ._busy import BusyTargets
from ._ready import wait_ready
from .transports.base import SetupFailed, block_views, padded_offsets
from ._nixl_targets import TargetRegistrations
from ._storage_cache import StorageCache

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


_MEM_CODES = {"DRAM": 0, "VRAM": 1}
_MEM_NAMES = {v: k for k, v in _MEM_CODES.items()}


class PackedDescs(Sequence[Tuple[int, int, int]]):
    """The descriptors of a packed object: its buffers at :func:`padded_offsets` of their sizes from ``base``, on
    device 0. Kept as the sizes, so that a thousand buffers cost no tuples to describe, pickle or read whole."""

    __slots__ = ("base", "sizes", "_offsets")

    def __init__(self, base: int, sizes: List[int], offsets: Optional[List[int]] = None) -> None:
        self.base, self.sizes, self._offsets = base, sizes, offsets

    @property
    def offsets(self) -> List[int]:
        """Where each buffer starts, from ``base``."""
        if self._offsets is None:
            self._offsets = padded_offsets(self.sizes)[0]
        return self._offsets

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        return (self.base + self.offsets[i], self.sizes[i], 0)

    def __iter__(self) -> Iterator[Tuple[int, int, int]]:
        return zip([self.base + o for o in self.offsets], self.sizes, [0] * len(self.sizes))

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, (tuple, list, PackedDescs)) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __reduce__(self) -> Any:
        return (_load_packed, (self.base, array("Q", self.sizes).tobytes()))

    def __repr__(self) -> str:
        return f"PackedDescs(base={self.base:#x}, {len(self.sizes)} buffers)"


def _load_packed(base: int, sizes: bytes) -> PackedDescs:
    a = array("Q")
    a.frombytes(sizes)
    return PackedDescs(base, a.tolist())


@dataclass(frozen=True)
class NixlInfo:
    """What a consumer needs to READ an object: agent name, agent metadata, descriptors, each buffer's memory type.

    ``mem_type`` is "VRAM" if any buffer is (it picks the consumer's device); ``mem_types`` is per buffer
    (defaults to ``mem_type`` for all). NIXL's partial metadata covers one registration, and a registration one
    memory type, so a mixed object has one more metadata blob per further type in ``extra_md``.
    """

    agent: str
    agent_md: bytes
    mem_type: str  # "DRAM" or "VRAM"
    descs: Sequence[Tuple[int, int, int]]  # (address, length, device id) per buffer; PackedDescs when packed
    mem_types: Tuple[str, ...] = ()
    extra_md: Tuple[bytes, ...] = ()
    # The producer packed the buffers into one registered block at the offsets a consumer's landing block uses
    # (``padded_offsets``), starting at descs[0]: a consumer without targets READs it whole, one descriptor.
    packed: bool = False

    def __post_init__(self) -> None:
        if not self.mem_types:
            object.__setattr__(self, "mem_types", (self.mem_type,) * len(self.descs))

    def __reduce__(self) -> Any:
        """Descriptors as one array of integers: a thousand tuples pickle to 60 KB, and cost that in time."""
        descs = self.descs
        cols = descs if isinstance(descs, PackedDescs) else array("Q", chain.from_iterable(descs)).tobytes()
        uniform = self.mem_types.count(self.mem_type) == len(self.mem_types)
        types = b"" if uniform else bytes(_MEM_CODES[t] for t in self.mem_types)  # b"": all are mem_type
        return (_load_info, (self.agent, self.agent_md, self.mem_type, cols, types, self.extra_md, self.packed))


def _load_info(agent: str, agent_md: bytes, mem_type: str, cols: Union[bytes, PackedDescs], types: bytes,
               extra_md: Tuple[bytes, ...], packed: bool) -> NixlInfo:
    if isinstance(cols, PackedDescs):
        descs: Sequence[Tuple[int, int, int]] = cols
    else:
        a = array("Q")
        a.frombytes(cols)
        v = a.tolist()
        descs = tuple(zip(v[0::3], v[1::3], v[2::3]))
    return NixlInfo(agent, agent_md, mem_type, descs, tuple(_MEM_NAMES[c] for c in types), extra_md, packed)


K = TypeVar("K", bound=Hashable)


def group_by_mem_type(types: Sequence[K]) -> List[Tuple[K, List[int]]]:
    """Buffer indices per memory type (or any key, e.g. a (local, remote) pair), in order of first appearance:
    NIXL takes one memory type per registration and per descriptor list."""
    groups: Dict[K, List[int]] = {}
    for i, t in enumerate(types):
        groups.setdefault(t, []).append(i)
    return list(groups.items())


def mem_type_of(buf: torch.Tensor) -> str:
    """NIXL's memory type for one buffer."""
    return "VRAM" if buf.device.type == "cuda" else "DRAM"


@dataclass
class _Remote:
    """What this agent loaded of one remote agent: partial-metadata loads since the last reset, and READs that
    may still use its descriptors (a remote agent is only removed while none is)."""

    loads: int = 0
    inflight: int = 0


RegKey = Tuple[str, int, int, int]  # (memory type, device id, storage address, storage bytes)


@dataclass
class _ParkedRead:
    """A READ that timed out but may still move data: its handles, local registrations and memory (the caller's
    targets among it, marked busy under ``hold``) stay until NIXL says it is no longer in progress."""

    handles: List[Any]
    regs: List[Any]
    keep: List[torch.Tensor]
    agent: str
    hold: Optional[int]


def storage_key(buf: torch.Tensor) -> RegKey:
    """The registration that covers ``buf``: its whole untyped storage (weights returned every step map to one)."""
    storage = buf.untyped_storage()
    return mem_type_of(buf), max(buf.get_device(), 0), storage.data_ptr(), storage.nbytes()


class NixlAgent:
    """This process's NIXL agent, which remote agents it has loaded, and its producer-side registrations.

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
    marked in ``busy``. At most ``max_parked`` READs are parked: beyond that no new READ starts (:class:`ParkedLimit`).
    """

    MAX_LOADS_PER_REMOTE = 256
    MAX_REMOTES = 64
    MAX_PARKED = 64

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
        self.parked: List[_ParkedRead] = []
        self.max_parked = self.MAX_PARKED
        self.busy = busy if busy is not None else BusyTargets()
        # Kept while the storage lives, not only while an object uses it: the same weights are returned every step.
        self.registrations: StorageCache[RegKey, Any] = StorageCache(self._register_storage, self._deregister,
                                                                     keep_while_alive=True)
        # (keys, registration objects, partial metadata) of the last object registered (see register())
        self.last_md: Optional[Tuple[List[Any], List[Any], List[bytes]]] = None
        self.targets = TargetRegistrations(self, storage_key)  # consumer side: rdt.get(into=...) targets, per storage
        self.blocks = BlockPool(self)  # producer side: registered blocks that packed objects are copied into
        self._stop = threading.Event()
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
                    self.targets.drain()
            except Exception:  # agent torn down at exit
                return

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
            _release_all(self.agent, read.handles, read.regs)
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


def agent(ctx: "RdtContext") -> NixlAgent:
    """The context's agent, created on first use (creation takes ~0.4 s)."""
    if ctx.nixl is None:
        with ctx._lock:
            if ctx.nixl is None:
                # the context's table of busy targets, which rdt.get(into=) checks (a bare context in tests has none)
                ctx.nixl = NixlAgent(f"rdt-{ctx.instance.hex()}", getattr(ctx, "busy_targets", None))
    return ctx.nixl


def _sync_cuda(bufs: List[torch.Tensor]) -> None:
    """Wait for the current stream of every CUDA device the buffers are on (NIXL moves VRAM outside streams)."""
    for dev in {b.device for b in bufs if b.device.type == "cuda"}:
        torch.cuda.current_stream(dev).synchronize()


def register(ctx: "RdtContext", entry: "Entry") -> NixlInfo:
    """Describe an object's buffers for consumers (once per object), registering each storage it uses unless a live
    object registered it already; the object counts as one user of each (see :func:`release`). An object of many
    small CPU buffers is packed into one registered block instead (:func:`_packs`)."""
    known = entry.exports.get("nixl")
    if known is not None:
        return known[1]
    spans = entry.flat.spans  # one buffer per storage: (a tensor on it, first byte, end byte); no view made
    if not spans:  # only empty tensors: such objects travel inline, never here
        raise SetupFailed(f"object {entry.obj_id.hex()} has no bytes to register with NIXL")
    wait_ready(entry)  # a one-sided READ follows no stream: the writes queued before the return must be done
    ag = agent(ctx)
    if _packs(entry):
        return _register_packed(ag, entry)
    types: List[str] = []
    keys: List[RegKey] = []
    items: List[Tuple[RegKey, Any]] = []
    descs: List[Tuple[int, int, int]] = []
    for owner, lo, hi in spans:
        storage = owner.untyped_storage()
        mem = "DRAM" if owner.is_cpu else mem_type_of(owner)
        dev = 0 if owner.is_cpu else max(owner.get_device(), 0)
        base = storage.data_ptr()
        key = (mem, dev, base, storage.nbytes())
        types.append(mem)
        keys.append(key)
        items.append((key, storage))
        descs.append((base + lo, hi - lo, dev))
    regs = ag.registrations.acquire_many(items)
    try:
        # The same registrations as the previous object (the same weights returned again): the same metadata.
        same = ag.last_md is not None and ag.last_md[0] == keys and all(a is b for a, b in zip(ag.last_md[1], regs))
        if same:
            mds = ag.last_md[2]
        else:
            with ag.lock:
                # Partial metadata: connection info plus just this object's storages' registrations, so it stays
                # small however many objects are alive, and is never stale (full metadata fetched once would miss
                # later ones). NIXL's partial metadata covers one memory type per call: one blob per type, in order
                # of appearance.
                mds = [ag.agent.get_partial_agent_metadata(
                    ag.agent.get_reg_descs([(k[2], k[3], k[1], "") for k in keys if k[0] == mem], mem), True)
                    for mem, _ in group_by_mem_type(types)]
            ag.last_md = (keys, regs, mds)  # holds the registration objects: their identity cannot be reused
    except BaseException:
        ag.registrations.release_many(keys)
        raise
    info = NixlInfo(ag.name, mds[0], "VRAM" if "VRAM" in types else "DRAM", tuple(descs), tuple(types),
                    tuple(mds[1:]))
    entry.exports["nixl"] = (tuple(keys), info)
    return info


# An object is packed when it has at least PACK_MIN buffers, all in CPU memory, of PACK_MEAN bytes or less on
# average and PACK_MAX in all: NIXL posts one UCX operation per descriptor (~4 us each here) and registers each
# storage, while one copy into a registered block costs ~0.1 ms per MB. The copy is made at registration, so
# such an object's consumers read the bytes as they were then (as with snapshot=True).
PACK_MIN = 16
PACK_MEAN = 256 << 10
PACK_MAX = 64 << 20


def _packs(entry: "Entry") -> bool:
    table = entry.flat.table
    n = len(table.sizes)
    return n >= PACK_MIN and table.total <= min(PACK_MAX, n * PACK_MEAN) and table.device_types == {"cpu"}


def _register_packed(ag: NixlAgent, entry: "Entry") -> NixlInfo:
    """Copy the object's buffers into one registered block from the agent's pool, laid out as a consumer's landing
    block (:func:`padded_offsets`), and describe each buffer within it."""
    sizes = list(entry.flat.table.sizes)
    offsets, total = padded_offsets(sizes)
    block = ag.blocks.take(total)
    try:
        base = block.addr
        copy_parts([(base + o, a, n) for o, (a, n) in zip(offsets, entry.flat.ranges)])
        info = NixlInfo(ag.name, block.md, "DRAM", PackedDescs(base, sizes, offsets), packed=True)
    except BaseException:
        ag.blocks.give(block)
        raise
    entry.exports["nixl"] = ((), info, block)
    return info


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


def release(ctx: "RdtContext", entry: "Entry") -> None:
    """The object was freed: it is one user fewer of each storage registration (the last one deregisters), and a
    packed object's block goes back to the pool."""
    known = entry.exports.pop("nixl", None)
    if known is None or ctx.nixl is None:
        return
    ctx.nixl.registrations.release_many(list(known[0]))  # never raises
    if len(known) > 2:
        ctx.nixl.blocks.give(known[2])


def encode_info(info: NixlInfo) -> bytes:
    """Binary form for control replies (no pickle)."""
    name = info.agent.encode()
    out = [struct.pack("!H", len(name)), name, struct.pack("!I", len(info.agent_md)), info.agent_md,
           info.mem_type.encode()[:4].ljust(4, b" "), struct.pack("!I", len(info.descs))]
    out += [struct.pack("!QQI", a, n, d) for a, n, d in info.descs]
    out.append(bytes(_MEM_CODES[t] for t in info.mem_types))
    out.append(struct.pack("!H", len(info.extra_md)))
    out += [struct.pack("!I", len(md)) + md for md in info.extra_md]
    out.append(b"\x01" if info.packed else b"\x00")
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
        codes = data[off:off + k]
        off += k
        (n_extra,) = struct.unpack_from("!H", data, off)
        off += 2
        extra = []
        for _ in range(n_extra):
            (x,) = struct.unpack_from("!I", data, off)
            off += 4
            extra.append(data[off:off + x])
            off += x
        (flags,) = struct.unpack_from("!B", data, off)
        off += 1
    except (struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"malformed NIXL info: {e}") from e
    if (mem not in ("DRAM", "VRAM") or len(md) != m or len(codes) != k or any(c not in _MEM_NAMES for c in codes)
            or off > len(data) or flags > 1):
        raise ValueError("malformed NIXL info")
    return NixlInfo(name, md, mem, tuple(descs), tuple(_MEM_NAMES[c] for c in codes), tuple(extra), bool(flags))


def fetch(ctx: "RdtContext", info: NixlInfo, device: torch.device, timeout: float,
          dests: Sequence[Optional[torch.Tensor]] = (), label: str = "an object") -> List[torch.Tensor]:
    """READ every buffer into fresh tensors on ``device`` (or into ``dests``, the caller's targets); raises
    TimeoutError, ParkedLimit or RuntimeError. ``label`` names the object in what a parked READ is marked with.

    Each buffer keeps its own kind of memory: a VRAM source is read to ``device`` when it is a CUDA device (else
    into DRAM: the consumer has no GPU), a DRAM source into CPU memory.
    """
    ag = agent(ctx)
    _check_room(ag)
    ag.ensure_remote(info.agent, info.agent_md, *info.extra_md)
    parked = False
    try:
        return _read(ctx, ag, info, device, timeout, dests, label)
    except _Parked:
        parked = True  # it stays counted as in flight until the progress thread reaps it
        raise
    finally:
        if not parked:
            ag.done_remote(info.agent)


class _Parked(TimeoutError):
    """A READ timed out but may still be moving data: its memory was parked on the agent."""


class ParkedLimit(RuntimeError):
    """No READ was started: ``max_parked`` READs that timed out are still in flight."""


def _check_room(ag: NixlAgent) -> None:
    """Refuse to start a READ while ``max_parked`` timed-out READs are still in flight (each holds its memory)."""
    with ag.lock:
        if len(ag.parked) < ag.max_parked:
            return
        sources = sorted({p.agent for p in ag.parked})
    raise ParkedLimit(f"{len(ag.parked)} NIXL READs of this process timed out and are still in flight (from "
                      f"agents {', '.join(sources[:3])}{' ...' if len(sources) > 3 else ''}); no new READ starts "
                      "until one ends")


def _read(ctx: "RdtContext", ag: NixlAgent, info: NixlInfo, device: torch.device,
          timeout: float, dests: Sequence[Optional[torch.Tensor]] = (), label: str = "an object") -> List[torch.Tensor]:
    """The READ itself, into fresh tensors: a VRAM buffer on ``device``, a DRAM one in CPU memory. One transfer
    per (local, remote) memory-type pair, since a NIXL descriptor list has a single memory type."""
    if not dests and len(info.descs) > 1 and set(info.mem_types) == {"DRAM"}:
        return _read_block(ctx, ag, info, timeout)
    dst: List[torch.Tensor] = []
    targets: List[int] = []  # the caller's tensors: registered once per storage, across fetches
    for i, ((_, n, _), t) in enumerate(zip(info.descs, info.mem_types)):
        on = device if t == "VRAM" and device.type == "cuda" else torch.device("cpu")
        given = dests[i] if i < len(dests) else None  # rdt.get(into=...): READ straight into the caller's target
        if given is not None and given.numel() == n and given.device.type == on.type:
            dst.append(given)
            targets.append(i)
        else:
            dst.append(torch.empty(n, dtype=torch.uint8, device=on) if on.type == "cuda" else ctx.buffers.empty(n))
    _sync_cuda(dst)  # fresh VRAM blocks may still be in use, in stream order, by kernels of the current stream
    local_types = [mem_type_of(d) for d in dst]
    regs: List[Any] = []
    try:
        with ag.lock:
            covered = set(i for i, ok in zip(targets, ag.targets.cover([dst[i] for i in targets])) if ok)
            for _, idx in group_by_mem_type(local_types):
                idx = [i for i in idx if i not in covered]
                if idx:
                    regs.append(ag.agent.register_memory([dst[i] for i in idx]))
    except BaseException:
        with ag.lock:
            _release_all(ag.agent, [], regs)
        raise
    plan = [([dst[i] for i in idx], [info.descs[i] for i in idx], local_type, remote_type)
            for (local_type, remote_type), idx in group_by_mem_type(list(zip(local_types, info.mem_types)))]
    _transfer(ag, info, plan, regs, dst, timeout, [dst[i] for i in targets], label)
    return dst


def _read_block(ctx: "RdtContext", ag: NixlAgent, info: NixlInfo, timeout: float) -> Any:
    """The READ of an object of many DRAM buffers into one fresh block: one registration and no tensor per
    buffer (the leaves are rebuilt from the block; see ``BlockViews``)."""
    descs = info.descs
    views = block_views(ctx, descs.sizes if isinstance(descs, PackedDescs) else [n for _, n, _ in descs])
    base = views.block.data_ptr()
    with ag.lock:
        regs = [ag.agent.register_memory([views.block])]
    if info.packed:  # laid out as this block is: one descriptor for the whole object
        total = views.offsets[-1] + views.sizes[-1]
        local, remote = [(base, total, 0)], [(info.descs[0][0], total, 0)]
    else:
        local = [(base + o, n, 0) for o, (_, n, _) in zip(views.offsets, info.descs)]
        remote = list(info.descs)
    _transfer(ag, info, [(local, remote, "DRAM", "DRAM")], regs, [views.block], timeout)
    return views


def _transfer(ag: NixlAgent, info: NixlInfo, plan: List[Tuple[Any, Any, str, str]], regs: List[Any],
              keep: List[torch.Tensor], timeout: float, targets: Sequence[torch.Tensor] = (),
              label: str = "an object") -> None:
    """Post one READ per (local, remote) memory-type pair of ``plan`` and wait for all (``regs``: the local
    registrations, released here with the handles; ``keep``: the local memory, parked if a READ times out;
    ``targets``: the caller's tensors among it, marked busy while a parked READ may write them)."""
    handles: List[Any] = []
    try:
        with ag.lock:
            for local_descs, remote_descs, local_type, remote_type in plan:
                by_address = isinstance(local_descs[0], tuple)  # (address, bytes, device) rather than tensors
                local = ag.agent.get_xfer_descs(local_descs, local_type) if by_address \
                    else ag.agent.get_xfer_descs(local_descs)
                remote = ag.agent.get_xfer_descs(remote_descs, remote_type)
                handles.append(ag.agent.initialize_xfer("READ", local, remote, info.agent))
            states = [ag.agent.transfer(h) for h in handles]
        deadline = time.monotonic() + timeout
        delay = 1e-5
        while "PROC" in states:
            if time.monotonic() > deadline:
                # It may still complete later: keep its memory (and handles: releasing one does not stop UCX, it
                # only hides when the bytes land) until it does, and mark the caller's targets busy meanwhile.
                hold = ag.busy.mark(targets, f"the NIXL READ of {label} from {info.agent}")
                with ag.lock:
                    ag.parked.append(_ParkedRead(handles, regs, keep, info.agent, hold))
                handles, regs = [], []
                late = (f"; it is still in flight and may write into the {len(targets)} into= target(s) until it "
                        "ends (a later rdt.get into them waits for it)") if hold is not None else ""
                raise _Parked(f"NIXL READ from {info.agent} not done within {timeout:.1f}s{late}")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
            with ag.lock:
                states = [ag.agent.check_xfer_state(h) if st == "PROC" else st for h, st in zip(handles, states)]
        bad = [st for st in states if st != "DONE"]
        if bad:
            raise RuntimeError(f"NIXL READ from {info.agent} failed (state {bad[0]}); the producer may have died")
    finally:
        if handles or regs:
            with ag.lock:
                _release_all(ag.agent, handles, regs)


def _release_all(nixl_agent: Any, handles: List[Any], regs: List[Any]) -> None:
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
