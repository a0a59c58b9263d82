"""Boxes in a global tensor, what a producer holds (:class:`Layout`), what a consumer wants (:class:`Region`), and
the byte runs that copy one box of a row-major shard into a row-major target."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

from ..errors import InvalidArgumentError

Box = Tuple[Tuple[int, int], ...]  # per dimension: [start, stop)


@dataclass(frozen=True)
class Layout:
    """Where a plain tensor sits in its global parameter: the global shape and the index of its first element
    (the tensor's own shape is the extent). ``Layout((1024, 512), (256, 0))``: rows 256.. of a 1024 x 512 weight."""

    global_shape: Tuple[int, ...]
    start: Optional[Tuple[int, ...]] = None  # None: all zeros (the whole tensor, or the first shard)

    @staticmethod
    def whole(shape: Sequence[int]) -> "Layout":
        """A replicated tensor: this rank holds all of it."""
        return Layout(tuple(int(s) for s in shape))


@dataclass(frozen=True)
class Region:
    """A region of one global parameter a consumer wants: ``param`` narrowed along ``dim`` to
    ``[start, start + length)`` (length None: to the end), then along each extra ``(dim, start, length)`` of
    ``more``. No narrowing at all: the whole parameter."""

    param: str
    dim: Optional[int] = None
    start: int = 0
    length: Optional[int] = None
    more: Tuple[Tuple[int, int, int], ...] = ()

    def box(self, shape: Tuple[int, ...], target: str) -> Box:
        """The region as a box of the global ``shape``; refuses a narrow outside it, naming ``target``."""
        out = [(0, n) for n in shape]
        narrows = ([] if self.dim is None else [(self.dim, self.start, self.length)]) + list(self.more)
        for dim, start, length in narrows:
            nd = len(shape)
            if not isinstance(dim, int) or not -nd <= dim < nd:
                raise InvalidArgumentError(f"target {target!r}: dim {dim} of {self.param!r} is outside its "
                                           f"{nd} dimensions (global shape {tuple(shape)})",
                                           hint="narrow along a dimension the parameter has")
            dim %= nd
            if not _is_int(start) or not (length is None or _is_int(length)):
                raise InvalidArgumentError(f"target {target!r}: {self.param!r} narrowed along dim {dim} with start "
                                           f"{start!r} and length {length!r}", hint="narrow with int start and length")
            start = int(start)
            n = shape[dim] - start if length is None else int(length)
            if start < 0 or n <= 0 or start + n > shape[dim]:
                raise InvalidArgumentError(
                    f"target {target!r}: {self.param!r} narrowed along dim {dim} to [{start}, {start + n}) is outside "
                    f"its global shape {tuple(shape)}", hint="want a region inside the parameter's global shape")
            lo, hi = out[dim]
            if start < lo or start + n > hi:
                raise InvalidArgumentError(f"target {target!r}: two narrows of {self.param!r} along dim {dim} do "
                                           "not nest", hint="narrow each dimension once")
            out[dim] = (start, start + n)
        return tuple(out)


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def box_of(start: Sequence[int], shape: Sequence[int]) -> Box:
    return tuple((int(s), int(s) + int(n)) for s, n in zip(start, shape))


def volume(box: Box) -> int:
    v = 1
    for lo, hi in box:
        v *= max(hi - lo, 0)
    return v


def intersect(a: Box, b: Box) -> Optional[Box]:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def runs(src_shape: Sequence[int], src_lo: Sequence[int], dst_shape: Sequence[int], dst_lo: Sequence[int],
         extent: Sequence[int]) -> Tuple[np.ndarray, np.ndarray, int]:
    """Element offsets (source, destination) of the contiguous runs that copy a box of ``extent`` at ``src_lo`` of a
    row-major ``src_shape`` tensor to ``dst_lo`` of a row-major ``dst_shape`` one, and the run length (elements).
    Trailing dimensions the box spans whole on both sides merge into one run."""
    nd = len(extent)
    if nd == 0:
        return np.zeros(1, np.int64), np.zeros(1, np.int64), 1
    d = nd - 1
    while d > 0 and extent[d] == src_shape[d] == dst_shape[d]:
        d -= 1
    length = int(np.prod(extent[d:], dtype=np.int64))
    s_stride = np.cumprod([1] + list(src_shape[::-1]), dtype=np.int64)[:nd][::-1]
    d_stride = np.cumprod([1] + list(dst_shape[::-1]), dtype=np.int64)[:nd][::-1]
    src = np.array([int(np.dot(src_lo, s_stride))], np.int64)
    dst = np.array([int(np.dot(dst_lo, d_stride))], np.int64)
    for j in range(d):  # every index of the outer dimensions: one run each
        step = np.arange(extent[j], dtype=np.int64)
        src = np.add.outer(src, step * s_stride[j]).ravel()
        dst = np.add.outer(dst, step * d_stride[j]).ravel()
    return src, dst, length
