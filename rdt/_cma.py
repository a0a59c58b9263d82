"""Same-node reads straight from the producer's memory with ``process_vm_readv`` (cross-memory attach).

One copy, done by the kernel from the producer's pages into the consumer's buffer: no segment to fill on the
producer's side, no page-table work for a shared mapping on the consumer's, and nothing asked of the producer
process (it may be busy or even stopped). This is how MPI libraries and UCX move large messages within a node.

The kernel allows it only where the consumer could ptrace the producer: same user, and Yama's ``ptrace_scope``
at 0 (or absent), or ``CAP_SYS_PTRACE``. rdt never relaxes that; where it is refused, ``shm`` falls back to a
shared-memory segment (see ``transports/shm``).

Each object the producer keeps readable this way has a small **guard** in the producer's memory: the object's
id, zeroed before its tensors are released. A consumer reads the tensors, then the guard; only a guard that
still names the object proves the bytes came from the live object (and from the right process).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from collections import OrderedDict
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from rdt_transports._proc import pid_alive

MAGIC = b"rdtcma1\0"
GUARD_BYTES = len(MAGIC) + 16
_PARALLEL_MIN = 16 << 20  # below this one thread is as fast (the split costs more than it saves)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load() -> Optional[ctypes._CFuncPtr]:
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


_READV = _load()


class CmaError(OSError):
    """A cross-memory read failed; the caller falls back to a path that asks the producer."""


class CmaDenied(CmaError):
    """The kernel forbids reading that process (ptrace rules, seccomp, no syscall): do not try it again."""


@dataclass(frozen=True)
class CmaInfo:
    """Where an object's buffers and guard live in the producer's address space."""

    guard: int
    ranges: Tuple[Tuple[int, int], ...]  # (address, nbytes) per buffer


def yama_allows_siblings() -> bool:
    """Whether Yama lets a process read a non-descendant of the same user (scope 0, or no Yama at all)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return f.read().strip() == "0"
    except OSError:
        return True


def supported() -> bool:
    """Whether this process can attempt cross-memory reads at all (Linux, glibc with the wrapper)."""
    return _READV is not None


def _guard_bytes(obj_id: bytes) -> bytes:
    return MAGIC + obj_id[:16].ljust(16, b"\0")


def guard_for(obj_id: bytes) -> np.ndarray:
    """The producer-side guard naming ``obj_id`` (kept alive with the object, zeroed by :func:`clear`)."""
    return np.frombuffer(_guard_bytes(obj_id), dtype=np.uint8).copy()


def clear(guard: np.ndarray) -> None:
    """Mark the object gone: any consumer read that finishes after this sees a wrong guard."""
    guard[:] = 0


def _read_once(pid: int, local: int, remote: int, n: int) -> None:
    assert _READV is not None
    done = 0
    while done < n:
        lv = _IoVec(local + done, n - done)
        rv = _IoVec(remote + done, n - done)
        got = _READV(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
        if got < 0:
            err = ctypes.get_errno()
            if err in (errno.EPERM, errno.EACCES, errno.ENOSYS):
                raise CmaDenied(err, f"process_vm_readv on pid {pid}: {os.strerror(err)}")
            raise CmaError(err, f"process_vm_readv on pid {pid}: {os.strerror(err)}")
        if got == 0:
            raise CmaError(errno.EFAULT, f"process_vm_readv on pid {pid}: no bytes at {remote + done:#x}")
        done += got


_IOV_MAX = 1024  # iovecs per process_vm_readv (Linux's UIO_MAXIOV)


def _read_batched(pid: int, parts: Sequence[Tuple[int, int, int]]) -> None:
    """Many (local, remote, n) ranges in one process_vm_readv per 1024: one syscall, not one per buffer."""
    assert _READV is not None
    for s in range(0, len(parts), _IOV_MAX):
        chunk = parts[s:s + _IOV_MAX]
        k = len(chunk)
        vec = np.array(chunk, dtype=np.uint64)  # columns: local, remote, n
        lv = np.ascontiguousarray(vec[:, [0, 2]])  # struct iovec {base, len}, as two uint64 per entry
        rv = np.ascontiguousarray(vec[:, [1, 2]])
        if _READV(pid, lv.ctypes.data_as(ctypes.POINTER(_IoVec)), k, rv.ctypes.data_as(ctypes.POINTER(_IoVec)), k,
                  0) == int(vec[:, 2].sum()):
            continue
        for local, remote, n in chunk:  # an error or a short read: redo range by range (raises the right error)
            _read_once(pid, local, remote, n)


def gather(parts: Sequence[Tuple[int, int, int]]) -> None:
    """Copy many (dest, src, n) byte ranges within this process: one process_vm_readv on our own pid per 1024
    ranges where the kernel allows it, else one memmove each (packing a thousand small tensors costs one call)."""
    if _READV is not None:
        try:
            _read_batched(os.getpid(), parts)
            return
        except CmaError:
            pass
    for dest, src, n in parts:
        ctypes.memmove(dest, src, n)


def split_even(parts: Sequence[Tuple[int, int, int]], k: int) -> List[List[Tuple[int, int, int]]]:
    """(dest, src, n) ranges cut into at most ``k`` lists of about equal bytes, in order (a range that straddles
    a boundary is split there), so that ``k`` threads finish together whatever the sizes of the ranges."""
    total = sum(n for _, _, n in parts)
    share = max(-(-total // max(k, 1)), 1)
    out: List[List[Tuple[int, int, int]]] = [[]]
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


class _DeniedPids:
    """Pids the kernel refused, most recent last: at most ``cap`` (the oldest is forgotten and merely tried
    again), and a pid whose process died is forgotten when asked about, so a reused pid starts afresh."""

    def __init__(self, cap: int = 1024) -> None:
        self.cap = cap
        self._pids: "OrderedDict[int, None]" = OrderedDict()
        self._lock = threading.Lock()

    def add(self, pid: int) -> None:
        with self._lock:
            self._pids[pid] = None
            self._pids.move_to_end(pid)
            while len(self._pids) > self.cap:
                self._pids.popitem(last=False)

    def __contains__(self, pid: object) -> bool:
        with self._lock:
            if pid not in self._pids:
                return False
        if isinstance(pid, int) and pid_alive(pid):
            return True
        with self._lock:
            self._pids.pop(pid, None)  # type: ignore[call-overload]
        return False

    def __len__(self) -> int:
        with self._lock:
            return len(self._pids)


class CmaReader:
    """Reads producers' buffers into local memory, splitting large reads across a few threads (ctypes releases
    the GIL, and one thread cannot saturate memory bandwidth). Remembers producers the kernel refused."""

    def __init__(self, threads: int = 0) -> None:
        self.threads = threads or max(1, min(4, os.cpu_count() or 1))
        self._pool: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        self._denied = _DeniedPids()

    def denied(self, pid: int) -> bool:
        return pid in self._denied

    def read(self, pid: int, info: CmaInfo, dests: Sequence[int], obj_id: bytes) -> None:
        """Copy each ``info.ranges[i]`` of process ``pid`` to address ``dests[i]`` here, then check the guard.

        Raises :class:`CmaDenied` (remembered for ``pid``) or :class:`CmaError` (bad address, no process, or a
        guard that no longer names ``obj_id``); on error the destination contents are unspecified.
        """
        if _READV is None:
            raise CmaDenied(errno.ENOSYS, "process_vm_readv is not available")
        try:
            self.spread([(d, a, n) for d, (a, n) in zip(dests, info.ranges) if n],
                        lambda part: _read_batched(pid, part))
        except CmaDenied:
            self._denied.add(pid)
            raise
        self.check(pid, info, obj_id)

    def check(self, pid: int, info: CmaInfo, obj_id: bytes) -> None:
        """Raise :class:`CmaError` unless the guard in process ``pid`` still names ``obj_id`` (the object is live)."""
        if _READV is None:
            raise CmaDenied(errno.ENOSYS, "process_vm_readv is not available")
        got = np.empty(GUARD_BYTES, dtype=np.uint8)
        try:
            _read_once(pid, got.ctypes.data, info.guard, GUARD_BYTES)
        except CmaDenied:
            self._denied.add(pid)
            raise
        if got.tobytes() != _guard_bytes(obj_id):
            raise CmaError(errno.ESTALE, f"object {obj_id.hex()} is no longer held by pid {pid}")

    def spread(self, parts: Sequence[Tuple[int, int, int]],
               fn: Callable[[Sequence[Tuple[int, int, int]]], None]) -> None:
        """Run ``fn`` over (dest, src, n) ranges split into one even share of bytes per thread (this thread takes
        the first share); small totals run here in one call. Waits for every share, then raises the first error."""
        total = sum(n for _, _, n in parts)
        if self.threads < 2 or total < _PARALLEL_MIN:
            fn(parts)
            return
        shares = split_even(parts, self.threads)
        pool = self._executor()
        futures = [pool.submit(fn, s) for s in shares[1:]]
        first: Optional[BaseException] = None
        try:
            fn(shares[0])
        except BaseException as e:  # still wait for the others: they write into our buffers
            first = e
        for f in futures:
            try:
                f.result()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def close(self) -> None:
        """Let the reader threads go (a later read starts them again)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="rdt-cma")
            return self._pool
