"""Same-node transfer through POSIX shared memory.

The producer copies an object's buffers once into a private (0600) segment with an unguessable name that embeds
its pid; consumers map it copy-on-write (MAP_PRIVATE), so a consumer that writes to its tensors changes only its
own pages, never the producer's or another consumer's. Segments are unlinked (or kept in the producer's pool,
see ``segment_pool``) when the object is freed, unlinked at exit, and by any later rdt process on the node that
finds the owner pid dead.

A segment starts with a header naming the object it holds, and every consumer mapping holds a shared ``flock``
on it for as long as the mapping lives (Python's mmap keeps a duplicate of the descriptor, so the lock lasts
exactly as long as the mapping). The producer reuses a freed segment only when it can take the lock
exclusively, i.e. when no consumer maps it any more; a consumer that finds another object's id in the header, or
the segment locked for rewriting, knows its object was freed.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import queue
import re
import secrets
import threading
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from rdt_transports import _lifecycle, _proc
from rdt_transports._proc import pid_alive

SHM_DIR = "/dev/shm"
PREFIX = "rdt-"
ALIGN = 256
HEADER = ALIGN  # b"rdtseg1\0" + the 16-byte object id, padded to ALIGN
MAGIC = b"rdtseg1\0"
# Object segments are rdt-<pid>-<16 hex owner token><16 random hex>: the token names the owner's lock (see
# rdt_transports._proc). Other files of this form (rdt_transports' shm allreduce segments, barrier semaphores:
# peers derive those names from a published pid) have no lock of their own and are judged by pid.
_NAME_RE = re.compile(r"rdt-([0-9]+)-([0-9a-f]{16})[0-9a-f]{16}")  # fullmatch: no trailing newline, ASCII digits
# What the reaper removes: segments, and the named semaphores of rdt_transports' shared-memory barrier
_REAP_RE = re.compile(r"(?:sem\.)?rdt-([0-9]+)-([0-9a-f]{16})[0-9a-f]{16}")


@dataclass(frozen=True)
class Segment:
    """A written segment: its name and each buffer's (offset, nbytes)."""

    name: str
    layout: Tuple[Tuple[int, int], ...]
    size: int


def _layout(sizes: Sequence[int]) -> Tuple[Tuple[Tuple[int, int], ...], int]:
    out = []
    off = HEADER
    for n in sizes:
        out.append((off, n))
        off += (n + ALIGN - 1) // ALIGN * ALIGN
    return tuple(out), max(off, 1)


def layout_for(buffers: Sequence[torch.Tensor]) -> Tuple[Tuple[Tuple[int, int], ...], int]:
    """Where each buffer goes in a segment, and the bytes the segment needs."""
    return _layout([b.numel() for b in buffers])


def header(obj_id: bytes) -> bytes:
    return MAGIC + obj_id[:16].ljust(16, b"\0")


def write_segment(buffers: Sequence[torch.Tensor], obj_id: bytes = b"", capacity: int = 0) -> Segment:
    """Copy CPU uint8 buffers into a new segment of at least ``capacity`` bytes (one copy, by the kernel's write
    path, which is the cheapest way to fill fresh tmpfs pages)."""
    layout, size = _layout([b.numel() for b in buffers])
    size = max(size, capacity)
    name = f"{PREFIX}{os.getpid()}-{_proc.owner_token()}{secrets.token_hex(8)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        os.pwrite(fd, header(obj_id), 0)
        for (off, n), buf in zip(layout, buffers):
            view = memoryview(buf.numpy()).cast("B")
            done = 0
            while done < n:
                done += os.pwrite(fd, view[done:], off + done)
    except BaseException:
        os.close(fd)
        unlink(name)
        raise
    os.close(fd)
    return Segment(name, layout, size)


class SegmentReused(FileNotFoundError):
    """The segment now holds another object (or is being rewritten): the object asked for was freed."""


class DeferredUnmapper:
    """Unmaps consumers' segment mappings on a background thread once their last tensor is gone.

    Unmapping 128 MiB of touched pages takes ~4 ms; done inline it would sit on the consumer task's return path.
    """

    def __init__(self) -> None:
        self._live: Dict[int, mmap.mmap] = {}
        self._next = 0
        self._queue: "queue.SimpleQueue[Optional[int]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def adopt(self, mm: mmap.mmap) -> torch.Tensor:
        """A uint8 tensor over ``mm``; the mapping is closed in the background after the tensor (and views) die."""
        arr = np.frombuffer(mm, dtype=np.uint8)
        with self._lock:
            self._next += 1
            key = self._next
            self._live[key] = mm
            if self._thread is None:
                self._thread = _lifecycle.spawn(self._run, "rdt-unmap")
                _lifecycle.at_exit(self.stop)
        weakref.finalize(arr, self._queue.put, key)
        return torch.from_numpy(arr)

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the background thread (before the interpreter finalizes); True if it ended. Mappings whose
        tensors die later stay mapped until exit."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return True
        self._queue.put(None)
        thread.join(timeout)
        return not thread.is_alive()

    def _run(self) -> None:
        while True:
            key = self._queue.get()
            if key is None:  # stop()
                return
            with self._lock:
                mm = self._live.pop(key, None)
            if mm is not None:
                try:
                    mm.close()  # also closes mmap's duplicate descriptor, releasing the shared lock
                except BufferError:  # cannot happen once the array is gone; never kill the thread
                    pass

    def pending(self) -> int:
        """Mappings still open (for tests)."""
        with self._lock:
            return len(self._live)


def map_segment(name: str, layout: Sequence[Tuple[int, int]], obj_id: Optional[bytes] = None,
                unmapper: Optional[DeferredUnmapper] = None) -> List[torch.Tensor]:
    """Map a segment copy-on-write and return one uint8 tensor per buffer (no copy until written).

    The mapping holds a shared lock on the segment until it is unmapped, so the producer cannot reuse the
    segment under it. With ``obj_id``, the header must name that object (else :class:`SegmentReused`). With an
    ``unmapper``, the mapping is closed by it in the background once the tensors are gone.
    """
    if not _NAME_RE.fullmatch(name):
        raise FileNotFoundError(f"not an rdt segment name: {name!r}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SegmentReused(f"segment {name} is being rewritten for another object") from None
        if obj_id is not None and os.pread(fd, len(MAGIC) + 16, 0) != header(obj_id):
            raise SegmentReused(f"segment {name} no longer holds object {obj_id.hex()}")
        size = os.fstat(fd).st_size
        if any(off + n > size for off, n in layout):
            raise SegmentReused(f"segment {name} is smaller than the object's layout")
        # mmap keeps its own duplicate of fd, and with it the shared lock, until the mapping is gone
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    whole = unmapper.adopt(mm) if unmapper is not None else torch.frombuffer(mm, dtype=torch.uint8)
    return [whole[off:off + n] for off, n in layout]


def unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def reap_dead_owners() -> int:
    """Unlink segments (and barrier semaphores) whose owner process is gone (killed before it could clean up),
    then the owners' lock files.

    A file whose name carries an owner token with a lock file is removed only once that lock can be taken,
    which holds across pid namespaces. Any other (allreduce segments, semaphores) is kept while some process
    holding an owner lock with that pid, or a process with that pid in our namespace, lives: conservative, a
    pid shared across namespaces delays reaping but never deletes a live owner's file.
    """
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    owners = _proc.lock_states(names)
    held_pids = {pid for (pid, _), held in owners.items() if held}
    for name in names:
        m = _REAP_RE.fullmatch(name)
        if m is None:
            continue
        pid, token = int(m.group(1)), m.group(2)
        held = owners.get((pid, token))
        dead = not held if held is not None else pid not in held_pids and not pid_alive(pid)
        if dead:
            unlink(name)
            removed += 1
    for name in names:
        if _proc.LOCK_RE.fullmatch(name):
            _proc.reap_lock(name)
    return removed


def owner_alive(name: str) -> bool:
    """Whether the process that wrote segment ``name`` still runs (on this node, in any pid namespace)."""
    m = _NAME_RE.fullmatch(name)
    if m is None:
        return False
    pid, token = int(m.group(1)), m.group(2)
    held = _proc.lock_held(pid, token)
    if held is not None:
        return held
    try:  # no owner lock: a file named by pid only; conservative as in reap_dead_owners
        names = os.listdir(SHM_DIR)
    except OSError:
        names = []
    return pid_alive(pid) or any(h for (p, _), h in _proc.lock_states(names, pid).items())


def segments_of(pid: int) -> List[str]:
    """Names of live segments owned by ``pid`` (for tests and stats); for this process, only its own or those
    without an owner lock (another pid namespace may have a process with the same pid)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    own = _proc.current_owner_token() if pid == os.getpid() else None
    locked = {t for (p, t) in _proc.lock_states(names, pid, probe=False)} if pid == os.getpid() else set()
    out = []
    for n in names:
        m = _NAME_RE.fullmatch(n)
        if m and int(m.group(1)) == pid and (m.group(2) == own or m.group(2) not in locked):
            out.append(n)
    return out


def semaphores_of(pid: int) -> List[str]:
    """Names (``sem.rdt-<pid>-...``) of the named semaphores ``pid`` made for rdt_transports' shm allreduce."""
    try:
        return [n for n in os.listdir(SHM_DIR) if n.startswith(f"sem.{PREFIX}{pid}-")]
    except OSError:
        return []
