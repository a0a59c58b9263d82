"""The checksum of ``verify=True``: CRC-32C (Castagnoli, as iSCSI and ext4 use it: reflected polynomial
0x82F63B78, initial value and final xor 0xFFFFFFFF), chained like ``zlib.crc32`` (``crc32c(b, crc32c(a))`` is the
CRC of ``a + b``), so that the checksum of a set of byte ranges is the CRC of their bytes concatenated, whatever
their offsets, lengths and alignment.

Chosen by measurement (docs/weight-sync.md, "Verify"): on the 2-core reference machine, per CPU-second of one core
on 256 MiB, the ``crc32c`` library (hardware CRC instructions: SSE 4.2 on x86-64, the CRC extension on ARMv8; it
releases the GIL above 32 KiB) runs at 10.9 GB/s where ``zlib.crc32`` runs at 2.4, ISA-L's CRC-32 at 9.5, xxHash's
XXH3 at 11.8 and a position-weighted sum of 64-bit words (numpy matrix-vector product) at 7-8; a plain sum of words
reaches 11.2 but is blind to swapped words. A CRC has no blind spot of that kind (every error burst up to 32 bits,
any reordering of unequal words), and unlike XXH3 it has an exact data-parallel form: the CRC is affine over GF(2),
so a GPU computes it with table lookups and xors over all bytes at once and a tree that joins the pieces
(:func:`torch_crc32c`: torch operations only, any device). Both forms give bit-identical values by construction (integer
operations only); tests/unit/test_checksum.py holds them against each other and against an independent byte-at-a-time
reference.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Dict, List, Mapping, Sequence, Tuple, Union

import crc32c as _crc32c
import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

POLY = 0x82F63B78  # CRC-32C, reflected
MASK = 0xFFFFFFFF
CHUNK = 64  # bytes per row of the data-parallel form (its position table: CHUNK x 256 entries)
PIECE = 1 << 22  # bytes the data-parallel form handles at once (its temporaries: 8 x PIECE bytes)
GATHER_BYTES = 1 << 20  # strided short ranges are gathered into a buffer of this size, then checksummed at once


def crc32c(data: object, value: int = 0) -> int:
    """CRC-32C of a bytes-like object (bytes, a contiguous numpy array or memoryview), continuing from ``value``
    (the CRC of the bytes before it). The library releases the GIL while it reads 32 KiB or more."""
    return _crc32c.crc32c(data, value)


# ------------------------------------------------------------------------------------------------ ranges
def ranges_crc(views: Sequence[np.ndarray], group: np.ndarray, buf: np.ndarray, off: np.ndarray,
               n: np.ndarray) -> Dict[int, int]:
    """CRC-32C per group of ranges (``views[buf][off:off + n]``), each group's ranges chained in their order.
    Consecutive ranges of a group that are contiguous are read as one; a run of equal short ranges at one stride
    (a row-parallel slice: one range per row) is gathered in blocks and read at once, not one call per range."""
    out: Dict[int, int] = {}
    for g, b, o, k, stride, count in _segments(*_merged(group, buf, off, n)):
        view = views[b]
        value = out.get(g, 0)
        if count == 1 or k >= GATHER_BYTES // 8:
            for i in range(count):
                value = _crc32c.crc32c(view[o + i * stride:o + i * stride + k], value)
        else:
            value = _strided_crc(view, o, stride, k, count, value)
        out[g] = value
    return out


def tensor_ranges_crc(buffers: Union[Sequence[torch.Tensor], Mapping[int, torch.Tensor]], group: np.ndarray,
                      buf: np.ndarray, off: np.ndarray, n: np.ndarray) -> Dict[int, int]:
    """:func:`ranges_crc` over 1-D uint8 tensors: CPU memory through the library, a GPU's where it is
    (:func:`torch_ranges_crc`: no copy to the host). The values are the same either way."""
    values = buffers.values() if isinstance(buffers, Mapping) else buffers
    if all(t.device.type == "cpu" for t in values):
        views = ({k: t.numpy() for k, t in buffers.items()} if isinstance(buffers, Mapping)
                 else [t.numpy() for t in buffers])
        return ranges_crc(views, group, buf, off, n)
    return torch_ranges_crc(buffers, group, buf, off, n)


def _merged(group: Any, buf: Any, off: Any, n: Any) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The ranges with consecutive ones of a group and buffer that continue each other joined into one."""
    group, buf, off, n = (np.asarray(a).astype(np.int64) for a in (group, buf, off, n))
    if not len(n):
        return group, buf, off, n
    joins = (group[1:] == group[:-1]) & (buf[1:] == buf[:-1]) & (off[1:] == off[:-1] + n[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return group[starts], buf[starts], off[starts], np.add.reduceat(n, starts)


def _segments(group: np.ndarray, buf: np.ndarray, off: np.ndarray,
              n: np.ndarray) -> List[Tuple[int, int, int, int, int, int]]:
    """(group, buffer, first offset, length, stride, count) of sequences of ranges with one group, buffer and
    length at one stride (a single range: count 1), in order."""
    m = len(n)
    if m == 0:
        return []
    if m == 1:
        return [(int(group[0]), int(buf[0]), int(off[0]), int(n[0]), 0, 1)]
    step = np.diff(off)
    same = (group[1:] == group[:-1]) & (buf[1:] == buf[:-1]) & (n[1:] == n[:-1]) & (step > 0)
    # a range starts a sequence unless it continues the previous one at the stride that one continued with
    starts = np.concatenate(([True], ~same))
    starts[2:] |= same[:-1] & (step[1:] != step[:-1])
    first = np.flatnonzero(starts)
    count = np.diff(np.append(first, m))
    stride = np.where(count > 1, np.append(step, 0)[first], 0)
    return list(zip(group[first].tolist(), buf[first].tolist(), off[first].tolist(), n[first].tolist(),
                    stride.tolist(), count.tolist()))


def _strided_crc(view: np.ndarray, off: int, stride: int, k: int, count: int, value: int) -> int:
    """CRC of ``count`` ranges of ``k`` bytes at ``stride``, gathered a block at a time into one buffer (numpy's
    strided copy: near memcpy speed, where torch's byte-wise strided copy is 30x slower)."""
    rows = max(GATHER_BYTES // k, 1)
    scratch = np.empty(min(rows, count) * k, dtype=np.uint8)
    for first in range(0, count, rows):
        r = min(rows, count - first)
        block = scratch[:r * k]
        np.copyto(block.reshape(r, k), as_strided(view[off + first * stride:], (r, k), (stride, 1)))
        value = _crc32c.crc32c(block, value)
    return value


# ------------------------------------------------------------------------------- the data-parallel form
def _step(c: np.ndarray) -> np.ndarray:
    """One zero byte through the CRC register (the linear map A: c -> T[c & 0xFF] ^ (c >> 8))."""
    return _table()[c & 0xFF] ^ (c >> 8)


@lru_cache(maxsize=None)
def _table() -> np.ndarray:
    """The byte table T: the register after one byte x with a zero register (uint64 holding 32 bits)."""
    t = np.arange(256, dtype=np.uint64)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ POLY, t >> 1)
    return t


@lru_cache(maxsize=None)
def _positions() -> np.ndarray:
    """(CHUNK, 256): byte x at position p of a CHUNK-byte row contributes A^(CHUNK-1-p)(T[x]) to the row's CRC."""
    out = np.empty((CHUNK, 256), np.uint64)
    out[CHUNK - 1] = _table()
    for p in range(CHUNK - 2, -1, -1):
        out[p] = _step(out[p + 1])
    return out


def _compose(a: Tuple[int, ...], b: Tuple[int, ...]) -> Tuple[int, ...]:
    """The linear map ``a`` after ``b`` (each: the images of the 32 basis bits)."""
    return tuple(_apply(a, x) for x in b)


def _apply(m: Tuple[int, ...], x: int) -> int:
    out = 0
    bit = 0
    while x:
        if x & 1:
            out ^= m[bit]
        x >>= 1
        bit += 1
    return out


@lru_cache(maxsize=None)
def _shift(nbytes: int) -> Tuple[int, ...]:
    """A^nbytes (the register after ``nbytes`` zero bytes), by squaring."""
    one = tuple(int(_step(np.array([1 << i], np.uint64))[0]) for i in range(32))
    out = tuple(1 << i for i in range(32))
    power = one
    while nbytes:
        if nbytes & 1:
            out = _compose(power, out)
        nbytes >>= 1
        if nbytes:
            power = _compose(power, power)
    return out


@lru_cache(maxsize=64)
def _shift_tables(nbytes: int) -> np.ndarray:
    """(4, 256): A^nbytes of a 32-bit value, as the xor of one lookup per byte of it."""
    m = _shift(nbytes)
    out = np.zeros((4, 256), np.uint64)
    for j in range(4):
        for x in range(256):
            out[j, x] = _apply(m, x << (8 * j))
    return out


def _device_tables(device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    pos = torch.from_numpy(_positions().astype(np.int64)).reshape(-1).to(device)
    return pos, torch.arange(CHUNK, device=device, dtype=torch.int64) * 256


def _shifted(v: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A^nbytes of every value of ``v`` (int64 holding 32 bits)."""
    t = torch.from_numpy(_shift_tables(nbytes).astype(np.int64)).to(v.device)
    out = t[0][v & 0xFF]
    for j in range(1, 4):
        out = out ^ t[j][(v >> (8 * j)) & 0xFF]
    return out


def _xor_rows(x: torch.Tensor) -> torch.Tensor:
    """The xor of each row of ``x`` (width a power of two), by halving."""
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        x = x[:, :half] ^ x[:, half:]
    return x[:, 0]


def _linear(data: torch.Tensor) -> int:
    """The linear part L of the CRC of ``data`` (1-D uint8, any device): leading zero bytes add nothing to it, so
    the data is padded in front to whole CHUNK-byte rows; each row's part is one table lookup per byte and an xor
    across the row; the rows are joined by a tree, the left half shifted past the right half's bytes."""
    n = data.numel()
    if n == 0:
        return 0
    pad = (-n) % CHUNK
    if pad:
        data = torch.cat((torch.zeros(pad, dtype=torch.uint8, device=data.device), data))
    pos, base = _device_tables(data.device)
    rows = data.view(-1, CHUNK).to(torch.int64)
    v = _xor_rows(pos[rows + base])  # one value per row
    width = CHUNK
    while v.numel() > 1:
        if v.numel() % 2:  # a zero row in front changes nothing
            v = torch.cat((torch.zeros(1, dtype=torch.int64, device=v.device), v))
        pairs = v.view(-1, 2)
        v = _shifted(pairs[:, 0], width) ^ pairs[:, 1]
        width *= 2
    return int(v[0].item())


def torch_crc32c(data: torch.Tensor, value: int = 0) -> int:
    """The same CRC-32C as :func:`crc32c`, computed with torch operations on ``data``'s own device (a GPU's
    memory is checksummed where it is): ``data`` is viewed as bytes (any dtype, contiguous). The register after
    the bytes is A^n(~value) xor L(bytes), and the CRC its complement; pieces of PIECE bytes are chained."""
    flat = data.reshape(-1).view(torch.uint8) if data.dtype != torch.uint8 else data.reshape(-1)
    for first in range(0, flat.numel(), PIECE):
        piece = flat[first:first + PIECE]
        reg = _apply(_shift(piece.numel()), ~value & MASK) ^ _linear(piece)
        value = ~reg & MASK
    return value


def torch_ranges_crc(buffers: Union[Sequence[torch.Tensor], Mapping[int, torch.Tensor]], group: Sequence[int],
                     buf: Sequence[int], off: Sequence[int], n: Sequence[int]) -> Dict[int, int]:
    """:func:`ranges_crc` with :func:`torch_crc32c` on the buffers' own device (1-D uint8 tensors): contiguous
    ranges joined, a run of equal ranges at one stride (a row-parallel slice) gathered on the device up to PIECE
    bytes at a time and read at once, not one computation per range."""
    out: Dict[int, int] = {}
    for g, b, o, k, stride, count in _segments(*_merged(group, buf, off, n)):
        t = buffers[b]
        value = out.get(g, 0)
        if count == 1:
            value = torch_crc32c(t[o:o + k], value)
        else:
            rows = max(PIECE // k, 1)
            for first in range(0, count, rows):
                r = min(rows, count - first)
                block = t.as_strided((r, k), (stride, 1), t.storage_offset() + o + first * stride)
                value = torch_crc32c(block.contiguous(), value)
        out[g] = value
    return out
