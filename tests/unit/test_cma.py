"""Cross-memory reads (process_vm_readv) against a real second process: bytes, guard, freed memory, dead and
forbidden processes; the even split of a read across threads."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch

from rdt.transports.shm import cma as _cma
from rdt_transports import _cma as low_cma

pytestmark = pytest.mark.skipif(not _cma.supported(), reason="no process_vm_readv in this libc")

OBJ = bytes(range(16))
BIG = 40 << 20  # above the parallel threshold: split across threads

_HOLDER = r"""
import json, sys
import torch
from rdt.transports.shm import cma as _cma
from rdt_transports import _cma as low_cma
obj = bytes(range(16))
big = (torch.arange(%d, dtype=torch.int64) %% 251).to(torch.uint8)
small = torch.arange(100, dtype=torch.uint8)
guard = _cma.guard_for(obj)
print(json.dumps({"guard": int(guard.ctypes.data), "big": big.data_ptr(), "small": small.data_ptr()}), flush=True)
for line in sys.stdin:
    if line.strip() == "clear":
        _cma.clear(guard)
        print("cleared", flush=True)
""" % BIG


@pytest.fixture()
def holder() -> Iterator[Dict[str, Any]]:
    """A second process holding two buffers and a guard for OBJ; 'clear' on stdin zeroes the guard."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        info = json.loads(proc.stdout.readline())
        info["proc"] = proc
        yield info
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _info(h: Dict[str, Any]) -> _cma.CmaInfo:
    return _cma.CmaInfo(h["guard"], ((h["big"], BIG), (h["small"], 100), (h["small"], 0)))


def test_reads_the_other_process_buffers(holder) -> None:
    reader = _cma.CmaReader(threads=2)
    big, small, empty = torch.empty(BIG, dtype=torch.uint8), torch.empty(100, dtype=torch.uint8), torch.empty(0)
    reader.read(holder["proc"].pid, _info(holder), [big.data_ptr(), small.data_ptr(), 0], OBJ)
    assert torch.equal(big, (torch.arange(BIG, dtype=torch.int64) % 251).to(torch.uint8))
    assert torch.equal(small, torch.arange(100, dtype=torch.uint8))
    assert empty.numel() == 0


def test_single_thread_reader_gives_the_same_bytes(holder) -> None:
    big = torch.empty(BIG, dtype=torch.uint8)
    _cma.CmaReader(threads=1).read(holder["proc"].pid, _cma.CmaInfo(holder["guard"], ((holder["big"], BIG),)),
                                   [big.data_ptr()], OBJ)
    assert int(big[251 * 3 + 7]) == 7 and int(big[-1]) == (BIG - 1) % 251


def test_cleared_guard_means_object_gone(holder) -> None:
    proc = holder["proc"]
    proc.stdin.write("clear\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "cleared"
    reader = _cma.CmaReader()
    small = torch.empty(100, dtype=torch.uint8)
    with pytest.raises(_cma.CmaError, match="no longer held") as info:
        reader.read(proc.pid, _cma.CmaInfo(holder["guard"], ((holder["small"], 100),)), [small.data_ptr()], OBJ)
    assert not isinstance(info.value, _cma.CmaDenied) and not reader.denied(proc.pid)


def test_another_object_id_is_refused(holder) -> None:
    small = torch.empty(100, dtype=torch.uint8)
    with pytest.raises(_cma.CmaError, match="no longer held"):
        _cma.CmaReader().read(holder["proc"].pid, _cma.CmaInfo(holder["guard"], ((holder["small"], 100),)),
                              [small.data_ptr()], bytes(16))


def test_unmapped_address_fails_cleanly(holder) -> None:
    dst = torch.empty(4096, dtype=torch.uint8)
    with pytest.raises(_cma.CmaError) as info:
        _cma.CmaReader().read(holder["proc"].pid, _cma.CmaInfo(holder["guard"], ((4096, 4096),)),
                              [dst.data_ptr()], OBJ)
    assert not isinstance(info.value, _cma.CmaDenied)


def test_dead_process_fails_cleanly() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    dst = torch.empty(16, dtype=torch.uint8)
    reader = _cma.CmaReader()
    with pytest.raises(_cma.CmaError) as info:
        reader.read(proc.pid, _cma.CmaInfo(dst.data_ptr(), ((dst.data_ptr(), 16),)), [dst.data_ptr()], OBJ)
    assert not isinstance(info.value, _cma.CmaDenied) and not reader.denied(proc.pid)


_DENIED = r"""
import os, sys, torch
from rdt.transports.shm import cma as _cma
from rdt_transports import _cma as low_cma
target = int(sys.argv[1])
if os.getuid() == 0:
    os.setgid(65534); os.setuid(65534)  # another user, without CAP_SYS_PTRACE
r = _cma.CmaReader()
dst = torch.empty(16, dtype=torch.uint8)
try:
    r.read(target, _cma.CmaInfo(4096, ((4096, 16),)), [dst.data_ptr()], bytes(16))
except _cma.CmaDenied:
    print("denied", r.denied(target))
except _cma.CmaError as e:
    print("error", e)
"""


def test_a_process_the_kernel_protects_is_denied_and_remembered() -> None:
    """Reading a process of another user is refused by the kernel: CmaDenied, and the pid is remembered."""
    target = os.getpid() if os.getuid() == 0 else 1  # as root: a child that drops to nobody reads us
    out = subprocess.run([sys.executable, "-c", _DENIED, str(target)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip() == "denied True", (out.stdout, out.stderr[-2000:])


def test_guard_layout() -> None:
    g = _cma.guard_for(OBJ)
    assert g.tobytes() == _cma.MAGIC + OBJ and g.flags.writeable
    _cma.clear(g)
    assert not g.any()


@pytest.mark.skipif(not _cma.supported(), reason="process_vm_readv is not allowed here")
def test_batched_read_of_many_ranges_and_a_bad_one() -> None:
    """2 500 ranges (more than one iovec batch) land in order; a range at a bad address raises CmaError."""
    srcs = [torch.full((16 + i % 7,), i % 251, dtype=torch.uint8) for i in range(2500)]
    dst = torch.zeros(sum(s.numel() for s in srcs), dtype=torch.uint8)
    parts, at = [], 0
    for s in srcs:
        parts.append((dst.data_ptr() + at, s.data_ptr(), s.numel()))
        at += s.numel()
    _cma._read_batched(os.getpid(), parts)
    assert torch.equal(dst, torch.cat(srcs))
    parts[1200] = (parts[1200][0], 8, parts[1200][2])  # unmapped page
    with pytest.raises(_cma.CmaError):
        _cma._read_batched(os.getpid(), parts)


def _contiguous_parts(seed: int) -> List[Tuple[int, int, int]]:
    """50 (dest, src, n) ranges of mixed sizes, back to back on both sides (src = dest + 10**12)."""
    rng = random.Random(seed)
    parts: List[Tuple[int, int, int]] = []
    at = 0
    for _ in range(50):
        n = rng.choice([1, 17, 4096, 1 << 20, 37 << 20])
        parts.append((at, 10 ** 12 + at, n))
        at += n
    return parts


@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_split_even_keeps_every_byte_in_order(k):
    parts = _contiguous_parts(k)
    shares = low_cma.split_even(parts, k)
    total = sum(n for *_, n in parts)
    assert 1 <= len(shares) <= k
    flat = [p for s in shares for p in s]
    assert sum(n for *_, n in flat) == total
    pos = 0
    for dest, src, n in flat:  # contiguous, in order, source and destination cut at the same places
        assert dest == pos and src == 10 ** 12 + pos and n > 0
        pos += n
    sizes = [sum(n for *_, n in s) for s in shares]
    assert max(sizes) - min(sizes) <= -(-total // k)
    assert all(sz <= -(-total // k) for sz in sizes)


@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_split_even_iov_cuts_where_split_even_does(k):
    """The array form of split_even (no Python object per range) gives the same shares."""
    import numpy as np

    parts = _contiguous_parts(k)
    local = np.array([(d, n) for d, _, n in parts], dtype=np.uint64)
    remote = np.array([(s, n) for _, s, n in parts], dtype=np.uint64)
    got = low_cma.split_even_iov(local, remote, k)
    want = low_cma.split_even(parts, k)
    assert [[(int(a), int(b), int(n)) for (a, n), (b, _) in zip(lv.tolist(), rv.tolist())] for lv, rv in got] == want
    assert local[:, 0].tolist() == [d for d, _, _ in parts]  # the caller's arrays are not changed


def _iov(pairs: List[Tuple[int, int]]) -> "np.ndarray":
    import numpy as np

    return np.array(pairs, dtype=np.uint64).reshape(-1, 2)


def test_many_small_ranges_read_as_spans_in_any_order() -> None:
    """1 500 small tensors allocated one after another are read as a few remote spans (the bytes between them
    into scratch), across several syscalls, into destinations in shuffled order; every byte lands where asked."""
    import numpy as np

    srcs = [torch.full((4192,), i % 251, dtype=torch.uint8) for i in range(1500)]
    order = list(range(len(srcs)))
    random.Random(7).shuffle(order)
    dst = torch.zeros(4192 * len(srcs), dtype=torch.uint8)
    dests = [dst.data_ptr() + 4192 * order[i] for i in range(len(srcs))]
    remote = _iov([(s.data_ptr(), 4192) for s in srcs])
    local = _iov([(d, 4192) for d in dests])
    scratch = np.empty(4096, dtype=np.uint8)
    for r, l in ((remote, local), (remote[order], local[order])):  # allocation order, and shuffled
        plan = low_cma.spans_plan(l, r, scratch.ctypes.data, 4096)
        assert plan is not None and len(plan) >= 3  # 1 500 ranges and their gaps: more than one call's 1 024
        assert sum(len(rv) for _, rv in plan) < len(srcs) // 2
        dst.zero_()
        assert low_cma.read_plan(low_cma.READV, os.getpid(), plan)
        assert all(torch.equal(dst[4192 * order[i]:4192 * (order[i] + 1)], srcs[i]) for i in range(len(srcs)))
    # Through the reader, with the object's guard checked after the read.
    guard = _cma.guard_for(OBJ)
    dst.zero_()
    _cma.CmaReader(threads=1).read(os.getpid(), _cma.CmaInfo(guard.ctypes.data, [(s.data_ptr(), 4192) for s in srcs]),
                                   dests, OBJ)
    assert all(torch.equal(dst[4192 * order[i]:4192 * (order[i] + 1)], srcs[i]) for i in range(len(srcs)))


def test_ranges_far_apart_are_not_spanned_and_a_span_over_a_hole_falls_back() -> None:
    """Ranges more than a page apart stay separate iovecs; a span across an inaccessible page fails as a whole and
    the reader reads range by range instead, with every byte right."""
    import ctypes
    import mmap

    import numpy as np

    scratch = np.empty(4096, dtype=np.uint8)
    far = torch.arange(64 * 65536 // 4, dtype=torch.int32)
    base = far.data_ptr()
    pairs = [(base + i * 65536, 64) for i in range(64)]
    assert low_cma.spans_plan(_iov(pairs), _iov(pairs), scratch.ctypes.data, 4096) is None

    page = mmap.PAGESIZE
    m = mmap.mmap(-1, 3 * page)
    m[:] = bytes(i % 253 for i in range(3 * page))
    holder = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(holder)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(addr + page), page, 0) == 0  # PROT_NONE
    try:
        # 32 ranges ending the first page, 32 starting the third: one page apart, so one span across the hole.
        ranges = [(addr + page - 64 * (32 - i), 64) for i in range(32)] + [(addr + 2 * page + 64 * i, 64)
                                                                         for i in range(32)]
        dst = torch.zeros(64 * 64, dtype=torch.uint8)
        local = _iov([(dst.data_ptr() + 64 * i, 64) for i in range(64)])
        plan = low_cma.spans_plan(local, _iov(ranges), scratch.ctypes.data, page)
        assert plan is not None and sum(len(rv) for _, rv in plan) == 1
        assert not low_cma.read_plan(low_cma.READV, os.getpid(), plan)  # the kernel stops at the hole
        guard = _cma.guard_for(OBJ)
        dst.zero_()
        _cma.CmaReader(threads=1).read(os.getpid(), _cma.CmaInfo(guard.ctypes.data, ranges),
                                       [dst.data_ptr() + 64 * i for i in range(64)], OBJ)
        want = b"".join(bytes(m[a - addr:a - addr + n]) for a, n in ranges)
        assert dst.numpy().tobytes() == want
    finally:
        libc.mprotect(ctypes.c_void_p(addr + page), page, mmap.PROT_READ | mmap.PROT_WRITE)
        del holder
        m.close()
