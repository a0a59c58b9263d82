"""UCX backend (ucxx): two-sided tagged send/recv for cpu and cuda tensors over UCX endpoints.

Connections: every rank runs a UCX listener on an ephemeral port and publishes ``host:port`` in the group
rendezvous (``ucx/addr/<rank>``), and its Ray node id and UCX worker address (``ucx/waddr/<rank>``). For each pair
of ranks exactly one connection exists: the lower rank connects to the higher one, lazily, on the first operation
that involves that peer. The higher rank waits for the incoming, authenticated connection. Peers on another node
connect to the listener; peers on the same Ray node connect worker to worker (below), because UCX gives a
listener endpoint only ``tcp`` here while a worker-address endpoint gets shared memory and CMA.

Authentication: the listener accepts anyone, so every new endpoint runs a mutual challenge-response before it
is used. The server sends a random nonce; the client answers with its rank, its own nonce and
HMAC-SHA256(secret, "c" | server nonce | group uid | client rank); the server checks it with
``hmac.compare_digest`` and answers with HMAC-SHA256(secret, "s" | client nonce | group uid | server rank |
client rank). Anything else (wrong MAC, wrong size, silence past the handshake timeout, a rank that may not
connect to us, a duplicate) closes the endpoint and is counted in ``stats["rejected_connections"]``. Nothing
from the network is ever unpickled: all control messages are fixed-size :mod:`struct` records. UCX tag
matching is per worker, but ucxx hashes every tag with a random per-endpoint value agreed at connection time,
so an unauthenticated endpoint cannot produce messages that match our receives.

Same-node peers (``RDT_UCX_SAME_NODE=0`` turns this off): UCX selects its shared-memory transports (sysv, posix,
cma) only for endpoints made from a worker address *without* UCX peer error handling (with it, sm is "unreachable";
listener endpoints require it). A worker address lets anyone who learns it send to our worker, and worker tag
matching does not look at the sender, so: the client sends HELLO(rank, pid, start time, nonce, MAC) on a tag derived
from the group uid and the server's rank; the server checks the MAC, reads the client's worker address from the
rendezvous (never from the network), connects back and sends CHALLENGE(pid, start time, nonce, MAC over both nonces)
on a tag derived from the client's nonce; the client checks it and answers RESPONSE(MAC) on a tag derived from the
server's nonce. Both then derive per-direction keys from the secret and both nonces, and every later message of the
pair travels on ``blake2b(key, tag)``: a sender without the secret cannot produce a tag that matches a control or
user receive. Bad MACs, wrong-size hellos and duplicates are counted in ``stats["rejected_connections"]``. Without
UCX error handling the pair watches the peer's process (its pid and start time from the handshake) with a pidfd
(death -> PeerUnavailableError) and sends BYE on abort/shutdown. ``describe()`` / ``transports()`` report per peer
which path was taken and which transports UCX put on the endpoint's lanes (read with ``ucp_ep_print_info``).

Transfer protocol (``_ucx_ops``), matched on (peer, tag) so posting order does not matter: the sender sends a
header HDR(tag, nbytes, dtype code) on the tag's own header tag, with the payload inside when it is a host tensor of
at most 64 KiB; the receiver checks size and dtype and answers ACK or NACK on the tag's reply tag (NACK: both sides
raise TensorMismatchError, the receiver's tensor untouched). Larger payloads follow on ``tag`` only after the ACK,
straight into the user's buffer, which keeps a sender from ever blocking on a receiver that will not take them
and keeps them out of UCX's unexpected-message queue. A small send whose (size, dtype) the peer accepted lately
does not wait for its own verdict: it completes once out and once the previous send's verdict is in, so a
refusal of it is raised by the next send to that peer (a new size or dtype, a large or a CUDA send raises at once).

Threading and progress (``_ucx_progress``): the worker runs in UCX blocking mode with no UCX progress thread and
no ucxx Python futures. A thread waiting on a Work progresses the worker itself, advances every pending operation
and sleeps on the worker's epoll fd between events (after up to 1 ms of busy progress, 30 us on a busy machine:
``rdt_transports._spin``; ``RDT_UCX_SPIN_US`` fixes it); a pump thread does the same while nobody waits
(handshakes, control messages, operations nobody waits on). The asyncio loop thread runs connection set-up,
handshakes, the listener and the pidfd watch; its UCX requests are completed by the same engine.
``isend``/``irecv`` may be called from any thread; UCX submission and progress happen under one lock, sleeping
outside it.

Environment: ucxx picks transports from ``UCX_*`` variables (the tests set only ``UCX_NET_DEVICES=lo``; nothing
restricts ``UCX_TLS``). Measured on the 2-core CI machine (UCX 1.21, ucxx 0.52; rdt-bench p2p, two actors on one
node, medians of 3 runs each): same-node worker-address endpoints get ``sysv+posix+cma``, 4.5-5.1 GB/s at
128 MiB and 3.9-4.7 GB/s at 16 MiB; listener endpoints (``RDT_UCX_SAME_NODE=0``, as across nodes) get ``tcp``,
1.6-1.7 GB/s at 128 MiB. A 4 KiB transfer took 0.95-1.45 ms while completions crossed UCX's progress thread,
ucxx's notifier thread and an event loop; with progress in the waiting thread, 76-93 us (docs/benchmarks.md). CUDA
tensors are passed through ``__cuda_array_interface__``; the current stream is synchronised when an operation is
posted. The CUDA path has not been tested (no GPU here).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ctypes
import gc
import hashlib
import hmac
import logging
import os
import struct
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from ..errors import (
    BackendUnavailableError,
    CollectiveTimeoutError,
    CommunicationError,
    GroupDestroyedError,
    InvalidArgumentError,
    PeerUnavailableError,
    RdtError,
    TensorMismatchError,
)
from .. import _lifecycle
from .._proc import Proc, identity, process_alive, ray_node_id
from ..types import Capabilities
from ._ucx_ops import CTL as _CTL, P2POp, RecvOp, SendOp
from ._ucx_progress import AwaitOp, Op, ProgressEngine
from .base import Backend, BackendConfig, Work

logger = logging.getLogger(__name__)

# Control-channel tags (ucxx hashes them with the endpoint's random tag); user tags are < 2**31, so these
# never collide with payload tags.
_CTL_TAG = 1 << 40
_HS_TAG_CHALLENGE = (1 << 40) + 1
_HS_TAG_RESPONSE = (1 << 40) + 2
_HS_TAG_CONFIRM = (1 << 40) + 3

_HDR = 1  # control record kinds on the connection's control tag (see _ucx_ops.CTL); only BYE is sent there now

_NONCE = 32
_MAC = 32
_RESPONSE = struct.Struct(f"<I{_NONCE}s{_MAC}s")  # client rank, client nonce, client MAC
_RANK = struct.Struct("<I")

_PROTO = b"rdt-ucx-v1"
_MAX_HANDSHAKE_S = 30.0
_SPARES_KEPT = 16  # spare receive buffers per size per backend (verdicts: 24 B, headers: 64 KiB)

# Same-node handshake over worker-address endpoints (see "Same-node peers" in the module docstring).
_BYE = 4
_HELLO = struct.Struct(f"<IIQ{_NONCE}s{_MAC}s")  # client rank, client pid, its start time, client nonce, MAC
_CHALLENGE = struct.Struct(f"<IQ{_NONCE}s{_MAC}s")  # server pid, its start time, server nonce, server MAC
_PROC = struct.Struct("<IQ")  # (pid, start time; 0: unknown) as the handshake MACs cover it
_SHM_TLS = frozenset({"sysv", "posix", "cma", "xpmem", "knem", "cuda_ipc"})

# Stable wire codes for dtypes (index + 1); unknown dtypes travel as 0 and are compared by size only.
_DTYPE_NAMES = (
    "float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool",
    "complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
)


def _dtype_code(dtype: torch.dtype) -> int:
    """Wire code of a torch dtype (0 when unknown)."""
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        name = str(dtype).replace("torch.", "")
        code = _DTYPE_NAMES.index(name) + 1 if name in _DTYPE_NAMES else 0
        _DTYPE_CODES[dtype] = code
    return code


_DTYPE_CODES: Dict[torch.dtype, int] = {}  # cache of _dtype_code (it runs once per operation)


def _dtype_name(code: int) -> str:
    """Readable name of a wire dtype code, for error messages."""
    return _DTYPE_NAMES[code - 1] if 0 < code <= len(_DTYPE_NAMES) else f"unknown({code})"


def _byte_view(tensor: torch.Tensor) -> Any:
    """A flat uint8 view of a contiguous tensor that ucxx accepts (buffer protocol or __cuda_array_interface__)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    if flat.is_cuda:
        return flat  # torch exposes __cuda_array_interface__ for uint8 CUDA tensors
    return flat.numpy()


def _local_host() -> str:
    """Address peers should connect to: RDT_UCX_HOST, else Ray's node IP, else loopback."""
    host = os.environ.get("RDT_UCX_HOST")
    if host:
        return host
    if os.environ.get("UCX_NET_DEVICES", "").split(",") == ["lo"]:
        return "127.0.0.1"  # UCX is limited to loopback: the node IP would be unreachable for it
    try:
        import ray.util

        return str(ray.util.get_node_ip_address())
    except Exception:  # Ray missing or not able to resolve: single-host fallback
        return "127.0.0.1"


def _wire(proc: Proc) -> Tuple[int, int]:
    """A (pid, start time) as the handshake carries it (an unknown start time as 0)."""
    return proc[0], proc[1] or 0


def _tag64(*parts: bytes) -> int:
    """A 64-bit UCX tag derived from ``parts`` (handshake tags: unguessable when a part is a fresh nonce)."""
    return int.from_bytes(hashlib.blake2b(b"|".join((_PROTO,) + parts), digest_size=8).digest(), "little")


def _wire_tag(key: bytes, tag: int) -> int:
    """The UCX tag that carries ``tag`` on an authenticated worker-address pair (keyed: outsiders cannot match it)."""
    return int.from_bytes(hashlib.blake2b(struct.pack("<Q", tag), key=key, digest_size=8).digest(), "little")


def _node_id() -> str:
    """This process's Ray node id, '' when unknown or same-node endpoints are disabled (RDT_UCX_SAME_NODE=0)."""
    if os.environ.get("RDT_UCX_SAME_NODE", "1") == "0":
        return ""
    return ray_node_id()


def _ep_transports(ep: Any) -> str:
    """The UCX transports of an endpoint's lanes ('sysv+posix+cma', 'tcp'), read with ``ucp_ep_print_info``;
    '' when that cannot be read (ucxx does not expose it, so libucp is called directly)."""
    import ctypes
    import ctypes.util
    import re

    try:
        with open("/proc/self/maps") as f:
            libs = [w for w in f.read().split() if "/libucp.so" in w]
        ucp = ctypes.CDLL(libs[0] if libs else "libucp.so.0")
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.tmpfile.restype = ctypes.c_void_p
        libc.fread.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p]
        ucp.ucp_ep_print_info.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        fp = libc.tmpfile()
        if not fp:
            return ""
        try:
            ucp.ucp_ep_print_info(ctypes.c_void_p(ep._ep.handle), ctypes.c_void_p(fp))
            libc.fflush(ctypes.c_void_p(fp))
            libc.rewind(ctypes.c_void_p(fp))
            buf = ctypes.create_string_buffer(1 << 16)
            n = libc.fread(buf, 1, len(buf) - 1, ctypes.c_void_p(fp))
        finally:
            libc.fclose(ctypes.c_void_p(fp))
        tls = re.findall(r"lane\[\d+\]:\s+\d+:(\w+)/", buf.raw[:n].decode("ascii", "replace"))
        return "+".join(dict.fromkeys(tls))
    except Exception as e:  # noqa: BLE001 - informational only
        logger.debug("ucx: cannot read the endpoint's transports: %s", e)
        return ""


def _import_ucxx() -> Tuple[Any, Any, Any]:
    """Import ucxx lazily; BackendUnavailableError with the install command when it is missing or broken."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        import ucxx  # noqa: F401
        from ucxx._lib_async import application_context
        from ucxx._lib_async.application_context import ApplicationContext
    except Exception as e:  # ImportError, or a missing/broken libucx raising OSError/RuntimeError
        raise BackendUnavailableError(
            f"the ucx backend needs the ucxx package, which cannot be imported: {type(e).__name__}: {e}",
            hint="pip install ucxx-cu13  (or ucxx-cu12 to match your CUDA; or pip install 'ray-direct-transport[ucx]')",
        ) from e
    global _UCXXTag, _Array, _hash64bits
    from ucxx._lib.arr import Array
    from ucxx._lib.libucxx import UCXXTag
    from ucxx._lib_async.utils import hash64bits

    _UCXXTag, _Array, _hash64bits = UCXXTag, Array, hash64bits
    return ucxx, ApplicationContext, application_context


_UCXXTag: Any = None  # ucxx's tag, buffer and tag-hash helpers, bound by _import_ucxx
_Array: Any = None
_hash64bits: Any = None


class _Peer:
    """Connection state for one remote rank; touched only on the event-loop thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.ready: "asyncio.Future[Any]" = loop.create_future()  # resolves to the authenticated ucxx Endpoint
        self.ep: Any = None
        self.reader: Optional["asyncio.Task[None]"] = None
        self.connecting = False
        self.error: Optional[BaseException] = None
        self.path = ""  # "worker-address" (same node) or "listener"
        self.transports = ""  # what UCX chose for the endpoint, e.g. "sysv+posix+cma" or "tcp"
        self.send_key: Optional[bytes] = None  # worker-address endpoints: keys of the pair's wire tags
        self.recv_key: Optional[bytes] = None
        self.agreed: Dict[Tuple[int, int], None] = {}  # (nbytes, dtype code) the peer accepted lately (engine lock)
        self.unverified: Any = None  # the last send to this peer; its verdict may still be on the way (engine lock)
        self.tags: Dict[Tuple[bool, int], Any] = {}  # (send, sub-tag) -> UCX tag on this pair (engine lock held)
        self.pidfd: Optional[int] = None  # watches a same-node peer's process (no UCX error handling there)
        self.dead: "asyncio.Future[None]" = loop.create_future()  # resolved by _fail_peer (error in .error)


class _UcxWork(Work):
    """Handle of one isend/irecv; waiting drives UCX progress in the waiting thread."""

    def __init__(self, backend: "UcxBackend", op: P2POp) -> None:
        self._backend = backend
        self._op = op  # holds the tensor and the buffers while UCX may still touch them

    def wait(self, timeout: float) -> None:
        """Block until done; CollectiveTimeoutError past ``timeout`` (the operation withdrawn when UCX holds
        nothing of its tensor yet, else given as long again first), GroupDestroyedError after abort."""
        op, backend = self._op, self._backend
        self._drive(timeout)
        if not op.done and not backend._aborted.is_set():
            if not backend._withdraw(op, self._timeout_error(timeout, "withdrawn")):
                self._drive(timeout)  # its payload is moving: let it land now rather than after the error
                if not op.done:
                    raise self._timeout_error(2 * timeout, "still posted: its payload was moving")
        if op.done:
            if op.error is not None:
                raise op.error
            return
        raise backend._closed_error(op.peer, op.kind)

    def _timeout_error(self, waited: float, what: str) -> CollectiveTimeoutError:
        """The error of a wait that timed out; ``what``: what became of the operation."""
        op, cfg = self._op, self._backend.config
        return CollectiveTimeoutError(
            f"ucx {op.kind} (tag {op.tag}) did not complete within {waited:.3f}s; the operation is {what}",
            group=cfg.group_name, rank=cfg.rank, peer=op.peer, op=op.kind,
            hint="make sure the peer posts the matching operation with the same tag, size and dtype, and that it is "
            "alive")

    def _drive(self, timeout: float) -> None:
        """Progress until the operation is done, the backend aborted or ``timeout`` has passed."""
        op, backend = self._op, self._backend
        if op.done:
            return
        try:
            backend._engine.wait(op, time.monotonic() + timeout, backend._aborted)
        except RdtError:
            raise
        except Exception as e:  # a UCX error out of progress itself: typed, with group and ranks
            raise backend._op_error(op, e) from e

    def is_completed(self) -> bool:
        return self._op.done


# Backends not shut down yet. At exit they are shut down before the interpreter finalizes: a UCX progress thread
# left running would call into Python (endpoint-closed callbacks) while the interpreter is being torn down.
_UNCLOSED: "weakref.WeakSet[UcxBackend]" = weakref.WeakSet()


@_lifecycle.at_exit
def _shutdown_unclosed() -> None:
    for backend in list(_UNCLOSED):
        try:
            backend.shutdown()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


class UcxBackend(Backend):
    """Point-to-point transfers over UCX (ucxx) with an authenticated endpoint per pair of ranks."""

    capabilities = Capabilities(
        name="ucx",
        devices=frozenset({"cpu", "cuda"}),
        two_sided=True,
        one_sided=False,
        native_collectives=frozenset(),
        can_abort=True,
        requires="ucxx-cu13",
    )

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self._ucxx, app_context_cls, self._app_module = _import_ucxx()
        self.stats: Dict[str, int] = collections.Counter()  # rejected_connections, connections, ...
        self._aborted = threading.Event()
        self._closed = False
        self._shutdown_lock = threading.Lock()
        self._uid = config.group_uid.encode()
        self._handshake_timeout = min(float(config.timeout), _MAX_HANDSHAKE_S)
        self._peers: Dict[int, _Peer] = {}
        self._tasks: Set["asyncio.Task[Any]"] = set()
        self._listener: Any = None
        self._ctx: Any = None
        self._engine: Optional[ProgressEngine] = None
        self._node = _node_id()
        self._hello_pending: Set[int] = set()  # client ranks with a same-node handshake in progress
        self._pending: Dict[Tuple[str, int, int], P2POp] = {}  # (op, peer, tag) -> operation in flight
        self._pending_lock = threading.Lock()
        self._spares: Dict[int, List[Tuple[bytearray, Any]]] = {}  # receive buffers by size (_take_buffer)
        self._bye_task: Optional["asyncio.Task[Any]"] = None
        _UNCLOSED.add(self)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._run_loop, name=f"rdt-ucx-{config.group_name}-r{config.rank}", daemon=True
        )
        self._thread.start()
        try:
            self._call(self._start(app_context_cls), timeout=max(30.0, float(config.timeout)))
            host = _local_host()
            # The worker address goes first: a peer that read ucx/addr/<rank> finds ucx/waddr/<rank> at once.
            config.rendezvous.put(f"ucx/waddr/{config.rank}", self._node.encode() + b"|" + self._waddr)
            config.rendezvous.put(f"ucx/addr/{config.rank}", f"{host}:{self._listener.port}".encode())
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ loop plumbing
    def _run_loop(self) -> None:
        """Body of the event-loop thread."""
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _call(self, coro: Any, timeout: float) -> Any:
        """Run ``coro`` on the loop from another thread and wait (bounded) for its result."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    async def _start(self, app_context_cls: Any) -> None:
        """Create this backend's UCX context/worker, its progress engine and listener (on the loop, so ucxx's
        futures bind to it). ucxx's own progress (a UCX progress thread) is replaced by the engine's."""

        class _Context(app_context_cls):  # type: ignore[misc, valid-type]
            def continuous_ucx_progress(self, event_loop: Any = None) -> None:
                """Progress comes from the backend's ProgressEngine, not from ucxx."""

        # No Python futures: each would cost a wake-up of ucxx's notifier thread and of this loop per request.
        self._ctx = _Context(progress_mode="blocking", enable_delayed_submission=False, enable_python_future=False)
        self._engine = ProgressEngine(self._ctx.worker, f"rdt-ucx-{self.config.group_name}-r{self.config.rank}",
                                      self._op_error)
        self._listener = self._ctx.create_listener(
            self._on_connect, port=0, endpoint_error_handling=True, connect_timeout=self._handshake_timeout
        )
        self._waddr = bytes(self._ctx.worker_address) if self._node else b""
        if self._node:
            self._spawn(self._accept_hellos())

    def _ectx(self, peer: Optional[int] = None, op: Optional[str] = None) -> Dict[str, Any]:
        """Error context fields."""
        return {"group": self.config.group_name, "rank": self.config.rank, "peer": peer, "op": op}

    def _closed_error(self, peer: Optional[int], op: Optional[str]) -> GroupDestroyedError:
        """The error for operations on an aborted or shut-down backend."""
        return GroupDestroyedError("the UCX backend was aborted or shut down", **self._ectx(peer, op),
                                   hint="destroy and re-create the group")

    def _peer(self, peer: int) -> _Peer:
        """State for ``peer``, created on first use (loop thread only)."""
        state = self._peers.get(peer)
        if state is None:
            state = self._peers[peer] = _Peer(self._loop)
            state.ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # no "never retrieved" noise
        return state

    # ------------------------------------------------------------------ authentication
    def _client_mac(self, nonce: bytes, rank: int) -> bytes:
        """MAC a connecting rank proves group membership with."""
        return hmac.new(self.config.secret, _PROTO + b"|c|" + nonce + b"|" + self._uid + b"|" + _RANK.pack(rank),
                        hashlib.sha256).digest()

    def _server_mac(self, nonce: bytes, server: int, client: int) -> bytes:
        """MAC the accepting rank proves group membership with."""
        return hmac.new(self.config.secret, _PROTO + b"|s|" + nonce + b"|" + self._uid + b"|" + _RANK.pack(server)
                        + _RANK.pack(client), hashlib.sha256).digest()

    def _reject(self, ep: Any, reason: str) -> None:
        """Close an endpoint that failed authentication; count and log it, never raise."""
        self.stats["rejected_connections"] += 1
        logger.debug("ucx group %s rank %d: rejected incoming connection: %s", self.config.group_name,
                     self.config.rank, reason)
        if ep is not None:
            self._close_ep(ep)

    def _mac(self, *parts: bytes) -> bytes:
        """HMAC-SHA256 with the group secret over the protocol name, the group uid and ``parts``."""
        return hmac.new(self.config.secret, b"|".join((_PROTO, self._uid) + parts), hashlib.sha256).digest()

    def _hello_tag(self, server: int) -> int:
        """Tag a same-node client's HELLO arrives on at ``server``'s worker."""
        return _tag64(b"hello", self._uid, _RANK.pack(server))

    def _pair_keys(self, client: int, server: int, n_client: bytes, n_server: bytes) -> Tuple[bytes, bytes]:
        """(client->server, server->client) keys of an authenticated worker-address pair's wire tags."""
        base = self._mac(b"k", n_client, n_server, _RANK.pack(client), _RANK.pack(server))
        return (hmac.new(base, b"c2s", hashlib.sha256).digest(), hmac.new(base, b"s2c", hashlib.sha256).digest())

    async def _peer_waddr(self, peer: int) -> Tuple[str, bytes]:
        """(node id, worker address) ``peer`` published; node id '' when it takes listener endpoints only."""
        raw = await self._loop.run_in_executor(
            None, lambda: self.config.rendezvous.get(f"ucx/waddr/{peer}", self.config.timeout,
                                                     what=f"UCX worker address of rank {peer}"))
        node, _, addr = raw.partition(b"|")
        return node.decode("ascii", "replace"), addr

    async def _waddr_endpoint(self, addr: bytes) -> Any:
        """An endpoint to a same-node worker. UCX error handling is off: with it UCX refuses shared memory.
        Made like ucxx's ``create_endpoint_from_worker_address``, under the engine lock."""
        from ucxx._lib.libucxx import UCXAddress, UCXEndpoint
        from ucxx._lib_async.endpoint import Endpoint

        assert self._engine is not None
        with self._engine.lock:
            raw = UCXEndpoint.create_from_worker_address(self._ctx.worker, UCXAddress.create_from_buffer(addr), False)
        self._engine.wake()
        return Endpoint(endpoint=raw, ctx=self._ctx, tags=None)

    async def _io(self, ep: Any, buf: Any, tag: int, send: bool, force_tag: bool) -> None:
        """Send or receive ``buf`` on a ucxx endpoint with ``tag`` (hashed with the endpoint's random tag unless
        ``force_tag``, as ucxx's Endpoint.send/recv do); completed by the progress engine."""
        if not force_tag:
            tag = _hash64bits(ep._tags["msg_send" if send else "msg_recv"], hash(tag))

        def post() -> Any:
            raw = ep._ep
            if raw is None:
                raise ConnectionResetError("the UCX endpoint is closed")
            raw.raise_on_error()
            return (raw.tag_send if send else raw.tag_recv)(_Array(buf), _UCXXTag(tag))

        await self._await_op(post, buf)

    async def _worker_recv(self, buf: Any, tag: int) -> None:
        """Receive ``buf`` on this worker with ``tag`` from any endpoint (same-node hellos)."""
        worker = self._ctx.worker
        await self._await_op(lambda: worker.tag_recv(_Array(buf), _UCXXTag(tag)), buf)

    async def _await_op(self, factory: Any, keep: Any) -> None:
        """Post a request built by ``factory`` on the engine and await its completion."""
        if self._engine is None:
            raise self._closed_error(None, None)
        future = self._loop.create_future()
        self._engine.post(AwaitOp(factory, keep, self._loop, future))
        await future

    async def _accept_hellos(self) -> None:
        """Receive same-node HELLOs on our worker, one handshake task each (bounded: one per lower rank)."""
        tag = self._hello_tag(self.config.rank)
        while not (self._closed or self._aborted.is_set()):
            buf = bytearray(_HELLO.size)
            try:
                await self._worker_recv(buf, tag)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # truncated (wrong size) message from an outsider
                if self._closed or self._aborted.is_set():
                    return
                self._reject(None, f"malformed same-node hello: {type(e).__name__}: {e}")
                continue
            client, pid, started, n_client, mac = _HELLO.unpack(bytes(buf))
            if not hmac.compare_digest(mac, self._mac(b"h", _RANK.pack(client), _RANK.pack(self.config.rank),
                                                      _PROC.pack(pid, started), n_client)):
                self._reject(None, "same-node hello with a bad MAC (wrong group secret or group incarnation)")
            elif not 0 <= client < self.config.rank:
                self._reject(None, f"rank {client} may not connect to rank {self.config.rank}")
            elif client in self._hello_pending or self._peer(client).ready.done():
                self._reject(None, f"duplicate same-node connection from rank {client}")
            else:
                self._hello_pending.add(client)
                self._spawn(self._serve_hello(client, (pid, started or None), n_client))

    async def _serve_hello(self, client: int, proc: Proc, n_client: bytes) -> None:
        """Server side of a same-node handshake: challenge the client on a fresh endpoint to its worker."""
        ep = None
        try:
            node, addr = await asyncio.wait_for(self._peer_waddr(client), self._handshake_timeout)
            if node != self._node:
                self._reject(None, f"rank {client} says hello but is on another node")
                return
            ep = await asyncio.wait_for(self._waddr_endpoint(addr), self._handshake_timeout)
            n_server = os.urandom(_NONCE)
            me = _RANK.pack(self.config.rank)
            response = bytearray(_MAC)
            got = asyncio.ensure_future(self._io(ep, response, _tag64(b"resp", n_server), False, True))
            try:
                mine = _wire(identity())
                mac = self._mac(b"s", n_client, n_server, me, _RANK.pack(client), _PROC.pack(*mine))
                challenge = _CHALLENGE.pack(*mine, n_server, mac)
                await asyncio.wait_for(self._io(ep, bytearray(challenge), _tag64(b"chal", n_client), True, True),
                                       self._handshake_timeout)
                await asyncio.wait_for(got, self._handshake_timeout)
            finally:
                if not got.done():
                    got.cancel()
            if not hmac.compare_digest(bytes(response), self._mac(b"c", n_server, n_client, _RANK.pack(client), me)):
                self._reject(ep, "same-node handshake response with a bad MAC")
                return
            state = self._peer(client)
            if state.ready.done():
                self._reject(ep, f"duplicate same-node connection from rank {client}")
                return
            to_client, from_client = self._pair_keys(client, self.config.rank, n_client, n_server)[::-1]
            state.send_key, state.recv_key = to_client, from_client
            self._attach(client, state, ep, "worker-address", proc)
        except asyncio.CancelledError:
            if ep is not None:
                self._close_ep(ep)
            raise
        except BaseException as e:  # timeout, closed endpoint, rendezvous failure
            self._reject(ep, f"same-node handshake with rank {client} failed: {type(e).__name__}: {e}")
        finally:
            self._hello_pending.discard(client)

    async def _connect_same_node(self, peer: int, addr: bytes) -> Any:
        """Client side of a same-node handshake; returns the authenticated endpoint (keys set on the peer)."""
        ep = await asyncio.wait_for(self._waddr_endpoint(addr), self._handshake_timeout)
        try:
            me, them = _RANK.pack(self.config.rank), _RANK.pack(peer)
            n_client = os.urandom(_NONCE)
            challenge = bytearray(_CHALLENGE.size)
            got = asyncio.ensure_future(self._io(ep, challenge, _tag64(b"chal", n_client), False, True))
            try:
                mine = _wire(identity())
                hello = _HELLO.pack(self.config.rank, *mine, n_client,
                                    self._mac(b"h", me, them, _PROC.pack(*mine), n_client))
                await asyncio.wait_for(self._io(ep, bytearray(hello), self._hello_tag(peer), True, True),
                                       self._handshake_timeout)
                await asyncio.wait_for(got, self._handshake_timeout)
            finally:
                if not got.done():
                    got.cancel()
            pid, started, n_server, mac = _CHALLENGE.unpack(bytes(challenge))
            if not hmac.compare_digest(mac, self._mac(b"s", n_client, n_server, them, me, _PROC.pack(pid, started))):
                raise PeerUnavailableError(
                    f"rank {peer}'s worker failed authentication", **self._ectx(peer, "connect"),
                    hint="the address in the rendezvous belongs to another group incarnation or process")
            response = self._mac(b"c", n_server, n_client, me, them)
            await asyncio.wait_for(self._io(ep, bytearray(response), _tag64(b"resp", n_server), True, True),
                                   self._handshake_timeout)
        except BaseException:
            self._close_ep(ep)
            raise
        state = self._peer(peer)
        state.send_key, state.recv_key = self._pair_keys(self.config.rank, peer, n_client, n_server)
        return ep, (pid, started or None)

    def _close_ep(self, ep: Any) -> None:
        """Close a ucxx endpoint without raising (bounded by ucxx's close period); under the engine lock, since
        closing progresses the worker."""
        engine = self._engine
        try:
            if engine is None:
                ep.abort(period=10**8, max_attempts=1)
            else:
                with engine.lock:
                    ep.abort(period=10**8, max_attempts=1)
        except Exception:  # already closed or errored
            pass

    async def _on_connect(self, ep: Any) -> None:
        """Listener callback: authenticate a new endpoint, then attach it as the connection to that rank."""
        if self._closed or self._aborted.is_set():
            self._close_ep(ep)
            return
        try:
            nonce = os.urandom(_NONCE)
            await asyncio.wait_for(self._io(ep, bytearray(nonce), _HS_TAG_CHALLENGE, True, False),
                                   self._handshake_timeout)
            buf = bytearray(_RESPONSE.size)
            await asyncio.wait_for(self._io(ep, buf, _HS_TAG_RESPONSE, False, False), self._handshake_timeout)
            client, client_nonce, mac = _RESPONSE.unpack(bytes(buf))
        except asyncio.CancelledError:
            self._close_ep(ep)
            raise
        except BaseException as e:  # timeout, truncated or malformed message, closed endpoint
            self._reject(ep, f"handshake failed: {type(e).__name__}: {e}")
            return
        if not hmac.compare_digest(mac, self._client_mac(nonce, client)):
            self._reject(ep, "bad MAC (wrong group secret or group incarnation)")
            return
        if not 0 <= client < self.config.rank:
            self._reject(ep, f"rank {client} may not connect to rank {self.config.rank}")
            return
        state = self._peer(client)
        if state.ep is not None or state.ready.done():
            self._reject(ep, f"duplicate connection from rank {client}")
            return
        try:
            reply = _RANK.pack(1) + self._server_mac(client_nonce, self.config.rank, client)
            await asyncio.wait_for(self._io(ep, bytearray(reply), _HS_TAG_CONFIRM, True, False),
                                   self._handshake_timeout)
        except asyncio.CancelledError:
            self._close_ep(ep)
            raise
        except BaseException as e:
            self._reject(ep, f"handshake confirm failed: {type(e).__name__}: {e}")
            return
        if state.ready.done():  # raced with another authenticated connection or a failure
            self._reject(ep, f"duplicate connection from rank {client}")
            return
        self._attach(client, state, ep, "listener", None)

    async def _connect(self, peer: int, state: _Peer) -> None:
        """Connect to a higher rank, authenticate both ways and attach the endpoint."""
        ep = None
        try:
            raw = await self._loop.run_in_executor(
                None, lambda: self.config.rendezvous.get(f"ucx/addr/{peer}", self.config.timeout,
                                                         what=f"UCX address of rank {peer}"))
            host, _, port_s = raw.decode("ascii", "replace").rpartition(":")
            port = int(port_s)
            if not host or not 0 < port < 65536:
                raise ValueError(f"malformed address {raw!r}")
            node, addr = await asyncio.wait_for(self._peer_waddr(peer), self._handshake_timeout)
            if self._node and node == self._node:
                ep, proc = await self._connect_same_node(peer, addr)
                if state.ready.done():
                    self._close_ep(ep)
                    return
                self._attach(peer, state, ep, "worker-address", proc)
                return
            ep = await asyncio.wait_for(
                self._ctx.create_endpoint(host, port, endpoint_error_handling=True,
                                          connect_timeout=self._handshake_timeout),
                self._handshake_timeout)
            challenge = bytearray(_NONCE)
            await asyncio.wait_for(self._io(ep, challenge, _HS_TAG_CHALLENGE, False, False), self._handshake_timeout)
            my_nonce = os.urandom(_NONCE)
            response = _RESPONSE.pack(self.config.rank, my_nonce, self._client_mac(bytes(challenge), self.config.rank))
            await asyncio.wait_for(self._io(ep, bytearray(response), _HS_TAG_RESPONSE, True, False),
                                   self._handshake_timeout)
            confirm = bytearray(_RANK.size + _MAC)
            await asyncio.wait_for(self._io(ep, confirm, _HS_TAG_CONFIRM, False, False), self._handshake_timeout)
            if not hmac.compare_digest(bytes(confirm[_RANK.size:]), self._server_mac(my_nonce, peer, self.config.rank)):
                raise PeerUnavailableError(
                    f"rank {peer}'s listener failed authentication", **self._ectx(peer, "connect"),
                    hint="the address in the rendezvous belongs to another group incarnation or process")
        except asyncio.CancelledError:
            if ep is not None:
                self._close_ep(ep)
            raise
        except BaseException as e:
            if ep is not None:
                self._close_ep(ep)
            if isinstance(e, RdtError):
                err: BaseException = e
            else:
                err = PeerUnavailableError(
                    f"cannot connect to rank {peer}: {type(e).__name__}: {e}", **self._ectx(peer, "connect"),
                    hint="check that the peer is alive, created the group with the ucx backend, and that its "
                    "node IP is reachable (set RDT_UCX_HOST to override the advertised address)")
            self._fail_peer(peer, state, err)
            return
        if state.ready.done():
            self._close_ep(ep)
            return
        self._attach(peer, state, ep, "listener", None)

    def _attach(self, peer: int, state: _Peer, ep: Any, path: str, proc: Optional[Proc]) -> None:
        """Make an authenticated endpoint the pair's connection and start its control reader."""
        state.ep = ep
        state.path = path
        state.transports = _ep_transports(ep) or ("tcp" if path == "listener" else "")
        self.stats["connections"] += 1
        loop = self._loop
        if proc is not None and proc[0] != os.getpid():
            self._watch(peer, state, ep, proc)

        # Weak: ucxx's endpoint finalizer holds the callback's owner strongly, so a callback holding the backend or
        # the endpoint would keep both (and the UCX worker with its shared-memory segments) alive for ever.
        this, ep_ref = weakref.ref(self), weakref.ref(ep)

        def on_close() -> None:  # called from the UCX progress thread when the endpoint errors or closes
            backend, endpoint = this(), ep_ref()
            if backend is None or endpoint is None:
                return
            try:
                loop.call_soon_threadsafe(backend._on_ep_closed, peer, endpoint)
            except RuntimeError:  # loop already closed during shutdown
                pass

        try:
            ep.set_close_callback(on_close)
        except Exception:  # older ucxx without close callbacks: the reader still notices errors
            pass
        state.ready.set_result(ep)
        state.reader = loop.create_task(self._reader(peer, state, ep))
        if self._engine is not None:
            self._engine.wake()  # operations waiting for this connection post their requests now

    def _watch(self, peer: int, state: _Peer, ep: Any, proc: Proc) -> None:
        """Fail the peer when its process ``(pid, start time)``, from its authenticated handshake, exits: a
        same-node endpoint has no UCX error handling to tell us. The pidfd is checked to be that process (the pid
        may name a later one once the peer died)."""
        pid, started = proc
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError) as e:  # old kernel, or the process is already gone
            if isinstance(e, ProcessLookupError):
                self._fail_peer(peer, state, self._gone_error(peer, f"its process {pid} exited"))
            else:
                logger.debug("ucx rank %d: cannot watch rank %d's process %d: %s", self.config.rank, peer, pid, e)
            return
        if not process_alive(pid, started):  # after the open: while it holds, the pidfd is the peer's
            os.close(fd)
            self._fail_peer(peer, state, self._gone_error(peer, f"its process {pid} exited"))
            return
        state.pidfd = fd

        def exited() -> None:
            if state.ep is ep:
                self._fail_peer(peer, state, self._gone_error(peer, f"its process {pid} exited"))
            self._unwatch(state)

        self._loop.add_reader(fd, exited)

    def _unwatch(self, state: _Peer) -> None:
        """Stop watching a peer's process (loop thread)."""
        fd, state.pidfd = state.pidfd, None
        if fd is not None:
            try:
                self._loop.remove_reader(fd)
            finally:
                os.close(fd)

    def _gone_error(self, peer: int, why: str) -> PeerUnavailableError:
        """The error for operations on a peer that went away."""
        return PeerUnavailableError(f"connection to rank {peer} closed: {why}", **self._ectx(peer),
                                    hint="the peer died or destroyed the group; destroy and re-create the group")

    async def _precv(self, state: _Peer, buf: Any, tag: int) -> None:
        """Receive from the pair; on a worker-address pair only a keyed tag matches, which needs the secret."""
        if state.recv_key is None:
            await self._io(state.ep, buf, tag, False, False)
        else:
            await self._guarded(state, self._io(state.ep, buf, _wire_tag(state.recv_key, tag), False, True))

    async def _guarded(self, state: _Peer, coro: Any) -> None:
        """Await a UCX request on a worker-address pair, failing when the peer is declared dead (pidfd, BYE):
        without UCX error handling the request itself would wait forever."""
        if state.dead.done():
            coro.close()
            raise state.error or self._closed_error(None, None)
        op = asyncio.ensure_future(coro)
        try:
            await asyncio.wait([op, state.dead], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not op.done():
                op.cancel()
        if op.done() and not op.cancelled():
            op.result()
            return
        raise state.error or self._closed_error(None, None)

    def _on_ep_closed(self, peer: int, ep: Any) -> None:
        """Endpoint error/close callback (on the loop): fail everything waiting on that peer."""
        state = self._peers.get(peer)
        if state is not None and state.ep is ep:
            self._fail_peer(peer, state, PeerUnavailableError(
                f"connection to rank {peer} closed", **self._ectx(peer),
                hint="the peer died or destroyed the group; destroy and re-create the group"))

    def _fail_peer(self, peer: int, state: _Peer, err: BaseException) -> None:
        """Mark a peer unusable and fail every operation waiting on it."""
        if state.error is None:
            state.error = err
        if not state.dead.done():
            state.dead.set_result(None)
        if not state.ready.done():
            state.ready.set_exception(err)
        if self._engine is not None:
            self._engine.wake()  # operations on that peer fail at their next look

    # ------------------------------------------------------------------ control channel
    async def _reader(self, peer: int, state: _Peer, ep: Any) -> None:
        """Receive control records from one peer and dispatch them to waiting operations."""
        try:
            while True:
                buf = bytearray(_CTL.size)
                await self._precv(state, buf, _CTL_TAG)
                kind = _CTL.unpack(bytes(buf))[0]
                if kind == _BYE:
                    self._fail_peer(peer, state, self._gone_error(peer, "the peer aborted or shut down"))
                    return
                else:
                    logger.debug("ucx rank %d: unknown control record kind %d from rank %d", self.config.rank,
                                 kind, peer)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self._fail_peer(peer, state, PeerUnavailableError(
                f"connection to rank {peer} failed: {type(e).__name__}: {e}", **self._ectx(peer),
                hint="the peer died or destroyed the group; destroy and re-create the group"))

    def _spawn(self, coro: Any) -> "asyncio.Task[Any]":
        """Start a tracked task on the loop (cancelled at abort/shutdown)."""
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------------ operations
    _dtype_code = staticmethod(_dtype_code)
    _byte_view = staticmethod(_byte_view)

    def _ensure_connection(self, peer: int) -> None:
        """Have the loop connect to ``peer`` when we are the lower rank (idempotent; any thread)."""
        state = self._peers.get(peer)
        if state is not None and (state.ep is not None or state.error is not None or state.connecting):
            return
        try:
            self._loop.call_soon_threadsafe(self._connect_if_needed, peer)
        except RuntimeError:  # loop closed by shutdown: the operation fails on the closed check
            pass

    def _connect_if_needed(self, peer: int) -> None:
        """Loop thread: create the peer's state and start connecting if this rank is the client."""
        if self._closed or self._aborted.is_set():
            return
        state = self._peer(peer)
        if not state.ready.done() and self.config.rank < peer and not state.connecting:
            state.connecting = True
            self._spawn(self._connect(peer, state))

    def _wire(self, state: _Peer, subtag: int, send: bool) -> Any:
        """The UCX tag that carries ``subtag`` on this pair: keyed on worker-address pairs, hashed with the
        endpoint's random tag (as ucxx does) on listener pairs."""
        cache = state.tags
        tag = cache.get((send, subtag))
        if tag is None:
            if len(cache) >= 4096:
                cache.clear()
            if state.send_key is not None:
                tag = _UCXXTag(_wire_tag(state.send_key if send else state.recv_key, subtag))
            else:
                tag = _UCXXTag(_hash64bits(state.ep._tags["msg_send" if send else "msg_recv"], hash(subtag)))
            cache[(send, subtag)] = tag
        return tag

    def _raw_send(self, state: _Peer, buf: Any, subtag: int) -> Any:
        """Post a tag send on the pair (engine lock held); returns the ucxx request."""
        raw = state.ep._ep
        if raw is None:
            raise state.error or self._closed_error(None, None)
        return raw.tag_send(_Array(buf), self._wire(state, subtag, True))

    def _raw_recv(self, state: _Peer, buf: Any, subtag: int, array: Any = None) -> Any:
        """Post a tag receive on the pair (engine lock held); returns the ucxx request. ``array``: ucxx's view of
        ``buf`` when the caller keeps one."""
        raw = state.ep._ep
        if raw is None:
            raise state.error or self._closed_error(None, None)
        return raw.tag_recv(_Array(buf) if array is None else array, self._wire(state, subtag, False))

    def _take_buffer(self, size: int) -> Tuple[bytearray, Any]:
        """A receive buffer of ``size`` bytes (a verdict, or a header with the largest inline payload) and ucxx's
        view of it (engine lock held): reused, since making one costs an allocation and a buffer-protocol parse
        per message. The caller clears what it parses before posting."""
        spares = self._spares.get(size)
        if spares:
            return spares.pop()
        buf = bytearray(size)
        return buf, _Array(buf)

    def _give_buffer(self, spare: Tuple[bytearray, Any]) -> None:
        """Return a buffer whose receive completed and whose bytes were consumed (engine lock held)."""
        spares = self._spares.setdefault(len(spare[0]), [])
        if len(spares) < _SPARES_KEPT:
            spares.append(spare)

    @staticmethod
    def _host_bytes(tensor: torch.Tensor) -> memoryview:
        """The bytes of a contiguous host tensor, without a copy, valid while ``tensor`` lives (read through its
        address: a third of the cost of numpy's view, and any dtype)."""
        nbytes = tensor.numel() * tensor.element_size()
        if not nbytes:
            return memoryview(b"")
        return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")

    @staticmethod
    def _fill(tensor: torch.Tensor, data: memoryview) -> None:
        """Copy received bytes into ``tensor`` (host or CUDA)."""
        if tensor.is_cuda:
            tensor.detach().reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        else:
            UcxBackend._host_bytes(tensor)[:] = data

    def _mismatch(self, op: str, peer: int, tag: int, nbytes: int, dcode: int, their_nbytes: int,
                  their_dcode: int) -> TensorMismatchError:
        """The error both sides raise when the sender's and receiver's tensors differ."""
        theirs, mine = f"{their_nbytes} bytes of {_dtype_name(their_dcode)}", f"{nbytes} bytes of {_dtype_name(dcode)}"
        what = (f"rank {peer} expects {theirs} for tag {tag}, this rank sent {mine}" if op == "send" else
                f"rank {peer} sent {theirs} for tag {tag}, this rank expects {mine}")
        return TensorMismatchError(what, **self._ectx(peer, op),
                                   hint="both sides must use tensors of the same dtype and number of elements")

    def _cancelled(self, peer: int, tag: int, nbytes: int, later: Optional[int] = None) -> CommunicationError:
        """The error of a send whose receiver withdrew its timed-out receive (``later``: the send that reports it
        for an earlier fast send, which had completed)."""
        what = (f"rank {peer} cancelled its receive of tag {tag} ({nbytes} bytes): it timed out before this send "
                "reached it; nothing was delivered")
        if later is not None:
            what += f" (reported by the next send, tag {later}, which was not sent)"
        return CommunicationError(what, **self._ectx(peer, "send"),
                                  hint=f"see the error on rank {peer}; raise the timeout there, or destroy and "
                                  "re-create the group")

    def _withdraw(self, op: P2POp, error: BaseException) -> bool:
        """End a timed-out operation that UCX holds nothing of its tensor for (see _ucx_ops); True when it ended."""
        engine = self._engine
        if engine is None:
            return True
        with engine.lock:
            return op.done or op.withdraw(error)

    def _late_mismatch(self, peer: int, tag: int, earlier_tag: int, nbytes: int, dcode: int, their_nbytes: int,
                       their_dcode: int) -> TensorMismatchError:
        """The error a send raises when the peer refused this rank's previous (fast, already completed) send."""
        return TensorMismatchError(
            f"rank {peer} refused an earlier send (tag {earlier_tag}) of {nbytes} bytes of {_dtype_name(dcode)}: it "
            f"expected {their_nbytes} bytes of {_dtype_name(their_dcode)}. This send (tag {tag}) was already out and "
            "may still be delivered", **self._ectx(peer, "send"),
            hint="both sides must use tensors of the same dtype and number of elements; destroy and re-create the "
            "group (a small send like an earlier accepted one completes before the receiver checks it, so the "
            "next send to that peer reports the refusal)")

    def _op_error(self, op: Op, e: BaseException) -> BaseException:
        """Map an exception raised while advancing ``op`` to the error its Work raises."""
        if isinstance(e, RdtError):
            return e
        peer, kind = getattr(op, "peer", None), getattr(op, "kind", None)
        if self._aborted.is_set() or self._closed:
            return self._closed_error(peer, kind)
        return PeerUnavailableError(
            f"UCX {kind} failed: {type(e).__name__}: {e}", **self._ectx(peer, kind),
            hint="the peer died or closed the connection; destroy and re-create the group")

    def _post(self, op: str, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        """Validate, prepare the buffer in the caller's thread and start the operation on the engine."""
        if self._aborted.is_set() or self._closed:
            raise self._closed_error(peer, op)
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise InvalidArgumentError(f"bad peer {peer} for world size {self.world_size}", **self._ectx(peer, op),
                                       hint="pass another rank of the group")
        if not 0 <= tag < (1 << 31):
            raise InvalidArgumentError(f"tag {tag} out of range [0, 2**31)", **self._ectx(peer, op))
        if tensor.is_cuda:
            # Producers (send) must have finished writing and readers (recv) reading before UCX touches memory.
            torch.cuda.current_stream(tensor.device).synchronize()
        key = (op, peer, tag)
        with self._pending_lock:
            pending = self._pending.get(key)
            if pending is not None and not pending.done:
                raise InvalidArgumentError(f"a {op} with tag {tag} {'to' if op == 'send' else 'from'} rank {peer} "
                                           "is already pending", **self._ectx(peer, op),
                                           hint="use a unique tag per pending transfer")
            work_op: P2POp = (SendOp if op == "send" else RecvOp)(self, tensor, peer, tag)
            self._pending[key] = work_op  # until it finishes (_finished)
        engine = self._engine
        if engine is None:
            raise self._closed_error(peer, op)
        engine.post(work_op)
        return _UcxWork(self, work_op)

    def _finished(self, op: P2POp) -> None:
        """An operation ended: it leaves the pending table (engine lock held; the pending lock nests inside it)."""
        key = (op.kind, op.peer, op.tag)
        with self._pending_lock:
            if self._pending.get(key) is op:
                del self._pending[key]

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        """Post a send of ``tensor`` to ``peer`` with ``tag``."""
        return self._post("send", tensor, peer, tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        """Post a receive into ``tensor`` from ``peer`` with ``tag``."""
        return self._post("recv", tensor, peer, tag)

    def describe(self) -> Dict[str, Any]:
        """What UCX chose per connected peer ({peer: {"path": "worker-address", "transports": "sysv+posix+cma"}})
        and the connection counters; read from UCX's endpoint info, else from how the endpoint was made."""
        peers = {p: {"path": s.path, "transports": s.transports or "?"}
                 for p, s in sorted(list(self._peers.items())) if s.ep is not None and s.path}
        return {"backend": "ucx", "same_node_endpoints": bool(self._node), "peers": peers,
                "connections": int(self.stats["connections"]),
                "rejected_connections": int(self.stats["rejected_connections"])}

    def transports(self) -> str:
        """One label for what carries this rank's traffic: 'shm/cma' (same node), 'tcp', both ('shm/cma+tcp'),
        or '' before any connection."""
        kinds = []
        for s in list(self._peers.values()):
            if s.ep is None or not s.path:
                continue
            tls = set(s.transports.split("+")) if s.transports else set()
            kind = "shm/cma" if tls & _SHM_TLS else (s.transports or ("?" if s.path == "worker-address" else "tcp"))
            if kind not in kinds:
                kinds.append(kind)
        return "+".join(sorted(kinds))

    # ------------------------------------------------------------------ abort / shutdown
    def abort(self) -> None:
        """Fail pending and future operations at once; closes endpoints in the background, never blocks."""
        if self._aborted.is_set():
            return
        self._aborted.set()
        if self._engine is not None:
            self._engine.fail_all(self._closed_error(None, None))
        try:
            self._loop.call_soon_threadsafe(self._abort_in_loop)
        except RuntimeError:  # loop already closed
            pass

    def _abort_in_loop(self) -> None:
        """Cancel every operation and close every endpoint (on the loop thread)."""
        err = self._closed_error(None, None)
        for task in list(self._tasks):
            task.cancel()
        byes = []
        for peer, state in self._peers.items():
            self._fail_peer(peer, state, err)
            self._unwatch(state)
            if state.reader is not None:
                state.reader.cancel()
            if state.ep is not None and state.send_key is not None:
                byes.append(state)  # no UCX error handling on that endpoint: tell the peer, then close
            elif state.ep is not None:
                self._close_ep(state.ep)
        if byes and self._bye_task is None:
            self._bye_task = self._loop.create_task(self._say_bye(byes))

    async def _say_bye(self, states: "list[_Peer]") -> None:
        """Send BYE to same-node peers (bounded wait), then close their endpoints."""
        bye = _CTL.pack(_BYE, 0, 0, 0, 0, 0)  # sent unguarded: the peers are already marked failed on our side
        sends = [asyncio.ensure_future(self._io(s.ep, bytearray(bye), _wire_tag(s.send_key, _CTL_TAG), True, True))
                 for s in states if s.send_key is not None]
        try:
            await asyncio.wait(sends, timeout=0.5)
        finally:
            for f in sends:
                if not f.done():
                    f.cancel()
                elif not f.cancelled():
                    f.exception()
            for s in states:
                self._close_ep(s.ep)

    async def _close_all(self) -> None:
        """Cancel everything, close endpoints and the listener (on the loop thread)."""
        self._abort_in_loop()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        current = asyncio.current_task()
        if self._bye_task is not None:
            await asyncio.wait([self._bye_task], timeout=1.0)
        others = [t for t in asyncio.all_tasks(self._loop) if t is not current]
        for task in others:  # includes listener handshakes still in progress
            task.cancel()
        if others:
            await asyncio.wait(others, timeout=1.0)

    def shutdown(self) -> None:
        """Close endpoints and listener, stop UCX threads and the loop thread; idempotent, bounded in time."""
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True
        _UNCLOSED.discard(self)
        self._aborted.set()
        engine = self._engine
        if engine is not None:
            engine.fail_all(self._closed_error(None, None))
        if self._thread.is_alive():
            try:
                self._call(self._close_all(), timeout=5.0)
            except Exception as e:  # bounded: a stuck close must not hang shutdown
                logger.debug("ucx shutdown: closing endpoints failed: %s: %s", type(e).__name__, e)
        ctx = self._ctx
        if ctx is not None:
            self._stop_ucx_threads(ctx)
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=2.0)
        if not self._thread.is_alive() and not self._loop.is_closed():
            try:
                self._loop.close()
            except Exception as e:
                logger.debug("ucx shutdown: closing the loop failed: %s", e)
        self._peers.clear()
        with self._pending_lock:
            self._pending.clear()  # its operations hold UCX requests, and each request holds the worker
        self._ctx = None
        # The worker must be freed now, not at a later garbage collection or at interpreter exit, where UCX's
        # async thread would outlive it: endpoints and requests are still held in reference cycles (failed
        # peers' errors and cancelled tasks, through their tracebacks' frames), so collect them here.
        gc.collect()

    def _stop_ucx_threads(self, ctx: Any) -> None:
        """Stop the progress pump and ucxx's notifier thread, with bounded waits."""
        engine = self._engine
        if engine is not None and not engine.stop(timeout=2.0):
            logger.debug("ucx shutdown: the progress pump did not stop in time")
        notifier = getattr(ctx, "notifier_thread", None)
        if notifier is not None:
            try:
                ctx.notifier_thread_q.put("shutdown")
                ctx.worker.stop_request_notifier_thread()
            except Exception as e:
                logger.debug("ucx shutdown: stopping the notifier failed: %s", e)
            notifier.join(timeout=2.0)
            if not notifier.is_alive():
                ctx.notifier_thread = None

    def __del__(self) -> None:  # pragma: no cover - best effort for leaked backends
        try:
            if not self._closed and self._thread.is_alive():
                self.abort()
        except Exception:
            pass
