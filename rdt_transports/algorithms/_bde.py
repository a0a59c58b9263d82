"""Bidirectional-exchange collectives: recursive halving / doubling, Bruck and dissemination (log2 n rounds).

Recursive halving/doubling needs a power-of-two group. For other sizes the first 2*rem ranks
(rem = n - 2**floor(log2 n)) pair up before the main phase: even rank 2i hands its data to 2i+1 and sits out,
odd rank 2i+1 takes part as participant i; ranks >= 2*rem take part as participant rank-rem. Afterwards the
odd ranks hand the result back. Bruck and dissemination patterns work for any n without folding.
Steps: phase blocks (fold = 0, rounds = 1.., unfold = last) keep step numbers unique per pair.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from ..types import ReduceOp
from ._common import (
    P2P,
    chunk_bounds,
    exchange,
    finish_avg,
    flat,
    pack,
    pow2_floor,
    recv_blocking,
    reduce_into,
    send_blocking,
    span,
    token,
    unpack,
)

# Allreduce payloads up to this size use plain recursive doubling (log2 n rounds, full vector each round);
# larger ones use Rabenseifner's halving + doubling (2 log2 n rounds, ~2x the vector in total).
# From benchmarks/ measurements (to be tuned per transport).
RECURSIVE_DOUBLING_MAX_BYTES = 16 * 1024

_FOLD_STEP = 0
_ROUND_BASE = 1  # rounds of a phase use _ROUND_BASE + phase * 64 + round
_UNFOLD_STEP = 1000


class Fold:
    """Rank <-> participant mapping that folds a non-power-of-two group onto p = 2**floor(log2 n) ranks."""

    def __init__(self, rank: int, n: int) -> None:
        self.rank = rank
        self.n = n
        self.p = pow2_floor(n)
        self.rem = n - self.p
        if rank < 2 * self.rem:
            self.me = rank // 2 if rank % 2 else -1
        else:
            self.me = rank - self.rem

    def real(self, participant: int) -> int:
        """The real rank acting as ``participant``."""
        return participant * 2 + 1 if participant < self.rem else participant + self.rem

    def first_rank(self, participant: int) -> int:
        """Lowest real rank represented by ``participant`` (participants represent contiguous rank ranges)."""
        return 2 * participant if participant <= self.rem else participant + self.rem

    def fold_in(self, p2p: "P2P", buf: torch.Tensor, op: ReduceOp) -> None:
        """Even ranks below 2*rem hand ``buf`` to their odd neighbour, which reduces it into its own."""
        if self.rank >= 2 * self.rem:
            return
        if self.me < 0:
            send_blocking(p2p, buf, self.rank + 1, _FOLD_STEP)
            return
        tmp = torch.empty_like(buf)
        recv_blocking(p2p, tmp, self.rank - 1, _FOLD_STEP)
        reduce_into(buf, tmp, op)

    def fold_out(self, p2p: "P2P", send: torch.Tensor, recv: torch.Tensor) -> None:
        """Odd ranks below 2*rem hand ``send`` back to their even neighbour, which receives into ``recv``."""
        if self.rank >= 2 * self.rem:
            return
        if self.me < 0:
            recv_blocking(p2p, recv, self.rank + 1, _UNFOLD_STEP)
        else:
            send_blocking(p2p, send, self.rank - 1, _UNFOLD_STEP)


def _step(phase: int, rnd: int) -> int:
    """Step number of round ``rnd`` in main phase ``phase``."""
    return _ROUND_BASE + phase * 64 + rnd


def halving(p2p: "P2P", fold: Fold, buf: torch.Tensor, bounds: Sequence[Tuple[int, int]], op: ReduceOp,
            phase: int) -> None:
    """Recursive-halving reduce-scatter among participants; participant q ends owning chunk q of ``bounds``."""
    me, lo, hi = fold.me, 0, fold.p
    tmp = torch.empty_like(buf)
    d, rnd = fold.p // 2, 0
    while d >= 1:
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if me & d else ((lo, mid), (mid, hi))
        ks, ke = span(bounds, *keep)
        gs, ge = span(bounds, *give)
        peer = fold.real(me ^ d)
        exchange(p2p, buf[gs:ge], peer, tmp[ks:ke], peer, _step(phase, rnd))
        reduce_into(buf[ks:ke], tmp[ks:ke], op)
        lo, hi = keep
        d, rnd = d // 2, rnd + 1


def doubling_gather(p2p: "P2P", fold: Fold, buf: torch.Tensor, bounds: Sequence[Tuple[int, int]],
                    phase: int) -> None:
    """Recursive-doubling allgather among participants, from participant q owning chunk q of ``bounds``."""
    me, d, rnd = fold.me, 1, 0
    while d < fold.p:
        mine = (me // d) * d
        theirs = mine ^ d
        ms, me_ = span(bounds, mine, mine + d)
        ts, te = span(bounds, theirs, theirs + d)
        peer = fold.real(me ^ d)
        exchange(p2p, buf[ms:me_], peer, buf[ts:te], peer, _step(phase, rnd))
        d, rnd = d * 2, rnd + 1


def doubling_reduce(p2p: "P2P", fold: Fold, buf: torch.Tensor, op: ReduceOp, phase: int) -> None:
    """Recursive-doubling allreduce among participants (whole vector each round)."""
    tmp = torch.empty_like(buf)
    me, d, rnd = fold.me, 1, 0
    while d < fold.p:
        partner = me ^ d
        peer = fold.real(partner)
        exchange(p2p, buf, peer, tmp, peer, _step(phase, rnd))
        if me < partner:  # canonical operand order: lower participant's value first, so partners agree bitwise
            reduce_into(buf, tmp, op)
        else:
            reduce_into(tmp, buf, op)
            buf.copy_(tmp)
        d, rnd = d * 2, rnd + 1


# ---------------------------------------------------------------------------------------------- collectives
def allreduce(p2p: "P2P", tensor: torch.Tensor, op: ReduceOp) -> None:
    """Recursive doubling for small vectors, else Rabenseifner (recursive halving + recursive doubling)."""
    n = p2p.world_size
    buf = flat(tensor)
    fold = Fold(p2p.rank, n)
    fold.fold_in(p2p, buf, op)
    if fold.me >= 0:
        if buf.numel() * buf.element_size() <= RECURSIVE_DOUBLING_MAX_BYTES or buf.numel() < fold.p:
            doubling_reduce(p2p, fold, buf, op, 0)
        else:
            bounds = chunk_bounds(buf.numel(), fold.p)
            halving(p2p, fold, buf, bounds, op, 0)
            doubling_gather(p2p, fold, buf, bounds, 1)
    fold.fold_out(p2p, buf, buf)
    finish_avg(buf, op, n)


def reducescatter(p2p: "P2P", tensor: torch.Tensor, inputs: List[torch.Tensor], op: ReduceOp) -> None:
    """Fold, recursive halving over the n blocks (participants own their represented ranks' blocks), unfold."""
    n, r, m = p2p.world_size, p2p.rank, tensor.numel()
    acc = torch.cat([flat(t) for t in inputs])  # a working copy; inputs stay untouched
    fold = Fold(r, n)
    fold.fold_in(p2p, acc, op)
    if fold.me >= 0:
        bounds = [(fold.first_rank(q) * m, fold.first_rank(q + 1) * m) for q in range(fold.p)]
        halving(p2p, fold, acc, bounds, op, 0)
    out = flat(tensor)
    partner = r - 1 if fold.me >= 0 and r < 2 * fold.rem else r
    fold.fold_out(p2p, acc[partner * m:(partner + 1) * m], out)
    if fold.me >= 0:
        out.copy_(acc[r * m:(r + 1) * m])
    finish_avg(out, op, n)


def allgather(p2p: "P2P", outputs: List[torch.Tensor], tensor: torch.Tensor) -> None:
    """Bruck-style recursive doubling for any n: in round k exchange up to 2**k blocks with ranks r -/+ 2**k."""
    r, n = p2p.rank, p2p.world_size
    flat(outputs[r]).copy_(flat(tensor))
    d, rnd = 1, 0
    while d < n:
        cnt = min(d, n - d)
        send = pack([outputs[(r + i) % n] for i in range(cnt)])
        dests = [outputs[(r + d + i) % n] for i in range(cnt)]
        recv = flat(dests[0]) if cnt == 1 else torch.empty(cnt * tensor.numel(), dtype=send.dtype,
                                                           device=send.device)
        exchange(p2p, send, (r - d) % n, recv, (r + d) % n, _step(0, rnd))
        if cnt > 1:
            unpack(recv, dests)
        d, rnd = d * 2, rnd + 1


def alltoall(p2p: "P2P", outputs: List[torch.Tensor], inputs: List[torch.Tensor]) -> None:
    """Bruck all-to-all: rotate, then in round k forward every block whose index has bit k set to rank r+2**k."""
    r, n = p2p.rank, p2p.world_size
    m = inputs[0].numel()
    work = torch.cat([flat(inputs[(r + i) % n]) for i in range(n)])  # a working copy; inputs stay untouched
    blocks = [work[i * m:(i + 1) * m] for i in range(n)]
    d, rnd = 1, 0
    while d < n:
        moving = [blocks[i] for i in range(n) if i & d]
        send = pack(moving)  # exchange() completes before unpack() overwrites these blocks
        recv = torch.empty_like(send)
        exchange(p2p, send, (r + d) % n, recv, (r - d) % n, _step(0, rnd))
        unpack(recv, moving)
        d, rnd = d * 2, rnd + 1
    for i in range(n):
        flat(outputs[(r - i) % n]).copy_(blocks[i])


def barrier(p2p: "P2P") -> None:
    """Dissemination barrier: in round k signal rank r+2**k and wait for rank r-2**k (ceil(log2 n) rounds)."""
    r, n = p2p.rank, p2p.world_size
    out, into = token(p2p), token(p2p)
    d, rnd = 1, 0
    while d < n:
        exchange(p2p, out, (r + d) % n, into, (r - d) % n, _step(0, rnd))
        d, rnd = d * 2, rnd + 1
