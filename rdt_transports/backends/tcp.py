"""The tcp backend: CPU point-to-point over one authenticated TCP connection per pair of ranks, no extra package.

It is the reference *ordered-wire* backend: its wire is the pair's connection itself (DATA frames, sent after
the receiver's CTS, are read with ``recv_into`` straight into the target tensor), and matching by (peer, tag),
size/dtype checks, timeouts and aborts come from the shared matcher (:mod:`._matching`) that the NCCL backend
uses over its directional communicators. CI runs NCCL's matching logic through this backend. Collectives are
the group's p2p algorithms (no native ones). Security and limits are those of :mod:`._pairs`: HMAC
challenge-response with the group secret, only the group's ranks, listener closed after init, fixed frames.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Deque, Dict, Optional, Tuple

import torch

from ..errors import CollectiveTimeoutError, GroupDestroyedError
from ..types import Capabilities
from ._matching import MatchedBackend, Matcher, OrderedWire, WireOp
from ._pairs import Link
from .base import BackendConfig


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's own memory as a writable flat byte view (no copy; the tensor is contiguous)."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


class _SocketOp(WireOp):
    """A send or receive carried by a link's threads; completes when its bytes were written or read."""

    def __init__(self, backend: "TcpBackend", tensor: torch.Tensor, view: memoryview, peer: int, tag: int,
                 send: bool) -> None:
        self.tensor: Optional[torch.Tensor] = tensor  # keeps the memory alive while a thread may touch it
        self.view: Optional[memoryview] = view
        self._event = threading.Event()
        self._error: Optional[BaseException] = None
        self._backend = backend
        self.peer = peer
        self.tag = tag
        self.send = send

    def finish(self, error: Optional[BaseException]) -> None:
        if self._event.is_set():
            return
        self._error = error
        self._event.set()
        self.view = None
        self.tensor = None

    def wait(self, deadline: float) -> None:
        if not self._event.wait(max(deadline - time.monotonic(), 0.0)):
            op = "send" if self.send else "recv"
            raise CollectiveTimeoutError(
                f"tcp {op} (tag {self.tag}) was matched but its bytes did not move before the deadline; the "
                f"connection to rank {self.peer} was closed", group=self._backend.config.group_name,
                rank=self._backend.rank, peer=self.peer, op=op,
                hint="raise the timeout for large transfers, or check that the peer is not stuck")
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        return self._event.is_set()


class _SocketWire(OrderedWire):
    """The pair's TCP connection as the ordered wire: sends go to the link's writer, receives wait in a FIFO."""

    def __init__(self, backend: "TcpBackend") -> None:
        self._backend = backend
        self._m: Optional[Matcher] = None
        self._lock = threading.Lock()
        self._recvs: Dict[int, Deque[_SocketOp]] = collections.defaultdict(collections.deque)

    def bind(self, matcher: Matcher) -> None:
        self._m = matcher

    def prepare(self, tensor: torch.Tensor, peer: int, send: bool) -> Any:
        return tensor, _bytes_view(tensor)

    def post_send(self, prepared: Tuple[torch.Tensor, memoryview], peer: int, tag: int) -> WireOp:
        assert self._m is not None
        op = _SocketOp(self._backend, prepared[0], prepared[1], peer, tag, True)
        self._m.links[peer].send_data(tag, prepared[1], op.finish)
        return op

    def post_recv(self, prepared: Tuple[torch.Tensor, memoryview], peer: int, tag: int) -> WireOp:
        op = _SocketOp(self._backend, prepared[0], prepared[1], peer, tag, False)
        with self._lock:
            self._recvs[peer].append(op)
        return op

    def on_data(self, link: Link, tag: int, nbytes: int) -> None:
        with self._lock:
            queue = self._recvs.get(link.peer)
            op = queue.popleft() if queue else None
        if op is None or op.tag != tag or op.view is None or op.view.nbytes != nbytes:
            raise ConnectionError(f"rank {link.peer} sent {nbytes} bytes for tag {tag}, which no matched receive "
                                  "expects")
        try:
            link.read_into(op.view)
        except BaseException as e:
            op.finish(e)
            raise
        op.finish(None)

    def fail_peer(self, peer: int, error: BaseException) -> None:
        with self._lock:
            ops = list(self._recvs.pop(peer, ()))
        for op in ops:
            op.finish(error)
        if self._m is not None and peer in self._m.links:
            self._m.links[peer].close(error)  # the writer fails its queued sends; the peer sees the close

    def abort(self) -> None:
        with self._lock:
            peers = list(self._recvs)
        for peer in peers:
            self.fail_peer(peer, GroupDestroyedError("the tcp backend was aborted",
                                                     group=self._backend.config.group_name, rank=self._backend.rank,
                                                     peer=peer, hint="create the group again"))


class TcpBackend(MatchedBackend):
    """CPU tensors over authenticated per-pair TCP connections, matched by (peer, tag); no native collectives."""

    capabilities = Capabilities(
        name="tcp",
        devices=frozenset({"cpu"}),
        two_sided=True,
        one_sided=False,
        can_abort=True,
        checks_p2p_sizes=True,  # the matcher compares size and dtype before any byte moves
    )

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self._wire = _SocketWire(self)
        self.matcher = Matcher(config, self._wire, label="tcp", backend="tcp")
        self.stats = self.matcher.stats
