"""An in-process wire with NCCL's matching rule, for CPU tests: per direction, the k-th send meets the k-th recv.

Tags are ignored and sizes are not checked (the copy takes the shorter length), exactly what NCCL's directional
communicators do. ``MatchedFifoBackend`` is the NCCL backend's p2p design after issue 13: the matcher
(:class:`rdt_transports.backends._matching.Matcher`) over ``FifoWire``.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch

from rdt_transports.backends._matching import MatchedBackend, Matcher, OrderedWire, WireOp
from rdt_transports.backends.base import Backend, BackendConfig, Work
from rdt_transports.errors import CollectiveTimeoutError, GroupDestroyedError
from rdt_transports.types import Capabilities


class FifoOp:
    """One side of a transfer on the hub; done once both sides are posted and the bytes were copied."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.event = threading.Event()
        self.error: Optional[BaseException] = None

    def wait(self, deadline: float) -> bool:
        """True when done in time (raises the op's error); False at the deadline."""
        if not self.event.wait(max(deadline - time.monotonic(), 0.0)):
            return False
        if self.error is not None:
            raise self.error
        return True

    def done(self) -> bool:
        return self.event.is_set()


class FifoHub:
    """Every direction's queues of one simulated group."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sends: Dict[Tuple[int, int], Deque[FifoOp]] = collections.defaultdict(collections.deque)
        self._recvs: Dict[Tuple[int, int], Deque[FifoOp]] = collections.defaultdict(collections.deque)
        self.aborted: set = set()

    def post(self, src: int, dst: int, tensor: torch.Tensor, is_send: bool) -> FifoOp:
        op = FifoOp(tensor)
        with self._lock:
            if (src, dst) in self.aborted:
                op.error = GroupDestroyedError(f"direction {src}->{dst} was aborted")
                op.event.set()
                return op
            (self._sends if is_send else self._recvs)[(src, dst)].append(op)
            sends, recvs = self._sends[(src, dst)], self._recvs[(src, dst)]
            while sends and recvs:
                s, r = sends.popleft(), recvs.popleft()
                a = s.tensor.reshape(-1).view(torch.uint8)
                b = r.tensor.reshape(-1).view(torch.uint8)
                n = min(a.numel(), b.numel())
                b[:n].copy_(a[:n])
                s.event.set()
                r.event.set()
        return op

    def abort(self, src: int, dst: int) -> None:
        """Fail what is queued on one direction and refuse later posts (what ncclCommAbort does)."""
        with self._lock:
            self.aborted.add((src, dst))
            ops = list(self._sends.pop((src, dst), ())) + list(self._recvs.pop((src, dst), ()))
        for op in ops:
            op.error = GroupDestroyedError(f"direction {src}->{dst} was aborted")
            op.event.set()


class LocalRendezvous:
    """A dict with the Rendezvous calls the backends use, for ranks that are threads of one process."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._kv: Dict[str, bytes] = {}
        self.group_name = "local"

    def put(self, key: str, value: bytes, overwrite: bool = True) -> bool:
        with self._cv:
            if not overwrite and key in self._kv:
                return False
            self._kv[key] = value
            self._cv.notify_all()
            return True

    def try_get(self, key: str) -> Optional[bytes]:
        with self._cv:
            return self._kv.get(key)

    def get(self, key: str, timeout: float, what: str = "") -> bytes:
        deadline = time.monotonic() + timeout
        with self._cv:
            while key not in self._kv:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeoutError(f"rendezvous timed out waiting for {what or key!r}",
                                                 op="rendezvous")
                self._cv.wait(left)
            return self._kv[key]


class CountingBackend(Backend):
    """Delegates to ``inner`` and counts the receives posted per peer (to order threads in a test)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner.config)
        self.inner = inner
        self.capabilities = inner.capabilities  # type: ignore[misc]
        self.recvs: Dict[int, int] = collections.Counter()

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        return self.inner.isend(tensor, peer, tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        work = self.inner.irecv(tensor, peer, tag)
        self.recvs[peer] += 1
        return work

    def abort(self) -> None:
        self.inner.abort()

    def shutdown(self) -> None:
        self.inner.shutdown()


def wait_until(predicate: Any, timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class _FifoWireOp(WireOp):
    def __init__(self, op: FifoOp, peer: int) -> None:
        self._op = op
        self._peer = peer

    def wait(self, deadline: float) -> None:
        if not self._op.wait(deadline):
            raise CollectiveTimeoutError(f"the wire op with rank {self._peer} did not complete", peer=self._peer)

    def done(self) -> bool:
        return self._op.done()


class FifoWire(OrderedWire):
    """The hub as an OrderedWire for one rank: what the NCCL backend's directional communicators are."""

    def __init__(self, hub: FifoHub, rank: int) -> None:
        self.hub = hub
        self.rank = rank

    def prepare(self, tensor: torch.Tensor, peer: int, send: bool) -> Any:
        return tensor

    def post_send(self, prepared: Any, peer: int, tag: int) -> WireOp:
        return _FifoWireOp(self.hub.post(self.rank, peer, prepared, True), peer)

    def post_recv(self, prepared: Any, peer: int, tag: int) -> WireOp:
        return _FifoWireOp(self.hub.post(peer, self.rank, prepared, False), peer)

    def fail_peer(self, peer: int, error: BaseException) -> None:
        self.hub.abort(self.rank, peer)
        self.hub.abort(peer, self.rank)


class MatchedFifoBackend(MatchedBackend):
    """The NCCL backend's p2p design after issue 13: the matcher's RTS/CTS over sockets, data on the FIFO wire."""

    capabilities = Capabilities(name="fifo", devices=frozenset({"cpu"}), checks_p2p_sizes=True)

    def __init__(self, config: BackendConfig, hub: FifoHub) -> None:
        super().__init__(config)
        self.hub = hub
        self.matcher = Matcher(config, FifoWire(hub, config.rank), label="fifo", backend="fifo")


def make_ranks(cls: Any, world: int, timeout: float, secret: bytes, *extra: Any,
               secrets: Optional[Dict[int, bytes]] = None) -> List[Any]:
    """``world`` backends of one fresh group, each built on its own thread (init connects the ranks)."""
    rdv = LocalRendezvous()
    uid = uuid.uuid4().hex
    out: List[Any] = [None] * world
    errors: List[BaseException] = []

    def build(r: int) -> None:
        try:
            key = (secrets or {}).get(r, secret)
            out[r] = cls(BackendConfig("threaded", uid, r, world, timeout, key, rdv), *extra)  # type: ignore[arg-type]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            out[r] = e

    threads = [threading.Thread(target=build, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return out
