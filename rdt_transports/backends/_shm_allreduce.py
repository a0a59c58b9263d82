"""Allreduce through shared memory for a Gloo group whose ranks all live on one Ray node.

TCP loopback costs two copies per byte per hop; on one node the ranks can instead read each other's inputs
directly. Each rank owns one 0600 segment per size class (``rdt-<pid>-<32 hex>``, the hex derived from the group
secret so names are unguessable; the same pattern rdt's reaper removes when the owner dies):
``[input (cls bytes) | reduced chunk area (cls bytes)]``.

One call: copy the input into my segment -> barrier -> reduce *my* chunk over every rank's input, in rank order
(so every rank ends with identical bits) into my chunk area -> barrier -> copy every rank's reduced chunk into the
output -> barrier (inputs may be overwritten by the next call). Barriers are Gloo's, under the call's deadline.
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import os
from typing import Callable, Dict, List, Tuple

import torch

from ..types import ReduceOp

SHM_DIR = "/dev/shm"
MIN_CLASS = 1 << 20


def _class_of(nbytes: int) -> int:
    cls = MIN_CLASS
    while cls < nbytes:
        cls <<= 1
    return cls


def _reduce_into(acc: torch.Tensor, x: torch.Tensor, op: ReduceOp) -> None:
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        acc.add_(x)
    elif op is ReduceOp.PRODUCT:
        acc.mul_(x)
    elif op is ReduceOp.MIN:
        torch.minimum(acc, x, out=acc)
    else:
        torch.maximum(acc, x, out=acc)


class ShmAllreduce:
    """Shared-memory allreduce for one group in one process (CPU tensors)."""

    def __init__(self, uid: str, rank: int, pids: List[int], secret: bytes,
                 barrier: Callable[[float], None]) -> None:
        self._uid = uid
        self._rank = rank
        self._pids = pids
        self._secret = secret
        self._barrier = barrier
        self._maps: Dict[Tuple[int, int], Tuple[mmap.mmap, torch.Tensor]] = {}
        self._own: List[str] = []

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

    def run(self, tensor: torch.Tensor, op: ReduceOp, deadline_left: Callable[[], float]) -> None:
        """Allreduce ``tensor`` (contiguous CPU) in place."""
        flat = tensor.view(-1)
        es, n = flat.element_size(), flat.numel()
        nbytes = n * es
        cls = _class_of(nbytes)
        mine = self._segment(self._rank, cls)
        mine[:nbytes].view(flat.dtype).copy_(flat)
        self._barrier(deadline_left())
        segs = [self._segment(r, cls) for r in range(self.world_size)]
        bounds = self._chunks(n)
        lo, hi = bounds[self._rank]
        if hi > lo:
            acc = mine[cls + lo * es: cls + hi * es].view(flat.dtype)
            acc.copy_(segs[0][lo * es: hi * es].view(flat.dtype))
            for r in range(1, self.world_size):
                _reduce_into(acc, segs[r][lo * es: hi * es].view(flat.dtype), op)
            if op is ReduceOp.AVG:
                acc.div_(self.world_size)
        self._barrier(deadline_left())
        for r, (lo, hi) in enumerate(bounds):
            if hi > lo:
                flat[lo:hi].copy_(segs[r][cls + lo * es: cls + hi * es].view(flat.dtype))
        self._barrier(deadline_left())

    def _chunks(self, n: int) -> List[Tuple[int, int]]:
        w = self.world_size
        base, extra = divmod(n, w)
        out, start = [], 0
        for r in range(w):
            size = base + (1 if r < extra else 0)
            out.append((start, start + size))
            start += size
        return out

    def close(self) -> None:
        """Unmap everything and unlink my segments; idempotent."""
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
