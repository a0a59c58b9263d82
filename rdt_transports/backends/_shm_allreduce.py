"""Allreduce through shared memory for a Gloo group whose ranks all live on one Ray node.

TCP loopback costs two copies per byte per hop; on one node the ranks can instead read each other's inputs
directly. Each rank owns one 0600 segment per size class (``rdt-<pid>-<32 hex>``, the hex derived from the group
secret so names are unguessable; the same pattern rdt's reaper removes when the owner dies) holding two input
areas: ``[area 0 (cls bytes) | area 1 (cls bytes)]``. Call number ``k`` (counted alike on every rank) uses area
``p = k % 2`` of every rank; rank r's chunk is elements ``lo_r..hi_r``.

1. Copy my input into my area ``p``, except my own chunk (only I read it: straight from the caller's tensor).
2. Arrive at barrier A (:class:`~._shm_barrier.ShmBarrier`, named semaphores instead of Gloo's TCP barrier).
3. Reduce my chunk over every rank's input in rank order, taking rank j's A token just before reading its input
   (so the work starts as soon as the first inputs are there), into my area ``p`` at my chunk, then copy it into
   the caller's tensor. Every chunk is reduced by one rank and copied by all: every rank ends with identical bits.
4. Arrive at barrier B; copy each peer's reduced chunk (its area ``p`` at its chunk) as soon as I hold its B token.

Why two barriers are enough (no third one after step 4); every "after" follows from taking a token:
- Within a call: I read j's input (step 3) only after taking j's A token, so after j's step 1, and j's result
  (step 4) only after taking j's B token, so after j's step 3. Meanwhile j writes its area only in step 1 (all
  but its own chunk) and in step 3 (its own chunk, which nobody reads in step 3).
- Across calls: j writes its area ``p`` again only in call k+2, which starts after j's call k+1 returned, which
  needed my B token of call k+1; I post that during call k+1, so after every read I made in call k. Call k+1 uses
  the other area, whose last readers (call k-1) are done by the same argument one call earlier. So a fast rank
  never overwrites what a slow rank still reads, and no barrier is needed after step 4.
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import os
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..errors import GroupDestroyedError
from ..types import ReduceOp
from ._shm_barrier import ShmBarrier

SHM_DIR = "/dev/shm"
MIN_CLASS = 1 << 20
_PLAN_CACHE_MAX = 64

_BINARY = {
    ReduceOp.SUM: torch.add,
    ReduceOp.AVG: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
}


def _class_of(nbytes: int) -> int:
    cls = MIN_CLASS
    while cls < nbytes:
        cls <<= 1
    return cls


class _Plan:
    """Views into the shared segments for one (size class, dtype, numel, parity), built once and reused."""

    __slots__ = ("bounds", "lo", "hi", "head", "tail", "peer_in", "acc", "results")

    def __init__(self, bounds: List[Tuple[int, int]], rank: int, inputs: List[torch.Tensor]) -> None:
        self.bounds = bounds
        self.lo, self.hi = bounds[rank]
        mine = inputs[rank]
        self.head = mine[:self.lo]  # my input outside my chunk: what peers read
        self.tail = mine[self.hi:]
        # Rank order of the inputs to my chunk; None marks mine (taken from the caller's tensor).
        self.peer_in: List[Optional[torch.Tensor]] = [
            None if r == rank else x[self.lo:self.hi] for r, x in enumerate(inputs)]
        self.acc = mine[self.lo:self.hi]
        # Every peer's chunk of the result, by rank (in its area, where it reduced it).
        self.results: Dict[int, Tuple[int, int, torch.Tensor]] = {
            r: (lo, hi, inputs[r][lo:hi]) for r, (lo, hi) in enumerate(bounds) if hi > lo and r != rank}


class ShmAllreduce:
    """Shared-memory allreduce for one group in one process (CPU tensors)."""

    def __init__(self, uid: str, rank: int, pids: List[int], secret: bytes, barrier: ShmBarrier) -> None:
        self._uid = uid
        self._rank = rank
        self._pids = pids
        self._secret = secret
        self._barrier = barrier
        self._maps: Dict[Tuple[int, int], Tuple[mmap.mmap, torch.Tensor]] = {}
        self._own: List[str] = []
        self._plans: Dict[Tuple[int, torch.dtype, int, int], _Plan] = {}
        self._calls = 0  # shared-memory calls so far: their parity picks the input area
        self._closed = False

    @property
    def world_size(self) -> int:
        return len(self._pids)

    def _name(self, rank: int, cls: int) -> str:
        tag = hmac.new(self._secret, f"{self._uid}/{rank}/{cls}".encode(), hashlib.sha256).hexdigest()[:32]
        return f"rdt-{self._pids[rank]}-{tag}"

    def _segment(self, rank: int, cls: int) -> torch.Tensor:
        """My own segment (created on first use) or a peer's (opened after the first barrier)."""
        key = (rank, cls)
        hit = self._maps.get(key)
        if hit is not None:
            return hit[1]
        path = os.path.join(SHM_DIR, self._name(rank, cls))
        size = 2 * cls
        if rank == self._rank:
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
            self._own.append(path)
            os.ftruncate(fd, size)
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        buf = torch.frombuffer(mm, dtype=torch.uint8)
        self._maps[key] = (mm, buf)
        return buf

    def _input_area(self, rank: int, cls: int, parity: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        """Rank ``rank``'s input area ``parity`` as ``n`` elements of ``dtype``."""
        es = torch.empty((), dtype=dtype).element_size()
        off = parity * cls
        return self._segment(rank, cls)[off: off + n * es].view(dtype)

    def _plan(self, cls: int, dtype: torch.dtype, n: int, parity: int) -> _Plan:
        """The cached views for this call shape (peers' segments must exist: call after the first barrier)."""
        key = (cls, dtype, n, parity)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= _PLAN_CACHE_MAX:
                self._plans.clear()
            inputs = [self._input_area(r, cls, parity, dtype, n) for r in range(self.world_size)]
            plan = self._plans[key] = _Plan(self._chunks(n), self._rank, inputs)
        return plan

    def run(self, tensor: torch.Tensor, op: ReduceOp, deadline_left: Callable[[], float]) -> None:
        """Allreduce ``tensor`` (contiguous CPU) in place."""
        if self._closed:
            raise GroupDestroyedError("allreduce refused: the group's shared memory is closed", op="allreduce",
                                      hint="create the group again")
        deadline = time.monotonic() + deadline_left()
        bar = self._barrier
        try:
            flat = tensor.view(-1)
            n = flat.numel()
            cls = _class_of(n * flat.element_size())
            parity = self._calls & 1
            self._calls += 1
            key = (cls, flat.dtype, n, parity)
            plan = self._plans.get(key)
            if plan is not None:
                head, tail, lo, hi = plan.head, plan.tail, plan.lo, plan.hi
            else:
                lo, hi = self._chunks(n)[self._rank]
                mine = self._input_area(self._rank, cls, parity, flat.dtype, n)
                head, tail = mine[:lo], mine[hi:]
            if lo > 0:
                head.copy_(flat[:lo])
            if hi < n:
                tail.copy_(flat[hi:])
            bar.arrive()  # A: my input is in place
            if plan is None:  # a new shape: every peer's segment exists once it has arrived
                bar.complete(deadline)
                plan = self._plan(cls, flat.dtype, n, parity)
            if hi > lo:
                acc, fn, take = plan.acc, _BINARY[op], bar.take
                first: Optional[torch.Tensor] = None
                for r, x in enumerate(plan.peer_in):  # rank order; start on each input as soon as it is there
                    if x is None:
                        x = flat[lo:hi]
                    else:
                        take(r, deadline)
                    if r == 0:
                        first = x
                    elif r == 1:
                        fn(first, x, out=acc)
                    else:
                        fn(acc, x, out=acc)
                if op is ReduceOp.AVG:
                    acc.div_(self.world_size)
                flat[lo:hi].copy_(acc)  # my own chunk of the result, while it is still in cache
            bar.complete(deadline)
            bar.arrive()  # B: my chunk is reduced
            results = plan.results
            pending = list(results)
            while pending:  # copy each peer's chunk as soon as that peer is done
                r = bar.take_any(pending, deadline)
                pending.remove(r)
                rlo, rhi, src = results[r]
                flat[rlo:rhi].copy_(src)
            bar.complete(deadline)
        except BaseException:
            bar.fail()  # peers waiting for me stop now instead of at their timeout
            raise

    def _chunks(self, n: int) -> List[Tuple[int, int]]:
        w = self.world_size
        base, extra = divmod(n, w)
        out, start = [], 0
        for r in range(w):
            size = base + (1 if r < extra else 0)
            out.append((start, start + size))
            start += size
        return out

    def fail(self) -> None:
        """Tell peers this rank gave up (the group errored or was aborted): their waits on it end within a slice."""
        if not self._closed:
            self._barrier.fail()

    def close(self) -> None:
        """Close the barrier, unmap everything and unlink my segments; idempotent."""
        self._closed = True
        self._barrier.close()
        self._plans = {}
        maps, self._maps = self._maps, {}
        for mm, buf in maps.values():
            del buf
            try:
                mm.close()
            except BufferError:  # a view is still alive somewhere; the mapping goes when it does
                pass
        own, self._own = self._own, []
        for path in own:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
