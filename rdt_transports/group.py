"""A collective group in one process: validation, tags, lifecycle, and dispatch to native ops or p2p algorithms.

Every public call validates its arguments against the backend's capabilities before touching a peer, runs
under a deadline (group default or per-call ``timeout=``), and turns any failure into a typed error that names
the group, this rank, the peer (when known) and the operation. A failure after data started moving leaves the
group ERRORED: it refuses further calls until destroyed and re-formed, so a half-done collective can never
silently mismatch the next one.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple

import torch

from . import _lifecycle, algorithms
from ._checked_p2p import CheckedP2P
from ._tensors import FLOAT_DTYPES, SUPPORTED_DTYPES, as_torch, check_same, check_tensor, plain_if_empty
from .backends.base import TAG_KIND_OBJECT, TAG_KIND_P2P, TAG_KIND_SHIFT, Backend, Work
from .errors import (
    CollectiveTimeoutError,
    CommunicationError,
    GroupDestroyedError,
    GroupErroredError,
    InvalidArgumentError,
    PeerUnavailableError,
    RdtError,
    UnsupportedError,
)
from .types import GroupState, ReduceOp, Timeout, to_seconds

logger = logging.getLogger("rdt_transports")

# Tag layout (31 bits): kind (2 bits) << 29 | payload. Tags only need to be unique per (src, dst) pair.
TAG_COLLECTIVE = 0
TAG_P2P = TAG_KIND_P2P
TAG_OBJECT = TAG_KIND_OBJECT
_STEP_BITS = 14
_SEQ_MASK = (1 << (29 - _STEP_BITS)) - 1
_PAYLOAD_MASK = (1 << 29) - 1


ABORT_KEY = "abort"  # in an incarnation's rendezvous: published by GroupHandle.destroy()/abort() from the driver
ERRORED_KEY = "errored"  # in an incarnation's rendezvous: "<rank>|<error>" of the first member whose call timed out


def make_tag(kind: int, payload: int) -> int:
    return (kind << TAG_KIND_SHIFT) | (payload & _PAYLOAD_MASK)


class _OpChannel(algorithms.P2P):
    """The p2p view algorithms use for one collective call: step numbers become unique tags, waits share a deadline."""

    def __init__(self, group: "CollectiveGroup", seq: int, deadline: float, op: str,
                 device: Optional[torch.device] = None) -> None:
        self._group = group
        self._backend = group.backend
        self.rank = group.rank
        self.world_size = group.world_size
        # Where algorithms put scratch and barrier tokens: the op's tensors' device, else the backend's own
        # device for GPU-only backends (an int index, e.g. nccl), else CPU.
        if device is None and "cpu" not in self._backend.capabilities.devices:
            index = getattr(self._backend, "device", None)
            device = torch.device("cuda", index) if isinstance(index, int) else None
        self.device = device
        self._base = (seq & _SEQ_MASK) << _STEP_BITS
        self._deadline = deadline
        self._op = op

    def _tag(self, step: int) -> int:
        if not 0 <= step < (1 << _STEP_BITS):
            raise InvalidArgumentError(f"algorithm step {step} out of range", op=self._op)
        return make_tag(TAG_COLLECTIVE, self._base | step)

    def isend(self, tensor: torch.Tensor, peer: int, step: int) -> Work:
        return self._backend.isend(tensor, peer, self._tag(step))

    def irecv(self, tensor: torch.Tensor, peer: int, step: int) -> Work:
        return self._backend.irecv(tensor, peer, self._tag(step))

    def wait(self, *works: Work) -> None:
        for w in works:
            w.wait(max(self._deadline - time.monotonic(), 1e-3))


class CollectiveGroup:
    """One named group as seen by one rank. Created by init_collective_group; use the module functions or methods."""

    def __init__(self, name: str, uid: str, backend: Backend, timeout: float, on_destroy: Callable[[], None],
                 members: Optional[Sequence[str]] = None) -> None:
        self.name = name
        self.members: List[str] = list(members or [])  # actor id (hex) per rank, "" where unknown
        self.uid = uid
        self.backend = backend
        self.rank = backend.rank
        self.world_size = backend.world_size
        self.timeout = timeout
        self._state = GroupState.HEALTHY
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._send_seq: Dict[int, itertools.count] = {}
        self._recv_seq: Dict[int, itertools.count] = {}
        self._on_destroy = on_destroy
        self._call_ids = itertools.count()
        self._calls: Dict[int, float] = {}  # calls in flight: id -> monotonic start (as many as calling threads)
        self.stats: Dict[str, float] = {"ops": 0, "bytes": 0, "errors": 0}
        self.metrics: Optional[Any] = None  # rdt_transports._metrics.Metrics, set by the process context
        # send/recv check size and dtype here when the backend cannot (see _checked_p2p)
        self._checked = None if backend.capabilities.checks_p2p_sizes else CheckedP2P(backend, _left)
        self._devices = backend.capabilities.devices  # read on every call: kept at hand
        self._cpu_ok = "cpu" in self._devices  # `t.is_cpu` costs a fifth of `t.device.type`
        self._backend_name = backend.capabilities.name

    # ------------------------------------------------------------------ lifecycle
    @property
    def backend_name(self) -> str:
        return self._backend_name

    @property
    def state(self) -> GroupState:
        return self._state

    def errored(self) -> Optional[BaseException]:
        """The error that moved the group out of HEALTHY, or None."""
        return self._error

    def abort(self, reason: str = "aborted by user") -> None:
        """Fail pending and future calls at once (does not block); destroy() still has to be called."""
        with self._lock:
            if self._state in (GroupState.DESTROYED, GroupState.ABORTED):
                return
            self._state = GroupState.ABORTED
            self._error = GroupDestroyedError(reason, group=self.name, rank=self.rank)
        self.backend.abort()

    def destroy(self) -> None:
        """Release the backend's resources; idempotent."""
        with self._lock:
            if self._state is GroupState.DESTROYED:
                return
            self._state = GroupState.DESTROYED
        try:
            self.backend.shutdown()
        finally:
            self._on_destroy()

    def dead_ranks(self) -> List[int]:
        """Ranks whose actor Ray reports DEAD (asks the GCS; used to name the culprit after a failure)."""
        if not self.members:
            self.members = _read_members(self)
        dead = []
        for r, actor_id in enumerate(self.members):
            if r != self.rank and actor_id and _actor_state(actor_id) == "DEAD":
                dead.append(r)
        return dead

    def _abort_requested(self) -> Optional[str]:
        """The driver's abort record for this incarnation, if any (one GCS read; only on a failure path)."""
        try:
            value = self.backend.config.rendezvous.try_get(ABORT_KEY)
        except Exception:  # noqa: BLE001 - no Ray here, or the GCS is unreachable: no record known
            return None
        return value.decode(errors="replace") if value is not None else None

    def _teardown_reason(self) -> Optional[str]:
        """Why this group is being torn down, if it is: this process is exiting (its exit hook destroys every group,
        so a peer whose socket closed first, e.g. an actor ended by the exiting driver's handles, only won the
        race), or the driver published an abort record (a peer aborted on it before this rank read it)."""
        if _lifecycle.exiting():
            return "the process is exiting"
        return self._abort_requested()

    def blocked_for(self, now: float) -> float:
        """Seconds the oldest call in flight has been running (0 when none): the abort watcher's cue."""
        calls = list(self._calls.values())
        return now - min(calls) if calls else 0.0

    def _mark_errored(self, err: BaseException) -> None:
        """Leave HEALTHY for good; after a timeout also abort this rank's side of the backend.

        A timed-out op may still be half posted at a peer (Gloo closes the pairs itself); aborting closes this
        rank's connections and fails its shared-memory barrier, so every peer's pending and next call fails fast
        instead of waiting for its own timeout, with no GCS read per call.
        """
        with self._lock:
            first = self._state is GroupState.HEALTHY
            if first:
                self._state = GroupState.ERRORED
                self._error = err
        self.stats["errors"] += 1
        if first and isinstance(err, TimeoutError):
            try:
                self.backend.abort()
            except Exception as e:  # noqa: BLE001 - abort is best effort; the group is errored either way
                logger.warning("rdt_transports: group=%s rank=%d: abort after a timeout failed: %s", self.name,
                               self.rank, e)
            try:  # for peers with no connection to notice the abort (NIXL): their blocked calls read it
                self.backend.config.rendezvous.put(ERRORED_KEY, f"{self.rank}|{err}".encode(), overwrite=False)
            except Exception:  # noqa: BLE001 - no Ray here, or the GCS is unreachable: peers wait their timeout
                pass

    def peer_failed(self, record: bytes) -> None:
        """Another member's call timed out (its ERRORED_KEY record): error this group and end blocked calls."""
        text = record.decode(errors="replace")
        head, _, message = text.partition("|")
        peer = int(head) if head.isdigit() else None
        if peer == self.rank or self._state is not GroupState.HEALTHY:
            return
        # A timeout of the group's work at that rank, so a timeout here too (the same class a NIXL member would
        # get from its own wait a moment later).
        self._mark_errored(CollectiveTimeoutError(
            f"rank {peer} of the group timed out and aborted its side ({message[:300]})", group=self.name,
            rank=self.rank, peer=peer,
            hint="destroy the group on every member and create it again; see the error on that rank",
        ))
        self.backend.abort()

    def fail(self, err: BaseException) -> None:
        """Mark the group ERRORED because of ``err`` from work done outside its own calls (e.g. an object send)."""
        self._mark_errored(err)

    def _check_usable(self, op: str) -> None:
        state = self._state
        if state is GroupState.HEALTHY:
            return
        if state is GroupState.ERRORED:
            raise GroupErroredError(
                f"group is errored after an earlier failure ({self._error})",
                group=self.name,
                rank=self.rank,
                op=op,
                hint="call destroy_collective_group() on every member and create the group again "
                "(with a replacement for any dead member)",
            )
        raise GroupDestroyedError(
            f"group was {state.value}", group=self.name, rank=self.rank, op=op,
            hint="create the group again before using it",
        )

    # ------------------------------------------------------------------ helpers
    def _tensor(self, x: Any, what: str, op: str) -> torch.Tensor:
        try:
            t = as_torch(x, what=what)
            check_tensor(t, what=what, devices=self.backend.capabilities.devices, backend=self.backend_name)
        except RdtError as e:
            e_ctx = type(e)(e.message, group=self.name, rank=self.rank, op=op, hint=e.hint)
            raise e_ctx from None
        return t

    def _tensors(self, xs: Sequence[Any], what: str, op: str, ref: torch.Tensor, n: Optional[int] = None) -> List[torch.Tensor]:
        if not isinstance(xs, (list, tuple)):
            raise InvalidArgumentError(
                f"{what} must be a list of tensors, got {type(xs).__name__}", group=self.name, rank=self.rank, op=op,
                hint=f"pass a list of world_size ({self.world_size}) tensors",
            )
        n = self.world_size if n is None else n
        if len(xs) != n:
            raise InvalidArgumentError(
                f"{what} has {len(xs)} tensors but the group has world_size {self.world_size}",
                group=self.name, rank=self.rank, op=op, hint=f"pass exactly {n} tensors",
            )
        ts = [self._tensor(x, f"{what}[{i}]", op) for i, x in enumerate(xs)]
        try:
            check_same(ts, ref, what=what)
        except RdtError as e:
            raise InvalidArgumentError(e.message, group=self.name, rank=self.rank, op=op, hint=e.hint) from None
        return ts

    def _check_rank(self, r: Any, what: str, op: str) -> int:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.world_size:
            raise InvalidArgumentError(
                f"{what}={r!r} is not a rank of this group (world_size {self.world_size})",
                group=self.name, rank=self.rank, op=op, hint=f"use a rank in 0..{self.world_size - 1}",
            )
        return r

    def _check_op(self, reduce_op: Any, dtype: torch.dtype, op: str) -> ReduceOp:
        if not isinstance(reduce_op, ReduceOp):
            raise InvalidArgumentError(
                f"op must be a rdt_transports.ReduceOp, got {reduce_op!r}", group=self.name, rank=self.rank, op=op,
                hint="pass e.g. rdt_transports.ReduceOp.SUM (SUM, PRODUCT, MIN, MAX or AVG)",
            )
        if reduce_op is ReduceOp.AVG and dtype not in FLOAT_DTYPES:
            raise UnsupportedError(
                f"ReduceOp.AVG needs a floating-point dtype, got {dtype}", group=self.name, rank=self.rank, op=op,
                hint="use ReduceOp.SUM and divide, or cast to float",
            )
        return reduce_op

    def _algorithm(self, op: str, algorithm: str, nbytes: int) -> str:
        native = self.backend.native()
        if algorithm == "auto":
            if (native is not None and op in self.backend.capabilities.native_collectives
                    and not algorithms.prefers_p2p(op, nbytes)):
                return "native"
            return algorithms.choose(op, nbytes, self.world_size, self.backend_name)
        if algorithm == "native":
            if native is None or op not in self.backend.capabilities.native_collectives:
                raise UnsupportedError(
                    f"backend {self.backend_name!r} has no native {op}", group=self.name, rank=self.rank, op=op,
                    hint="use algorithm='auto', 'ring', 'bde' or 'tree'",
                )
            return "native"
        if algorithm not in algorithms.algorithms_for(op):
            raise InvalidArgumentError(
                f"unknown algorithm {algorithm!r} for {op}", group=self.name, rank=self.rank, op=op,
                hint="choose one of " + ", ".join(("auto", "native") + tuple(algorithms.algorithms_for(op))),
            )
        return algorithm

    def _run(self, op: str, timeout: Timeout, fn: Callable[[float], None], nbytes: int, peer: Optional[int] = None) -> None:
        """Run ``fn(deadline)`` with lifecycle checks and typed errors."""
        if self._state is not GroupState.HEALTHY:
            self._check_usable(op)
        start = time.monotonic()
        deadline = start + (self.timeout if timeout is None else to_seconds(timeout, self.timeout))
        call_id = next(self._call_ids)
        self._calls[call_id] = start
        try:
            fn(deadline)
        except BaseException as e:
            self._calls.pop(call_id, None)
            self._failed(op, nbytes, start, e, peer)
        self._calls.pop(call_id, None)
        self._done(op, nbytes, start, peer)

    def _done(self, op: str, nbytes: int, start: float, peer: Optional[int]) -> None:
        """A call returned: fail it if the group was aborted meanwhile, else count it."""
        if self._state is GroupState.ABORTED:
            raise GroupDestroyedError("group was aborted during the call", group=self.name, rank=self.rank, op=op)
        stats = self.stats
        stats["ops"] += 1
        stats["bytes"] += nbytes
        if self.metrics is not None:
            self.metrics.op(self._backend_name, op, nbytes, time.monotonic() - start, True)

    def _failed(self, op: str, nbytes: int, start: float, error: BaseException, peer: Optional[int]) -> NoReturn:
        """A call raised ``error``: record it, mark the group errored where it must, and raise the typed error
        that names this group, rank, op and any dead member."""
        self._record(op, nbytes, start, error, peer)
        try:
            raise error
        except RdtError as e:
            dead: List[int] = []
            failed = self._error
            if isinstance(e, GroupDestroyedError) and self._state is GroupState.ERRORED and isinstance(
                    failed, RdtError):  # the backend was aborted because the group errored: say why
                raise type(failed)(failed.message, group=self.name, rank=self.rank, peer=failed.peer, op=op,
                                   object_id=failed.object_id, hint=failed.hint) from e
            reason = self._teardown_reason() if isinstance(e, CommunicationError) else None
            if reason is not None:  # the group is being torn down, and a peer's side closed before this rank's
                self.abort(reason)
                raise GroupDestroyedError(f"{op} ended: {reason}", group=self.name, rank=self.rank, op=op,
                                          hint="create the group again before using it") from e
            if isinstance(e, (CommunicationError, CollectiveTimeoutError)):
                self._mark_errored(e)
                dead = self.dead_ranks()
                # A closed connection usually means a death the GCS has not recorded yet: ask again briefly.
                for _ in range(10 if isinstance(e, PeerUnavailableError) and not dead else 0):
                    time.sleep(0.2)
                    dead = self.dead_ranks()
                    if dead:
                        break
            if dead or e.group != self.name or e.op != op or e.rank != self.rank:  # name the user's op and the dead
                message = e.message + (f" (dead member rank(s): {dead})" if dead else "")
                new = type(e)(
                    message, group=self.name, rank=self.rank,
                    peer=e.peer if e.peer is not None else (dead[0] if len(dead) == 1 else peer),
                    op=op, object_id=e.object_id,
                    hint=(f"rank(s) {dead} died: destroy the group and re-form it with the survivors plus "
                          "replacements" if dead else e.hint),
                )
                new.dead_ranks = dead
                raise new from e
            raise
        except Exception as e:  # a library error we did not classify
            err = CommunicationError(
                f"{type(e).__name__}: {e}", group=self.name, rank=self.rank, peer=peer, op=op,
                hint="see the cause; the group is now errored: destroy and re-create it",
            )
            self._mark_errored(err)
            raise err from e

    def _record(self, op: str, nbytes: int, start: float, error: Optional[BaseException], peer: Optional[int]) -> None:
        """Metrics for one call, and a log line with its context when it failed."""
        if self.metrics is not None:
            self.metrics.op(self._backend_name, op, nbytes, time.monotonic() - start, error is None)
        if error is not None:
            logger.warning("rdt_transports: group=%s backend=%s rank=%d peer=%s op=%s failed after %.3fs: %s: %s",
                           self.name, self.backend_name, self.rank, peer, op, time.monotonic() - start,
                           type(error).__name__, str(error).splitlines()[0][:300] if str(error) else "")

    def _channel(self, op: str, deadline: float, device: Optional[torch.device] = None) -> _OpChannel:
        return _OpChannel(self, next(self._seq), deadline, op, device)

    def _native(self, name: str, deadline: float, **kw: Any) -> None:
        native = self.backend.native()
        assert native is not None
        native.run(name, max(deadline - time.monotonic(), 1e-3), **kw)

    # ------------------------------------------------------------------ point to point
    def _p2p_tag(self, table: Dict[int, itertools.count], peer: int) -> int:
        with self._lock:
            counter = table.setdefault(peer, itertools.count())
            return make_tag(TAG_P2P, next(counter))

    def send(self, tensor: Any, dst_rank: int, *, timeout: Timeout = None) -> None:
        self._p2p(_SEND, tensor, dst_rank, timeout)

    def recv(self, tensor: Any, src_rank: int, *, timeout: Timeout = None) -> None:
        self._p2p(_RECV, tensor, src_rank, timeout)

    def _p2p(self, way: _Way, tensor: Any, peer: Any, timeout: Timeout) -> None:
        """send or recv: :meth:`_run`'s checks and bookkeeping without its closure and extra frames. p2p is latency
        bound and Python runs cold after each blocking wait: with this path the receiver's CPU per 4 KiB Gloo
        message went from 71 to 63 us (ray.util.collective's wrapper: 59-60 us, bare ProcessGroupGloo 37 us)."""
        if not (type(tensor) is torch.Tensor and type(peer) is int and 0 <= peer < self.world_size
                and peer != self.rank and (dtype := tensor.dtype) in SUPPORTED_DTYPES and tensor.is_contiguous()
                and (((cpu := tensor.is_cpu) and self._cpu_ok) or tensor.device.type in self._devices)):
            tensor, peer = self._p2p_checked_args(way, tensor, peer)  # raises the typed error
            dtype, cpu = tensor.dtype, tensor.is_cpu
        if self._state is not GroupState.HEALTHY:
            self._check_usable(way.op)
        start = time.monotonic()
        deadline = start + (self.timeout if timeout is None else to_seconds(timeout, self.timeout))
        nbytes = tensor.nbytes
        if not nbytes:
            tensor = plain_if_empty(tensor)  # e.g. torch.from_numpy of a size-0 array: zero strides
        call_id = next(self._call_ids)
        calls = self._calls
        calls[call_id] = start
        try:
            if self._checked is not None:  # what was read above is passed on: a torch call costs ~1 us cold
                (self._checked.send if way is _SEND else self._checked.recv)(tensor, peer, deadline, nbytes, dtype,
                                                                            cpu)
            else:
                tag = self._p2p_tag(self._send_seq if way is _SEND else self._recv_seq, peer)
                post = self.backend.isend if way is _SEND else self.backend.irecv
                post(tensor, peer, tag).wait(_left(deadline))
        except BaseException as e:
            calls.pop(call_id, None)
            self._failed(way.op, nbytes, start, e, peer)
        calls.pop(call_id, None)
        if self._state is GroupState.HEALTHY and self.metrics is None:  # _done, written out
            stats = self.stats
            stats["ops"] += 1
            stats["bytes"] += nbytes
        else:
            self._done(way.op, nbytes, start, peer)

    def _p2p_checked_args(self, way: _Way, tensor: Any, peer: Any) -> Tuple[torch.Tensor, int]:
        """The tensor and peer of a send/recv that failed the inline check: converted, or a typed error."""
        t = self._tensor(tensor, "tensor", way.op)
        r = self._check_rank(peer, way.peer_arg, way.op)
        if r == self.rank:
            raise InvalidArgumentError(f"cannot {way.verb} self", group=self.name, rank=self.rank, peer=r, op=way.op,
                                       hint=f"pick another rank as {way.peer_arg}")
        return t, r

    # ------------------------------------------------------------------ collectives
    def _collective(self, name: str, algorithm: str, timeout: Timeout, nbytes: int, **kw: Any) -> None:
        algo = self._algorithm(name, algorithm, nbytes)

        def body(deadline: float) -> None:
            if algo == "native":
                self._native(name, deadline, **kw)
            else:
                algorithms.run(name, algo, self._channel(name, deadline, _device_of(kw)), **kw)

        self._run(name, timeout, body, nbytes)

    def broadcast(self, tensor: Any, src_rank: int = 0, *, algorithm: str = "auto", timeout: Timeout = None) -> None:
        t = self._tensor(tensor, "tensor", "broadcast")
        src = self._check_rank(src_rank, "src_rank", "broadcast")
        self._collective("broadcast", algorithm, timeout, _nbytes(t), tensor=t, root=src)

    def allreduce(self, tensor: Any, op: ReduceOp = ReduceOp.SUM, *, algorithm: str = "auto", timeout: Timeout = None) -> None:
        t = self._tensor(tensor, "tensor", "allreduce")
        rop = self._check_op(op, t.dtype, "allreduce")
        self._collective("allreduce", algorithm, timeout, _nbytes(t), tensor=t, op=rop)

    def reduce(self, tensor: Any, dst_rank: int = 0, op: ReduceOp = ReduceOp.SUM, *, algorithm: str = "auto",
               timeout: Timeout = None) -> None:
        t = self._tensor(tensor, "tensor", "reduce")
        dst = self._check_rank(dst_rank, "dst_rank", "reduce")
        rop = self._check_op(op, t.dtype, "reduce")
        self._collective("reduce", algorithm, timeout, _nbytes(t), tensor=t, root=dst, op=rop)

    def allgather(self, tensor_list: Sequence[Any], tensor: Any, *, algorithm: str = "auto", timeout: Timeout = None) -> None:
        t = self._tensor(tensor, "tensor", "allgather")
        outs = self._tensors(tensor_list, "tensor_list", "allgather", t)
        self._collective("allgather", algorithm, timeout, _nbytes(t) * self.world_size, outputs=outs, tensor=t)

    def gather(self, tensor: Any, gather_list: Optional[Sequence[Any]] = None, dst_rank: int = 0, *,
               algorithm: str = "auto", timeout: Timeout = None) -> None:
        t = self._tensor(tensor, "tensor", "gather")
        dst = self._check_rank(dst_rank, "dst_rank", "gather")
        outs = None
        if self.rank == dst:
            if gather_list is None:
                raise InvalidArgumentError("the destination rank must pass gather_list", group=self.name,
                                           rank=self.rank, op="gather", hint="pass world_size output tensors")
            outs = self._tensors(gather_list, "gather_list", "gather", t)
        self._collective("gather", algorithm, timeout, _nbytes(t), outputs=outs, tensor=t, root=dst)

    def scatter(self, tensor: Any, scatter_list: Optional[Sequence[Any]] = None, src_rank: int = 0, *,
                algorithm: str = "auto", timeout: Timeout = None) -> None:
        t = self._tensor(tensor, "tensor", "scatter")
        src = self._check_rank(src_rank, "src_rank", "scatter")
        ins = None
        if self.rank == src:
            if scatter_list is None:
                raise InvalidArgumentError("the source rank must pass scatter_list", group=self.name,
                                           rank=self.rank, op="scatter", hint="pass world_size input tensors")
            ins = self._tensors(scatter_list, "scatter_list", "scatter", t)
        self._collective("scatter", algorithm, timeout, _nbytes(t), inputs=ins, tensor=t, root=src)

    def reducescatter(self, tensor: Any, tensor_list: Sequence[Any], op: ReduceOp = ReduceOp.SUM, *,
                      algorithm: str = "auto", timeout: Timeout = None) -> None:
        t = self._tensor(tensor, "tensor", "reducescatter")
        ins = self._tensors(tensor_list, "tensor_list", "reducescatter", t)
        rop = self._check_op(op, t.dtype, "reducescatter")
        self._collective("reducescatter", algorithm, timeout, _nbytes(t) * self.world_size, tensor=t, inputs=ins, op=rop)

    def alltoall(self, output_list: Sequence[Any], input_list: Sequence[Any], *, algorithm: str = "auto",
                 timeout: Timeout = None) -> None:
        if not isinstance(input_list, (list, tuple)) or not input_list:
            raise InvalidArgumentError("input_list must be a non-empty list of tensors", group=self.name,
                                       rank=self.rank, op="alltoall",
                                       hint=f"pass a list of world_size ({self.world_size}) tensors")
        ref = self._tensor(input_list[0], "input_list[0]", "alltoall")
        ins = self._tensors(input_list, "input_list", "alltoall", ref)
        outs = self._tensors(output_list, "output_list", "alltoall", ref)
        self._collective("alltoall", algorithm, timeout, _nbytes(ref) * self.world_size, outputs=outs, inputs=ins)

    def barrier(self, *, algorithm: str = "auto", timeout: Timeout = None) -> None:
        self._collective("barrier", algorithm, timeout, 0)

    def __repr__(self) -> str:
        return (f"CollectiveGroup(name={self.name!r}, backend={self.backend_name!r}, rank={self.rank}, "
                f"world_size={self.world_size}, state={self._state.value})")


@dataclasses.dataclass(frozen=True)
class _Way:
    """One direction of p2p, as error messages name it."""

    op: str
    peer_arg: str
    verb: str


_SEND = _Way("send", "dst_rank", "send to")
_RECV = _Way("recv", "src_rank", "receive from")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _actor_state(actor_id: str) -> str:
    try:
        import ray._private.state

        info = ray._private.state.actors(actor_id)
        return str(info.get("State", "")) if isinstance(info, dict) else ""
    except Exception:  # diagnosis is best effort; never mask the original error
        return ""


def _read_members(group: "CollectiveGroup") -> List[str]:
    """Members' actor ids as published by each rank at join time (actor-side init)."""
    out = []
    rdv = group.backend.config.rendezvous
    for r in range(group.world_size):
        try:
            value = rdv.try_get(f"member/{r}")
        except Exception:
            value = None
        out.append(value.decode() if value else "")
    return out


def _device_of(kw: Dict[str, Any]) -> Optional[torch.device]:
    """The device of a collective's tensors (the first tensor found in its keyword arguments)."""
    for v in kw.values():
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.Tensor):
                return t.device
    return None


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 1e-3)


__all__ = ["CollectiveGroup", "make_tag", "TAG_OBJECT", "TAG_P2P", "TAG_COLLECTIVE", "PeerUnavailableError"]
