"""Gloo backend: one torch ``ProcessGroupGloo`` per named group, never the process-wide default group.

The group's Gloo connections are set up through a Store on Ray's GCS (see ``_rendezvous.RayKVStore``), so no
extra port or file is needed for rendezvous. Gloo does every collective natively; p2p uses tagged send/recv.
A Gloo op that times out closes the pair (Gloo cannot cancel it), which is why the group marks itself ERRORED.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from datetime import timedelta
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from .._proc import identity, process_alive, ray_node_id
from .._rendezvous import RayKVStore
from ..errors import (
    CollectiveTimeoutError,
    CommunicationError,
    GroupDestroyedError,
    PeerUnavailableError,
    TensorMismatchError,
)
from ..types import COLLECTIVE_OPS, Capabilities, ReduceOp
from . import _pair_sockets
from ._shm_allreduce import ShmAllreduce
from ._shm_barrier import ShmBarrier
from .base import TAG_KIND_OBJECT, TAG_KIND_SHIFT, Backend, BackendConfig, NativeCollectives, Work, is_object_tag

COLLECTIVE_WAITERS = 16  # threads that wait on collectives and user p2p calls, per group
OBJECT_WAITERS = 32  # threads that wait on rdt object sends and receives, per group: never starve collectives
SHM_MIN_BYTES = 1  # on one node the shared-memory path beats Gloo at every size (4 KiB, 4 ranks: ~1 ms vs ~7 ms)

logger = logging.getLogger("rdt_transports")

_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.AVG: dist.ReduceOp.SUM,  # Gloo has no AVG: sum, then divide
}


def classify(exc: BaseException, *, op: str, peer: Optional[int], timeout: float) -> Exception:
    """Map a Gloo RuntimeError to our typed errors by its message."""
    text = str(exc)
    low = text.lower()
    if "timed out" in low or "timeout" in low:
        return CollectiveTimeoutError(
            f"{op} did not complete within {timeout:.2f}s ({text.splitlines()[0][:200]})",
            peer=peer, op=op,
            hint="check that every rank makes the same call and none is dead or stuck; raise the timeout for "
            "large transfers",
        )
    if "mismatch" in low or "size" in low and "expected" in low:
        return TensorMismatchError(text.splitlines()[0][:300], peer=peer, op=op,
                                   hint="make the tensors on both sides the same size and dtype")
    if "connection" in low or "closed" in low or "reset" in low or "broken pipe" in low or "abort" in low:
        return PeerUnavailableError(
            f"{op} failed: a peer closed its connection ({text.splitlines()[0][:200]})", peer=peer, op=op,
            hint="a member of the group died or destroyed the group; re-form the group with live members",
        )
    return CommunicationError(f"{op} failed: {text.splitlines()[0][:300]}", peer=peer, op=op)


class _GlooWork(Work):
    """A posted Gloo op whose wait ends at once when the group is aborted.

    Gloo's own ``wait()`` cannot be interrupted, and ``ProcessGroupGloo.abort()`` does not wake it; only a closed
    connection or the timeout does (and a timeout closes the pair: Gloo cannot cancel an op any other way). When
    the backend knows its pair sockets (``direct``), the caller waits in Gloo itself and an abort shuts those
    sockets down, which ends every wait at once. Otherwise the blocking wait runs on a helper thread while the
    caller watches the abort flag (a thread hop: about 100 µs per wait here).
    """

    SPIN_S = 1e-4

    def __init__(self, work: Any, op: str, peer: Optional[int], aborted: threading.Event,
                 pool: ThreadPoolExecutor, spin: bool = True, direct: bool = False) -> None:
        self._work = work
        self._op = op
        self._peer = peer
        self._aborted = aborted
        self._pool = pool
        self._spin = spin
        self._direct = direct

    def _check_abort(self) -> None:
        if self._aborted.is_set():
            raise GroupDestroyedError(f"{self._op} ended: the group was aborted", peer=self._peer, op=self._op,
                                      hint="destroy the group and create it again")

    def _gloo_wait(self, deadline: float) -> None:
        """Gloo's own wait until ``deadline`` (monotonic; time spent queued for a waiter thread counts)."""
        timeout = max(deadline - time.monotonic(), 0.001)
        try:
            self._work.wait(timedelta(seconds=timeout))
        except RuntimeError as e:
            raise classify(e, op=self._op, peer=self._peer, timeout=timeout) from e

    def wait(self, timeout: float) -> None:
        self._check_abort()
        deadline = time.monotonic() + timeout
        if self._direct:
            try:
                return self._gloo_wait(deadline)
            except CollectiveTimeoutError:
                raise  # it timed out on its own: an abort meanwhile (a sibling's timeout) is not the cause
            except Exception:
                self._check_abort()  # the abort shut the pairs down: report the abort, not the closed connection
                raise
        if self._spin:
            spin_until = time.monotonic() + self.SPIN_S
            while time.monotonic() < spin_until:
                if self._work.is_completed():
                    return self._gloo_wait(deadline)
        future = self._pool.submit(self._gloo_wait, deadline)
        # Not future.result(timeout=...): its TimeoutError is the builtin one, which our own
        # CollectiveTimeoutError also is, so an except clause could not tell them apart.
        while not futures_wait([future], timeout=0.05).done:
            self._check_abort()
        try:
            return future.result()
        except CollectiveTimeoutError:
            raise  # it timed out on its own (see above)
        except Exception:
            self._check_abort()  # the abort closed the pairs: report the abort, not the closed connection
            raise


class _GlooNative(NativeCollectives):
    def __init__(self, pg: Any, world_size: int, aborted: threading.Event, pool: ThreadPoolExecutor) -> None:
        self._pg = pg
        self._world = world_size
        self._aborted = aborted
        self._pool = pool
        self.shm: Optional[ShmAllreduce] = None  # set when every rank is on this node
        self.direct = False  # set when the backend can wake blocked waits by shutting its pair sockets down

    def _wait(self, work: Any, op: str, timeout: float) -> None:
        _GlooWork(work, op, None, self._aborted, self._pool, direct=self.direct).wait(timeout)

    def run(self, name: str, timeout: float, **kw: Any) -> None:
        getattr(self, "_" + name)(timeout, **kw)

    def _avg(self, t: torch.Tensor, rop: ReduceOp) -> None:
        if rop is ReduceOp.AVG:
            t.div_(self._world)

    def _broadcast(self, timeout: float, tensor: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._wait(self._pg.broadcast([tensor], opts), "broadcast", timeout)

    def _allreduce(self, timeout: float, tensor: torch.Tensor, op: ReduceOp) -> None:
        if self.shm is not None and tensor.numel() * tensor.element_size() >= SHM_MIN_BYTES:
            deadline = time.monotonic() + timeout
            self.shm.run(tensor, op, lambda: max(deadline - time.monotonic(), 0.001))
            return
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[op]
        self._wait(self._pg.allreduce([tensor], opts), "allreduce", timeout)
        self._avg(tensor, op)

    def _reduce(self, timeout: float, tensor: torch.Tensor, root: int, op: ReduceOp) -> None:
        opts = dist.ReduceOptions()
        opts.reduceOp = _OPS[op]
        opts.rootRank = root
        self._wait(self._pg.reduce([tensor], opts), "reduce", timeout)
        if self._pg.rank() == root:
            self._avg(tensor, op)

    def _allgather(self, timeout: float, outputs: List[torch.Tensor], tensor: torch.Tensor) -> None:
        self._wait(self._pg.allgather([list(outputs)], [tensor]), "allgather", timeout)

    def _gather(self, timeout: float, outputs: Optional[List[torch.Tensor]], tensor: torch.Tensor, root: int) -> None:
        opts = dist.GatherOptions()
        opts.rootRank = root
        outs = [list(outputs)] if outputs is not None else []
        self._wait(self._pg.gather(outs, [tensor], opts), "gather", timeout)

    def _scatter(self, timeout: float, inputs: Optional[List[torch.Tensor]], tensor: torch.Tensor, root: int) -> None:
        opts = dist.ScatterOptions()
        opts.rootRank = root
        ins = [list(inputs)] if inputs is not None else []
        self._wait(self._pg.scatter([tensor], ins, opts), "scatter", timeout)

    def _reducescatter(self, timeout: float, tensor: torch.Tensor, inputs: List[torch.Tensor], op: ReduceOp) -> None:
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _OPS[op]
        flat_in = torch.cat([i.reshape(-1) for i in inputs])
        self._wait(self._pg._reduce_scatter_base(tensor.view(-1), flat_in, opts), "reducescatter", timeout)
        self._avg(tensor, op)

    def _alltoall(self, timeout: float, outputs: List[torch.Tensor], inputs: List[torch.Tensor]) -> None:
        self._wait(self._pg.alltoall(list(outputs), list(inputs), dist.AllToAllOptions()), "alltoall", timeout)

    def _barrier(self, timeout: float) -> None:
        opts = dist.BarrierOptions()
        opts.timeout = timedelta(seconds=timeout)
        self._wait(self._pg.barrier(opts), "barrier", timeout)


class GlooBackend(Backend):
    """torch.distributed Gloo for CPU tensors, with native collectives."""

    capabilities = Capabilities(
        name="gloo",
        devices=frozenset({"cpu"}),
        two_sided=True,
        one_sided=False,
        native_collectives=COLLECTIVE_OPS,
        native_reduce_ops=frozenset(ReduceOp),
        can_abort=True,
        checks_p2p_sizes=False,  # Gloo truncates or aborts the process on a size mismatch
        requires="torch",
    )

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        store = RayKVStore(config.rendezvous, config.timeout)
        before = _pair_sockets.snapshot()
        try:
            self.pg = dist.ProcessGroupGloo(store, config.rank, config.world_size, timedelta(seconds=config.timeout))
        except RuntimeError as e:
            raise classify(e, op="init", peer=None, timeout=config.timeout) from e
        self._pairs = _pair_sockets.find(before, config)  # None: waits take the helper-thread path
        self._aborted = threading.Event()
        # Two bounded pools: object transfers that wait on slow consumers never hold the threads collectives need.
        self._waiters = ThreadPoolExecutor(max_workers=COLLECTIVE_WAITERS,
                                           thread_name_prefix=f"rdt-gloo-{config.group_name}")
        self._object_waiters = ThreadPoolExecutor(max_workers=OBJECT_WAITERS,
                                                  thread_name_prefix=f"rdt-gloo-obj-{config.group_name}")
        self._native = _GlooNative(self.pg, config.world_size, self._aborted, self._waiters)
        self._native.direct = self._pairs is not None
        self._native.shm = self._single_node_shm(config)
        self._closed = False

    def _single_node_shm(self, config: BackendConfig) -> Optional[ShmAllreduce]:
        """A shared-memory allreduce when every rank runs on this Ray node (disable with RDT_GLOO_SHM=0)."""
        if os.environ.get("RDT_GLOO_SHM", "1") == "0" or config.world_size < 2:
            return None
        node = ray_node_id()
        barrier: Optional[ShmBarrier] = None
        if node:
            try:  # my semaphores exist before my pid is published, so peers can open them after the rendezvous
                barrier = ShmBarrier(config.group_uid, config.rank, config.world_size, config.secret, self._aborted)
            except OSError as e:
                logger.warning("rdt_transports: group=%s rank=%d: no shared-memory allreduce (%s)",
                               config.group_name, config.rank, e)
                node = ""  # an empty node tells every rank to keep Gloo's allreduce
        try:
            rdv = config.rendezvous
            pid, started = identity()
            rdv.put(f"gloo-node/{config.rank}", f"{node}|{pid}|{started}".encode())
            peers = [rdv.get(f"gloo-node/{r}", config.timeout, what=f"rank {r}'s node").decode().split("|")
                     for r in range(config.world_size)]
            if barrier is None or any(len(p) != 3 or p[0] != node or not p[2].isdigit() for p in peers):
                if barrier is not None:
                    barrier.close()
                return None
            pids = [int(p) for _, p, _ in peers]
            starts: List[Optional[int]] = [int(st) for _, _, st in peers]
            try:  # a private /dev/shm or pid namespace per rank (containers) shows here: all fall back to Gloo
                barrier.connect(pids, starts)
                ok = all(process_alive(p, st) for p, st in zip(pids, starts))
            except OSError as e:
                logger.warning("rdt_transports: group=%s rank=%d: no shared-memory allreduce (%s)",
                               config.group_name, config.rank, e)
                ok = False
            rdv.put(f"gloo-shm/{config.rank}", b"1" if ok else b"0")
            if not all(rdv.get(f"gloo-shm/{r}", config.timeout, what=f"rank {r}'s shared-memory check") == b"1"
                       for r in range(config.world_size)):
                barrier.close()
                return None
        except BaseException:
            if barrier is not None:
                barrier.close()
            raise
        return ShmAllreduce(config.group_uid, config.rank, pids, config.secret, barrier)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        return self._p2p("send", self.pg.send, tensor, peer, tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        return self._p2p("recv", self.pg.recv, tensor, peer, tag)

    def send_wait(self, tensor: torch.Tensor, peer: int, tag: int, timeout: float) -> None:
        """Send and wait in the caller's thread, in Gloo itself, where an abort can wake the wait (direct pairs)."""
        if self._pairs is None or (tag >> TAG_KIND_SHIFT) == TAG_KIND_OBJECT or self._aborted.is_set():
            self._p2p("send", self.pg.send, tensor, peer, tag).wait(timeout)
            return
        try:  # written out, not shared with recv_wait: a frame costs microseconds on this path
            self.pg.send([tensor], peer, tag).wait(timedelta(seconds=max(timeout, 0.001)))
        except RuntimeError as e:
            raise self._p2p_error("send", e, peer, timeout) from e

    def recv_wait(self, tensor: torch.Tensor, peer: int, tag: int, timeout: float) -> None:
        """Receive and wait in the caller's thread (see :meth:`send_wait`)."""
        if self._pairs is None or (tag >> TAG_KIND_SHIFT) == TAG_KIND_OBJECT or self._aborted.is_set():
            self._p2p("recv", self.pg.recv, tensor, peer, tag).wait(timeout)
            return
        try:
            self.pg.recv([tensor], peer, tag).wait(timedelta(seconds=max(timeout, 0.001)))
        except RuntimeError as e:
            raise self._p2p_error("recv", e, peer, timeout) from e

    def _p2p_error(self, op: str, e: RuntimeError, peer: int, timeout: float) -> Exception:
        """The typed error of a failed direct send/recv: an abort shuts the pairs down, and is reported as such."""
        if self._aborted.is_set():
            return GroupDestroyedError(f"{op} ended: the group was aborted", peer=peer, op=op,
                                       hint="destroy the group and create it again")
        return classify(e, op=op, peer=peer, timeout=timeout)

    def _p2p(self, op: str, post: Any, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        """Post a send/recv; a pair already closed (peer gone, group aborted) raises a typed error at once."""
        if self._aborted.is_set():
            raise GroupDestroyedError(f"{op} refused: the group was aborted", peer=peer, op=op,
                                      hint="destroy the group and create it again")
        try:
            work = post([tensor], peer, tag)
        except RuntimeError as e:
            raise classify(e, op=op, peer=peer, timeout=self.config.timeout) from e
        pool = self._object_waiters if is_object_tag(tag) else self._waiters
        return _GlooWork(work, op, peer, self._aborted, pool, spin=False, direct=self._pairs is not None)

    def native(self) -> Optional[NativeCollectives]:
        return self._native

    def abort(self) -> None:
        """Fail local waits, tell same-node peers through the shared-memory barrier, and close Gloo's pairs."""
        self._aborted.set()
        if self._native.shm is not None:
            self._native.shm.fail()
        if self._pairs is not None:
            _pair_sockets.shut(self._pairs)  # wakes every wait blocked in Gloo here, and the peers' on these pairs
        try:
            self.pg.abort()
        except Exception:  # abort is best effort by contract
            pass

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._native.shm is not None:
            self._native.shm.close()
        self._waiters.shutdown(wait=False)
        self._object_waiters.shutdown(wait=False)
        try:
            self.pg.shutdown()
        except Exception:
            pass
