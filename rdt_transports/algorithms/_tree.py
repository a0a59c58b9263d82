"""Binomial-tree (minimum spanning tree) collectives: latency-optimal (ceil(log2 n) rounds) for small messages.

Every tree is rooted at virtual rank 0; ``to_virtual``/``to_real`` rotate ranks so any root works. A node's
subtree covers the contiguous virtual ranks vr .. vr+subtree_size-1, which lets gather/scatter move whole
subtrees as one contiguous slice of a buffer laid out in virtual-rank order. Each (parent, child) pair talks
once per phase, so one step number per phase is enough.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..types import ReduceOp
from ._common import (
    P2P,
    finish_avg,
    flat,
    pack,
    post_recv,
    post_send,
    recv_blocking,
    reduce_into,
    send_blocking,
    subtree_size,
    to_real,
    to_virtual,
    token,
    tree_children,
    tree_parent,
    unpack,
    wait_all,
)


# ---------------------------------------------------------------------------------------------- building blocks
def bcast_buffer(p2p: "P2P", buf: torch.Tensor, root: int, step: int) -> None:
    """Broadcast a flat buffer from root down the binomial tree (receive from parent, then feed children)."""
    n, vr = p2p.world_size, to_virtual(p2p.rank, root, p2p.world_size)
    if vr:
        recv_blocking(p2p, buf, to_real(tree_parent(vr), root, n), step)
    # Largest subtree first: it has the longest way to go.
    works = [post_send(p2p, buf, to_real(c, root, n), step) for c in reversed(tree_children(vr, n))]
    wait_all(p2p, *works)


def reduce_buffer(p2p: "P2P", acc: torch.Tensor, root: int, op: ReduceOp, step: int) -> None:
    """Reduce flat ``acc`` (overwritten on inner nodes) up the tree; the full result ends in root's ``acc``."""
    n, vr = p2p.world_size, to_virtual(p2p.rank, root, p2p.world_size)
    children = tree_children(vr, n)
    tmps = [torch.empty_like(acc) for _ in children]
    works = [post_recv(p2p, t, to_real(c, root, n), step) for t, c in zip(tmps, children)]
    for w, t in zip(works, tmps):  # fixed child order: the result does not depend on arrival order
        wait_all(p2p, w)
        reduce_into(acc, t, op)
    if vr:
        send_blocking(p2p, acc, to_real(tree_parent(vr), root, n), step)


def gather_blocks(p2p: "P2P", own: torch.Tensor, root: int, step: int) -> Optional[torch.Tensor]:
    """Gather every rank's flat block up the tree; root gets an n-block buffer in virtual-rank order."""
    n, vr = p2p.world_size, to_virtual(p2p.rank, root, p2p.world_size)
    m = own.numel()
    buf = torch.empty(subtree_size(vr, n) * m, dtype=own.dtype, device=own.device)
    buf[:m].copy_(own)
    works = []
    for c in tree_children(vr, n):
        lo = (c - vr) * m
        works.append(post_recv(p2p, buf[lo:lo + subtree_size(c, n) * m], to_real(c, root, n), step))
    wait_all(p2p, *works)
    if vr:
        send_blocking(p2p, buf, to_real(tree_parent(vr), root, n), step)
        return None
    return buf


def scatter_blocks(p2p: "P2P", buf: Optional[torch.Tensor], m: int, like: torch.Tensor, root: int,
                   step: int) -> torch.Tensor:
    """Scatter root's n-block buffer (virtual-rank order) down the tree; returns this rank's block."""
    n, vr = p2p.world_size, to_virtual(p2p.rank, root, p2p.world_size)
    if vr:
        buf = torch.empty(subtree_size(vr, n) * m, dtype=like.dtype, device=like.device)
        recv_blocking(p2p, buf, to_real(tree_parent(vr), root, n), step)
    assert buf is not None
    works = []
    for c in reversed(tree_children(vr, n)):
        lo = (c - vr) * m
        works.append(post_send(p2p, buf[lo:lo + subtree_size(c, n) * m], to_real(c, root, n), step))
    wait_all(p2p, *works)
    return buf[:m]


def _virtual_order(items: List[torch.Tensor], root: int, n: int) -> List[torch.Tensor]:
    """Reorder a per-real-rank list into virtual-rank order for the given root."""
    return [items[to_real(v, root, n)] for v in range(n)]


# ---------------------------------------------------------------------------------------------- collectives
def broadcast(p2p: "P2P", tensor: torch.Tensor, root: int) -> None:
    """Binomial-tree broadcast."""
    bcast_buffer(p2p, flat(tensor), root, 0)


def reduce(p2p: "P2P", tensor: torch.Tensor, root: int, op: ReduceOp) -> None:
    """Binomial-tree reduce to ``root``; other ranks' tensors are left untouched."""
    n, vr = p2p.world_size, to_virtual(p2p.rank, root, p2p.world_size)
    acc = flat(tensor)
    if vr and tree_children(vr, n):
        acc = acc.clone()  # an inner node must not clobber its caller's input
    reduce_buffer(p2p, acc, root, op, 0)
    if not vr:
        finish_avg(acc, op, n)


def allreduce(p2p: "P2P", tensor: torch.Tensor, op: ReduceOp) -> None:
    """Binomial reduce to rank 0, then binomial broadcast: every rank ends with root's bits."""
    acc = flat(tensor)
    reduce_buffer(p2p, acc, 0, op, 0)
    if p2p.rank == 0:
        finish_avg(acc, op, p2p.world_size)
    bcast_buffer(p2p, acc, 0, 1)


def gather(p2p: "P2P", outputs: Optional[List[torch.Tensor]], tensor: torch.Tensor, root: int) -> None:
    """Binomial-tree gather: each subtree's blocks travel to the parent as one message."""
    buf = gather_blocks(p2p, flat(tensor), root, 0)
    if buf is not None:
        assert outputs is not None
        unpack(buf, _virtual_order(outputs, root, p2p.world_size))


def scatter(p2p: "P2P", inputs: Optional[List[torch.Tensor]], tensor: torch.Tensor, root: int) -> None:
    """Binomial-tree scatter: each child gets its whole subtree's blocks as one message."""
    buf = None
    if p2p.rank == root:
        assert inputs is not None
        buf = pack(_virtual_order(inputs, root, p2p.world_size))
    flat(tensor).copy_(scatter_blocks(p2p, buf, tensor.numel(), tensor, root, 0))


def allgather(p2p: "P2P", outputs: List[torch.Tensor], tensor: torch.Tensor) -> None:
    """Binomial gather to rank 0, then binomial broadcast of the n-block buffer."""
    n = p2p.world_size
    buf = gather_blocks(p2p, flat(tensor), 0, 0)
    if buf is None:
        buf = torch.empty(n * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    bcast_buffer(p2p, buf, 0, 1)
    unpack(buf, outputs)


def reducescatter(p2p: "P2P", tensor: torch.Tensor, inputs: List[torch.Tensor], op: ReduceOp) -> None:
    """Binomial reduce of all n blocks to rank 0, then binomial scatter of the reduced blocks."""
    acc = torch.cat([flat(t) for t in inputs])  # a working copy; inputs stay untouched
    reduce_buffer(p2p, acc, 0, op, 0)
    mine = scatter_blocks(p2p, acc if p2p.rank == 0 else None, tensor.numel(), tensor, 0, 1)
    out = flat(tensor)
    out.copy_(mine)
    finish_avg(out, op, p2p.world_size)


def barrier(p2p: "P2P") -> None:
    """Tokens flow up the tree to rank 0 (everyone arrived), then back down (everyone may leave)."""
    t = token(p2p)
    reduce_buffer(p2p, t, 0, ReduceOp.MAX, 0)
    bcast_buffer(p2p, t, 0, 1)
