"""NCCL backend for CUDA tensors (torch tensors and cupy arrays), built on cupy's NCCL bindings.

Why cupy's bindings and not torch's ``ProcessGroupNCCL``:

* Control over streams, completion and abort. Each communicator here has its own CUDA stream and its own
  issuing thread. Completion is a CUDA event that ``Work.wait`` polls against a deadline, and a timeout calls
  ``ncclCommAbort``. ``ProcessGroupNCCL`` hides these things behind its watchdog thread, which by default
  tears down the whole process when an op times out (``TORCH_NCCL_ASYNC_ERROR_HANDLING``). That would kill
  the Ray actor instead of raising :class:`CollectiveTimeoutError`.
* No process-wide torch.distributed state and no Store protocol: the 128-byte NCCL unique id is exchanged
  through the group's ``config.rendezvous`` (Ray GCS KV).
* Point-to-point communicators are our own (see below), so their ordering can be made deadlock-free.
  ``ProcessGroupNCCL`` p2p has no tags and puts both directions of a pair on one communicator.

The cost is an extra package: ``pip install 'ray-direct-transport[gpu]'`` (cupy-cuda13x, the cu13 build that
matches the PyPI CUDA torch). cupy and NCCL are imported lazily, only when a group is created. A missing package, a
missing libnccl or no visible CUDA device raises :class:`BackendUnavailableError` with the fix, before any peer or
rendezvous key is touched (:func:`check_available`). ``create_collective_group`` runs that check on every
actor before rendezvous.

Communicators and ordering (no deadlock when two actors send to each other at once):

* One *world* communicator runs the native collectives: allreduce, broadcast, reduce, allgather,
  reducescatter. gather, scatter and alltoall are grouped send/recv (``ncclGroupStart/End``) on it, and barrier
  is a one-element allreduce. The group layer issues collectives in the same order on every rank, as NCCL
  requires.
* Point-to-point traffic never uses the world communicator. Each *direction* ``src -> dst`` gets its own
  two-rank communicator, created lazily on first use (``src`` mints the unique id and publishes it under
  ``nccl/p2p/<src>-<dst>``). Only ``src`` sends and only ``dst`` receives on it, so a blocked send can only
  wait for a receive that is queued behind receives for earlier sends of the same direction. That rules out
  any cycle. The classic case (A sends to B while B sends to A, each blocking) uses two independent
  communicators and streams.
* NCCL matches a direction's sends and receives in issue order and ignores tags, so p2p goes through the shared
  matcher (:mod:`._matching`): ``isend`` announces RTS(tag, size, dtype) on an authenticated per-pair TCP link,
  the receiver matches it with its receive by (peer, tag), compares size and dtype, issues its NCCL recv and
  answers CTS; the sender issues its NCCL send when the CTS arrives (from the link's reader thread). Per
  direction, CTS order is the order of both sides' NCCL calls, so matching is by (peer, tag) whatever thread
  posts, in whatever order, and a receive that times out before its match is simply withdrawn. A mismatch
  fails both sides before NCCL moves a byte; a timeout after the match aborts that pair's communicators.
  The tcp backend runs the same matcher over its sockets, which is how CI exercises this logic without a GPU.
* The producer's ordering event is recorded in ``isend``/``irecv``, on the caller's thread and current stream
  (the NCCL call itself is issued later, from the link's reader thread and then the communicator's thread).
* Every communicator has a dedicated CUDA stream. Before an operation is issued, its stream waits on an event
  recorded on the caller's current stream, so the NCCL kernel sees what the caller wrote. The tensor is
  ``record_stream``-ed so the caching allocator never reuses it early. ``Work.wait`` blocks the CPU until the
  completion event has fired, so results are visible to any stream afterwards.
* NCCL ops are asynchronous, and ``ncclCommInitRank`` and the first connection to a peer can block on the
  CPU until the peer arrives. All NCCL calls therefore run on the communicator's own thread, and callers
  only wait on Python events and CUDA events under the deadline. On timeout, or when
  ``ncclCommGetAsyncError`` reports a failure (for example a dead peer), the communicator is aborted and
  :class:`CollectiveTimeoutError` or :class:`PeerUnavailableError` is raised at once. ``ncclCommAbort`` runs on a
  thread of its own: it waits for the device to run what was queued before the NCCL kernel (a long kernel on the
  caller's stream), which the caller's deadline must not wait for. The group then marks itself
  ERRORED. ``destroy`` runs on the communicator's thread too. Limit: cupy binds only the blocking
  ``ncclCommInitRank`` (no ``ncclCommInitRankConfig`` with ``blocking=0``), so an abort during init cannot
  interrupt it: the waiter returns at its deadline and the communicator is aborted as soon as init returns
  (the thread stays in NCCL's bootstrap until then).

The matcher checks sizes and dtypes, so ``checks_p2p_sizes`` is True and the group adds no handshake. CPU
tensors handed to p2p (rare) are staged through the device. Running several NCCL
communicators at once on one GPU is what torch does for its p2p too. NCCL documents it as "may work while the
kernels fit on the GPU". This backend never holds one communicator's kernel waiting on another's.

This module cannot be exercised on a machine without CUDA; its CPU-side paths (import, availability errors,
capabilities) are covered by tests/test_gpu_cpu_side.py and the data paths by tests/test_gpu.py.
"""

from __future__ import annotations

import collections
import logging
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import _lifecycle
from ..errors import (
    BackendUnavailableError,
    CollectiveTimeoutError,
    CommunicationError,
    GroupDestroyedError,
    InvalidArgumentError,
    PeerUnavailableError,
    SharedDeviceError,
)
from ..types import COLLECTIVE_OPS, Capabilities, ReduceOp
from ._matching import Matcher, OrderedWire, WireOp
from .base import Backend, BackendConfig, NativeCollectives, Work

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "install the GPU extra on a machine with an NVIDIA GPU: pip install 'ray-direct-transport[gpu]' (cupy-cuda13x, "
    "which loads the libnccl that a CUDA build of torch ships in nvidia-nccl-cu13), and give the actor a GPU "
    "(@ray.remote(num_gpus=1)); on CPU-only machines use backend='gloo'"
)
_UID_BYTES = 128
_POLL_MIN_S = 2e-5
_POLL_MAX_S = 1e-3


# ---------------------------------------------------------------------------------------------- availability
def _import_nccl() -> Tuple[Any, Any]:
    """Import cupy and cupy.cuda.nccl lazily; BackendUnavailableError with the fix when they cannot work here."""
    problems: List[str] = []
    cupy = nccl = None
    try:
        import warnings

        with warnings.catch_warnings():  # cupy warns (not raises) when libnccl.so cannot be loaded
            warnings.simplefilter("ignore")
            import cupy  # noqa: F811
            from cupy.cuda import nccl  # noqa: F811
    except ImportError as e:
        problems.append(f"cupy (with its NCCL bindings) is not importable: {e}")
    except Exception as e:  # noqa: BLE001 - a broken install raises anything
        problems.append(f"importing cupy failed: {type(e).__name__}: {e}")
    if nccl is not None and not getattr(nccl, "available", True):
        problems.append("cupy cannot load libnccl.so.2")
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            problems.append(f"torch {torch.__version__} is a CPU-only build")
        else:
            problems.append("no CUDA device is visible to this process (torch.cuda.is_available() is False)")
    if problems:
        raise BackendUnavailableError(
            "the NCCL backend cannot run in this process: " + "; ".join(problems), op="init", hint=INSTALL_HINT
        )
    return cupy, nccl


def check_available() -> None:
    """Raise BackendUnavailableError (with the fix) unless cupy, libnccl and a CUDA device are usable here."""
    _import_nccl()


def device_identity() -> Optional[str]:
    """The GPU this process's rank would use, as "GPU <uuid> on node <id>" (PCI bus id where torch has no UUID);
    None when it cannot be told. Two ranks of one communicator on one GPU make NCCL hang or fail, so the group
    compares these before any NCCL call."""
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None and str(uuid):
        gpu = f"GPU {uuid}"
    elif getattr(props, "pci_bus_id", None) is not None:
        gpu = (f"GPU at PCI {getattr(props, 'pci_domain_id', 0):04x}:{props.pci_bus_id:02x}:"
               f"{getattr(props, 'pci_device_id', 0):02x}")
    else:
        return None
    return f"{gpu} on node {_node_id()}"


def _node_id() -> str:
    """Ray's node id where Ray runs here, else the host name."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    except Exception:  # noqa: BLE001 - fall back to the host name
        pass
    import socket

    return socket.gethostname()


def _nccl_dtype(nccl: Any, dtype: torch.dtype) -> int:
    table = {
        torch.float16: getattr(nccl, "NCCL_FLOAT16", 6),
        torch.bfloat16: getattr(nccl, "NCCL_BFLOAT16", 9),
        torch.float32: getattr(nccl, "NCCL_FLOAT32", 7),
        torch.float64: getattr(nccl, "NCCL_FLOAT64", 8),
        torch.int32: getattr(nccl, "NCCL_INT32", 2),
        torch.int64: getattr(nccl, "NCCL_INT64", 4),
        torch.uint8: getattr(nccl, "NCCL_UINT8", 1),
    }
    try:
        return table[dtype]
    except KeyError:
        raise InvalidArgumentError(f"NCCL cannot move dtype {dtype}", op="nccl",
                                   hint="use float16/bfloat16/float32/float64/int32/int64/uint8") from None


def _nccl_op(nccl: Any, op: ReduceOp) -> Tuple[int, bool]:
    """(nccl op, divide-by-world-size afterwards)."""
    if op is ReduceOp.AVG:
        avg = getattr(nccl, "NCCL_AVG", None)
        return (avg, False) if avg is not None else (nccl.NCCL_SUM, True)
    return {ReduceOp.SUM: nccl.NCCL_SUM, ReduceOp.PRODUCT: nccl.NCCL_PROD, ReduceOp.MIN: nccl.NCCL_MIN,
            ReduceOp.MAX: nccl.NCCL_MAX}[op], False


def _encode_uid(uid: Any) -> bytes:
    """The unique id as 128 bytes (cupy >= 13 returns bytes; older cupy a tuple of signed chars)."""
    if isinstance(uid, (bytes, bytearray)):
        raw = bytes(uid)
    else:
        raw = struct.pack(f"{_UID_BYTES}b", *[((int(x) + 128) % 256) - 128 for x in uid])
    if len(raw) != _UID_BYTES:
        raise CommunicationError(f"unexpected NCCL unique id of {len(raw)} bytes", op="init")
    return raw


def _decode_uid(raw: bytes) -> bytes:
    if len(raw) != _UID_BYTES:
        raise CommunicationError(f"malformed NCCL unique id ({len(raw)} bytes)", op="init")
    return raw


def _new_communicator(nccl: Any, world: int, uid: bytes, rank: int) -> Any:
    try:
        return nccl.NcclCommunicator(world, uid, rank)
    except TypeError:  # cupy < 13 takes the id as a tuple of signed chars
        return nccl.NcclCommunicator(world, struct.unpack(f"{_UID_BYTES}b", uid), rank)


# ---------------------------------------------------------------------------------------------- communicators
class _Op:
    """One posted operation: issued on its communicator's thread, complete when its CUDA event fires."""

    def __init__(self, name: str, peer: Optional[int], fn: Callable[[Any, int], None], keep: List[torch.Tensor],
                 ready: Optional[torch.cuda.Event], after: Optional[Callable[[], None]] = None) -> None:
        self.name = name
        self.peer = peer
        self.fn = fn  # fn(nccl_comm, stream_ptr): enqueue the NCCL calls
        self.keep = keep  # tensors that must outlive the op
        self.ready = ready  # event on the caller's stream the op must wait for
        self.after = after  # host-side epilogue (copy a staged result back), run by the waiter
        self.issued = threading.Event()
        self.done: Optional[torch.cuda.Event] = None
        self.error: Optional[BaseException] = None
        self.finished = False


class _Comm:
    """An NCCL communicator with its own stream and issuing thread (init and every enqueue run there)."""

    def __init__(self, backend: "NcclBackend", label: str, world: int, rank: int,
                 uid_source: Callable[[], bytes]) -> None:
        self.backend = backend
        self.label = label
        self.world = world
        self.rank = rank
        self.comm: Any = None
        self.stream: Optional[torch.cuda.Stream] = None
        self.ready = threading.Event()
        self.error: Optional[BaseException] = None
        self.aborted = False
        self.failure: Optional[BaseException] = None  # why it was aborted, when the matcher knows (a lost peer)
        self._claim_lock = threading.Lock()  # one release (abort or destroy) per communicator, never two
        self._claimed = False
        self._queue: "collections.deque[Optional[_Op]]" = collections.deque()
        self._cv = threading.Condition()
        self._uid_source = uid_source
        self._thread = _lifecycle.spawn(self._loop, f"rdt-nccl-{label}")

    # -- the communicator's own thread
    def _loop(self) -> None:
        nccl = self.backend._nccl
        try:
            torch.cuda.set_device(self.backend.device)
            self.stream = torch.cuda.Stream(device=self.backend.device)
            uid = self._uid_source()
            self.comm = _new_communicator(nccl, self.world, uid, self.rank)
            if self.aborted:  # abort() came while ncclCommInitRank blocked: release the communicator now
                claimed = self._claim()
                if claimed is not None:
                    claimed.abort()
        except BaseException as e:  # noqa: BLE001 - reported to every waiter
            self.error = e
            self.ready.set()
            return
        self.ready.set()
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                op = self._queue.popleft()
            if op is None:  # close(): destroy here, where every other call on the communicator was made
                claimed = None if self.aborted else self._claim()
                if claimed is not None:
                    self.aborted = True
                    try:
                        claimed.destroy()
                    except Exception:  # noqa: BLE001 - best effort at shutdown
                        pass
                return
            if self.aborted or self.error is not None:
                op.error = self.error or GroupDestroyedError("the NCCL communicator was aborted", op=op.name)
                op.issued.set()
                continue
            try:
                assert self.stream is not None
                if op.ready is not None:
                    self.stream.wait_event(op.ready)
                for t in op.keep:
                    if t.is_cuda:
                        t.record_stream(self.stream)
                op.fn(self.comm, self.stream.cuda_stream)
                done = torch.cuda.Event()
                done.record(self.stream)
                op.done = done
            except BaseException as e:  # noqa: BLE001
                op.error = e
            op.issued.set()

    # -- any thread
    def post(self, op: _Op) -> _Op:
        with self._cv:
            self._queue.append(op)
            self._cv.notify()
        return op

    def _claim(self) -> Any:
        """The communicator, to the one caller that will release it (abort or destroy); None to every other."""
        with self._claim_lock:
            if self._claimed or self.comm is None:
                return None
            self._claimed = True
            return self.comm

    def async_error(self) -> Optional[str]:
        # Under the claim lock: ncclCommGetAsyncError never runs on a communicator being aborted or destroyed.
        with self._claim_lock:
            comm = self.comm
            if comm is None or self.aborted or self._claimed:
                return None
            try:
                comm.check_async_error()
            except Exception as e:  # noqa: BLE001 - NcclError naming the failure
                return str(e)
        return None

    def abort(self) -> None:
        """Non-blocking: mark the communicator aborted and run ncclCommAbort on a thread of its own.

        ncclCommAbort frees the communicator's device memory and synchronises its streams, so it returns only once
        every kernel queued before the communicator's (a long kernel on the caller's stream that the NCCL kernel
        waits behind) has run; the caller's deadline must not wait for that. The NCCL kernel itself sees the abort
        flag and exits as soon as it starts.
        """
        if self.aborted:
            return
        self.aborted = True
        comm = self._claim()
        if comm is not None:
            _lifecycle.spawn(_abort_quietly, f"rdt-nccl-abort-{self.label}", comm)

    def close(self) -> None:
        """Stop the thread; an idle communicator is destroyed on it, a busy one is aborted first (never blocks)."""
        with self._cv:
            idle = not self._queue
            self._queue.append(None)
            self._cv.notify()
        if not idle or not self.ready.is_set():  # ops still queued, or init still running: abort them
            self.abort()


def _abort_quietly(comm: Any) -> None:
    """ncclCommAbort (blocks until the device has run what was queued before it); never raises."""
    try:
        comm.abort()
    except Exception:  # noqa: BLE001 - best effort by contract
        logger.debug("rdt_transports: ncclCommAbort failed", exc_info=True)


class _Prepared:
    """What a p2p op captured on the caller's thread: the device tensor, NCCL count/dtype, the ready event."""

    __slots__ = ("tensor", "count", "dtype", "ready", "after")

    def __init__(self, tensor: torch.Tensor, count: int, dtype: int, ready: torch.cuda.Event,
                 after: Optional[Callable[[], None]]) -> None:
        self.tensor = tensor
        self.count = count
        self.dtype = dtype
        self.ready = ready  # recorded on the caller's current stream at post time
        self.after = after


class _NcclWireOp(WireOp):
    def __init__(self, backend: "NcclBackend", comm: _Comm, op: _Op) -> None:
        self._backend = backend
        self._comm = comm
        self._op = op

    def wait(self, deadline: float) -> None:
        self._backend._wait(self._comm, self._op, max(deadline - time.monotonic(), 0.0))

    def done(self) -> bool:
        op = self._op
        return op.finished or op.error is not None or (op.done is not None and op.done.query())


class _NcclWire(OrderedWire):
    """The directional communicators as the matcher's ordered wire: ``src -> dst`` carries only src's sends."""

    def __init__(self, backend: "NcclBackend") -> None:
        self._b = backend

    def prepare(self, tensor: torch.Tensor, peer: int, send: bool) -> _Prepared:
        b = self._b
        after: Optional[Callable[[], None]] = None
        if send:
            if not tensor.is_cuda:  # a CPU tensor is staged through the device
                tensor = tensor.to(f"cuda:{b.device}")
        elif not tensor.is_cuda:
            staged = torch.empty(tensor.shape, dtype=tensor.dtype, device=f"cuda:{b.device}")

            def copy_back(dst: torch.Tensor = tensor, src: torch.Tensor = staged) -> None:
                dst.copy_(src.cpu())

            after, tensor = copy_back, staged
        tensor = b._device_tensor(tensor, "send" if send else "recv")
        dt = _nccl_dtype(b._nccl, tensor.dtype)  # unsupported dtypes fail here, on the caller's thread
        return _Prepared(tensor, tensor.numel(), dt, b._ready_event(), after)

    def post_send(self, prepared: _Prepared, peer: int, tag: int) -> WireOp:
        b = self._b
        comm = b._p2p_comm(b.rank, peer)
        ptr, count, dt = prepared.tensor.data_ptr(), prepared.count, prepared.dtype

        def fn(c: Any, stream: int) -> None:
            c.send(ptr, count, dt, 1, stream)

        return _NcclWireOp(b, comm, comm.post(_Op("send", peer, fn, [prepared.tensor], prepared.ready)))

    def post_recv(self, prepared: _Prepared, peer: int, tag: int) -> WireOp:
        b = self._b
        comm = b._p2p_comm(peer, b.rank)
        ptr, count, dt = prepared.tensor.data_ptr(), prepared.count, prepared.dtype

        def fn(c: Any, stream: int) -> None:
            c.recv(ptr, count, dt, 0, stream)

        op = _Op("recv", peer, fn, [prepared.tensor], prepared.ready, prepared.after)
        return _NcclWireOp(b, comm, comm.post(op))

    def fail_peer(self, peer: int, error: BaseException) -> None:
        b = self._b
        for key in ((b.rank, peer), (peer, b.rank)):
            comm = b._p2p.get(key)
            if comm is not None:
                if comm.failure is None:
                    comm.failure = error
                comm.abort()


class NcclBackend(Backend):
    """NCCL over cupy's bindings: native collectives on a world communicator, p2p on directional ones."""

    capabilities = Capabilities(
        name="nccl",
        devices=frozenset({"cuda"}),
        two_sided=True,
        one_sided=False,
        native_collectives=COLLECTIVE_OPS,
        native_reduce_ops=frozenset(ReduceOp),
        can_abort=True,
        checks_p2p_sizes=True,  # the matcher compares size and dtype (RTS/CTS) before NCCL moves a byte
        requires="cupy-cuda13x",
    )

    @staticmethod
    def check_available() -> None:
        """Preflight used by create_collective_group/init_collective_group before any rendezvous."""
        check_available()

    @staticmethod
    def device_identity() -> Optional[str]:
        """This rank's GPU (create_collective_group refuses two members on one GPU before any NCCL call)."""
        return device_identity()

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self._cupy, self._nccl = _import_nccl()  # before any rendezvous key is touched
        self.device = torch.cuda.current_device()
        self._lock = threading.Lock()
        self._closed = False
        self._aborted = False
        rdv = config.rendezvous
        self._check_devices(rdv, config)
        if config.rank == 0:
            rdv.put("nccl/world", _encode_uid(self._nccl.get_unique_id()))

        def world_uid() -> bytes:
            return _decode_uid(rdv.get("nccl/world", config.timeout, what="the NCCL unique id from rank 0"))

        self._world = _Comm(self, "world", config.world_size, config.rank, world_uid)
        self._p2p: Dict[Tuple[int, int], _Comm] = {}
        self._native = _NcclNative(self)
        # Join the world communicator eagerly so that a group is usable (and init errors surface) at creation.
        if not self._world.ready.wait(config.timeout):
            self._world.abort()
            raise CollectiveTimeoutError(
                f"NCCL communicator init did not complete within {config.timeout:.1f}s",
                group=config.group_name, rank=config.rank, op="init",
                hint="every rank must create the group; check that each actor has its own GPU visible",
            )
        if self._world.error is not None:
            raise self._classify(self._world.error, "init", None)
        try:  # p2p control: RTS/CTS over authenticated per-pair TCP links (the data stays on NCCL)
            self._matcher = Matcher(config, _NcclWire(self), label="nccl", backend="nccl")
        except BaseException:
            self._world.close()
            raise
        self._stopper = _lifecycle.at_exit(self.shutdown)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _check_devices(rdv: Any, config: BackendConfig) -> None:
        """Every rank publishes its GPU and reads the others' before NCCL is called: two ranks on one GPU raise
        SharedDeviceError in every rank (a communicator with two ranks on one device hangs or fails in NCCL)."""
        mine = device_identity() or ""
        rdv.put(f"nccl/device/{config.rank}", mine.encode())
        if config.world_size < 2 or not mine:
            return
        deadline = time.monotonic() + config.timeout
        for r in range(config.world_size):
            if r == config.rank:
                continue
            other = rdv.get(f"nccl/device/{r}", max(deadline - time.monotonic(), 1e-3),
                            what=f"rank {r}'s GPU").decode()
            if other == mine:
                raise SharedDeviceError(
                    f"ranks {min(r, config.rank)} and {max(r, config.rank)} of the NCCL group are both on {mine}",
                    group=config.group_name, rank=config.rank, op="init",
                    hint="give each rank its own GPU (@ray.remote(num_gpus=1)); for transfers between actors on "
                    "one GPU use tensor_transport='cuda_ipc' or 'nixl' instead of an NCCL group",
                )

    def _classify(self, e: BaseException, op: str, peer: Optional[int]) -> Exception:
        if isinstance(e, (CommunicationError, InvalidArgumentError, GroupDestroyedError)):
            return e
        text = f"{type(e).__name__}: {e}"
        low = text.lower()
        if "remote" in low or "unhandled system error" in low or "connection" in low:
            return PeerUnavailableError(f"{op} failed: {text}", group=self.config.group_name, rank=self.rank,
                                        peer=peer, op=op,
                                        hint="a member of the group died or left; re-form the group with live members")
        return CommunicationError(f"{op} failed: {text}", group=self.config.group_name, rank=self.rank, peer=peer,
                                  op=op)

    def _check_open(self, op: str) -> None:
        if self._aborted or self._closed:
            raise GroupDestroyedError("the NCCL backend was aborted or shut down", group=self.config.group_name,
                                      rank=self.rank, op=op, hint="create the group again")

    def _p2p_comm(self, src: int, dst: int) -> _Comm:
        key = (src, dst)
        with self._lock:
            c = self._p2p.get(key)
            if c is not None:
                return c
            rdv = self.config.rendezvous
            name = f"nccl/p2p/{src}-{dst}"
            if self.rank == src:
                rdv.put(name, _encode_uid(self._nccl.get_unique_id()))
            timeout = self.config.timeout

            def uid() -> bytes:
                return _decode_uid(rdv.get(name, timeout, what=f"the NCCL p2p id for {src}->{dst}"))

            c = _Comm(self, f"{src}to{dst}", 2, 0 if self.rank == src else 1, uid)
            self._p2p[key] = c
            return c

    def _device_tensor(self, t: torch.Tensor, op: str) -> torch.Tensor:
        if t.is_cuda and t.device.index != self.device:
            raise InvalidArgumentError(
                f"{op}: tensor is on {t.device} but this rank's NCCL communicator is on cuda:{self.device}",
                group=self.config.group_name, rank=self.rank, op=op,
                hint=f"move it with .to('cuda:{self.device}') or torch.cuda.set_device() before creating the group",
            )
        return t

    def _ready_event(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _wait(self, comm: _Comm, op: _Op, timeout: float) -> None:
        if op.finished:
            if op.error is not None:
                raise op.error
            return
        deadline = time.monotonic() + timeout
        err = self._wait_inner(comm, op, deadline, timeout)
        op.finished = True
        if err is not None:
            op.error = err
            raise err
        if op.after is not None:
            op.after()
        op.keep = []

    def _wait_inner(self, comm: _Comm, op: _Op, deadline: float, timeout: float) -> Optional[BaseException]:
        gname, rank = self.config.group_name, self.rank

        def timed_out(stage: str) -> BaseException:
            comm.abort()
            return CollectiveTimeoutError(
                f"NCCL {op.name} did not complete within {timeout:.2f}s ({stage}); the communicator was aborted",
                group=gname, rank=rank, peer=op.peer, op=op.name,
                hint="check that every rank makes the matching call and none is dead or stuck; raise the timeout "
                "for large transfers",
            )

        if not comm.ready.wait(max(deadline - time.monotonic(), 0)):
            return timed_out("waiting for the peer to join the communicator")
        if comm.error is not None:
            return self._classify(comm.error, op.name, op.peer)
        if not op.issued.wait(max(deadline - time.monotonic(), 0)):
            return timed_out("waiting to be issued")
        if op.error is not None:
            return self._classify(op.error, op.name, op.peer)
        assert op.done is not None
        delay = _POLL_MIN_S
        while not op.done.query():
            if comm.aborted:
                if comm.failure is not None:
                    return comm.failure
                return GroupDestroyedError(f"NCCL {op.name} was aborted", group=gname, rank=rank, peer=op.peer,
                                           op=op.name)
            msg = comm.async_error()
            if msg is not None:
                comm.abort()
                return PeerUnavailableError(
                    f"NCCL {op.name} failed asynchronously ({msg}); the communicator was aborted",
                    group=gname, rank=rank, peer=op.peer, op=op.name,
                    hint="a member of the group died or its network failed; re-form the group",
                )
            if time.monotonic() >= deadline:
                return timed_out("in flight")
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        return None

    # ------------------------------------------------------------------ point to point
    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        self._check_open("send")
        return self._matcher.isend(tensor, peer, tag)  # the wire's prepare() records the ready event here

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        self._check_open("recv")
        return self._matcher.irecv(tensor, peer, tag)

    def native(self) -> Optional[NativeCollectives]:
        return self._native

    def abort(self) -> None:
        self._aborted = True
        self._matcher.abort()
        for c in [self._world, *list(self._p2p.values())]:
            c.abort()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        _lifecycle.cancel(self._stopper)
        self._matcher.close()
        for c in [self._world, *list(self._p2p.values())]:
            c.close()


class _NcclNative(NativeCollectives):
    """The collectives, each one closure enqueued on the world communicator's thread."""

    def __init__(self, backend: NcclBackend) -> None:
        self._b = backend
        self._nccl = backend._nccl

    def run(self, name: str, timeout: float, **kw: Any) -> None:
        b = self._b
        b._check_open(name)
        for v in kw.values():
            for t in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(t, torch.Tensor):
                    b._device_tensor(t, name)
        fn, keep, after = getattr(self, "_" + name)(**kw)
        op = b._world.post(_Op(name, None, fn, keep, b._ready_event(), after))
        b._wait(b._world, op, timeout)

    def _dt(self, t: torch.Tensor) -> int:
        return _nccl_dtype(self._nccl, t.dtype)

    def _divide(self, t: torch.Tensor, divide: bool) -> None:
        if divide:
            t.div_(self._b.world_size)

    @staticmethod
    def _on(stream_ptr: int, device: int) -> Any:
        return torch.cuda.stream(torch.cuda.ExternalStream(stream_ptr, device=torch.device("cuda", device)))

    def _broadcast(self, tensor: torch.Tensor, root: int) -> Any:
        p, n, dt = tensor.data_ptr(), tensor.numel(), self._dt(tensor)
        return (lambda c, s: c.broadcast(p, p, n, dt, root, s)), [tensor], None

    def _allreduce(self, tensor: torch.Tensor, op: ReduceOp) -> Any:
        p, n, dt = tensor.data_ptr(), tensor.numel(), self._dt(tensor)
        nop, divide = _nccl_op(self._nccl, op)
        return (lambda c, s: c.allReduce(p, p, n, dt, nop, s)), [tensor], (lambda: self._divide(tensor, divide))

    def _reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp) -> Any:
        p, n, dt = tensor.data_ptr(), tensor.numel(), self._dt(tensor)
        nop, divide = _nccl_op(self._nccl, op)
        mine = self._b.rank == root
        return ((lambda c, s: c.reduce(p, p, n, dt, nop, root, s)), [tensor],
                (lambda: self._divide(tensor, divide and mine)))

    def _allgather(self, outputs: List[torch.Tensor], tensor: torch.Tensor) -> Any:
        n, dt, dev = tensor.numel(), self._dt(tensor), self._b.device
        flat = torch.empty(n * len(outputs), dtype=tensor.dtype, device=tensor.device)

        def fn(c: Any, s: int) -> None:
            c.allGather(tensor.data_ptr(), flat.data_ptr(), n, dt, s)
            with self._on(s, dev):
                for i, o in enumerate(outputs):
                    o.view(-1).copy_(flat[i * n:(i + 1) * n])

        return fn, [tensor, flat, *outputs], None

    def _reducescatter(self, tensor: torch.Tensor, inputs: List[torch.Tensor], op: ReduceOp) -> Any:
        n, dt, dev = tensor.numel(), self._dt(tensor), self._b.device
        nop, divide = _nccl_op(self._nccl, op)
        flat = torch.empty(n * len(inputs), dtype=tensor.dtype, device=tensor.device)

        def fn(c: Any, s: int) -> None:
            with self._on(s, dev):
                for i, x in enumerate(inputs):
                    flat[i * n:(i + 1) * n].copy_(x.reshape(-1))
            c.reduceScatter(flat.data_ptr(), tensor.data_ptr(), n, dt, nop, s)

        return fn, [tensor, flat, *inputs], (lambda: self._divide(tensor, divide))

    def _grouped(self, fn_body: Callable[[Any, int], None]) -> Callable[[Any, int], None]:
        nccl = self._nccl

        def fn(c: Any, s: int) -> None:
            nccl.groupStart()
            try:
                fn_body(c, s)
            finally:
                nccl.groupEnd()

        return fn

    def _gather(self, outputs: Optional[List[torch.Tensor]], tensor: torch.Tensor, root: int) -> Any:
        b, n, dt = self._b, tensor.numel(), self._dt(tensor)
        if b.rank != root:
            return self._grouped(lambda c, s: c.send(tensor.data_ptr(), n, dt, root, s)), [tensor], None
        assert outputs is not None

        def body(c: Any, s: int) -> None:
            for r, o in enumerate(outputs):
                if r != root:
                    c.recv(o.data_ptr(), n, dt, r, s)

        def fn(c: Any, s: int) -> None:
            self._grouped(body)(c, s)
            with self._on(s, b.device):
                outputs[root].view(-1).copy_(tensor.view(-1))

        return fn, [tensor, *outputs], None

    def _scatter(self, inputs: Optional[List[torch.Tensor]], tensor: torch.Tensor, root: int) -> Any:
        b, n, dt = self._b, tensor.numel(), self._dt(tensor)
        if b.rank != root:
            return self._grouped(lambda c, s: c.recv(tensor.data_ptr(), n, dt, root, s)), [tensor], None
        assert inputs is not None

        def body(c: Any, s: int) -> None:
            for r, x in enumerate(inputs):
                if r != root:
                    c.send(x.data_ptr(), n, dt, r, s)

        def fn(c: Any, s: int) -> None:
            self._grouped(body)(c, s)
            with self._on(s, b.device):
                tensor.view(-1).copy_(inputs[root].view(-1))

        return fn, [tensor, *inputs], None

    def _alltoall(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor]) -> Any:
        b = self._b
        n, dt = inputs[0].numel(), self._dt(inputs[0])

        def body(c: Any, s: int) -> None:
            for r in range(b.world_size):
                if r != b.rank:
                    c.send(inputs[r].data_ptr(), n, dt, r, s)
                    c.recv(outputs[r].data_ptr(), n, dt, r, s)

        def fn(c: Any, s: int) -> None:
            self._grouped(body)(c, s)
            with self._on(s, b.device):
                outputs[b.rank].view(-1).copy_(inputs[b.rank].view(-1))

        return fn, [*inputs, *outputs], None

    def _barrier(self) -> Any:
        token = torch.zeros(1, dtype=torch.uint8, device=f"cuda:{self._b.device}")
        p, dt = token.data_ptr(), self._dt(token)
        return (lambda c, s: c.allReduce(p, p, 1, dt, self._nccl.NCCL_SUM, s)), [token], None
