"""Ring and chain collectives: bandwidth-optimal for large messages (each link carries ~1x the data).

Rank r's ring neighbours are (r+1) % n (next) and (r-1) % n (prev). Rooted ops (broadcast, reduce, gather,
scatter) use the chain root -> root+1 -> ... (virtual ranks) and pipeline the data in chunks so that every
link is busy at once. Step numbers are the round (or chunk / block index), unique per directed pair.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..types import ReduceOp
from ._common import (
    P2P,
    chunk_bounds,
    exchange,
    finish_avg,
    flat,
    post_recv,
    post_send,
    recv_blocking,
    reduce_into,
    send_blocking,
    to_real,
    to_virtual,
    token,
    wait_all,
)

# Pipeline chunk for chained broadcast/reduce. From benchmarks/ measurements (to be tuned): big enough to
# amortise per-message overhead, small enough that the chain fills quickly.
PIPELINE_CHUNK_BYTES = 256 * 1024
# Broadcast chunks are larger: nothing is reduced per chunk, and 1 MiB keeps per-message costs small on TCP.
BROADCAST_CHUNK_BYTES = 1 << 20
MAX_PIPELINE_CHUNKS = 256  # keeps the step numbers (one per chunk) far below the 16384 limit


def pipeline_bounds(t: torch.Tensor, chunk_bytes: int) -> List[tuple]:
    """Element ranges of the pipeline chunks of flat ``t`` (identical on every rank: shapes match)."""
    numel = t.numel()
    if numel == 0:
        return []
    nbytes = numel * t.element_size()
    parts = min(numel, MAX_PIPELINE_CHUNKS, max(1, -(-nbytes // max(1, chunk_bytes))))
    return chunk_bounds(numel, parts)


def _ring_peers(p2p: "P2P") -> tuple:
    """(rank, world_size, next, prev) on the ring."""
    r, n = p2p.rank, p2p.world_size
    return r, n, (r + 1) % n, (r - 1) % n


# ---------------------------------------------------------------------------------------------- rooted (chain)
def broadcast(p2p: "P2P", tensor: torch.Tensor, root: int, chunk_bytes: int = BROADCAST_CHUNK_BYTES) -> None:
    """Pipelined chain broadcast: chunk k leaves rank v for rank v+1 as soon as it arrived from v-1."""
    n, vr = p2p.world_size, to_virtual(p2p.rank, root, p2p.world_size)
    buf = flat(tensor)
    bounds = pipeline_bounds(buf, chunk_bytes)
    prev = to_real(vr - 1, root, n) if vr > 0 else None
    nxt = to_real(vr + 1, root, n) if vr < n - 1 else None
    recvs = {}
    sends = []
    for k, (s, e) in enumerate(bounds):
        if prev is not None:
            for j in (k, k + 1):  # keep one receive posted ahead of the one we wait for
                if j < len(bounds) and j not in recvs:
                    recvs[j] = post_recv(p2p, buf[bounds[j][0]:bounds[j][1]], prev, j)
            wait_all(p2p, recvs.pop(k))
        if nxt is not None:
            sends.append(post_send(p2p, buf[s:e], nxt, k))
    wait_all(p2p, *sends)


def reduce(p2p: "P2P", tensor: torch.Tensor, root: int, op: ReduceOp,
           chunk_bytes: int = PIPELINE_CHUNK_BYTES) -> None:
    """Pipelined chain reduce toward root: virtual rank n-1 starts, each rank folds in its part and passes on."""
    n, vr = p2p.world_size, to_virtual(p2p.rank, root, p2p.world_size)
    src = to_real(vr + 1, root, n) if vr < n - 1 else None
    dst = to_real(vr - 1, root, n) if vr > 0 else None
    acc = flat(tensor)
    if src is not None and dst is not None:
        acc = acc.clone()  # inner chain node: keep the caller's input intact
    bounds = pipeline_bounds(acc, chunk_bytes)
    tmp = torch.empty_like(acc) if src is not None else None
    recvs = {}
    sends = []
    for k, (s, e) in enumerate(bounds):
        if src is not None:
            assert tmp is not None
            for j in (k, k + 1):
                if j < len(bounds) and j not in recvs:
                    recvs[j] = post_recv(p2p, tmp[bounds[j][0]:bounds[j][1]], src, j)
            wait_all(p2p, recvs.pop(k))
            reduce_into(acc[s:e], tmp[s:e], op)
        if dst is not None:
            sends.append(post_send(p2p, acc[s:e], dst, k))
    wait_all(p2p, *sends)
    if dst is None:
        finish_avg(acc, op, n)


def gather(p2p: "P2P", outputs: Optional[List[torch.Tensor]], tensor: torch.Tensor, root: int) -> None:
    """Chain gather: virtual rank v sends its block, then forwards blocks v+1..n-1 toward the root."""
    n, vr = p2p.world_size, to_virtual(p2p.rank, root, p2p.world_size)
    src = to_real(vr + 1, root, n) if vr < n - 1 else None
    if vr == 0:
        assert outputs is not None
        flat(outputs[root]).copy_(flat(tensor))
        # Block j is virtual rank j's tensor; all receives are posted at once, in arrival order.
        wait_all(p2p, *[post_recv(p2p, flat(outputs[to_real(j, root, n)]), src, j) for j in range(1, n)])
        return
    dst = to_real(vr - 1, root, n)
    pending = [post_send(p2p, flat(tensor), dst, vr)]
    bufs = [torch.empty_like(flat(tensor)) for _ in range(2 if src is not None else 0)]
    slot_send: List = [None, None]
    for idx, j in enumerate(range(vr + 1, n)):
        b = idx % 2
        wait_all(p2p, slot_send[b])  # double buffering: reuse a buffer only after its send finished
        recv_blocking(p2p, bufs[b], src, j)
        slot_send[b] = post_send(p2p, bufs[b], dst, j)
    wait_all(p2p, *pending, *slot_send)


def scatter(p2p: "P2P", inputs: Optional[List[torch.Tensor]], tensor: torch.Tensor, root: int) -> None:
    """Chain scatter: root emits blocks farthest-first; each rank forwards blocks beyond it and keeps its own."""
    n, vr = p2p.world_size, to_virtual(p2p.rank, root, p2p.world_size)
    nxt = to_real(vr + 1, root, n) if vr < n - 1 else None
    if vr == 0:
        assert inputs is not None
        works = [post_send(p2p, flat(inputs[to_real(j, root, n)]), nxt, j) for j in range(n - 1, 0, -1)]
        flat(tensor).copy_(flat(inputs[root]))
        wait_all(p2p, *works)
        return
    prev = to_real(vr - 1, root, n)
    bufs = [torch.empty_like(flat(tensor)) for _ in range(2 if nxt is not None else 0)]
    slot_send: List = [None, None]
    for idx, j in enumerate(range(n - 1, vr, -1)):
        b = idx % 2
        wait_all(p2p, slot_send[b])
        recv_blocking(p2p, bufs[b], prev, j)
        slot_send[b] = post_send(p2p, bufs[b], nxt, j)
    recv_blocking(p2p, flat(tensor), prev, vr)
    wait_all(p2p, *slot_send)


# ---------------------------------------------------------------------------------------------- all-to-all family
def reduce_scatter_inplace(p2p: "P2P", buf: torch.Tensor, bounds: List[tuple], op: ReduceOp, base: int) -> int:
    """Ring reduce-scatter over n chunks of flat ``buf`` in place; returns the chunk index this rank owns."""
    r, n, nxt, prev = _ring_peers(p2p)
    biggest = max(e - s for s, e in bounds)
    tmp = torch.empty(biggest, dtype=buf.dtype, device=buf.device)
    for step in range(n - 1):
        ss, se = bounds[(r - step) % n]
        rs, re_ = bounds[(r - step - 1) % n]
        exchange(p2p, buf[ss:se], nxt, tmp[:re_ - rs], prev, base + step)
        reduce_into(buf[rs:re_], tmp[:re_ - rs], op)
    return (r + 1) % n


def allgather_inplace(p2p: "P2P", buf: torch.Tensor, bounds: List[tuple], owned: int, base: int) -> None:
    """Ring allgather of n chunks of flat ``buf`` in place, starting from the chunk this rank owns."""
    r, n, nxt, prev = _ring_peers(p2p)
    for step in range(n - 1):
        ss, se = bounds[(owned - step) % n]
        rs, re_ = bounds[(owned - step - 1) % n]
        exchange(p2p, buf[ss:se], nxt, buf[rs:re_], prev, base + step)


def allreduce(p2p: "P2P", tensor: torch.Tensor, op: ReduceOp) -> None:
    """Ring reduce-scatter then ring allgather; each chunk is finished by one owner, so all ranks match bitwise."""
    n = p2p.world_size
    buf = flat(tensor)
    bounds = chunk_bounds(buf.numel(), n)
    owned = reduce_scatter_inplace(p2p, buf, bounds, op, 0)
    s, e = bounds[owned]
    finish_avg(buf[s:e], op, n)
    allgather_inplace(p2p, buf, bounds, owned, n - 1)


def allgather(p2p: "P2P", outputs: List[torch.Tensor], tensor: torch.Tensor) -> None:
    """Ring allgather: in round s, pass on the block received in round s-1."""
    r, n, nxt, prev = _ring_peers(p2p)
    flat(outputs[r]).copy_(flat(tensor))
    for step in range(n - 1):
        exchange(p2p, flat(outputs[(r - step) % n]), nxt, flat(outputs[(r - step - 1) % n]), prev, step)


def reducescatter(p2p: "P2P", tensor: torch.Tensor, inputs: List[torch.Tensor], op: ReduceOp) -> None:
    """Ring reduce-scatter over the input list; partial sums travel, inputs are never modified."""
    r, n, nxt, prev = _ring_peers(p2p)
    out = flat(tensor)
    bufs = [torch.empty_like(out), torch.empty_like(out)]
    send = flat(inputs[(r - 1) % n])
    for step in range(n - 1):
        recv = bufs[step % 2]
        exchange(p2p, send, nxt, recv, prev, step)
        reduce_into(recv, flat(inputs[(r - step - 2) % n]), op)
        send = recv
    out.copy_(send)
    finish_avg(out, op, n)


def alltoall(p2p: "P2P", outputs: List[torch.Tensor], inputs: List[torch.Tensor]) -> None:
    """Shifted pairwise exchange: in round s send to r+s and receive from r-s (n-1 rounds, no contention)."""
    r, n = p2p.rank, p2p.world_size
    flat(outputs[r]).copy_(flat(inputs[r]))
    for s in range(1, n):
        dst, src = (r + s) % n, (r - s) % n
        exchange(p2p, flat(inputs[dst]), dst, flat(outputs[src]), src, s)


def barrier(p2p: "P2P") -> None:
    """Two laps of a token around the ring: the first proves everyone arrived, the second releases them."""
    r, n, nxt, prev = _ring_peers(p2p)
    t = token(p2p)
    if r == 0:
        send_blocking(p2p, t, nxt, 0)
        recv_blocking(p2p, t, prev, 0)
        send_blocking(p2p, t, nxt, 1)
        return
    recv_blocking(p2p, t, prev, 0)
    send_blocking(p2p, t, nxt, 0)
    recv_blocking(p2p, t, prev, 1)
    if r < n - 1:
        send_blocking(p2p, t, nxt, 1)
