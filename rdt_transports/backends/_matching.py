"""(peer, tag) matching on top of an *ordered wire* (one where the k-th send to a peer meets the k-th receive
posted for it, whatever the tags), with size/dtype checks and clean timeouts. Used by the nccl and tcp backends.

Protocol, receiver-driven, over the authenticated per-pair links of :mod:`._pairs`:

1. ``isend`` records the send and queues RTS(tag, nbytes, dtype) to the peer. Nothing touches the wire.
2. The receiver keeps posted receives and unexpected RTS per (peer, tag). When both exist it compares size and
   dtype. On a match, under the peer's lock, it posts the wire receive and then queues CTS(tag, ok): the order of
   CTS frames on the link is the order of wire receives. On a mismatch it queues CTS(tag, mismatch, its size and
   dtype) and fails its receive with TensorMismatchError at once.
3. The sender's reader handles CTS frames in arrival order and posts one wire send per ok, so the wire's send
   order equals the CTS order equals the wire's receive order; a mismatch fails the send at once.

So matching is by (peer, tag) whatever thread posts and in whatever order. Deadlines: a Work waits on an Event with
the time left. A receive that times out before its match is withdrawn (nothing was on the wire); a send that times
out before its CTS is withdrawn and CANCEL(tag) drops the peer's unexpected entry. A timeout after the wire took
the operation (or a CANCEL crossing a CTS) breaks the wire's order for that peer: the wire is *poisoned* for that
peer (:meth:`OrderedWire.fail_peer`) and the group errors as after any timeout.
"""

from __future__ import annotations

import abc
import threading
import time
from typing import Any, Dict, Optional, Tuple

import torch

from .. import _lifecycle
from ..errors import (
    CollectiveTimeoutError,
    GroupDestroyedError,
    InvalidArgumentError,
    PeerUnavailableError,
    RdtError,
    TensorMismatchError,
)
from . import _pairs
from ._pairs import CANCEL, CTS, DATA, RTS, Link
from .base import Backend, BackendConfig, Work

MAX_UNEXPECTED = 1 << 14  # RTS frames per peer waiting for their receive; more is a misbehaving peer
_OK, _MISMATCH = 1, 2
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
           torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128)


def dtype_code(dtype: torch.dtype) -> int:
    """Wire code of a dtype (0 when unknown; then sizes alone are compared)."""
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0


def dtype_name(code: int) -> str:
    return str(_DTYPES[code - 1]) if 0 < code <= len(_DTYPES) else f"dtype code {code}"


class WireOp(abc.ABC):
    """One operation the wire has taken."""

    @abc.abstractmethod
    def wait(self, deadline: float) -> None:
        """Block until done; CollectiveTimeoutError at ``deadline`` (monotonic), or the op's own typed error."""

    @abc.abstractmethod
    def done(self) -> bool:
        """Whether the op finished (successfully or not)."""


class OrderedWire(abc.ABC):
    """Per-direction FIFO data movement: the k-th send to a peer meets the k-th receive posted for it."""

    def bind(self, matcher: "Matcher") -> None:
        """Called once the matcher's links exist (a wire that rides on them keeps the reference)."""

    @abc.abstractmethod
    def prepare(self, tensor: torch.Tensor, peer: int, send: bool) -> Any:
        """Caller's thread, at post time: capture what the op needs then (e.g. an event on the current stream)."""

    @abc.abstractmethod
    def post_send(self, prepared: Any, peer: int, tag: int) -> WireOp:
        """Queue a send (never blocks; called from the link's reader thread)."""

    @abc.abstractmethod
    def post_recv(self, prepared: Any, peer: int, tag: int) -> WireOp:
        """Queue a receive (never blocks; called under the peer's matching lock)."""

    def on_data(self, link: Link, tag: int, nbytes: int) -> None:
        """A DATA frame arrived on ``link`` (only wires that ride on the links send them)."""
        raise ConnectionError(f"rank {link.peer} sent DATA on a control-only link")

    @abc.abstractmethod
    def fail_peer(self, peer: int, error: BaseException) -> None:
        """Poison the wire to and from ``peer``: fail what is in flight there with ``error``; never blocks."""

    def abort(self) -> None:
        """Fail everything in flight; never blocks."""

    def close(self) -> None:
        """Release the wire's resources."""


class _Pending:
    """One isend/irecv: waiting for its match, then carried by the wire."""

    __slots__ = ("send", "peer", "tag", "nbytes", "dtype", "device", "prepared", "settled", "op", "error",
                 "__weakref__")

    def __init__(self, send: bool, peer: int, tag: int, tensor: torch.Tensor, prepared: Any) -> None:
        self.send = send
        self.peer = peer
        self.tag = tag
        self.nbytes = tensor.numel() * tensor.element_size()
        self.dtype = dtype_code(tensor.dtype)
        self.device = 1 if tensor.is_cuda else 0
        self.prepared = prepared
        self.settled = threading.Event()  # set once the wire took it (op) or it failed (error)
        self.op: Optional[WireOp] = None
        self.error: Optional[BaseException] = None

    def commit(self, op: WireOp) -> None:
        self.op = op
        self.prepared = None
        self.settled.set()

    def fail(self, error: BaseException) -> None:
        if not self.settled.is_set():
            self.error = error
            self.prepared = None
            self.settled.set()


class _PeerState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.posted: Dict[int, _Pending] = {}  # receives waiting for their RTS
        self.unexpected: Dict[int, Tuple[int, int, int]] = {}  # tag -> (nbytes, dtype, device) of an early RTS
        self.sends: Dict[int, _Pending] = {}  # sends waiting for their CTS
        self.error: Optional[BaseException] = None  # the link is gone


class MatchWork(Work):
    """Handle of one matched operation."""

    def __init__(self, matcher: "Matcher", pending: _Pending) -> None:
        self._m = matcher
        self._p = pending

    def wait(self, timeout: float) -> None:
        p, m = self._p, self._m
        deadline = time.monotonic() + timeout
        op_name = "send" if p.send else "recv"
        if not p.settled.wait(max(deadline - time.monotonic(), 0.0)) and m._withdraw(p):
            raise CollectiveTimeoutError(
                f"{op_name} (tag {p.tag}) found no matching {'recv' if p.send else 'send'} at rank {p.peer} within "
                f"{timeout:.2f}s; nothing was transferred", **m._ctx(p.peer, op_name),
                hint=f"make rank {p.peer} post the matching call (same tag, size and dtype), or raise the timeout")
        if p.error is not None:
            raise p.error
        assert p.op is not None
        try:
            p.op.wait(deadline)
        except CollectiveTimeoutError as e:
            m._poison(p.peer, e)
            raise

    def is_completed(self) -> bool:
        p = self._p
        return p.error is not None or (p.op is not None and p.op.done())


class Matcher:
    """isend/irecv matched by (peer, tag) over an :class:`OrderedWire`, with the RTS/CTS links for control."""

    def __init__(self, config: BackendConfig, wire: OrderedWire, *, label: str, backend: str) -> None:
        self.config = config
        self.wire = wire
        self.backend = backend
        self.stats: Dict[str, int] = {"rejected_connections": 0, "connections": 0}
        self._aborted = False
        self._closed = False
        self._peers: Dict[int, _PeerState] = {r: _PeerState() for r in range(config.world_size)
                                              if r != config.rank}
        deadline = time.monotonic() + config.timeout
        self.links: Dict[int, Link] = _pairs.connect_pairs(config, label, deadline, self.stats)
        wire.bind(self)
        self._stopper = _lifecycle.at_exit(self.close)
        for link in self.links.values():
            link.start(self._on_frame, self._on_closed)

    # ------------------------------------------------------------------ helpers
    def _ctx(self, peer: Optional[int], op: Optional[str]) -> Dict[str, Any]:
        return {"group": self.config.group_name, "rank": self.config.rank, "peer": peer, "op": op}

    def _gone(self, peer: int, op: str) -> Optional[BaseException]:
        if self._aborted or self._closed:
            return GroupDestroyedError(f"the {self.backend} backend was aborted or shut down", **self._ctx(peer, op),
                                       hint="create the group again")
        return self._peers[peer].error

    def pending(self) -> int:
        """Entries in the matching tables (0 when idle): receives, early RTS and sends waiting for their match."""
        return sum(len(s.posted) + len(s.unexpected) + len(s.sends) for s in self._peers.values())

    # ------------------------------------------------------------------ posting (any thread)
    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        error = self._gone(peer, "send")
        if error is not None:
            raise error
        p = _Pending(True, peer, tag, tensor, self.wire.prepare(tensor, peer, True))
        st = self._peers[peer]
        with st.lock:
            if st.error is not None:
                raise st.error
            if tag in st.sends:
                raise InvalidArgumentError(f"a send with tag {tag} to rank {peer} is already pending",
                                           **self._ctx(peer, "send"), hint="tags must be unique per pair")
            st.sends[tag] = p
        self.links[peer].send_frame(RTS, tag, p.nbytes, p.dtype, p.device)
        return MatchWork(self, p)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        error = self._gone(peer, "recv")
        if error is not None:
            raise error
        p = _Pending(False, peer, tag, tensor, self.wire.prepare(tensor, peer, False))
        st = self._peers[peer]
        with st.lock:
            if st.error is not None:
                raise st.error
            if tag in st.posted:
                raise InvalidArgumentError(f"a recv with tag {tag} from rank {peer} is already pending",
                                           **self._ctx(peer, "recv"), hint="tags must be unique per pair")
            info = st.unexpected.pop(tag, None)
            if info is None:
                st.posted[tag] = p
            else:
                self._match(p, info)
        return MatchWork(self, p)

    def _match(self, p: _Pending, info: Tuple[int, int, int]) -> None:
        """The peer's lock is held: post the wire receive then CTS, or refuse with CTS(mismatch)."""
        nbytes, dtype, _device = info
        link = self.links[p.peer]
        if nbytes != p.nbytes or (dtype and p.dtype and dtype != p.dtype):
            link.send_frame(CTS, p.tag, p.nbytes, p.dtype, p.device, _MISMATCH)
            p.fail(TensorMismatchError(
                f"rank {p.peer} sends {nbytes} bytes of {dtype_name(dtype)} (tag {p.tag}) but this rank receives "
                f"into {p.nbytes} bytes of {dtype_name(p.dtype)}; nothing was transferred", **self._ctx(p.peer, "recv"),
                hint="make the recv tensor the same size and dtype as the sent tensor"))
            return
        try:
            op = self.wire.post_recv(p.prepared, p.peer, p.tag)
        except RdtError as e:
            link.send_frame(CTS, p.tag, p.nbytes, p.dtype, p.device, _MISMATCH)
            p.fail(e)
            return
        p.commit(op)
        link.send_frame(CTS, p.tag, flag=_OK)

    def _withdraw(self, p: _Pending) -> bool:
        """Take a timed-out op out of the tables if it never reached the wire (then CANCEL a send)."""
        st = self._peers[p.peer]
        with st.lock:
            table = st.sends if p.send else st.posted
            if table.get(p.tag) is not p:
                return False
            del table[p.tag]
            p.fail(CollectiveTimeoutError("withdrawn after its timeout", **self._ctx(p.peer, "send" if p.send else "recv")))
        if p.send:
            self.links[p.peer].send_frame(CANCEL, p.tag)
        return True

    # ------------------------------------------------------------------ link threads
    def _on_frame(self, link: Link, frame: _pairs.Frame) -> None:
        kind, dtype, device, flag, tag, nbytes, _aux = frame
        peer = link.peer
        st = self._peers[peer]
        if kind == RTS:
            with st.lock:
                p = st.posted.pop(tag, None)
                if p is not None:
                    self._match(p, (nbytes, dtype, device))
                    return
                if tag in st.unexpected or len(st.unexpected) >= MAX_UNEXPECTED:
                    raise ConnectionError(f"rank {peer} announced tag {tag} twice or too many early sends")
                st.unexpected[tag] = (nbytes, dtype, device)
        elif kind == CTS:
            with st.lock:
                p = st.sends.pop(tag, None)
            if p is None:  # our send timed out and sent CANCEL while the receiver committed: the order is broken
                self._poison(peer, CollectiveTimeoutError(
                    f"a send to rank {peer} (tag {tag}) timed out just as the receiver matched it",
                    **self._ctx(peer, "send"), hint="destroy and re-create the group; raise the timeout"))
                return
            if flag == _OK:
                try:
                    p.commit(self.wire.post_send(p.prepared, peer, tag))
                except RdtError as e:
                    p.fail(e)
            else:
                p.fail(TensorMismatchError(
                    f"rank {peer} receives into {nbytes} bytes of {dtype_name(dtype)} (tag {tag}) but this rank "
                    f"sends {p.nbytes} bytes of {dtype_name(p.dtype)}; nothing was transferred",
                    **self._ctx(peer, "send"),
                    hint="make the send tensor the same size and dtype as the receiver's tensor"))
        elif kind == CANCEL:
            with st.lock:
                known = st.unexpected.pop(tag, None) is not None
            if not known:  # the receive was already on the wire: its data will never come
                self._poison(peer, CollectiveTimeoutError(
                    f"rank {peer} gave up a send (tag {tag}) that this rank had already matched",
                    **self._ctx(peer, "recv"), hint="destroy and re-create the group; raise the timeout"))
        elif kind == DATA:
            self.wire.on_data(link, tag, nbytes)

    def _on_closed(self, link: Link, reason: BaseException) -> None:
        peer = link.peer
        if self._aborted or self._closed:
            err: BaseException = GroupDestroyedError(f"the {self.backend} backend was aborted or shut down",
                                                     **self._ctx(peer, None))
        elif isinstance(reason, RdtError):
            err = reason
        else:
            err = PeerUnavailableError(
                f"the connection to rank {peer} was lost ({reason})", **self._ctx(peer, None),
                hint=f"rank {peer} died, aborted or timed out; destroy the group and re-form it")
        self._fail_peer(peer, err)
        self.wire.fail_peer(peer, err)

    def _fail_peer(self, peer: int, err: BaseException) -> None:
        st = self._peers[peer]
        with st.lock:
            if st.error is None:
                st.error = err
            pendings = list(st.posted.values()) + list(st.sends.values())
            st.posted.clear()
            st.sends.clear()
            st.unexpected.clear()
        for p in pendings:
            p.fail(err)

    def _poison(self, peer: int, err: BaseException) -> None:
        """The wire's order with ``peer`` is broken: fail what is in flight with it and close the pair's link, so
        both sides refuse further traffic on the pair (the group errors, as after any timeout)."""
        self._fail_peer(peer, err)
        self.wire.fail_peer(peer, err)
        link = self.links.get(peer)
        if link is not None:
            link.close(err)

    # ------------------------------------------------------------------ lifecycle
    def abort(self) -> None:
        """Fail every pending Work with GroupDestroyedError now and close the links; never blocks."""
        self._aborted = True
        for peer in self._peers:
            self._fail_peer(peer, GroupDestroyedError(f"the {self.backend} backend was aborted",
                                                      **self._ctx(peer, None),
                                                      hint="create the group again"))
        self.wire.abort()
        for link in self.links.values():
            link.close(GroupDestroyedError("aborted"))

    def close(self) -> None:
        """Abort, then join the link threads (bounded) and release the wire; idempotent."""
        if self._closed:
            return
        self.abort()
        self._closed = True
        _lifecycle.cancel(self._stopper)
        for link in self.links.values():
            link.join(_lifecycle.JOIN_TIMEOUT_S)
        self.wire.close()


class MatchedBackend(Backend):
    """A backend whose point-to-point is the shared matcher over its ordered wire; subclasses set ``matcher``."""

    matcher: Matcher

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        return self.matcher.isend(tensor, peer, tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        return self.matcher.irecv(tensor, peer, tag)

    def abort(self) -> None:
        self.matcher.abort()

    def shutdown(self) -> None:
        self.matcher.close()
