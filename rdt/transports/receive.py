"""Where a fetch's bytes land: the caller's targets (``rdt.get(into=...)``), views of one fresh block, pooled
receive buffers (``recv_buffers``), and this process's CUDA device. Shared by every transport and the consumer.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, List, Optional, Sequence, Tuple

import torch

from .base import Site


def target_device() -> Optional[torch.device]:
    """The consumer's current CUDA device, or None when this process has no CUDA."""
    try:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
    except Exception:  # noqa: BLE001
        pass
    return None


def landing(ctx: Any, site: Site, i: int, nbytes: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """Where buffer ``i`` of a fetch lands: the caller's target when ``rdt.get(into=...)`` gave one on that device
    type, else a fresh (pooled, for CPU) buffer."""
    device = device or torch.device("cpu")
    if i < len(site.into):
        t = site.into[i]
        if t is not None and t.numel() == nbytes and t.device.type == device.type:
            return t
    return fresh_bytes(ctx, nbytes, device)


def fresh_bytes(ctx: Any, nbytes: int, device: torch.device) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes`` on ``device``: from the receive pool for CPU memory."""
    if device.type == "cpu":
        return ctx.buffers.empty(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


class Targets(Sequence[Optional[torch.Tensor]]):
    """Per buffer of an ``rdt.get(into=...)`` fetch: the caller's tensor its bytes land in, as uint8 bytes, or None
    (it lands elsewhere and is copied in). Each uint8 view is made when first asked for: a transport that reads
    into addresses (shm) makes none, and a model's hundreds of targets cost no tensor each."""

    __slots__ = ("tensors", "complete", "_views")

    def __init__(self, tensors: List[Optional[torch.Tensor]], complete: bool) -> None:
        self.tensors = tensors  # contiguous, each with exactly its buffer's bytes
        self.complete = complete  # every buffer has its target
        self._views: List[Optional[torch.Tensor]] = [None] * len(tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        view = self._views[i]
        if view is None:
            t = self.tensors[i]
            if t is None:
                return None
            view = self._views[i] = t.detach().view(-1).view(torch.uint8)  # the same view every time it is asked
        return view

    def addresses(self) -> List[int]:
        """Each target's address (a complete set only; for readers that take raw pointers)."""
        return list(map(torch.Tensor.data_ptr, self.tensors))  # type: ignore[arg-type]


# Where each buffer of a block starts: every dtype's view of it is aligned (the widest element, complex128, is 16
# bytes; malloc gives the same 16). Tensors whose sizes are multiples of 16 bytes, as a model's are, land back to
# back, so a many-tensor object's leaves are cut from its block in one call (``SpecTable.rebuild``).
ALIGN = 16


class BlockViews(Sequence[torch.Tensor]):
    """Landing buffers that are byte ranges of one block: a sequence of uint8 views, each made only when indexed
    (an object of a thousand tensors then costs one allocation, and its leaves are rebuilt from the block)."""

    __slots__ = ("block", "offsets", "sizes", "dense")

    def __init__(self, block: torch.Tensor, offsets: List[int], sizes: List[int], dense: bool = False) -> None:
        self.block = block
        self.offsets = offsets
        self.sizes = sizes
        self.dense = dense  # the buffers lie back to back from the block's start (every size a multiple of ALIGN)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        o = self.offsets[i]
        return self.block[o:o + self.sizes[i]]

    def addresses(self) -> List[int]:
        """Each buffer's address (for readers that take raw pointers)."""
        base = self.block.data_ptr()
        return [base + o for o in self.offsets]

    def span(self, first: int, last: int) -> torch.Tensor:
        """One view from the start of buffer ``first`` to the end of buffer ``last`` (padding included)."""
        return self.block[self.offsets[first]:self.offsets[last] + self.sizes[last]]


def padded_offsets(sizes: Sequence[int]) -> Tuple[List[int], int]:
    """Where each buffer of a block starts (multiples of :data:`ALIGN`) and the block's size."""
    if not sizes:
        return [], 0
    dense = not any(map(_ALIGN_REM, sizes))  # a model's tensors: the sizes are the steps (C loops, no genexpr)
    ends = list(accumulate(sizes if dense else (-(-n // ALIGN) * ALIGN for n in sizes)))
    return [0] + ends[:-1], ends[-1]


_ALIGN_REM = ALIGN.__rmod__  # n -> n % ALIGN


def block_views(ctx: Any, sizes: List[int], device: Optional[torch.device] = None) -> BlockViews:
    """Fresh landing buffers of ``sizes`` bytes as byte ranges of one block, each at a multiple of ALIGN."""
    device = device or torch.device("cpu")
    offsets, total = padded_offsets(sizes)
    room = max(total, 1)
    block = fresh_bytes(ctx, room, device)
    return BlockViews(block, offsets, list(sizes), dense=bool(sizes) and total == sum(sizes))
