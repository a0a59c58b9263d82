"""Shared helpers for the p2p collective algorithms: chunking, reductions, exchanges and tree geometry.

Conventions used by every algorithm module:
  * tensors are handled as flat 1-D views (``flat(t)``); the caller guarantees contiguity;
  * a transfer whose size is zero is skipped; both sides compute sizes from the same (rank-independent)
    inputs, so they always skip the same transfers;
  * a *step* number is unique per directed (src, dst) pair within one call; algorithms with several phases
    give each phase its own block of step numbers (``base`` arguments).
"""

from __future__ import annotations

import abc
from typing import List, Optional, Sequence, Tuple

import torch

from ..backends.base import Work
from ..types import ReduceOp


class P2P(abc.ABC):
    """What an algorithm may use: this rank, the world size, and step-tagged isend/irecv."""

    rank: int
    world_size: int

    @abc.abstractmethod
    def isend(self, tensor: torch.Tensor, peer: int, step: int) -> Work: ...

    @abc.abstractmethod
    def irecv(self, tensor: torch.Tensor, peer: int, step: int) -> Work: ...

    @abc.abstractmethod
    def wait(self, *works: Work) -> None: ...


MAX_STEP = 1 << 14  # exclusive upper bound on step numbers accepted by the group's tag layout


def flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a contiguous tensor (works for 0-d tensors too), so algorithms can slice elements."""
    return t.view(-1)


def chunk_bounds(numel: int, parts: int) -> List[Tuple[int, int]]:
    """Split ``numel`` elements into ``parts`` balanced contiguous [start, end) ranges; some may be empty."""
    base, extra = divmod(numel, parts)
    bounds = []
    start = 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def span(bounds: Sequence[Tuple[int, int]], lo: int, hi: int) -> Tuple[int, int]:
    """Element range covered by chunks lo..hi-1 (lo < hi; contiguous because chunks are laid out in order)."""
    return bounds[lo][0], bounds[hi - 1][1]


def reduce_into(dst: torch.Tensor, src: torch.Tensor, op: ReduceOp) -> None:
    """dst = dst (op) src in place; AVG accumulates as SUM and is divided once at the end (see finish_avg)."""
    if dst.numel() == 0:
        return
    if op is ReduceOp.SUM or op is ReduceOp.AVG:
        dst.add_(src)
    elif op is ReduceOp.PRODUCT:
        dst.mul_(src)
    elif op is ReduceOp.MIN:
        torch.minimum(dst, src, out=dst)
    elif op is ReduceOp.MAX:
        torch.maximum(dst, src, out=dst)
    else:  # pragma: no cover - ReduceOp is closed
        raise ValueError(f"unsupported reduce op {op!r}")


def finish_avg(t: torch.Tensor, op: ReduceOp, world_size: int) -> None:
    """Turn a SUM into an AVG in place (caller guarantees a floating dtype); no-op for other ops."""
    if op is ReduceOp.AVG and t.numel() > 0:
        t.div_(world_size)


def post_send(p2p: "P2P", tensor: torch.Tensor, peer: int, step: int) -> Optional[Work]:
    """isend unless the tensor is empty (the receiver skips the matching receive identically)."""
    _check_step(step)
    if tensor.numel() == 0:
        return None
    return p2p.isend(tensor, peer, step)


def post_recv(p2p: "P2P", tensor: torch.Tensor, peer: int, step: int) -> Optional[Work]:
    """irecv unless the tensor is empty (the sender skips the matching send identically)."""
    _check_step(step)
    if tensor.numel() == 0:
        return None
    return p2p.irecv(tensor, peer, step)


def wait_all(p2p: "P2P", *works: Optional[Work]) -> None:
    """Wait for every posted work, ignoring the skipped (None) ones."""
    real = [w for w in works if w is not None]
    if real:
        p2p.wait(*real)


def exchange(
    p2p: "P2P",
    send: Optional[torch.Tensor],
    send_peer: int,
    recv: Optional[torch.Tensor],
    recv_peer: int,
    step: int,
) -> None:
    """Post the receive, then the send, and wait both, so two ranks exchanging never deadlock on rendezvous."""
    rw = post_recv(p2p, recv, recv_peer, step) if recv is not None else None
    sw = post_send(p2p, send, send_peer, step) if send is not None else None
    wait_all(p2p, rw, sw)


def send_blocking(p2p: "P2P", tensor: torch.Tensor, peer: int, step: int) -> None:
    """Send one tensor and wait for it."""
    wait_all(p2p, post_send(p2p, tensor, peer, step))


def recv_blocking(p2p: "P2P", tensor: torch.Tensor, peer: int, step: int) -> None:
    """Receive one tensor and wait for it."""
    wait_all(p2p, post_recv(p2p, tensor, peer, step))


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate flat views into one contiguous buffer so several blocks travel as one message."""
    if len(tensors) == 1:
        return flat(tensors[0])
    return torch.cat([flat(t) for t in tensors])


def unpack(buf: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``buf`` back into ``tensors`` (inverse of pack)."""
    start = 0
    for t in tensors:
        n = t.numel()
        flat(t).copy_(buf[start:start + n])
        start += n


def pow2_floor(n: int) -> int:
    """Largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def lowbit(v: int) -> int:
    """Lowest set bit of v (v > 0)."""
    return v & -v


def tree_parent(vr: int) -> int:
    """Parent of virtual rank vr (> 0) in the binomial tree rooted at virtual rank 0."""
    return vr - lowbit(vr)


def tree_children(vr: int, n: int) -> List[int]:
    """Children of virtual rank vr in a binomial tree of n nodes, nearest (smallest subtree) first."""
    limit = lowbit(vr) if vr else pow2_floor(n) << 1
    children = []
    m = 1
    while m < limit and vr + m < n:
        children.append(vr + m)
        m <<= 1
    return children


def subtree_size(vr: int, n: int) -> int:
    """Number of virtual ranks in vr's subtree; they are exactly vr .. vr+size-1."""
    if vr == 0:
        return n
    return min(lowbit(vr), n - vr)


def to_virtual(rank: int, root: int, n: int) -> int:
    """Virtual rank with ``root`` rotated to 0 (so trees and chains can assume root 0)."""
    return (rank - root) % n


def to_real(vr: int, root: int, n: int) -> int:
    """Inverse of to_virtual."""
    return (vr + root) % n


def _check_step(step: int) -> None:
    """Fail fast (before anything is posted) when an algorithm would overflow the step space."""
    if not 0 <= step < MAX_STEP:
        raise ValueError(f"algorithm step {step} outside [0, {MAX_STEP})")


def token(p2p: "P2P") -> torch.Tensor:
    """A one-byte message for barriers, on the channel's device when it names one (else CPU)."""
    device = getattr(p2p, "device", None) or "cpu"
    return torch.zeros(1, dtype=torch.uint8, device=device)
