"""Gloo backend: one torch ``ProcessGroupGloo`` per named group, never the process-wide default group.

The group's Gloo connections are set up through a Store on Ray's GCS (see ``_rendezvous.RayKVStore``), so no
extra port or file is needed for rendezvous. Gloo does every collective natively; p2p uses tagged send/recv.
A Gloo op that times out closes the pair (Gloo cannot cancel it), which is why the group marks itself ERRORED.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from .._rendezvous import RayKVStore
from ..errors import CollectiveTimeoutError, CommunicationError, PeerUnavailableError, TensorMismatchError
from ..types import Capabilities, ReduceOp
from .base import Backend, BackendConfig, NativeCollectives, Work

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
    def __init__(self, work: Any, op: str, peer: Optional[int]) -> None:
        self._work = work
        self._op = op
        self._peer = peer

    def wait(self, timeout: float) -> None:
        try:
            self._work.wait(timedelta(seconds=timeout))
        except RuntimeError as e:
            raise classify(e, op=self._op, peer=self._peer, timeout=timeout) from e

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


class _GlooNative(NativeCollectives):
    def __init__(self, pg: Any, world_size: int) -> None:
        self._pg = pg
        self._world = world_size

    def _wait(self, work: Any, op: str, timeout: float) -> None:
        _GlooWork(work, op, None).wait(timeout)

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
        native_collectives=frozenset(
            {"broadcast", "allreduce", "reduce", "allgather", "gather", "scatter", "reducescatter", "alltoall",
             "barrier"}
        ),
        native_reduce_ops=frozenset(ReduceOp),
        can_abort=True,
        checks_p2p_sizes=False,  # Gloo truncates or aborts the process on a size mismatch
        requires="torch",
    )

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        store = RayKVStore(config.rendezvous, config.timeout)
        try:
            self.pg = dist.ProcessGroupGloo(store, config.rank, config.world_size, timedelta(seconds=config.timeout))
        except RuntimeError as e:
            raise classify(e, op="init", peer=None, timeout=config.timeout) from e
        self._native = _GlooNative(self.pg, config.world_size)
        self._closed = False

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        return _GlooWork(self.pg.send([tensor], peer, tag), "send", peer)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        return _GlooWork(self.pg.recv([tensor], peer, tag), "recv", peer)

    def native(self) -> Optional[NativeCollectives]:
        return self._native

    def abort(self) -> None:
        try:
            self.pg.abort()
        except Exception:  # abort is best effort by contract
            pass

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.pg.shutdown()
        except Exception:
            pass
