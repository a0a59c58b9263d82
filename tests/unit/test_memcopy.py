"""Bulk copies (rdt_transports._memcopy): streaming stores give the same bytes as a plain copy, at every size and
alignment around the streaming threshold, and touch nothing outside the destination range."""

from __future__ import annotations

import platform

import pytest
import torch

from rdt_transports import _memcopy

STREAM_MIN = 512 * 1024


def test_the_install_built_the_streaming_copy() -> None:
    """The README's install compiles the extension: on x86-64 Linux a silent fallback to torch would cost a third
    of a same-node sync's copy bandwidth, so CI must notice a missing build step."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("streaming stores are x86-64 only; other CPUs copy with memcpy")
    assert _memcopy.streaming()
    assert _memcopy._streamcopy.STREAM_MIN == STREAM_MIN


def _pattern(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


SIZES = [0, 1, 15, 63, 64, 65, 4097, STREAM_MIN - 1, STREAM_MIN, STREAM_MIN + 17, (3 << 20) + 5]


@pytest.mark.parametrize("fallback", [False, True], ids=["extension", "torch"])
@pytest.mark.parametrize("n", SIZES)
def test_copy_parts_matches_a_plain_copy(n: int, fallback: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if fallback:
        monkeypatch.setattr(_memcopy, "_streamcopy", None)
    elif _memcopy._streamcopy is None:
        pytest.skip("extension not built here")
    guard = 64
    for dst_off, src_off in ((0, 0), (1, 0), (0, 7), (13, 5), (16, 48)):
        src = _pattern(n + src_off + guard, seed=n + dst_off)
        dst = _pattern(n + dst_off + 2 * guard, seed=n + 1000)
        before = dst.clone()
        d0 = dst.data_ptr() + guard + dst_off
        _memcopy.copy_parts([(d0, src.data_ptr() + src_off, n)])
        lo = guard + dst_off
        assert torch.equal(dst[lo:lo + n], src[src_off:src_off + n]), (n, dst_off, src_off)
        assert torch.equal(dst[:lo], before[:lo]) and torch.equal(dst[lo + n:], before[lo + n:])


def test_copy_parts_many_ranges_in_order() -> None:
    """Several ranges of mixed sizes in one call (the GIL released once) land where each one says."""
    sizes = [3, STREAM_MIN + 100, 4096, 2 * STREAM_MIN, 0, 77]
    srcs = [_pattern(n, seed=i) for i, n in enumerate(sizes)]
    dst = torch.zeros(sum(sizes) + 64 * len(sizes), dtype=torch.uint8)
    at, parts, where = 0, [], []
    for s, n in zip(srcs, sizes):
        parts.append((dst.data_ptr() + at, s.data_ptr(), n))
        where.append(at)
        at += n + 64
    _memcopy.copy_parts(parts)
    for s, n, w in zip(srcs, sizes, where):
        assert torch.equal(dst[w:w + n], s)
    with pytest.raises(TypeError):
        _memcopy.copy_parts([(1, 2)])  # type: ignore[list-item]  # a malformed part is refused, nothing copied


@pytest.mark.parametrize("n", [100, STREAM_MIN, 5 << 20])
def test_copy_tensor(n: int) -> None:
    src, dst = _pattern(n, seed=1), torch.zeros(n, dtype=torch.uint8)
    _memcopy.copy_tensor(dst, src)
    assert torch.equal(dst, src)
