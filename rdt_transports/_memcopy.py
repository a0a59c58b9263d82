"""Bulk copies between CPU addresses: streaming stores where the C extension is built, torch's copy otherwise.

A consumer copying a model into its own parameters is bound by memory bandwidth; streaming (non-temporal)
stores skip reading each destination line first, a third less traffic (``_streamcopy.c`` says more). The
extension is optional (``setup.py``): without a compiler the same calls copy with torch, just slower.
"""

from __future__ import annotations

import ctypes
from typing import Sequence, Tuple

import torch

try:
    from . import _streamcopy  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: torch copies instead
    _streamcopy = None

Part = Tuple[int, int, int]  # (destination address, source address, bytes)


def streaming() -> bool:
    """Whether large copies use streaming stores here (the extension is built and the CPU is x86-64)."""
    return _streamcopy is not None and bool(_streamcopy.STREAMS)


def raw(addr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` at ``addr`` (memory someone else keeps alive for the tensor's use)."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)


def copy_parts(parts: Sequence[Part]) -> None:
    """Copy each (dest, src, n) range in order; ranges must not overlap. Releases the GIL while bytes move."""
    if _streamcopy is not None:
        _streamcopy.copy_many(parts)
        return
    for dest, src, n in parts:
        if n:
            raw(dest, n).copy_(raw(src, n))


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for contiguous CPU tensors of equal byte length that do not overlap."""
    n = src.nbytes
    if _streamcopy is None or n < _streamcopy.STREAM_MIN:
        dst.copy_(src)
        return
    _streamcopy.copy(dst.data_ptr(), src.data_ptr(), n)
