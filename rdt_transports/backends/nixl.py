"""NIXL backend: two-sided send/recv built on one-sided RDMA WRITE (receiver-driven), for cpu and cuda tensors.

Protocol (per transfer, matched on (peer, tag) so that posting order does not matter):

1. ``irecv`` registers the destination buffer and sends the sender a *ready-to-receive* (RTR) notification: a
   fixed binary header packed with :mod:`struct` (magic, version, kind, src/dst rank, tag, nbytes, dtype code,
   address, length, device id, memory type, registration id and range) followed by the NIXL *partial agent
   metadata* of that registration (the remote key the sender needs), followed by an HMAC-SHA256 over all of it,
   keyed by a key derived from the group secret and group uid.
2. ``isend`` waits (in :meth:`NixlBackend.progress`) for the RTR with its tag from that peer, checks nbytes and
   dtype (on mismatch it sends a NACK so the receiver fails too), registers its source, loads the receiver's
   registration metadata if it has not seen that registration yet, and posts a WRITE whose completion
   notification is an authenticated DONE message; NIXL delivers it only after the data has landed.
3. ``irecv``'s Work completes when that DONE arrives.
4. A receive that ends without its DONE (timeout, abort, shutdown) sends the sender a CANCEL, and while the sender
   may still write into its buffer (a registered RTR went out) it keeps the tensor and its registration until the
   sender answers CANCEL_ACK, dies, or the backend shuts down (bounded: MAX_CANCELLED, past which new receives are
   refused). A timed-out receive first waits _CANCEL_GRACE_S for that answer; a sender whose WRITE is in flight
   answers CANCEL_BUSY at once and the receive then waits as long again for the WRITE to end (if its DONE arrives
   meanwhile, the receive completes: the data is whole). The sender reads every notification that has arrived
   before it starts a write, and between 64 MiB pieces of its own CMA copy: a cancelled receive is never written
   after its sender has seen the cancel, and a send for a cancelled tag fails with CommunicationError naming it.

Security: nothing received from the network is unpickled (NIXL's ``deserialize_descs`` uses pickle, so it is
never used). Every notification must carry a valid HMAC and a well-formed size; others are dropped and counted
in :attr:`NixlBackend.stats`. Full agent metadata comes through Ray's GCS (trusted). Registration metadata comes
inside authenticated RTRs (only group members hold the secret) and is parsed by NIXL's own binary
deserializer, never by pickle.

Memory registration (measured here, UCX over cma+tcp on loopback, DRAM): a first registration of a fresh
buffer costs 0.04 ms (4 KiB), 0.06 ms (1 MiB), 0.10 ms (16 MiB), 0.18 ms (128 MiB); deregistration is ~0.01 ms;
the very first registration in a process pays a one-off ~6-12 ms set-up. On DRAM over TCP/CMA registering per call
would therefore be cheap, but on InfiniBand or for VRAM (GPUDirect) registering pins memory and costs
milliseconds to hundreds of milliseconds, and every new registration also makes the sender load new remote
metadata. So registrations are cached: a bounded LRU cache keyed by (device, storage address, storage size),
registering the tensor's whole storage so that every view of it reuses one registration. The cache holds a
*weak* reference to the storage (so it never keeps user memory alive); a hit whose storage has died is a stale
entry (the address was reused) and is deregistered and registered afresh. In-flight operations hold the tensor,
so an entry in use can never go stale and is never evicted. The cache is capped in bytes and entries
(``RDT_NIXL_REG_CACHE_BYTES``, default 4 GiB; 256 entries); dead and least-recently-used idle entries are
deregistered first, and everything is deregistered at shutdown.
On the sender, loaded remote registrations are tracked per peer; when a new one overlaps an old one (the peer
re-registered reused memory) or too many accumulate, the peer's agent is removed and re-added from its full
metadata (once no transfer to it is in flight), so stale remote keys are never used and memory stays bounded.
Prepared WRITE handles are cached too (64, least recently used first), keyed by both ends' registrations and
addresses, and reposted with the new DONE message once their last WRITE is DONE; a handle is released before the
local registration or the peer's remote keys it points into go.

Progress: NIXL's own UCX progress thread busy-polls (measured: 0.8 CPU-seconds per second while idle, and
128 MiB send/recv between two processes on 2 cores fell from 4.0-4.4 GB/s to 1.8-1.9 GB/s with it), so it is off
by default and UCX is progressed by :meth:`NixlBackend.progress`, which every ``Work.wait`` drives. Both sides of
a transfer wait on it, so this suffices; but over a TCP-only transport a WRITE also needs the *receiver's*
process to progress, so a rank that blocks in another group while its NIXL receive is pending can stall the
sender until it waits here. Pass ``progress_thread=True`` or set ``RDT_NIXL_PROGRESS_THREAD=1`` to trade a core
for independent progress.

CUDA tensors are registered as VRAM with their device id; the current stream of the tensor's device is
synchronised when an operation is posted so that producers have finished writing (sender) and readers are done
with the buffer (receiver). The CUDA path cannot be tested on a CPU-only machine.

Same-node groups: UCX puts its shared-memory transports (sysv, posix) on an endpoint only without UCX peer error
handling, which NIXL's UCX backend turns on by default; with it every notification crossed TCP on loopback
(measured here at 64 KiB after a barrier: ``send_notif`` 20 -> 6 us, the WRITE's post 56 -> 26 us, the receiver's
wait 206 -> 157-168 us). So when every rank runs on this Ray node and sees the others' pids, the agent is made
with ``ucx_error_handling_mode=none`` and each wait watches the peer's pid instead (a dead peer fails the wait
with PeerUnavailableError within ``_PEER_WATCH_S``). Groups that span nodes keep peer error handling.
``RDT_NIXL_UCX_ERROR_MODE=peer|none`` overrides the choice; ``describe()`` says which was taken.

Environment: UCX needs an active-message capable transport (tcp); ``UCX_TLS=sm,self`` alone fails at agent
creation. ``UCX_NET_DEVICES=lo`` is enough on a single host; ``NIXL_LOG_LEVEL=WARN`` silences NIXL's INFO lines.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import (
    BackendUnavailableError,
    CollectiveTimeoutError,
    CommunicationError,
    GroupDestroyedError,
    InvalidArgumentError,
    PeerUnavailableError,
    TensorMismatchError,
)
from .. import _cma, _spin
from .._proc import pid_alive, process_alive, ray_node_id, start_time
from ..types import Capabilities
from .base import Backend, BackendConfig, Work

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------- wire format
_MAGIC = b"RDTX"
_VERSION = 1
_KIND_RTR = 1
_KIND_DONE = 2
_KIND_NACK = 3
_KIND_EAGER = 4  # a small message's data inside the notification itself (no WRITE, no wait for the RTR)
_KIND_EAGER_ACK = 5  # the receiver took an EAGER message: the send completes (so delivery is certain)
_KIND_EAGER_NACK = 6  # the receiver refused an EAGER message: the send fails with the mismatch
_KIND_CANCEL = 7  # the receive of this tag ended without its data: write nothing into its buffer
_KIND_CANCEL_ACK = 8  # the sender saw the CANCEL: nothing more will be written for this tag (any WRITE has ended)
_KIND_CANCEL_BUSY = 9  # the sender saw the CANCEL while its WRITE of this tag runs: the ACK follows when it ends
_TO_RECEIVER = (_KIND_EAGER, _KIND_DONE, _KIND_NACK, _KIND_CANCEL_ACK, _KIND_CANCEL_BUSY)  # about a receive
_KINDS = (_KIND_RTR, _KIND_DONE, _KIND_NACK, _KIND_EAGER, _KIND_EAGER_ACK, _KIND_EAGER_NACK, _KIND_CANCEL,
          _KIND_CANCEL_ACK, _KIND_CANCEL_BUSY)
# magic, version, kind, src, dst, tag, nbytes, dtype, addr, length, devid, memtype, reg_id, reg_base, reg_len, md_len
_HEADER = struct.Struct("!4sBBIIIQBQQIBQQQI")
_MAC_LEN = 32
_MAX_MD_LEN = 1 << 16
_MEM_DRAM = 0
_MEM_VRAM = 1
_MEM_NONE = 2  # an RTR with no registration: the receiver takes the message only as EAGER
_MEM_NAMES = {_MEM_DRAM: "DRAM", _MEM_VRAM: "VRAM"}
# Messages up to this size travel inside an authenticated notification. Both ends HMAC the data (SHA-256, ~1.2 us
# per KiB here), so EAGER's cost grows with size while what it saves (the ready-to-receive round trip and the
# WRITE's set-up) does not. Interleaved in the same actors (back to back / after a barrier): at 64 KiB the WRITE
# was as fast (378 / 382 us against 388 / 400) for less CPU; at 32 KiB EAGER was faster (261 / 234 against 316 / 339).
EAGER_MAX_BYTES = 32 << 10
# From this size a same-node CPU send is copied by rdt straight into the receiver's tensor with process_vm_writev
# on CMA_THREADS threads (UCX's own CMA copy runs on one: 6.1 GB/s here, two threads 10.8 GB/s); below it the
# split costs more than it saves. RDT_NIXL_CMA=0 keeps every byte on NIXL.
CMA_MIN_BYTES = 16 << 20
CMA_THREADS = max(1, min(4, os.cpu_count() or 1))
EAGER_WINDOW = 64  # unacknowledged EAGER messages per peer; past it a send waits for the receiver's RTR
# Cancelled receives whose sender has not answered yet, each holding its tensor and registration; past this many a
# new receive is refused (the peer does not progress: the group needs re-creating).
MAX_CANCELLED = 256
_CANCEL_RECORDS = 4096  # cancelled tags remembered without a buffer (sends not posted yet, small receives)
# How long a timed-out receive waits for its sender's answer to the CANCEL. A sender that progresses answers within
# a millisecond or so (its CMA copy looks between 64 MiB pieces, ~10 ms each here); one that does not progress is
# not writing, and reads the CANCEL before it ever starts a write.
_CANCEL_GRACE_S = 0.2
_SHUTDOWN_FLUSH_S = 0.05  # shutdown progresses this long for outstanding CANCELs to leave (and answers to come)
_CMA_PIECE = 64 << 20  # the CMA copy looks for a CANCEL between pieces of this size
# Stable dtype codes (index in this tuple); names missing from this torch build are skipped.
_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
    "complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
)
_DTYPE_TO_CODE: Dict[torch.dtype, int] = {
    getattr(torch, n): i for i, n in enumerate(_DTYPE_NAMES) if isinstance(getattr(torch, n, None), torch.dtype)
}
_CODE_TO_DTYPE: Dict[int, torch.dtype] = {c: d for d, c in _DTYPE_TO_CODE.items()}

# Waiting (no progress thread): poll, then sleep. A sleep lasts 60 us or more here whatever it asks for, and one
# that doubled to 1 ms made a 1 MiB transfer wait up to 1 ms past its completion; a sleep is now also at most a
# 16th of the wait so far, so it overshoots a long transfer by ~6 % at most. How long to poll depends on the
# machine (see rdt_transports/_spin.py): 1 ms while the run queue is short, 20 us when it is longer than twice the
# cores (both ends poll then, and each steals the CPU the other needs).
_WAIT_POLL_BUSY_S = 20e-6
_WAIT_MAX_SLEEP_S = 1e-3  # sleeps double from 20 us to this (and to at most a 16th of the wait so far)


def _same_node_pids(config: BackendConfig) -> Optional[Dict[int, Tuple[int, int]]]:
    """Every rank's (pid, start time) when all ranks run on this Ray node and each pid runs, with that start time,
    as seen from here (one pid namespace), else None. Each rank publishes its own through the rendezvous before
    the agent exists (its UCX mode depends on it); the start time tells a reused pid from the peer."""
    node = ray_node_id()
    rdv = config.rendezvous
    rdv.put(f"nixl/node/{config.rank}", f"{node}|{os.getpid()}|{start_time(os.getpid())}".encode())
    ranks: Dict[int, Tuple[str, int, str]] = {}
    for r in range(config.world_size):
        raw = rdv.get(f"nixl/node/{r}", config.timeout, what=f"rank {r}'s node").decode()
        peer_node, pid, start = (raw.split("|") + ["", ""])[:3]
        ranks[r] = (peer_node, int(pid), start)
    if not node or any(n != node or not st.isdigit() or str(start_time(p)) != st or not pid_alive(p)
                       for n, p, st in ranks.values()):
        return None
    return {r: (pid, int(st)) for r, (_, pid, st) in ranks.items()}


def _poll_window(now: float) -> float:
    """How long a wait polls before it sleeps."""
    return _spin.window(_WAIT_POLL_BUSY_S, now=now)


_PEER_WATCH_S = 0.05  # a wait on a same-node peer (no UCX error handling) checks its pid this often
_MAX_REMOTE_REGS_PER_PEER = 1024
# Prepared WRITE handles kept for reuse, keyed by both ends' buffers: a pipeline stage or a weight push sends from
# and into the same tensors every step, and building a handle (two descriptor lists, createXferReq, release) cost
# ~22 us of the sender's critical path here. A handle is reposted only once its last WRITE is DONE.
_XFER_CACHE_ENTRIES = 64
_FIRST_CONTACT_FLUSH_S = 0.05  # UCX wire-up on loopback took 1-4 ms
_DEFAULT_CACHE_BYTES = 4 << 30
_DEFAULT_CACHE_ENTRIES = 256


@dataclass(frozen=True)
class _Msg:
    """A parsed, authenticated control notification."""

    kind: int
    src: int
    dst: int
    tag: int
    nbytes: int
    dtype: int
    addr: int
    length: int
    devid: int
    memtype: int
    reg_id: int
    reg_base: int
    reg_len: int
    md: bytes


def _dtype_name(code: int) -> str:
    """Readable name of a dtype code, for error messages."""
    d = _CODE_TO_DTYPE.get(code)
    return str(d).replace("torch.", "") if d is not None else f"dtype#{code}"


def _import_nixl() -> Tuple[Any, Any]:
    """Import nixl_agent and nixl_agent_config from whichever NIXL wheel is installed."""
    errors = []
    for mod in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            m = __import__(mod, fromlist=["nixl_agent", "nixl_agent_config"])
            return m.nixl_agent, m.nixl_agent_config
        except ImportError as e:  # try the next flavour
            errors.append(f"{mod}: {e}")
    raise BackendUnavailableError(
        "the NIXL backend needs the NIXL Python package, which could not be imported (" + "; ".join(errors) + ")",
        op="init",
        hint="pip install nixl-cu13 (or nixl-cu12 to match a CUDA 12 torch)",
    )


# ---------------------------------------------------------------------------------------------- registrations
class _Registration:
    """One registered memory region (a whole tensor storage) and what is needed to reuse it safely."""

    __slots__ = ("key", "descs", "reg_id", "base", "length", "devid", "memtype", "weak", "inflight", "_md")

    def __init__(self, key: Tuple, descs: Any, reg_id: int, base: int, length: int, devid: int, memtype: int,
                 weak: Any) -> None:
        self.key = key
        self.descs = descs
        self.reg_id = reg_id
        self.base = base
        self.length = length
        self.devid = devid
        self.memtype = memtype
        self.weak = weak
        self.inflight = 0
        self._md: Optional[bytes] = None

    def expired(self) -> bool:
        """True when the storage this registration was made for has been freed."""
        return self.weak is not None and self.weak.expired()

    def partial_md(self, agent: Any) -> bytes:
        """NIXL partial metadata (remote key) of this registration, computed once."""
        if self._md is None:
            self._md = bytes(agent.get_partial_agent_metadata(self.descs, False))
        return self._md


def _storage_weakref(storage: torch.UntypedStorage) -> Any:
    """A weak reference to a storage (so the cache never keeps user memory alive), or None if unsupported."""
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(storage)
    except Exception:  # pragma: no cover - very old/new torch; then entries are only evicted by LRU
        return None


class _RegistrationCache:
    """Bounded LRU cache of NIXL memory registrations keyed by (device, storage address, storage size)."""

    def __init__(self, agent: Any, max_bytes: int, max_entries: int) -> None:
        self._agent = agent
        self._max_bytes = max_bytes
        self._max_entries = max_entries
        self._entries: "collections.OrderedDict[Tuple, _Registration]" = collections.OrderedDict()
        self._bytes = 0
        self._next_id = 1
        self.registrations = 0  # counters, for tests and diagnostics
        self.hits = 0
        self.on_drop: Optional[Any] = None  # called with an entry before it is deregistered (cached handles go)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def acquire(self, tensor: torch.Tensor) -> _Registration:
        """Registration covering ``tensor`` (registering its storage if needed), pinned until release()."""
        storage = tensor.untyped_storage()
        base, length = storage.data_ptr(), storage.nbytes()
        dev = tensor.device
        key = (dev.type, dev.index if dev.index is not None else -1, base, length)
        entry = self._entries.get(key)
        if entry is not None and entry.expired() and entry.inflight == 0:
            self._drop(entry)  # the address was freed and reused by another storage: re-register
            entry = None
        if entry is None:
            self._purge_expired()
            memtype = _MEM_VRAM if dev.type == "cuda" else _MEM_DRAM
            devid = tensor.get_device() if dev.type == "cuda" else 0
            descs = self._agent.get_reg_descs([(base, length, devid, "")], _MEM_NAMES[memtype])
            self._agent.register_memory(descs)
            entry = _Registration(key, descs, self._next_id, base, length, devid, memtype, _storage_weakref(storage))
            self._next_id += 1
            self.registrations += 1
            self._entries[key] = entry
            self._bytes += length
        else:
            self.hits += 1
            self._entries.move_to_end(key)
        entry.inflight += 1
        self._evict()
        return entry

    def release(self, entry: _Registration) -> None:
        """Unpin a registration; it stays cached unless the cache is over its caps."""
        entry.inflight = max(0, entry.inflight - 1)
        self._evict()

    def _purge_expired(self) -> None:
        """Deregister every idle entry whose storage died (its address may be reused by a new tensor)."""
        for entry in [e for e in self._entries.values() if e.inflight == 0 and e.expired()]:
            self._drop(entry)

    def _evict(self) -> None:
        """Deregister least-recently-used idle entries while over the byte or entry cap."""
        if self._bytes <= self._max_bytes and len(self._entries) <= self._max_entries:
            return
        for entry in list(self._entries.values()):
            if self._bytes <= self._max_bytes and len(self._entries) <= self._max_entries:
                break
            if entry.inflight == 0:
                self._drop(entry)

    def _drop(self, entry: _Registration) -> None:
        """Deregister one entry; errors are logged, never raised (the region is forgotten either way)."""
        self._entries.pop(entry.key, None)
        self._bytes -= entry.length
        if self.on_drop is not None:
            self.on_drop(entry)
        try:
            self._agent.deregister_memory(entry.descs)
        except Exception as e:  # pragma: no cover - defensive
            logger.warning("nixl: deregistering %#x+%d failed: %s", entry.base, entry.length, e)

    def clear(self) -> None:
        """Deregister everything (shutdown)."""
        for entry in list(self._entries.values()):
            self._drop(entry)


# ---------------------------------------------------------------------------------------------- work
_PENDING = "pending"
_DONE = "done"
_FAILED = "failed"


class _NixlWork(Work):
    """Handle of one posted send or recv; waiting drives the backend's progress engine."""

    def __init__(self, backend: "NixlBackend", op: str, peer: int, tag: int, tensor: torch.Tensor) -> None:
        self.backend = backend
        self.op = op
        self.peer = peer
        self.tag = tag
        self.tensor = tensor  # keeps the memory alive while the transfer may touch it
        self.nbytes = tensor.numel() * tensor.element_size()
        self.dtype_code = _DTYPE_TO_CODE.get(tensor.dtype, 255)
        self.state = _PENDING
        self.error: Optional[BaseException] = None
        self.posted = time.monotonic()
        self.flush_until = 0.0  # send: standalone notification sent; keep progressing until then (first contact)
        self.flush_error: Optional[BaseException] = None
        self.eager = False  # send: the data went inside an EAGER notification; the receiver's ACK completes it
        self.reg: Optional[_Registration] = None
        self.rtr: Optional[_Msg] = None  # send: the matching ready-to-receive
        self.xfer: Any = None  # send: the NIXL transfer handle while the WRITE runs
        self.xfer_key: Optional[Tuple] = None  # send: its key in the backend's handle cache (None: not cached)
        self.writing = False  # send: rdt's CMA copy into the receiver runs (it looks for a CANCEL between pieces)
        self.cancelled = False  # send: the receiver cancelled during that copy
        self.ack_cancel = False  # send: the receiver cancelled while the WRITE ran: answer when it ends
        self.landed = False  # recv, cancelled: the sender's DONE came after all (the data is whole)
        self.busy = False  # recv, cancelled: the sender said its WRITE runs (the ACK follows)
        self.phase = "waiting for the receiver's ready-to-receive" if op == "send" else "waiting for the data"

    def wait(self, timeout: float) -> None:
        """Block until done; raise the transfer's error, CollectiveTimeoutError or GroupDestroyedError."""
        self.backend._wait(self, timeout)

    def is_completed(self) -> bool:
        return self.state != _PENDING


# ---------------------------------------------------------------------------------------------- backend
class NixlBackend(Backend):
    """Point-to-point transport over NIXL (UCX): receiver-driven WRITE with authenticated notifications."""

    capabilities = Capabilities(
        name="nixl",
        devices=frozenset({"cpu", "cuda"}),
        two_sided=True,
        one_sided=True,
        native_collectives=frozenset(),
        can_abort=True,
        requires="nixl-cu13",
    )

    def __init__(self, config: BackendConfig, *, cache_bytes: Optional[int] = None,
                 cache_entries: int = _DEFAULT_CACHE_ENTRIES, progress_thread: Optional[bool] = None) -> None:
        super().__init__(config)
        nixl_agent, nixl_agent_config = _import_nixl()
        self._lock = threading.RLock()
        self._aborted = threading.Event()
        self._closed = False
        self._key = hmac.new(config.secret, b"rdt-nixl-v1|" + config.group_uid.encode(), hashlib.sha256).digest()
        self._names = [self._agent_name(r) for r in range(config.world_size)]
        self._rank_of = {n: r for r, n in enumerate(self._names)}
        self.stats: Dict[str, int] = collections.Counter()  # dropped_* counters, for diagnostics and tests
        if progress_thread is None:
            progress_thread = os.environ.get("RDT_NIXL_PROGRESS_THREAD", "0") == "1"
        same_node = _same_node_pids(config)
        self._peer_pids = {r: p for r, (p, _) in same_node.items()} if same_node else None  # every rank here
        self._peer_starts = {r: st for r, (_, st) in same_node.items()} if same_node else {}
        self._cma = (self._peer_pids is not None and _cma.WRITEV is not None and CMA_THREADS > 1
                     and os.environ.get("RDT_NIXL_CMA", "1") != "0")  # False for good once the kernel refuses
        self._cma_pool: Optional[ThreadPoolExecutor] = None
        self.ucx_error_mode = os.environ.get("RDT_NIXL_UCX_ERROR_MODE") or (
            "none" if self._peer_pids is not None else "peer")
        if self.ucx_error_mode not in ("none", "peer"):
            raise InvalidArgumentError(f"RDT_NIXL_UCX_ERROR_MODE={self.ucx_error_mode!r}", **self._ctx(op="init"),
                                       hint="set it to 'peer', 'none', or leave it unset (chosen per group)")
        try:
            self._agent = nixl_agent(self._names[config.rank], nixl_agent_config(enable_prog_thread=progress_thread,
                                                                                 backends=[]))
            self._agent.create_backend("UCX", {"ucx_error_handling_mode": self.ucx_error_mode})
        except Exception as e:
            raise BackendUnavailableError(
                f"could not create a NIXL agent with the UCX backend: {type(e).__name__}: {e}",
                group=config.group_name, rank=config.rank, op="init",
                hint="UCX needs an active-message transport such as tcp: do not restrict UCX_TLS to sm,self; on one "
                "host UCX_NET_DEVICES=lo is enough",
            ) from e
        if cache_bytes is None:
            cache_bytes = int(os.environ.get("RDT_NIXL_REG_CACHE_BYTES", _DEFAULT_CACHE_BYTES))
        self._cache = _RegistrationCache(self._agent, cache_bytes, cache_entries)
        self._cache.on_drop = self._forget_xfers_of_reg
        # (peer, local reg id, local addr, nbytes, remote reg id, remote addr, devid, memtype) -> [handle, busy]
        self._xfers: "collections.OrderedDict[Tuple, List[Any]]" = collections.OrderedDict()
        self._peer_md: Dict[int, bytes] = {}  # full metadata of loaded peers (from the GCS)
        self._remote_regs: Dict[int, Dict[int, Tuple[int, int]]] = {}  # peer -> reg_id -> (base, len) loaded
        self._inflight_to: Dict[int, int] = collections.Counter()  # peer -> WRITEs in flight
        self._wired: set = set()  # peers our UCX endpoint has completed a transfer/flush to (connection is up)
        self._sends: Dict[Tuple[int, int], _NixlWork] = {}  # (peer, tag) -> pending send
        self._recvs: Dict[Tuple[int, int], _NixlWork] = {}  # (peer, tag) -> pending recv
        self._mailbox: Dict[Tuple[int, int, int], _Msg] = {}  # (peer, kind, tag) -> unmatched message
        self._eager_out: Dict[int, int] = collections.Counter()  # peer -> EAGER sends awaiting their ACK
        self._eager_parked: Dict[int, int] = collections.Counter()  # peer -> EAGER messages parked in the mailbox
        # Receiver: cancelled receives the sender may still write into, held until it answers (see the protocol).
        self._cancelled: Dict[Tuple[int, int], _NixlWork] = {}
        self._cancelled_small: "collections.OrderedDict[Tuple[int, int], None]" = collections.OrderedDict()
        # Sender: CANCELs for sends not posted yet (such a send fails at once; a late RTR for it is dropped).
        self._peer_cancels: "collections.OrderedDict[Tuple[int, int], None]" = collections.OrderedDict()
        self._cancel_due = False  # abort() could not take the lock: the next holder cancels the pending receives
        self._reap_at = 0.0  # when progress() next checks that the senders of cancelled receives still live
        config.rendezvous.put(f"nixl/md/{config.rank}", bytes(self._agent.get_agent_metadata()))

    # ------------------------------------------------------------------ helpers
    def _agent_name(self, rank: int) -> str:
        """NIXL agent name of ``rank`` in this group incarnation."""
        return f"rdt-{self.config.group_uid}-r{rank}"

    def _ctx(self, peer: Optional[int] = None, op: Optional[str] = None) -> Dict[str, Any]:
        """Error context fields."""
        return {"group": self.config.group_name, "rank": self.config.rank, "peer": peer, "op": op}

    def _mac(self, data: bytes) -> bytes:
        """HMAC-SHA256 of a control message under the group key."""
        return hmac.new(self._key, data, hashlib.sha256).digest()

    def _pack(self, kind: int, peer: int, tag: int, nbytes: int, dtype: int, reg: Optional[_Registration] = None,
              addr: int = 0, length: int = 0, payload: bytes = b"", memtype: int = 0) -> bytes:
        """Build an authenticated control message addressed to ``peer`` (``payload``: an EAGER message's data)."""
        md = reg.partial_md(self._agent) if reg is not None else payload
        head = _HEADER.pack(
            _MAGIC, _VERSION, kind, self.config.rank, peer, tag, nbytes, dtype, addr, length,
            reg.devid if reg else 0, reg.memtype if reg else memtype, reg.reg_id if reg else 0,
            reg.base if reg else 0, reg.length if reg else 0, len(md),
        )
        body = head + md
        return body + self._mac(body)

    def _unpack(self, src_name: str, raw: bytes) -> Optional[_Msg]:
        """Parse and authenticate a notification; None (and a counted, debug-logged drop) if it is not valid."""
        src = self._rank_of.get(src_name if isinstance(src_name, str) else str(src_name))
        if src is None:
            return self._drop("unknown_agent", src_name, raw)
        raw = bytes(raw)
        if len(raw) < _HEADER.size + _MAC_LEN:
            return self._drop("malformed", src_name, raw)
        body, mac = raw[:-_MAC_LEN], raw[-_MAC_LEN:]
        if not hmac.compare_digest(self._mac(body), mac):
            return self._drop("bad_mac", src_name, raw)
        f = _HEADER.unpack_from(body)
        msg = _Msg(*f[2:15], md=body[_HEADER.size:])
        magic, version, md_len = f[0], f[1], f[15]
        ok = (
            magic == _MAGIC and version == _VERSION and msg.kind in _KINDS and msg.src == src
            and msg.dst == self.config.rank and msg.tag < (1 << 31) and md_len == len(msg.md) <= _MAX_MD_LEN
        )
        if ok and msg.kind == _KIND_RTR and msg.memtype == _MEM_NONE:
            ok = md_len == 0 and msg.nbytes <= EAGER_MAX_BYTES and msg.dtype in _CODE_TO_DTYPE
        elif ok and msg.kind == _KIND_RTR:
            ok = (
                msg.length == msg.nbytes and msg.memtype in _MEM_NAMES and msg.dtype in _CODE_TO_DTYPE
                and (msg.nbytes == 0 or (md_len > 0 and msg.reg_base <= msg.addr
                                         and msg.addr + msg.length <= msg.reg_base + msg.reg_len))
            )
        elif ok and msg.kind == _KIND_EAGER:
            ok = md_len == msg.nbytes <= EAGER_MAX_BYTES
        if not ok:
            return self._drop("malformed", src_name, raw)
        return msg

    def _drop(self, why: str, src: Any, raw: bytes) -> None:
        """Count and debug-log a dropped notification."""
        self.stats[f"dropped_{why}"] += 1
        logger.debug("nixl[%s rank %d]: dropped %s notification (%d bytes) from %r",
                     self.config.group_name, self.config.rank, why, len(raw), src)
        return None

    def _ensure_peer(self, peer: int, op: str) -> None:
        """Load the peer's agent metadata from the rendezvous the first time we talk to it."""
        if peer in self._peer_md:
            return
        try:
            md = self.config.rendezvous.get(f"nixl/md/{peer}", self.config.timeout, what=f"NIXL metadata of rank {peer}")
        except CollectiveTimeoutError as e:
            raise PeerUnavailableError(
                f"rank {peer} never published its NIXL metadata within {self.config.timeout:.1f}s",
                **self._ctx(peer, op), hint="make sure every rank creates the group with the nixl backend",
            ) from e
        with self._lock:
            if peer in self._peer_md or self._closed:
                return
            name = self._agent.add_remote_agent(md)
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != self._names[peer]:
                raise PeerUnavailableError(
                    f"metadata published for rank {peer} belongs to agent {name!r}, expected {self._names[peer]!r}",
                    **self._ctx(peer, op), hint="destroy and re-create the group",
                )
            self._peer_md[peer] = md
            self._remote_regs[peer] = {}

    def _check_open(self, op: str, peer: int) -> None:
        """Refuse new operations after abort or shutdown."""
        if self._aborted.is_set() or self._closed:
            raise GroupDestroyedError("the NIXL backend was aborted or shut down", **self._ctx(peer, op),
                                      hint="destroy and re-create the group")

    @staticmethod
    def _sync_cuda(tensor: torch.Tensor) -> None:
        """Wait for queued kernels on the tensor's current stream (NIXL reads/writes the memory directly)."""
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()

    # ------------------------------------------------------------------ posting
    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        """Post a send: small ones go at once inside a notification (EAGER), others as a WRITE once the receiver's
        ready-to-receive for ``tag`` arrives."""
        self._check_open("send", peer)
        self._ensure_peer(peer, "send")
        self._sync_cuda(tensor)
        work = _NixlWork(self, "send", peer, tag, tensor)
        with self._lock:
            self._check_open("send", peer)
            if (peer, tag) in self._sends:
                raise CommunicationError(f"a send with tag {tag} to rank {peer} is already pending",
                                         **self._ctx(peer, "send"), hint="tags must be unique per (src, dst) pair")
            self._drain()  # a CANCEL that has arrived is seen before anything is sent
            if (peer, tag) in self._peer_cancels:
                del self._peer_cancels[(peer, tag)]
                self._finish(work, self._cancelled_error(work))
                return work
            self._sends[(peer, tag)] = work
            rtr = self._mailbox.pop((peer, _KIND_RTR, tag), None)
            if rtr is not None:
                work.rtr = rtr
                self._try_start_send(work)
            elif 0 < work.nbytes <= EAGER_MAX_BYTES and self._eager_out[peer] < EAGER_WINDOW:
                self._send_eager(work)
        return work

    def _send_eager(self, work: _NixlWork) -> None:
        """Send a small message's data inside one authenticated notification; done at the receiver's ACK."""
        data = work.tensor.detach().reshape(-1).view(torch.uint8)
        payload = (data.cpu() if data.is_cuda else data).numpy().tobytes()
        work.eager = True
        work.phase = "waiting for the receiver to take the data"
        self._eager_out[work.peer] += 1
        try:
            self._agent.send_notif(self._names[work.peer], self._pack(_KIND_EAGER, work.peer, work.tag, work.nbytes,
                                                                        work.dtype_code, payload=payload))
        except Exception as e:
            self._finish(work, PeerUnavailableError(
                f"could not send the data of tag {work.tag}: {type(e).__name__}: {e}", **self._ctx(work.peer, "send"),
                hint="the peer's process may have died; re-create the group"))

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        """Post a receive: register the buffer and tell the sender where to write it (small ones: take the EAGER
        data, and send an RTR without a registration, which also returns the sender's EAGER credit)."""
        self._check_open("recv", peer)
        self._ensure_peer(peer, "recv")
        self._sync_cuda(tensor)
        work = _NixlWork(self, "recv", peer, tag, tensor)
        with self._lock:
            self._check_open("recv", peer)
            if (peer, tag) in self._recvs or (peer, tag) in self._cancelled:
                raise CommunicationError(f"a recv with tag {tag} from rank {peer} is already pending",
                                         **self._ctx(peer, "recv"), hint="tags must be unique per (src, dst) pair")
            if len(self._cancelled) >= MAX_CANCELLED:
                raise CommunicationError(
                    f"{len(self._cancelled)} cancelled receives still wait for their sender's answer (at most "
                    f"{MAX_CANCELLED}), each holding its tensor: rank(s) {sorted({p for p, _ in self._cancelled})} "
                    "do not progress", **self._ctx(peer, "recv"),
                    hint="destroy and re-create the group; raise the timeout if the peers were only slow")
            self._cancelled_small.pop((peer, tag), None)
            if 0 < work.nbytes <= EAGER_MAX_BYTES:
                msg = self._pack(_KIND_RTR, peer, tag, work.nbytes, work.dtype_code, memtype=_MEM_NONE)
            elif work.nbytes:
                work.reg = self._cache.acquire(tensor)
                msg = self._pack(_KIND_RTR, peer, tag, work.nbytes, work.dtype_code, work.reg,
                                 tensor.data_ptr(), work.nbytes)
            else:
                msg = self._pack(_KIND_RTR, peer, tag, 0, work.dtype_code)
            self._recvs[(peer, tag)] = work
            eager = self._mailbox.pop((peer, _KIND_EAGER, tag), None)
            if eager is not None:
                self._eager_parked[peer] -= 1
                self._deliver_eager(work, eager)
            try:
                self._agent.send_notif(self._names[peer], msg)
            except Exception as e:
                self._finish(work, PeerUnavailableError(
                    f"could not send ready-to-receive for tag {tag}: {type(e).__name__}: {e}",
                    **self._ctx(peer, "recv"), hint="the peer's process may have died; re-create the group"))
        return work

    # ------------------------------------------------------------------ progress
    def progress(self) -> None:
        """Drain notifications into mailboxes/pending works and advance running transfers (thread-safe)."""
        with self._lock:
            if self._closed:
                return
            self._drain()
            if self._cancel_due or self._cancelled:
                self._tend_cancels()
            for work in list(self._sends.values()):
                if work.state != _PENDING or work.eager:  # an EAGER send only waits for its ACK
                    continue
                if work.flush_until:
                    if time.monotonic() >= work.flush_until:
                        self._wired.add(work.peer)
                        self._finish(work, work.flush_error)
                elif work.xfer is not None:
                    self._poll_xfer(work)
                elif work.rtr is not None:
                    self._try_start_send(work)

    def _drain(self) -> None:
        """Read every notification that has arrived and route it (lock held). Writes start only after one."""
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as e:  # pragma: no cover - defensive
            logger.debug("nixl: get_new_notifs failed: %s", e)
            return
        for name, msgs in notifs.items():
            for raw in msgs:
                msg = self._unpack(name, raw)
                if msg is not None:
                    self._dispatch(msg)

    def _dispatch(self, msg: _Msg) -> None:
        """Route one authenticated message to the operation waiting for it, or park it in the mailbox."""
        key = (msg.src, msg.tag)
        if msg.kind == _KIND_CANCEL:  # about one of our sends
            self._on_cancel(msg)
            return
        if msg.kind in _TO_RECEIVER and (msg.kind > _KIND_CANCEL or key in self._cancelled
                                         or key in self._cancelled_small):
            self._on_cancelled_recv_msg(msg)  # about one of our receives that was cancelled
            return
        if msg.kind in (_KIND_EAGER_ACK, _KIND_EAGER_NACK):
            work = self._sends.get(key)
            if work is None or not work.eager or work.state != _PENDING:
                self.stats["dropped_unexpected"] += 1
                return
            self._wired.add(msg.src)
            self._finish(work, None if msg.kind == _KIND_EAGER_ACK else TensorMismatchError(
                f"send of {work.nbytes} bytes ({_dtype_name(work.dtype_code)}) was refused by rank {msg.src}, which "
                f"receives into {msg.nbytes} bytes ({_dtype_name(msg.dtype)}) (tag {msg.tag})",
                **self._ctx(msg.src, "send"), hint="post tensors of the same dtype and number of elements on both sides"))
            return
        if msg.kind == _KIND_EAGER:
            work = self._recvs.get(key)
            if work is not None and work.state == _PENDING:
                self._deliver_eager(work, msg)
            elif (msg.src, _KIND_EAGER, msg.tag) in self._mailbox or self._eager_parked[msg.src] >= 2 * EAGER_WINDOW:
                self.stats["dropped_eager"] += 1
            else:
                self._mailbox[(msg.src, _KIND_EAGER, msg.tag)] = msg
                self._eager_parked[msg.src] += 1
            return
        if msg.kind == _KIND_RTR:
            work = self._sends.get(key)
            if work is not None and work.eager:  # the data went EAGER already; the ACK completes the send
                return
            if key in self._peer_cancels:  # cancelled before it came (never so on one UCX endpoint): never written
                self.stats["dropped_cancelled"] += 1
            elif work is not None and work.rtr is None and work.state == _PENDING:
                work.rtr = msg  # started by progress() once every notification that arrived has been read
            elif (msg.src, _KIND_RTR, msg.tag) in self._mailbox or work is not None:
                self.stats["dropped_duplicate"] += 1
            else:
                self._mailbox[(msg.src, _KIND_RTR, msg.tag)] = msg
            return
        work = self._recvs.get(key)
        if work is None or work.state != _PENDING:
            self.stats["dropped_unexpected"] += 1  # DONE/NACK can only follow our RTR
            return
        if msg.kind == _KIND_DONE:
            if msg.nbytes != work.nbytes:
                self._finish(work, TensorMismatchError(
                    f"recv of {work.nbytes} bytes got a completion for {msg.nbytes} bytes (tag {msg.tag})",
                    **self._ctx(msg.src, "recv"), hint="post matching sizes on both sides"))
            else:
                self._finish(work, None)
        else:
            self._finish(work, TensorMismatchError(
                f"recv of {work.nbytes} bytes ({_dtype_name(work.dtype_code)}) does not match the send posted by "
                f"rank {msg.src}: {msg.nbytes} bytes ({_dtype_name(msg.dtype)}) (tag {msg.tag})",
                **self._ctx(msg.src, "recv"), hint="post tensors of the same dtype and number of elements on both sides"))

    def _deliver_eager(self, work: _NixlWork, msg: _Msg) -> None:
        """Complete a receive with an EAGER message's data and ACK it, or refuse it (NACK: the send fails too)."""
        ok = msg.nbytes == work.nbytes and msg.dtype == work.dtype_code
        try:
            self._agent.send_notif(self._names[msg.src], self._pack(
                _KIND_EAGER_ACK if ok else _KIND_EAGER_NACK, msg.src, msg.tag, work.nbytes, work.dtype_code))
        except Exception as e:  # the sender then times out, naming the peer
            logger.debug("nixl: EAGER answer to rank %d failed: %s", msg.src, e)
        if not ok:
            self._finish(work, TensorMismatchError(
                f"recv of {work.nbytes} bytes ({_dtype_name(work.dtype_code)}) does not match the send posted by "
                f"rank {msg.src}: {msg.nbytes} bytes ({_dtype_name(msg.dtype)}) (tag {msg.tag}); the receive tensor "
                "was left untouched", **self._ctx(msg.src, "recv"),
                hint="post tensors of the same dtype and number of elements on both sides"))
            return
        data = torch.frombuffer(bytearray(msg.md), dtype=torch.uint8)
        work.tensor.detach().reshape(-1).view(torch.uint8).copy_(data)
        self._finish(work, None)

    # ------------------------------------------------------------------ cancels
    def _cancelled_error(self, work: _NixlWork, detail: str = "nothing was sent") -> CommunicationError:
        """The error of a send whose receiver cancelled its receive."""
        return CommunicationError(
            f"rank {work.peer} cancelled its receive of tag {work.tag} ({work.nbytes} bytes): it ended without the "
            f"data (timed out, aborted, or its group was destroyed); {detail}", **self._ctx(work.peer, "send"),
            hint=f"see the error on rank {work.peer}; raise the timeout there, or destroy and re-create the group")

    def _notify(self, peer: int, kind: int, tag: int, nbytes: int = 0, dtype: int = 0) -> None:
        """Send a control message with no data; a failure is only logged (the peer is gone or going)."""
        try:
            self._agent.send_notif(self._names[peer], self._pack(kind, peer, tag, nbytes, dtype))
        except Exception as e:  # noqa: BLE001 - the peer's own wait reports its state
            logger.debug("nixl: notification %d for tag %d to rank %d failed: %s", kind, tag, peer, e)

    @staticmethod
    def _remember(table: "collections.OrderedDict[Tuple[int, int], None]", key: Tuple[int, int]) -> None:
        """Add ``key`` to a bounded record, forgetting the oldest past _CANCEL_RECORDS."""
        table[key] = None
        while len(table) > _CANCEL_RECORDS:
            table.popitem(last=False)

    def _on_cancel(self, msg: _Msg) -> None:
        """The receiver gave up tag ``msg.tag``: write nothing more for it, and answer once nothing can land."""
        key = (msg.src, msg.tag)
        self._mailbox.pop((msg.src, _KIND_RTR, msg.tag), None)
        work = self._sends.get(key)
        if work is None:  # not posted yet (or over): a send posted later fails at once
            self._remember(self._peer_cancels, key)
        elif work.writing:  # our CMA copy runs (we read this between its pieces): it stops and answers
            work.cancelled = True
            return
        elif work.xfer is not None:  # the WRITE runs: its bytes may still land; answer when it ends
            work.ack_cancel = True
            self._notify(msg.src, _KIND_CANCEL_BUSY, msg.tag)
            return
        elif not work.flush_until:  # not started (or EAGER, which the receiver drops): fails now
            self._finish(work, self._cancelled_error(work))
        self._notify(msg.src, _KIND_CANCEL_ACK, msg.tag)

    def _on_cancelled_recv_msg(self, msg: _Msg) -> None:
        """A message about a receive we cancelled: the sender's answer settles it; its data is dropped."""
        key = (msg.src, msg.tag)
        work = self._cancelled.get(key)
        if msg.kind == _KIND_CANCEL_ACK:
            if work is not None:
                self._settle(key)
            elif key in self._cancelled_small:
                del self._cancelled_small[key]
            else:
                self.stats["dropped_unexpected"] += 1
        elif msg.kind == _KIND_CANCEL_BUSY and work is not None:
            work.busy = True
        elif msg.kind == _KIND_DONE and work is not None and msg.nbytes == work.nbytes:
            work.landed = True  # the WRITE ended before the sender saw the CANCEL: the data is whole
        else:
            self.stats["dropped_cancelled"] += 1  # an EAGER message (never copied in), a NACK

    def _cancel_recv(self, work: _NixlWork, error: BaseException) -> None:
        """End a pending receive without its data: send CANCEL; while the sender may write into its buffer (a
        registered RTR went out), keep the tensor and registration pinned until the sender answers, dies or the
        backend shuts down (lock held)."""
        if work.state != _PENDING:
            return
        key = (work.peer, work.tag)
        if self._recvs.get(key) is work:
            del self._recvs[key]
        work.state, work.error = _FAILED, error
        if work.reg is not None:
            self._cancelled[key] = work
        else:  # only our own EAGER copy could fill it, and that needs the receive to be pending
            self._remember(self._cancelled_small, key)
            work.tensor = None  # type: ignore[assignment]
        self._notify(work.peer, _KIND_CANCEL, work.tag, work.nbytes, work.dtype_code)

    def _settle(self, key: Tuple[int, int]) -> None:
        """The sender of a cancelled receive answered (or died, or we shut down): release its tensor."""
        work = self._cancelled.pop(key)
        if work.reg is not None:
            self._cache.release(work.reg)
            work.reg = None
        work.tensor = None  # type: ignore[assignment]

    def _tend_cancels(self) -> None:
        """After abort(): cancel every pending receive and fail sends not writing yet. Every _PEER_WATCH_S: settle
        cancelled receives whose same-node sender died (lock held)."""
        if self._cancel_due:
            self._cancel_due = False
            err = GroupDestroyedError("the NIXL backend was aborted", group=self.config.group_name,
                                      rank=self.config.rank, hint="destroy and re-create the group")
            for work in list(self._recvs.values()):
                self._cancel_recv(work, err)
            for work in list(self._sends.values()):
                if work.xfer is None and not work.writing and not work.flush_until:
                    self._finish(work, err)
        now = time.monotonic()
        if self._cancelled and self._peer_pids is not None and now >= self._reap_at:
            self._reap_at = now + _PEER_WATCH_S
            for key in [k for k in self._cancelled if not self._peer_lives(k[0])]:
                self._settle(key)

    def _peer_lives(self, peer: int) -> bool:
        """Whether a same-node peer's process (the one that joined: same start time) still runs."""
        assert self._peer_pids is not None
        pid = self._peer_pids[peer]
        return pid_alive(pid) and start_time(pid) == self._peer_starts.get(peer)

    def _try_start_send(self, work: _NixlWork) -> None:
        """Validate the matched RTR and post the WRITE (or defer it while a remote-metadata reset must wait)."""
        rtr = work.rtr
        assert rtr is not None
        peer = work.peer
        if self._aborted.is_set():  # nothing starts writing after abort() (progress may still run for cancels)
            self._finish(work, GroupDestroyedError(f"send of tag {work.tag} was aborted before it started",
                                                   **self._ctx(peer, "send"), hint="destroy and re-create the group"))
            return
        if rtr.nbytes != work.nbytes or rtr.dtype != work.dtype_code:
            err = TensorMismatchError(
                f"send of {work.nbytes} bytes ({_dtype_name(work.dtype_code)}) does not match the recv posted by "
                f"rank {peer}: {rtr.nbytes} bytes ({_dtype_name(rtr.dtype)}) (tag {work.tag})",
                **self._ctx(peer, "send"), hint="post tensors of the same dtype and number of elements on both sides")
            try:
                self._agent.send_notif(self._names[peer], self._pack(_KIND_NACK, peer, work.tag, work.nbytes,
                                                                       work.dtype_code))
            except Exception as e:  # the receiver then times out instead
                logger.debug("nixl: NACK to rank %d failed: %s", peer, e)
                self._finish(work, err)
                return
            self._finish_after_notif(work, err)
            return
        if rtr.memtype == _MEM_NONE:  # the receiver takes small messages only as EAGER
            self._send_eager(work)
            return
        done = self._pack(_KIND_DONE, peer, work.tag, work.nbytes, work.dtype_code)
        if self._cma_path(work.nbytes) and rtr.memtype == _MEM_DRAM and work.tensor.is_cpu and self._write_cma(
                work, rtr, done):
            return
        try:
            if work.nbytes == 0:
                self._agent.send_notif(self._names[peer], done)
                self._finish_after_notif(work, None)
                return
            if not self._load_remote_reg(peer, rtr):
                return  # retried by progress() once the transfers to this peer have drained
            work.reg = self._cache.acquire(work.tensor)
            work.xfer = self._write_handle(work, rtr, done)
            self._inflight_to[peer] += 1
            work.phase = "waiting for the WRITE to complete"
            state = self._agent.transfer(work.xfer, done)
        except Exception as e:
            self._finish(work, PeerUnavailableError(
                f"could not start the WRITE of tag {work.tag}: {type(e).__name__}: {e}",
                **self._ctx(peer, "send"), hint="the peer may have died or shut down; re-create the group"))
            return
        if state == "ERR":
            self._finish(work, PeerUnavailableError(f"NIXL failed to post the WRITE of tag {work.tag}",
                                                    **self._ctx(peer, "send"), hint="re-create the group"))
        elif state == "DONE":
            self._wired.add(peer)
            self._finish(work, None)

    def _cma_path(self, nbytes: int) -> bool:
        """Whether a CPU send of ``nbytes`` to a same-node peer goes by rdt's multi-threaded CMA write."""
        return self._cma and nbytes >= CMA_MIN_BYTES

    def _write_cma(self, work: _NixlWork, rtr: _Msg, done: bytes) -> bool:
        """Copy the data into the receiver's tensor (the address its authenticated RTR gave) with process_vm_writev
        on CMA_THREADS threads, then send DONE. False (nothing else done) when the kernel refuses: use the WRITE."""
        assert self._peer_pids is not None
        pid = self._peer_pids[work.peer]
        if start_time(pid) != self._peer_starts.get(work.peer):  # never write into a process that reuses its pid
            self._finish(work, PeerUnavailableError(
                f"rank {work.peer}'s process (pid {pid}) is gone: tag {work.tag} was not sent",
                **self._ctx(work.peer, "send"), hint="the peer died; re-create the group with live members"))
            return True
        if self._cma_pool is None:
            self._cma_pool = ThreadPoolExecutor(CMA_THREADS - 1, thread_name_prefix="rdt-nixl-cma")
        work.phase = "copying into the receiver's tensor (process_vm_writev)"
        try:
            copied = self._cma_pieces(work, pid, rtr.addr)
        except _cma.CmaDenied as e:
            self._cma = False
            logger.info("nixl: group=%s rank=%d: no same-node CMA writes (%s); NIXL WRITEs instead",
                        self.config.group_name, self.config.rank, e)
            return False
        except _cma.CmaError as e:
            self._finish(work, PeerUnavailableError(
                f"could not copy the data of tag {work.tag} into rank {work.peer}'s tensor: {e}",
                **self._ctx(work.peer, "send"), hint="the peer may have died or shut down; re-create the group"))
            return True
        if work.cancelled:  # the receiver gave up during the copy: stop, and say so
            self._finish(work, self._cancelled_error(work, f"the copy stopped after {copied} bytes"))
            self._notify(work.peer, _KIND_CANCEL_ACK, work.tag)
            return True
        self.stats["cma_writes"] += 1
        try:
            self._agent.send_notif(self._names[work.peer], done)
        except Exception as e:
            self._finish(work, PeerUnavailableError(
                f"could not send the completion of tag {work.tag}: {type(e).__name__}: {e}",
                **self._ctx(work.peer, "send"), hint="the peer's process may have died; re-create the group"))
            return True
        self._finish_after_notif(work, None)
        return True

    def _cma_pieces(self, work: _NixlWork, pid: int, remote: int) -> int:
        """Copy ``work``'s bytes to ``remote`` in ``pid`` in _CMA_PIECE pieces, reading notifications between them;
        stop early when the receiver cancels. Returns the bytes copied."""
        local, n, done = work.tensor.data_ptr(), work.nbytes, 0
        work.writing = True
        try:
            while done < n and not work.cancelled:
                k = min(_CMA_PIECE, n - done)
                _cma.spread([(local + done, remote + done, k)], lambda part: _cma.batched(_cma.WRITEV, pid, part),
                            CMA_THREADS, self._cma_pool)
                done += k
                if done < n:
                    self._drain()
        finally:
            work.writing = False
        return done

    def _write_handle(self, work: _NixlWork, rtr: _Msg, done: bytes) -> Any:
        """A WRITE handle from ``work``'s tensor into the receiver's buffer: a cached idle one, else a new one
        (cached while there is room)."""
        assert work.reg is not None
        key = (work.peer, work.reg.reg_id, work.tensor.data_ptr(), work.nbytes, rtr.reg_id, rtr.addr, rtr.devid,
               rtr.memtype)
        entry = self._xfers.get(key)
        if entry is not None and not entry[1]:
            entry[1] = True
            self._xfers.move_to_end(key)
            work.xfer_key = key
            self.stats["write_handles_reused"] += 1
            return entry[0]
        local = self._agent.get_xfer_descs([(work.tensor.data_ptr(), work.nbytes, work.reg.devid)],
                                           _MEM_NAMES[work.reg.memtype])
        remote = self._agent.get_xfer_descs([(rtr.addr, rtr.length, rtr.devid)], _MEM_NAMES[rtr.memtype])
        handle = self._agent.initialize_xfer("WRITE", local, remote, self._names[work.peer], done)
        self.stats["write_handles_made"] += 1
        if entry is None:
            self._trim_xfers(_XFER_CACHE_ENTRIES - 1)
            if len(self._xfers) < _XFER_CACHE_ENTRIES:
                self._xfers[key] = [handle, True]
                work.xfer_key = key
        return handle

    def _trim_xfers(self, keep: int) -> None:
        """Release least recently used idle cached handles until at most ``keep`` remain (busy ones stay)."""
        for key in list(self._xfers):
            if len(self._xfers) <= keep:
                return
            if not self._xfers[key][1]:
                self._release_handle(self._xfers.pop(key)[0])

    def _forget_xfers(self, match: Any) -> None:
        """Release the cached handles whose key ``match`` accepts (they must be idle: callers ensure it)."""
        for key in [k for k in self._xfers if match(k)]:
            handle, busy = self._xfers.pop(key)
            if busy:  # pragma: no cover - a registration in use is never dropped, a peer never reset mid-WRITE
                logger.warning("nixl: dropping a cached WRITE handle that is still in use (tag key %s)", key)
            self._release_handle(handle)

    def _forget_xfers_of_reg(self, entry: "_Registration") -> None:
        """The local registration ``entry`` is about to go: its cached handles go first."""
        self._forget_xfers(lambda k: k[1] == entry.reg_id)

    @staticmethod
    def _release_handle(handle: Any) -> None:
        """Release a NIXL transfer handle (cancelling it if still running); never raises."""
        try:
            handle.release()
        except Exception as e:  # noqa: BLE001 - release is best effort
            logger.debug("nixl: releasing a transfer handle failed: %s", e)

    def _finish_after_notif(self, work: _NixlWork, error: Optional[BaseException]) -> None:
        """Complete a send that ended with a standalone notification, after a short flush on first contact.

        Without a progress thread UCX only wires up a new endpoint while this process progresses, so a
        notification sent to a peer we never transferred to could otherwise sit unsent after the work returns.
        """
        if work.peer in self._wired:
            self._finish(work, error)
            return
        work.flush_until = time.monotonic() + _FIRST_CONTACT_FLUSH_S
        work.flush_error = error
        work.phase = "flushing a notification to a new peer"

    def _load_remote_reg(self, peer: int, rtr: _Msg) -> bool:
        """Make the receiver's registration usable for WRITEs; False if that must wait for in-flight WRITEs."""
        regs = self._remote_regs[peer]
        if rtr.reg_id in regs:
            return True
        end = rtr.reg_base + rtr.reg_len
        stale = any(b < end and rtr.reg_base < b + n for b, n in regs.values())
        if stale or len(regs) >= _MAX_REMOTE_REGS_PER_PEER:
            if self._inflight_to[peer]:
                return False
            # Forget every remote key of this peer (some are stale): reload its connection metadata from scratch.
            self._forget_xfers(lambda k: k[0] == peer)
            self._agent.remove_remote_agent(self._names[peer])
            self._agent.add_remote_agent(self._peer_md[peer])
            regs.clear()
        name = self._agent.add_remote_agent(rtr.md)
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != self._names[peer]:
            raise PeerUnavailableError(f"registration metadata from rank {peer} names agent {name!r}",
                                       **self._ctx(peer, "send"))
        regs[rtr.reg_id] = (rtr.reg_base, rtr.reg_len)
        return True

    def _poll_xfer(self, work: _NixlWork) -> None:
        """Check a running WRITE."""
        try:
            state = self._agent.check_xfer_state(work.xfer)
        except Exception as e:
            state = f"ERR ({type(e).__name__}: {e})"
        if state == "DONE":
            self._wired.add(work.peer)
            self._finish(work, None)
        elif state != "PROC":
            self._finish(work, PeerUnavailableError(
                f"NIXL reported an error for the WRITE of tag {work.tag} ({state})",
                **self._ctx(work.peer, "send"), hint="the peer died or disconnected; re-create the group"))

    def _finish(self, work: _NixlWork, error: Optional[BaseException]) -> None:
        """Complete a work: release its transfer handle and registration pin, drop it from the pending tables."""
        if work.state != _PENDING:
            return
        if work.xfer is not None:
            self._inflight_to[work.peer] -= 1
            self._release_xfer(work, ok=error is None)  # a WRITE ends without error only once NIXL says DONE
        if work.ack_cancel:  # the receiver cancelled while the WRITE ran: it has ended now
            self._notify(work.peer, _KIND_CANCEL_ACK, work.tag)
        if work.eager:
            self._eager_out[work.peer] -= 1
        if work.reg is not None:
            self._cache.release(work.reg)
            work.reg = None
        table = self._sends if work.op == "send" else self._recvs
        if table.get((work.peer, work.tag)) is work:
            del table[(work.peer, work.tag)]
        work.error = error
        work.state = _DONE if error is None else _FAILED
        work.tensor = None  # type: ignore[assignment]

    def _release_xfer(self, work: _NixlWork, ok: bool = False) -> None:
        """Give back a work's transfer handle: to the cache, idle, after a WRITE that completed (``ok``); else
        release it (cancelling it if still running) and drop it from the cache. Never raises."""
        key, work.xfer_key = work.xfer_key, None
        entry = self._xfers.get(key) if key is not None else None
        if entry is not None and entry[0] is work.xfer:
            if ok:
                entry[1] = False
                work.xfer = None
                return
            del self._xfers[key]
        self._release_handle(work.xfer)
        work.xfer = None

    # ------------------------------------------------------------------ waiting
    def _wait(self, work: _NixlWork, timeout: float) -> None:
        """Drive progress until ``work`` completes: poll (1 ms, or 20 us on a busy machine; not at all for a
        large same-node receive), then sleeps backing off from 20 us to 1 ms but never past a 16th of the wait so
        far (a long wait costs little CPU; none overshoots by much)."""
        start = time.monotonic()
        deadline = start + timeout
        # A receive of CMA_MIN_BYTES or more from this node is copied by the sender on CMA_THREADS threads: polling
        # here would take a core from that copy, so it sleeps from the start (16 MiB back to back, interleaved runs
        # on 2 cores: 2.9 -> 1.9 ms; 128 MiB 14.6 -> 13.6 ms).
        poll = 0.0 if work.op == "recv" and work.nbytes >= CMA_MIN_BYTES and self._cma else _poll_window(start)
        delay = 20e-6
        pid = self._peer_pids.get(work.peer) if self._peer_pids is not None and self.ucx_error_mode == "none" \
            else None
        watch = start + _PEER_WATCH_S
        while True:
            if work.state == _PENDING and not self._aborted.is_set():
                self.progress()
            if work.state == _DONE:
                return
            if work.state == _FAILED:
                assert work.error is not None
                self._await_answer(work, timeout)  # a receive abort() cancelled: its sender's answer first
                raise work.error
            if self._aborted.is_set():
                err: BaseException = GroupDestroyedError(
                    f"{work.op} of tag {work.tag} was aborted", **self._ctx(work.peer, work.op),
                    hint="destroy and re-create the group")
                self._give_up(work, err, timeout, complete=False)
                raise work.error if work.error is not None else err
            now = time.monotonic()
            if pid is not None and now >= watch:  # no UCX error handling here: the peer's process tells its death
                watch = now + _PEER_WATCH_S
                if not process_alive(pid, self._peer_starts.get(work.peer)):  # a reused pid is not the peer
                    err = PeerUnavailableError(
                        f"rank {work.peer} (pid {pid}, this node) died during {work.op} of tag {work.tag}: "
                        f"{work.phase}", **self._ctx(work.peer, work.op),
                        hint="destroy the group and re-form it with a replacement for the dead rank")
                    with self._lock:
                        self._finish(work, err)
                    raise err
            if now >= deadline:
                err = CollectiveTimeoutError(
                    f"{work.op} of tag {work.tag} ({work.nbytes} bytes) did not complete: {work.phase} for "
                    f"{now - start:.2f}s (timeout {timeout:.2f}s)",
                    **self._ctx(work.peer, work.op),
                    hint=f"check that rank {work.peer} posts the matching "
                    f"{'recv' if work.op == 'send' else 'send'} and is alive, or raise the timeout",
                )
                if self._give_up(work, err, timeout):
                    return
                raise work.error if work.error is not None else err
            waited = now - start
            if waited >= poll:
                time.sleep(min(delay, waited / 16, max(deadline - now, 0.0)))
                delay = min(delay * 2, _WAIT_MAX_SLEEP_S)

    def _give_up(self, work: _NixlWork, err: BaseException, timeout: float, complete: bool = True) -> bool:
        """End a wait that failed with ``err``. A send that has not started writing is withdrawn (it must never
        read the caller's tensor later); a receive is cancelled (see the protocol) and waits for its sender's
        answer (:meth:`_await_answer`). True when the data arrived meanwhile and ``complete``: the receive then
        completes after all; otherwise the work has failed (with ``err``, or an error that arrived first)."""
        with self._lock:
            if work.state == _PENDING and not self._closed:
                self._drain()  # an answer that has arrived decides first
            if work.state != _PENDING:
                return work.state == _DONE
            if work.op == "send":
                if work.xfer is None and not work.flush_until and not work.eager:
                    self._finish(work, err)
                return False
            self._cancel_recv(work, err)
        if self._await_answer(work, timeout) and complete:
            work.state, work.error = _DONE, None
            return True
        return False

    def _await_answer(self, work: _NixlWork, timeout: float) -> bool:
        """Wait up to _CANCEL_GRACE_S for the answer to a cancelled receive, as long as ``timeout`` again while the
        sender says its WRITE runs; True when its DONE came (the data is whole)."""
        key = (work.peer, work.tag)
        end = time.monotonic() + _CANCEL_GRACE_S
        extended = False
        while self._cancelled.get(key) is work and not self._closed:
            now = time.monotonic()
            if work.busy and not extended:
                end, extended = now + timeout, True
            if now >= end:
                break
            self.progress()
            time.sleep(0.001)
        return work.landed

    def transports(self) -> str:
        """What carries this group's traffic, for labels: 'shm/cma' when the agent runs without UCX error handling
        (same node: UCX takes sysv/posix for notifications and cma for WRITEs), else '' (UCX's choice, tcp among
        them)."""
        return "shm/cma" if self.ucx_error_mode == "none" else ""

    def p2p_label(self, nbytes: int) -> str:
        """What carries a CPU message of ``nbytes``, for labels: rdt's CMA copy from CMA_MIN_BYTES on a node,
        else :meth:`transports`."""
        if self._cma_path(nbytes):
            return f"rdt cma x{CMA_THREADS}"
        return self.transports()

    def describe(self) -> Dict[str, Any]:
        """The UCX error-handling mode chosen for this group, whether peers' pids are watched, and from what size
        rdt copies same-node CPU messages itself."""
        return {"backend": "nixl", "ucx_error_handling_mode": self.ucx_error_mode,
                "same_node": self._peer_pids is not None, "transports": self.transports() or "ucx",
                "cma_write_min_bytes": CMA_MIN_BYTES if self._cma else None}

    # ------------------------------------------------------------------ lifecycle
    def abort(self) -> None:
        """Make pending and future waits fail at once, cancel pending receives and withdraw sends that have not
        started writing; never blocks (when another thread holds the lock, the next progress() does it)."""
        self._aborted.set()
        self._cancel_due = True
        if self._lock.acquire(blocking=False):
            try:
                if not self._closed:
                    self._tend_cancels()
            finally:
                self._lock.release()

    def shutdown(self) -> None:
        """Release every transfer handle and registration, forget remote agents and drop the agent; idempotent."""
        self._aborted.set()
        with self._lock:
            if self._closed:
                return
            err = GroupDestroyedError("the NIXL backend was shut down", group=self.config.group_name,
                                      rank=self.config.rank, hint="destroy and re-create the group")
            for work in list(self._recvs.values()):
                self._cancel_recv(work, err)
        end = time.monotonic() + _SHUTDOWN_FLUSH_S
        while self._cancelled and time.monotonic() < end:  # let the CANCELs leave; answers may come back
            self.progress()
            time.sleep(0.001)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for work in list(self._sends.values()):
                self._finish(work, err)
            for key in list(self._cancelled):
                self._settle(key)
            self._cancelled_small.clear()
            self._peer_cancels.clear()
            self._mailbox.clear()
            self._eager_out.clear()
            self._eager_parked.clear()
            self._forget_xfers(lambda _k: True)  # before the registrations and remote agents they point into
            self._cache.clear()
            for peer in list(self._peer_md):
                try:
                    self._agent.remove_remote_agent(self._names[peer])
                except Exception as e:  # pragma: no cover - defensive
                    logger.debug("nixl: removing remote agent %d failed: %s", peer, e)
            self._peer_md.clear()
            self._remote_regs.clear()
            self._agent = None
            pool, self._cma_pool = self._cma_pool, None
        if pool is not None:
            pool.shutdown(wait=False)

    @property
    def registration_cache(self) -> _RegistrationCache:
        """The registration cache (for diagnostics and tests)."""
        return self._cache
