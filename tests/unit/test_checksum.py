"""verify=True's checksum (rdt._objects.checksum): the library's CRC-32C on CPU, the data-parallel torch form a GPU
runs on its own memory, and an independent bit-at-a-time reference written here agree bit for bit, on ranges at
any byte offset and length, chained across ranges; a flipped byte, swapped words and a moved range all change it.
The torch form runs here on CPU tensors (the same operations a GPU runs), and on a GPU where one is present."""

from __future__ import annotations

import random
from typing import Dict, List, Sequence, Tuple

import numpy as np
import pytest
import torch

from rdt._objects import checksum
from rdt._process.versions import decode_ranges, decode_sums, encode_ranges, range_sums


def reference(data: bytes, value: int = 0) -> int:
    """CRC-32C one bit at a time, from its definition (reflected 0x82F63B78, init and final xor 0xFFFFFFFF)."""
    crc = ~value & 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return ~crc & 0xFFFFFFFF


def reference_ranges(buffers: Sequence[bytes], runs: Sequence[Tuple[int, int, int, int]]) -> Dict[int, int]:
    out: Dict[int, int] = {}
    for g, b, o, n in runs:
        out[g] = reference(buffers[b][o:o + n], out.get(g, 0))
    return out


def test_known_value():
    assert reference(b"123456789") == 0xE3069283  # CRC-32C's check value
    assert checksum.crc32c(b"123456789") == 0xE3069283
    assert checksum.torch_crc32c(torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)) == 0xE3069283


@pytest.mark.parametrize("n", [0, 1, 7, 63, 64, 65, 127, 200, 4099])
def test_library_torch_form_and_reference_agree(n):
    rng = random.Random(n)
    data = bytes(rng.randrange(256) for _ in range(n))
    for value in (0, 0xFFFFFFFF, rng.randrange(1 << 32)):
        want = reference(data, value)
        assert checksum.crc32c(data, value) == want
        assert checksum.torch_crc32c(torch.frombuffer(bytearray(data) or bytearray(1), dtype=torch.uint8)[:n],
                                     value) == want


def test_the_torch_form_chains_its_pieces(monkeypatch):
    """Data longer than one piece is checksummed piece by piece, each continuing the last; the same value."""
    monkeypatch.setattr(checksum, "PIECE", 1000)
    data = np.random.default_rng(1).integers(0, 256, 5555, dtype=np.uint8)
    assert checksum.torch_crc32c(torch.from_numpy(data), 7) == checksum.crc32c(data, 7) == reference(data.tobytes(), 7)


def test_a_tensor_of_any_dtype_is_read_as_its_bytes():
    t = torch.randn(33, 5, dtype=torch.float32).to(torch.bfloat16)
    assert checksum.torch_crc32c(t) == checksum.crc32c(t.view(torch.uint8).numpy())


def _random_runs(rng: random.Random, sizes: List[int], count: int) -> List[Tuple[int, int, int, int]]:
    runs = []
    for _ in range(count):
        b = rng.randrange(len(sizes))
        o = rng.randrange(sizes[b])
        runs.append((rng.randrange(4), b, o, rng.randrange(0, sizes[b] - o + 1)))
    return runs


def _cols(runs):
    return [np.array([r[i] for r in runs], dtype=np.int64) for i in range(4)]


@pytest.mark.parametrize("seed", range(5))
def test_ranges_at_any_offset_and_length(seed):
    """Groups of ranges at unaligned offsets and lengths (zero-length ones too), over several buffers: the
    production path (merged, gathered), the torch form and the reference agree; so does the wire round trip."""
    rng = random.Random(seed)
    sizes = [rng.randrange(1, 5000) for _ in range(3)]
    bufs = [np.random.default_rng(seed + i).integers(0, 256, s, dtype=np.uint8) for i, s in enumerate(sizes)]
    runs = _random_runs(rng, sizes, 40)
    want = reference_ranges([b.tobytes() for b in bufs], runs)
    assert checksum.ranges_crc(bufs, *_cols(runs)) == want
    assert checksum.torch_ranges_crc([torch.from_numpy(b) for b in bufs], *_cols(runs)) == want
    wire = decode_ranges(encode_ranges(*_cols(runs)))
    assert decode_sums(range_sums([torch.from_numpy(b) for b in bufs], *wire)) == want


@pytest.mark.parametrize("length", [1, 6, 8, 896, 4864])
def test_strided_rows_and_contiguous_runs(monkeypatch, length):
    """A row-parallel slice (one range per row at one stride: gathered in blocks) and a run split in adjacent
    pieces (merged into one read): the same values as one range at a time."""
    monkeypatch.setattr(checksum, "GATHER_BYTES", 3 * length + 5)  # several blocks, the last one partial
    stride, rows = length * 2 + 3, 17
    buf = np.random.default_rng(length).integers(0, 256, stride * rows + 64, dtype=np.uint8)
    runs = [(0, 0, 5 + r * stride, length) for r in range(rows)]
    runs += [(1, 0, 10 + i * 7, 7) for i in range(20)]  # adjacent pieces of one range
    runs += [(0, 0, 1, length)]  # the group goes on after its strided rows
    want = reference_ranges([buf.tobytes()], runs)
    assert checksum.ranges_crc([buf], *_cols(runs)) == want
    assert want[1] == reference(buf[10:150].tobytes())
    # the device form gathers the rows on the device, PIECE bytes at a time (here: several pieces)
    monkeypatch.setattr(checksum, "PIECE", 3 * length + 5)
    assert checksum.torch_ranges_crc([torch.from_numpy(buf)], *_cols(runs)) == want


def test_bytes_off_the_cpu_are_checksummed_where_they_are(monkeypatch):
    """verify=True's entry (producer and loader alike): CPU tensors through the library, others (a GPU's
    memory) through the torch form on their device, never copied to the host first."""
    runs = [(0, 0, 3, 100), (1, 1, 0, 50)]
    cpu = {0: torch.arange(200, dtype=torch.int64).to(torch.uint8), 1: torch.full((64,), 7, dtype=torch.uint8)}
    want = reference_ranges([cpu[0].numpy().tobytes(), cpu[1].numpy().tobytes()], runs)
    assert checksum.tensor_ranges_crc(cpu, *_cols(runs)) == want
    assert checksum.tensor_ranges_crc(list(cpu.values()), *_cols(runs)) == want
    seen = []
    monkeypatch.setattr(checksum, "torch_ranges_crc", lambda bufs, *cols: seen.append(bufs) or {})
    off_cpu = [torch.empty(200, dtype=torch.uint8, device="meta"), torch.empty(64, dtype=torch.uint8, device="meta")]
    assert checksum.tensor_ranges_crc(off_cpu, *_cols(runs)) == {} and seen == [off_cpu]


def test_flipped_bytes_swapped_words_and_moved_ranges_are_caught():
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    base = checksum.crc32c(data)
    seen = {base}
    for pos in (0, 1, 4095, 1 << 15, (1 << 16) - 1):  # one byte flipped, one bit at a time and whole
        for mask in (1, 0x80, 0xFF):
            bad = data.copy()
            bad[pos] ^= mask
            assert checksum.crc32c(bad) != base
            assert checksum.torch_crc32c(torch.from_numpy(bad)) == checksum.crc32c(bad)
    words = data.view(np.uint64)
    for i, j in ((0, 1), (5, 4000), (10, 8000)):  # two unequal 64-bit words swapped
        assert words[i] != words[j]
        bad = words.copy()
        bad[[i, j]] = bad[[j, i]]
        assert checksum.crc32c(bad.view(np.uint8)) != base
    rows = data.reshape(64, 1024)  # two rows swapped (runs landed in each other's place)
    bad = rows.copy()
    bad[[3, 40]] = bad[[40, 3]]
    assert checksum.crc32c(bad) != base
    for shift in (1, 2, 8, 1024):  # a range read from a moved offset: the same length, other bytes
        value = checksum.crc32c(data[shift:shift + 4096])
        assert value != checksum.crc32c(data[:4096])
        seen.add(value)
    ranges = [(0, 0, 0, 100), (0, 0, 200, 100)]  # the same two ranges in the other order
    swapped = [(0, 0, 200, 100), (0, 0, 0, 100)]
    assert checksum.ranges_crc([data], *_cols(ranges)) != checksum.ranges_crc([data], *_cols(swapped))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here: the torch form runs on CPU tensors above")
def test_the_torch_form_on_a_gpu_equals_the_library_on_cpu():
    data = np.random.default_rng(9).integers(0, 256, (1 << 22) + 12345, dtype=np.uint8)
    on_gpu = torch.from_numpy(data).cuda()
    assert checksum.torch_crc32c(on_gpu, 99) == checksum.crc32c(data, 99)
    runs = [(0, 0, 3, 1000), (0, 0, 5000, 77), (1, 0, 1 << 20, 1 << 21)]
    assert checksum.torch_ranges_crc([on_gpu], *_cols(runs)) == checksum.ranges_crc([data], *_cols(runs))
