"""Cross-memory attach: ``process_vm_readv`` / ``process_vm_writev`` over many byte ranges, split across threads.

The kernel copies between two processes' memory in one step, where the caller could ptrace the other process
(same user, Yama's ``ptrace_scope`` at 0 or absent, or ``CAP_SYS_PTRACE``); elsewhere it fails with EPERM and
callers fall back to another path. One thread copies about 6 GB/s here and two about 11 GB/s (2 cores), so large
copies are cut into even shares, one per thread. Shared by the object layer's direct reads
(``rdt.transports.shm.cma``) and the NIXL backend's same-node writes.
"""

from __future__ import annotations

import ctypes
import errno
import os
from concurrent.futures import Executor
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

Part = Tuple[int, int, int]  # (local address, remote address, bytes)
IOV_MAX = 1024  # iovecs per call (Linux's UIO_MAXIOV)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load(name: str) -> Optional[ctypes._CFuncPtr]:
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


READV = _load("process_vm_readv")
WRITEV = _load("process_vm_writev")


class CmaError(OSError):
    """A cross-memory copy failed; the caller falls back to a path that involves the other process."""


class CmaDenied(CmaError):
    """The kernel forbids copying with that process (ptrace rules, seccomp, no syscall): do not try it again."""


def _once(fn: ctypes._CFuncPtr, pid: int, local: int, remote: int, n: int) -> None:
    """One range, looping over short copies; raises the typed error of a failure."""
    done = 0
    while done < n:
        lv = _IoVec(local + done, n - done)
        rv = _IoVec(remote + done, n - done)
        got = fn(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
        if got < 0:
            err = ctypes.get_errno()
            if err in (errno.EPERM, errno.EACCES, errno.ENOSYS):
                raise CmaDenied(err, f"{fn.__name__} on pid {pid}: {os.strerror(err)}")
            raise CmaError(err, f"{fn.__name__} on pid {pid}: {os.strerror(err)}")
        if got == 0:
            raise CmaError(errno.EFAULT, f"{fn.__name__} on pid {pid}: no bytes at {remote + done:#x}")
        done += got


def batched(fn: Optional[ctypes._CFuncPtr], pid: int, parts: Sequence[Part]) -> None:
    """Many (local, remote, n) ranges with ``fn`` (READV or WRITEV): one syscall per 1024, not one per range."""
    if fn is None:
        raise CmaDenied(errno.ENOSYS, "cross-memory attach is not available")
    for s in range(0, len(parts), IOV_MAX):
        chunk = parts[s:s + IOV_MAX]
        k = len(chunk)
        vec = np.array(chunk, dtype=np.uint64)  # columns: local, remote, n
        lv = np.ascontiguousarray(vec[:, [0, 2]])  # struct iovec {base, len}, as two uint64 per entry
        rv = np.ascontiguousarray(vec[:, [1, 2]])
        if fn(pid, lv.ctypes.data_as(ctypes.POINTER(_IoVec)), k, rv.ctypes.data_as(ctypes.POINTER(_IoVec)), k,
              0) == int(vec[:, 2].sum()):
            continue
        for local, remote, n in chunk:  # an error or a short copy: redo range by range (raises the right error)
            _once(fn, pid, local, remote, n)


def batched_iov(fn: Optional[ctypes._CFuncPtr], pid: int, local: np.ndarray, remote: np.ndarray) -> None:
    """:func:`batched` for ranges given as two (n, 2) uint64 arrays of ``struct iovec`` (address, length), equal
    lengths row by row: no per-range Python object on the way to the kernel."""
    if fn is None:
        raise CmaDenied(errno.ENOSYS, "cross-memory attach is not available")
    iov = ctypes.POINTER(_IoVec)
    for s in range(0, len(local), IOV_MAX):
        lv, rv = local[s:s + IOV_MAX], remote[s:s + IOV_MAX]
        k = len(lv)
        if fn(pid, lv.ctypes.data_as(iov), k, rv.ctypes.data_as(iov), k, 0) == int(lv[:, 1].sum()):
            continue
        for (dest, n), (src, _) in zip(lv.tolist(), rv.tolist()):  # an error or a short copy: range by range
            if n:
                _once(fn, pid, dest, src, n)


def spans_plan(local: np.ndarray, remote: np.ndarray, scratch: int, max_gap: int
               ) -> Optional[List[Tuple[np.ndarray, np.ndarray]]]:
    """Per syscall, (local, remote) iovec arrays that read ranges lying close together in the other process as one
    remote span each, the bytes between them landing in ``scratch`` (``max_gap`` bytes at least). The kernel pins
    the pages of each remote iovec separately: a thousand 4 KiB tensors allocated one after another are read in
    two thirds of the time as spans. None: fewer than half the ranges join (read them as they are)."""
    n = len(remote)
    r, dest = remote.view(np.int64), local.view(np.int64)[:, 0]
    if not (r[1:, 0] >= r[:-1, 0]).all():  # the usual order is the allocation order: sort only if needed
        order = np.argsort(r[:, 0], kind="stable")
        r, dest = r[order], dest[order]
    ra, rn = r[:, 0], r[:, 1]
    ends = ra + rn
    gap = ra[1:] - ends[:-1]
    cut = np.ones(n + 1, dtype=bool)  # cut[i]: range i starts a span (and range i-1 ends one)
    np.logical_or(gap < 0, gap > max_gap, out=cut[1:n])
    starts = np.flatnonzero(cut[:n])
    if len(starts) * 2 > n:
        return None
    # The byte stream, in remote order: before range i its gap (when joined to range i-1), then range i itself.
    iov = np.empty((2 * n, 2), dtype=np.int64)
    iov[0::2, 0] = scratch
    iov[0, 1] = 0
    iov[2::2, 1] = np.where(cut[1:n], 0, gap)
    iov[1::2, 0] = dest
    iov[1::2, 1] = rn
    entries = iov  # the kernel skips the empty entries (no gap, an empty range): cheaper than dropping them
    spans = np.empty((len(starts), 2), dtype=np.int64)
    spans[:, 0] = ra[starts]
    spans[:, 1] = ends[np.flatnonzero(cut[1:])] - spans[:, 0]
    span_end = np.cumsum(spans[:, 1])  # where each span ends in the stream
    stream_end = np.cumsum(entries[:, 1])
    plan = []
    for s in range(0, len(entries), IOV_MAX):
        lv = entries[s:s + IOV_MAX]
        a = int(stream_end[s - 1]) if s else 0
        b = int(stream_end[s + len(lv) - 1])
        if b == a:
            continue
        first, last = int(span_end.searchsorted(a, "right")), int(span_end.searchsorted(b - 1, "right"))
        rv = spans[first:last + 1].copy()
        skip = a - (int(span_end[first - 1]) if first else 0)  # the chunk starts inside its first span
        rv[0, 0] += skip
        rv[0, 1] -= skip
        rv[-1, 1] -= int(span_end[last]) - b  # and ends inside its last
        plan.append((lv.view(np.uint64), rv.view(np.uint64)))
    return plan


def read_plan(fn: Optional[ctypes._CFuncPtr], pid: int, plan: Sequence[Tuple[np.ndarray, np.ndarray]]) -> bool:
    """Run a :func:`spans_plan`; False on any error or short copy (a span crossed unmapped memory: the caller
    reads range by range instead)."""
    if fn is None:
        raise CmaDenied(errno.ENOSYS, "cross-memory attach is not available")
    iov = ctypes.POINTER(_IoVec)
    for lv, rv in plan:
        want = int(lv[:, 1].sum())
        if fn(pid, lv.ctypes.data_as(iov), len(lv), rv.ctypes.data_as(iov), len(rv), 0) != want:
            return False
    return True


def split_even(parts: Sequence[Part], k: int) -> List[List[Part]]:
    """(local, remote, n) ranges cut into at most ``k`` lists of about equal bytes, in order (a range that
    straddles a boundary is split there), so that ``k`` threads finish together whatever the sizes of the ranges."""
    total = sum(n for _, _, n in parts)
    share = max(-(-total // max(k, 1)), 1)
    out: List[List[Part]] = [[]]
    room = share
    for dest, src, n in parts:
        off = 0
        while off < n:
            if room == 0:
                out.append([])
                room = share
            take = min(n - off, room)
            out[-1].append((dest + off, src + off, take))
            off += take
            room -= take
    return [s for s in out if s]


def split_even_iov(local: np.ndarray, remote: np.ndarray, k: int) -> List[Tuple[np.ndarray, np.ndarray]]:
    """:func:`split_even` for ranges given as (n, 2) uint64 iovec arrays (equal lengths row by row): at most ``k``
    (local, remote) pairs of about equal bytes, in order, a range straddling a boundary split there; no Python
    object per range."""
    n = remote[:, 1].astype(np.int64)
    total = int(n.sum())
    if total == 0:
        return []
    share = max(-(-total // max(k, 1)), 1)
    ends = np.cumsum(n)
    starts = ends - n
    out: List[Tuple[np.ndarray, np.ndarray]] = []
    for a in range(0, total, share):
        b = min(a + share, total)
        i0 = int(np.searchsorted(ends, a, "right"))  # the first range ending after a
        i1 = int(np.searchsorted(starts, b, "left"))  # the first range starting at or after b
        lv, rv = local[i0:i1].astype(np.uint64), remote[i0:i1].astype(np.uint64)
        head = np.uint64(a - int(starts[i0]))
        tail = np.uint64(int(ends[i1 - 1]) - b)
        lv[0, 0] += head
        rv[0, 0] += head
        lv[0, 1] -= head
        rv[0, 1] -= head
        lv[-1, 1] -= tail
        rv[-1, 1] -= tail
        out.append((lv, rv))
    return out


def spread_iov(local: np.ndarray, remote: np.ndarray, fn: Callable[[np.ndarray, np.ndarray], None], threads: int,
               pool: Optional[Executor]) -> None:
    """:func:`spread` for iovec arrays: ``fn(local, remote)`` over ``threads`` even shares, this thread taking the
    first; waits for every share, then raises the first error."""
    shares = split_even_iov(local, remote, threads if pool is not None else 1)
    futures = [pool.submit(fn, lv, rv) for lv, rv in shares[1:]] if pool is not None else []
    first: Optional[BaseException] = None
    try:
        if shares:
            fn(*shares[0])
    except BaseException as e:  # still wait for the others: they copy into live buffers
        first = e
    for f in futures:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001 - the first error is raised below
            first = first or e
    if first is not None:
        raise first


def spread(parts: Sequence[Part], fn: Callable[[Sequence[Part]], None], threads: int,
           pool: Optional[Executor]) -> None:
    """Run ``fn`` over ``parts`` cut into ``threads`` even shares: this thread takes the first, ``pool`` the rest
    (``pool`` None or one thread: all here). Waits for every share, then raises the first error."""
    if threads < 2 or pool is None:
        fn(parts)
        return
    shares = split_even(parts, threads)
    futures = [pool.submit(fn, s) for s in shares[1:]]
    first: Optional[BaseException] = None
    try:
        fn(shares[0])
    except BaseException as e:  # still wait for the others: they copy into live buffers
        first = e
    for f in futures:
        try:
            f.result()
        except BaseException as e:
            first = first or e
    if first is not None:
        raise first
