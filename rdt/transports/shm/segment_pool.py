"""A producer's pool of freed shared-memory segments, reused so that writing an object skips fresh tmpfs pages.

Filling fresh tmpfs pages costs about 6x more than copying into pages that already exist (128 MiB: ~80 ms
against ~10 ms on a 2-core VM). When an object that went through shared memory is freed, its segment waits here
(bounded in bytes, dropped after ``ttl`` seconds idle) for the next object of a similar size. A segment is
reused only once no consumer maps it any more (see the locking rule in ``segments``); one still mapped stays
unavailable until its consumers let go or it expires. Everything here is unlinked at exit, and a killed
producer's segments are reaped by the next rdt process on the node like any other.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from . import segments as _shm
from ..recv_buffers import ParallelCopier

_GRAIN = 1 << 20  # capacities are rounded up to this, so objects of nearly equal size share segments


@dataclass
class _Pooled:
    """A freed segment: its name, an open descriptor (for the lock test) and, once reused, a shared mapping."""

    name: str
    capacity: int
    fd: int
    since: float = field(default_factory=time.monotonic)
    mm: Optional[mmap.mmap] = None
    view: Optional[torch.Tensor] = None  # uint8 view of mm, kept so the copy needs no per-use setup

    def close(self) -> None:
        self.view = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a view escaped; the mapping goes with it
                pass
            self.mm = None
        try:
            os.close(self.fd)
        except OSError:
            pass


class SegmentPool:
    """Freed segments of one producer process, by name (thread-safe)."""

    def __init__(self, max_bytes: int, ttl: float) -> None:
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._free: Dict[str, _Pooled] = {}
        self._mapped: Dict[str, _Pooled] = {}  # live (reused) segments whose writable mapping is kept
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self._copier = ParallelCopier()

    # ------------------------------------------------------------------ producer side
    def write(self, buffers: Sequence[torch.Tensor], obj_id: bytes) -> _shm.Segment:
        """A segment holding ``buffers`` (CPU uint8) with ``obj_id`` in its header: a reused one if possible."""
        layout, size = _shm.layout_for(buffers)
        capacity = -(-size // _GRAIN) * _GRAIN
        pooled = self._take(size, capacity)
        if pooled is None:
            self.misses += 1
            return _shm.write_segment(buffers, obj_id, capacity if self.max_bytes > 0 else 0)
        try:
            if pooled.mm is None:
                pooled.mm = mmap.mmap(pooled.fd, pooled.capacity, flags=mmap.MAP_SHARED)
                pooled.view = torch.frombuffer(pooled.mm, dtype=torch.uint8)
            view = pooled.view
            assert view is not None
            view[:_shm.HEADER].zero_()
            for (off, n), buf in zip(layout, buffers):
                self._copier.copy(view[off:off + n], buf.reshape(-1))
            view[:len(_shm.MAGIC) + 16].copy_(torch.frombuffer(bytearray(_shm.header(obj_id)), dtype=torch.uint8))
        except BaseException:
            fcntl.flock(pooled.fd, fcntl.LOCK_UN)
            pooled.close()
            _shm.unlink(pooled.name)
            raise
        fcntl.flock(pooled.fd, fcntl.LOCK_UN)  # consumers may map it from now on
        self.hits += 1
        self._keep_mapping(pooled)
        return _shm.Segment(pooled.name, layout, pooled.capacity)

    def _take(self, size: int, capacity: int) -> Optional[_Pooled]:
        """The smallest free segment that fits and that no consumer maps, locked exclusively; or None."""
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            for p in sorted(self._free.values(), key=lambda p: p.capacity):
                if not size <= p.capacity <= 2 * capacity:
                    continue
                try:
                    fcntl.flock(p.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # some consumer still maps it
                del self._free[p.name]
                self._bytes -= p.capacity
                return p
        return None

    def _keep_mapping(self, pooled: _Pooled) -> None:
        """Remember the writable mapping of a live segment, so its next reuse skips mapping it again."""
        with self._lock:
            self._mapped[pooled.name] = pooled

    def release(self, seg: _shm.Segment) -> None:
        """The object in ``seg`` was freed: keep the segment for reuse if it fits in the pool, else unlink it."""
        with self._lock:
            known = self._mapped.pop(seg.name, None)
            if self.max_bytes <= 0 or self._bytes + seg.size > self.max_bytes:
                self._evict_for(seg.size)
            if self.max_bytes <= 0 or self._bytes + seg.size > self.max_bytes:
                if known is not None:
                    known.close()
                _shm.unlink(seg.name)
                return
            if known is None:
                try:
                    fd = os.open(os.path.join(_shm.SHM_DIR, seg.name), os.O_RDWR)
                except OSError:  # already gone (reaped, or unlinked at exit)
                    return
                known = _Pooled(seg.name, seg.size, fd)
            try:  # a stale ref to the freed object must not find it here (the header is outside every tensor)
                os.pwrite(known.fd, bytes(len(_shm.MAGIC) + 16), 0)
            except OSError:
                known.close()
                _shm.unlink(seg.name)
                return
            known.since = time.monotonic()
            self._free[seg.name] = known
            self._bytes += known.capacity

    def _evict_for(self, need: int) -> None:
        """Drop the oldest free segments until ``need`` more bytes fit (caller holds the lock)."""
        for p in sorted(self._free.values(), key=lambda p: p.since):
            if self._bytes + need <= self.max_bytes:
                return
            self._drop(p)

    def _drop(self, p: _Pooled) -> None:
        del self._free[p.name]
        self._bytes -= p.capacity
        p.close()
        _shm.unlink(p.name)  # consumers that still map it keep their pages; the name is gone

    def _expire(self, now: float) -> None:
        for p in [p for p in self._free.values() if now - p.since > self.ttl]:
            self._drop(p)

    # ------------------------------------------------------------------ housekeeping
    def trim(self) -> None:
        """Drop segments idle for longer than ``ttl`` (called periodically)."""
        with self._lock:
            self._expire(time.monotonic())

    def names(self) -> List[str]:
        with self._lock:
            return list(self._free)

    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def close(self) -> None:
        """Unlink every pooled segment and unmap live ones' writable mappings; idempotent."""
        with self._lock:
            for p in list(self._free.values()):
                self._drop(p)
            for p in self._mapped.values():
                p.close()
            self._mapped.clear()
