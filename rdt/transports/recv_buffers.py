"""Large CPU receive buffers: huge pages where the kernel offers them, recycled once the consumer drops them.

A fresh 128 MiB ``torch.empty`` costs ~32 000 page faults (4 KiB each, zeroed) the first time it is written,
about as much as the transfer itself. An anonymous mapping advised ``MADV_HUGEPAGE`` faults in 2 MiB pages
instead (about 5x cheaper), and a buffer whose tensors have all died goes back to a bounded pool, so a consumer
that receives objects of similar size in a loop writes into pages that are already there. The memory is private
to the consumer. Disable huge pages with ``RDT_HUGE_PAGES=0``; bound or turn off the pool with
``rdt.configure(pool_bytes=...)``.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from rdt_transports._memcopy import copy_tensor

# From POOL_MIN_BYTES buffers come from the pool: glibc serves a fresh multi-MiB allocation with fresh pages (a
# fault per 4 KiB page: +1 ms for a 4 MB landing), a recycled mapping has them already. Below it, torch's
# allocator reuses its heap. From HUGE_MIN_BYTES sizes round to 2 MiB and ask for huge pages; below, to 64 KiB.
POOL_MIN_BYTES = 1 << 20
HUGE_MIN_BYTES = 4 << 20
_HUGE = 2 << 20
_SMALL = 64 << 10


def _huge_pages_enabled() -> bool:
    if os.environ.get("RDT_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode


_HUGE_PAGES = _huge_pages_enabled()


def _new_mapping(size: int) -> mmap.mmap:
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _HUGE_PAGES and size >= HUGE_MIN_BYTES:
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # no THP for this mapping: 4 KiB pages, still correct
            pass
    return mm


def _close(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # the last view is still being torn down; the mapping goes with it
        pass


class BufferPool:
    """Hands out large uninitialised uint8 CPU tensors and takes their memory back when the last view dies.

    Bounded by ``max_bytes`` of idle buffers; an idle buffer is unmapped after ``ttl`` seconds (or at once when
    it does not fit). Thread-safe: buffers come back on whichever thread drops the last view.

    A finalizer may run anywhere, including inside this pool's locked region on the same thread (a GC pass
    triggered by an allocation there), so it enqueues the buffer's key on a lock-free queue and drains the queue
    itself only if it can take the lock without waiting; otherwise the next ``empty``, ``trim``, ``idle_bytes``
    or ``close`` drains it (the reaper calls ``trim`` periodically, so returned memory never waits long).
    """

    def __init__(self, max_bytes: int, ttl: float) -> None:
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._lock = threading.Lock()
        self._live: Dict[int, mmap.mmap] = {}
        self._free: List[Tuple[float, mmap.mmap]] = []
        self._returned: "queue.SimpleQueue[int]" = queue.SimpleQueue()  # keys of dead buffers, from finalizers
        self._idle_bytes = 0
        self._next = 0
        self.hits = 0
        self.misses = 0

    def empty(self, nbytes: int) -> torch.Tensor:
        """An uninitialised CPU uint8 tensor of ``nbytes`` (recycled memory when some fits)."""
        if nbytes < POOL_MIN_BYTES:
            return torch.empty(nbytes, dtype=torch.uint8)
        unit = _HUGE if nbytes >= HUGE_MIN_BYTES else _SMALL
        size = -(-nbytes // unit) * unit
        mm = self._take(size)
        if mm is None:
            mm = _new_mapping(size)
            self.misses += 1
        else:
            self.hits += 1
        arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
        with self._lock:
            self._next += 1
            key = self._next
            self._live[key] = mm
        weakref.finalize(arr, self._on_dead, key)
        return torch.from_numpy(arr)

    def _on_dead(self, key: int) -> None:
        """Finalizer: enqueue the buffer, then drain at once only if the lock is free (never wait for it: this
        thread may be the one holding it)."""
        self._returned.put(key)  # SimpleQueue.put is reentrant
        if not self._lock.acquire(blocking=False):
            return  # the holder, or the next call, drains it
        try:
            drop = self._drain()
        finally:
            self._lock.release()
        _close_all(drop)

    def _take(self, size: int) -> Optional[mmap.mmap]:
        drop: List[mmap.mmap] = []
        try:
            with self._lock:
                drop = self._drain()
                drop += self._expire(time.monotonic())
                best = None
                for i, (_, mm) in enumerate(self._free):
                    if size <= len(mm) <= 2 * size and (best is None or len(mm) < len(self._free[best][1])):
                        best = i
                if best is None:
                    return None
                _, mm = self._free.pop(best)
                self._idle_bytes -= len(mm)
                return mm
        finally:
            _close_all(drop)

    def _drain(self) -> List[mmap.mmap]:
        """Move buffers whose views died into the idle list (caller holds the lock); returns those to unmap."""
        drop = []
        while True:
            try:
                key = self._returned.get_nowait()
            except queue.Empty:
                return drop
            mm = self._live.pop(key, None)
            if mm is None:
                continue
            if self._idle_bytes + len(mm) <= self.max_bytes:
                self._free.append((time.monotonic(), mm))
                self._idle_bytes += len(mm)
            else:
                drop.append(mm)

    def _expire(self, now: float) -> List[mmap.mmap]:
        """Remove buffers idle longer than ``ttl`` (caller holds the lock); returns them for unmapping."""
        keep, drop = [], []
        for since, mm in self._free:
            if now - since > self.ttl:
                self._idle_bytes -= len(mm)
                drop.append(mm)
            else:
                keep.append((since, mm))
        self._free = keep
        return drop

    def trim(self) -> None:
        """Take back dropped buffers and unmap those idle for longer than ``ttl`` (called periodically)."""
        with self._lock:
            drop = self._drain() + self._expire(time.monotonic())
        _close_all(drop)

    def idle_bytes(self) -> int:
        with self._lock:
            drop = self._drain()
            n = self._idle_bytes
        _close_all(drop)
        return n

    def close(self) -> None:
        """Unmap every idle buffer (buffers still in use are unmapped when their tensors die)."""
        with self._lock:
            drop = self._drain()
            free, self._free, self._idle_bytes = self._free, [], 0
        _close_all(drop + [mm for _, mm in free])


def _close_all(mms: List[mmap.mmap]) -> None:
    for mm in mms:
        _close(mm)


class ParallelCopier:
    """Copies large CPU buffers with a few threads (torch's copy releases the GIL): one thread cannot saturate
    memory bandwidth, and a producer filling a shared-memory segment is on its caller's critical path."""

    MIN_BYTES = 16 << 20

    def __init__(self, threads: int = 0) -> None:
        self.threads = threads or max(1, min(4, os.cpu_count() or 1))
        self._pool: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` for 1-D contiguous uint8 CPU tensors of equal length."""
        n = src.numel()
        if self.threads < 2 or n < self.MIN_BYTES:
            copy_tensor(dst, src)
            return
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="rdt-copy")
        step = ((n + self.threads - 1) // self.threads + 63) // 64 * 64
        parts = [(lo, min(lo + step, n)) for lo in range(0, n, step)]
        futures = [self._pool.submit(copy_tensor, dst[lo:hi], src[lo:hi]) for lo, hi in parts[1:]]
        lo, hi = parts[0]
        copy_tensor(dst[lo:hi], src[lo:hi])
        for f in futures:
            f.result()
