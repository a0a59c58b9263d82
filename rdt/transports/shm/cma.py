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

import errno
import os
import threading
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from itertools import chain
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from rdt_transports import _cma as _low
from rdt_transports._cma import CmaDenied, CmaError
from rdt_transports._proc import process_alive, start_time

MAGIC = b"rdtcma1\0"
GUARD_BYTES = len(MAGIC) + 16
_PARALLEL_MIN = 16 << 20  # below this one thread is as fast (the split costs more than it saves)
# Spans: from 32 ranges of 64 KiB or less on average, joined across gaps of up to a page (reading a page costs
# about what one more iovec does; 1 000 ranges of 4 KiB: 0.88 -> 0.58 ms plus 0.06-0.09 ms of planning).
_SPAN_MIN_RANGES, _SPAN_MAX_MEAN, _SPAN_MAX_GAP = 32, 64 << 10, 4096


_READV = _low.READV


class CmaInfo:
    """Where an object's buffers and guard live in the producer's address space. The ranges are kept as the
    ``struct iovec`` array the kernel reads (address, length as native 64-bit pairs): pickled as one bytes object
    and handed to ``process_vm_readv`` as they are, however many buffers there are."""

    __slots__ = ("guard", "iov")

    def __init__(self, guard: int, ranges: Union[bytes, Sequence[Tuple[int, int]]]) -> None:
        self.guard = guard
        self.iov = ranges if isinstance(ranges, bytes) else array("Q", chain.from_iterable(ranges)).tobytes()

    @property
    def ranges(self) -> List[Tuple[int, int]]:
        """(address, nbytes) per buffer."""
        a = array("Q")
        a.frombytes(self.iov)
        v = a.tolist()
        return list(zip(v[0::2], v[1::2]))

    def __reduce__(self) -> Any:
        return (CmaInfo, (self.guard, self.iov))

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, CmaInfo) and (self.guard, self.iov) == (other.guard, other.iov)

    def __hash__(self) -> int:
        return hash((self.guard, self.iov))

    def __repr__(self) -> str:
        return f"CmaInfo(guard={self.guard:#x}, {len(self.iov) // 16} ranges)"


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
    _low._once(_low.READV, pid, local, remote, n)


def _read_batched(pid: int, parts: Sequence[Tuple[int, int, int]]) -> None:
    """Many (local, remote, n) ranges in one process_vm_readv per 1024: one syscall, not one per buffer."""
    _low.batched(_READV, pid, parts)


class _DeniedPids:
    """Processes the kernel refused, by pid with their start time, most recent last: at most ``cap`` (the oldest
    is forgotten and merely tried again), and one that is gone is forgotten when asked about, so a process given
    its pid later (another start time) starts afresh."""

    def __init__(self, cap: int = 1024) -> None:
        self.cap = cap
        self._pids: "OrderedDict[int, Optional[int]]" = OrderedDict()  # pid -> start time of the refusing process
        self._lock = threading.Lock()

    def add(self, pid: int, started: Optional[int] = None) -> None:
        """Remember that process ``(pid, started)`` refused us (``started`` None: the process at ``pid`` now)."""
        started = start_time(pid) if started is None else started
        with self._lock:
            self._pids[pid] = started
            self._pids.move_to_end(pid)
            while len(self._pids) > self.cap:
                self._pids.popitem(last=False)

    def denied(self, pid: int, started: Optional[int] = None) -> bool:
        """Whether process ``(pid, started)`` refused us (``started`` None: whichever process has ``pid`` now)."""
        with self._lock:
            if pid not in self._pids:
                return False
            refused = self._pids[pid]
        if not process_alive(pid, refused):  # the process that refused is gone: forget it
            with self._lock:
                if pid in self._pids and self._pids[pid] == refused:
                    del self._pids[pid]
            return False
        return started is None or refused is None or started == refused

    def __contains__(self, pid: object) -> bool:
        return isinstance(pid, int) and self.denied(pid)

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
        self._scratch: Optional[np.ndarray] = None  # where the bytes between spanned ranges land (never read)

    def denied(self, pid: int, started: Optional[int] = None) -> bool:
        """Whether the kernel refused process ``(pid, started)`` (see :class:`_DeniedPids`)."""
        return self._denied.denied(pid, started)

    def read(self, pid: int, info: CmaInfo, dests: Sequence[int], obj_id: bytes,
             started: Optional[int] = None) -> None:
        """Copy each ``info.ranges[i]`` of process ``pid`` (started at ``started``) to address ``dests[i]`` here,
        then check the guard.

        Raises :class:`CmaDenied` (remembered for that process) or :class:`CmaError` (bad address, no process, or
        a guard that no longer names ``obj_id``); on error the destination contents are unspecified.
        """
        if _READV is None:
            raise CmaDenied(errno.ENOSYS, "process_vm_readv is not available")
        try:
            remote = np.frombuffer(info.iov, dtype=np.uint64).reshape(-1, 2)
            local = np.empty_like(remote)
            local[:, 0] = dests
            local[:, 1] = remote[:, 1]
            if self.threads < 2 or int(remote[:, 1].sum()) < _PARALLEL_MIN:  # one thread: the arrays as they are
                if not self._read_spans(pid, local, remote):
                    _low.batched_iov(_READV, pid, local, remote)
            else:  # even shares of bytes over the reader threads, as arrays (no Python object per range)
                _low.spread_iov(local, remote, lambda lv, rv: _low.batched_iov(_READV, pid, lv, rv), self.threads,
                                self._executor())
        except CmaDenied:
            self._denied.add(pid, started)
            raise
        self.check(pid, info, obj_id)

    def _read_spans(self, pid: int, local: np.ndarray, remote: np.ndarray) -> bool:
        """Many small ranges lying close together in the producer (tensors allocated one after another) read as
        a few spans, the bytes between them dropped in a scratch buffer. False: not this case, or a span could not
        be read whole (the caller reads range by range)."""
        n = len(remote)
        if n < _SPAN_MIN_RANGES or int(remote[:, 1].sum()) > n * _SPAN_MAX_MEAN:
            return False
        if self._scratch is None:
            self._scratch = np.empty(_SPAN_MAX_GAP, dtype=np.uint8)
        plan = _low.spans_plan(local, remote, self._scratch.ctypes.data, _SPAN_MAX_GAP)
        return plan is not None and _low.read_plan(_READV, pid, plan)

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
        _low.spread(parts, fn, self.threads, self._executor())

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
