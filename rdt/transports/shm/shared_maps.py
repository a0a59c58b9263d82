"""Same-node reads from a mapping of the producer's own shared memory, kept mapped across syncs.

A trainer whose weights live in shared memory (torch's ``share_memory_()``, e.g. ``model.share_memory()``) holds
each storage as an unlinked tmpfs file it keeps open. A consumer that may read the producer's memory (the rule
``cma`` checks) may also open those files through ``/proc/<pid>/fd``. It maps each one once, keeps the mapping
while it is used (a trainer publishes the same storages every step), and copies from it on every core: one
user-space copy with streaming stores (``rdt_transports._memcopy``), no kernel copy per byte range, and no
page-table work after the first sync.

As for a direct read, the consumer reads the object's guard (``cma``) after the copy: only a guard that still
names the object proves the bytes came from the live object. A mapping unused for ``ttl`` seconds, or of a
producer that died, is unmapped by :meth:`MapReader.trim` (rdt's reaper), so a consumer keeps a storage the
producer freed for at most that long.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from rdt_transports._memcopy import copy_parts
from rdt_transports._proc import process_alive, start_time

Part = Tuple[int, int, int]  # (destination address, source address, bytes)



class MapError(OSError):
    """A producer's shared storage could not be mapped (gone, changed or refused): read it another way."""


class SharedFile(NamedTuple):
    """One shared storage of the producer: the descriptor it holds and the file's identity."""

    fd: int
    dev: int
    ino: int
    size: int


@dataclass(frozen=True)
class MapInfo:
    """Where each buffer of an object lies in the producer's shared files: ``parts[i]`` = (file index, offset)."""

    files: Tuple[SharedFile, ...]
    parts: Tuple[Tuple[int, int], ...]

    def __reduce__(self) -> Any:
        """Two integer arrays: a model's hundreds of storages pickle in microseconds, not a dataclass each."""
        return (_load_map_info, (array("Q", chain.from_iterable(self.files)).tobytes(),
                                 array("q", chain.from_iterable(self.parts)).tobytes()))


def _load_map_info(files: bytes, parts: bytes) -> MapInfo:
    f, p = array("Q"), array("q")
    f.frombytes(files)
    p.frombytes(parts)
    fv, pv = f.tolist(), p.tolist()
    return MapInfo(tuple(map(SharedFile, fv[0::4], fv[1::4], fv[2::4], fv[3::4])), tuple(zip(pv[0::2], pv[1::2])))


def describe(spans: Sequence[Tuple[torch.Tensor, int, int]]) -> Optional[MapInfo]:
    """Producer: the shared files behind an object's buffers, given per buffer (a tensor on its storage, first
    byte, end byte); None unless every buffer lies in a CPU storage torch shared by file descriptor (the default
    strategy on Linux). Only reads the descriptor torch keeps: never moves a storage."""
    files: List[SharedFile] = []
    index: Dict[int, int] = {}
    parts: List[Tuple[int, int]] = []
    for owner, lo, hi in spans:
        if hi <= lo:
            parts.append((-1, 0))
            continue
        if not owner.is_cpu:
            return None
        storage = owner.untyped_storage()
        base = storage.data_ptr()
        f = index.get(base)
        if f is None:
            # Kept on the storage's Python object, which torch keeps for as long as the storage lives, as does
            # the descriptor: weights published every step are described once (290 storages: 1.1 ms a step).
            shared = getattr(storage, "_rdt_shared_file", None)
            if shared is None:
                shared = _shared_file(storage)
                if shared is None:
                    return None
                try:
                    storage._rdt_shared_file = shared
                except (AttributeError, TypeError):  # a storage kind without attributes: described every time
                    pass
            f = index[base] = len(files)
            files.append(shared)
        parts.append((f, lo))
    return MapInfo(tuple(files), tuple(parts))


def _shared_file(storage: Any) -> Optional[SharedFile]:
    """The file torch shares ``storage`` through (by file descriptor), or None."""
    if not storage.is_shared():
        return None
    try:
        fd = storage._get_shared_fd()  # raises for storages shared by file name, or not by torch
        st = os.fstat(fd)
    except (AttributeError, RuntimeError, OSError):
        return None
    if st.st_size != storage.nbytes():
        return None
    return SharedFile(fd, st.st_dev, st.st_ino, st.st_size)


def spans_of(tensors: Sequence[torch.Tensor]) -> List[Tuple[torch.Tensor, int, int]]:
    """(tensor, first byte, end byte) in its storage for contiguous ``tensors``: :func:`describe`'s input."""
    out = []
    for t in tensors:
        lo = t.storage_offset() * t.element_size()
        out.append((t, lo, lo + t.numel() * t.element_size()))
    return out


# ---------------------------------------------------------------------- consumer
_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_mmap.restype = ctypes.c_void_p
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_munmap.restype = ctypes.c_int
_PROT_READ, _MAP_SHARED = 0x1, 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapping:
    __slots__ = ("addr", "size", "pid", "started", "fd", "dev", "ino", "users", "last")

    def __init__(self, addr: int, pid: int, started: Optional[int], f: SharedFile) -> None:
        self.addr, self.size, self.pid, self.started = addr, f.size, pid, started
        self.fd, self.dev, self.ino = f.fd, f.dev, f.ino  # the producer's descriptor of the file, and the file
        self.users = 0
        self.last = time.monotonic()

    def held(self) -> bool:
        """Whether the producer still holds the file open (its storage lives): its descriptor still names it. An
        unreadable descriptor table counts as held (the ttl still applies)."""
        try:
            st = os.stat(f"/proc/{self.pid}/fd/{self.fd}")
        except FileNotFoundError:
            return False
        except OSError:
            return True
        return (st.st_dev, st.st_ino) == (self.dev, self.ino)


def _map_file(pid: int, started: Optional[int], f: SharedFile) -> _Mapping:
    """Map the producer's file ``f`` read-only through its descriptor in process ``(pid, started)``."""
    path = f"/proc/{pid}/fd/{f.fd}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise MapError(e.errno, f"opening {path}: {e.strerror}") from e
    try:
        if not process_alive(pid, started):  # checked after the open: the descriptor was that process's
            raise MapError(0, f"the producer (pid {pid}) is gone; its pid may name another process now")
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino, st.st_size) != (f.dev, f.ino, f.size):
            raise MapError(0, f"{path} is no longer the storage the object named (the producer freed it)")
        addr = _mmap(None, f.size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise MapError(err, f"mmap of {path}: {os.strerror(err)}")
        return _Mapping(addr, pid, started, f)
    finally:
        os.close(fd)


Key = Tuple[int, Optional[int], int, int]  # (producer pid, its start time, device, inode)

class MapReader:
    """A consumer's mappings of producers' shared files: (pid, start time, device, inode) -> mapping, reused
    across reads.

    Bounded: a mapping of a file its producer no longer holds (the storage was freed), of a dead producer, or
    unused for ``ttl`` seconds goes at the next :meth:`trim` (rdt's reaper); and at most ``max_maps`` mappings
    of ``max_bytes`` in all are kept, idle ones of freed files dropped first, then the least recently used.
    """

    def __init__(self, spread: Callable[[Sequence[Part], Callable[[Sequence[Part]], None]], None], ttl: float,
                 max_bytes: int, max_maps: int = 4096) -> None:
        """``spread(parts, fn)`` runs ``fn`` over the parts split across threads (``CmaReader.spread``); ``max_bytes``
        is the process's ``RdtConfig.shm_map_bytes``."""
        self._spread = spread
        self.ttl = ttl
        self.max_maps = max_maps
        self.max_bytes = max_bytes
        self._maps: "OrderedDict[Key, _Mapping]" = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._maps)

    def mapped_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def read(self, pid: int, info: MapInfo, dests: Sequence[int], sizes: Sequence[int],
             started: Optional[int] = None) -> None:
        """Copy buffer ``i`` (``sizes[i]`` bytes) of the object ``info`` describes in process ``(pid, started)``
        (``started`` None: the process at ``pid`` now) to ``dests[i]``. Raises :class:`MapError`; the caller then
        checks the object's guard on success."""
        maps = self._acquire(pid, start_time(pid) if started is None else started, info.files)
        try:
            parts: List[Part] = []
            for d, (f, off), n in zip(dests, info.parts, sizes):
                if not n:
                    continue
                m = maps[f] if 0 <= f < len(maps) else None
                if m is None or off < 0 or off + n > m.size:
                    raise MapError(0, f"buffer {f}@{off} (+{n} bytes) lies outside the object's shared files")
                parts.append((d, m.addr + off, n))
            self._spread(parts, copy_parts)
        finally:
            self._release(maps)

    def _acquire(self, pid: int, started: Optional[int], files: Sequence[SharedFile]) -> List[_Mapping]:
        got: List[_Mapping] = []
        added = False
        try:
            for f in files:
                key = (pid, started, f.dev, f.ino)
                with self._lock:
                    m = self._maps.get(key)
                    if m is not None:
                        m.users += 1
                        self._maps.move_to_end(key)
                if m is None:
                    m = _map_file(pid, started, f)  # outside the lock: opening and mapping may take a while
                    m.users = 1
                    with self._lock:
                        old = self._maps.get(key)
                        if old is not None:  # another thread mapped it meanwhile: use theirs
                            old.users += 1
                            _munmap(m.addr, m.size)
                            m = old
                        else:
                            self._maps[key] = m
                            self._bytes += m.size
                            added = True
                got.append(m)
        except BaseException:
            self._release(got)
            raise
        if added:  # only a new mapping can take the count or the bytes over the cap
            self.trim(over_cap_only=True)
        return got

    def _release(self, maps: Sequence[_Mapping]) -> None:
        now = time.monotonic()
        with self._lock:
            for m in maps:
                m.users -= 1
                m.last = now

    def _over_cap(self) -> bool:
        return len(self._maps) > self.max_maps or self._bytes > self.max_bytes

    def trim(self, *, over_cap_only: bool = False, now: Optional[float] = None) -> int:
        """Unmap idle mappings: unless ``over_cap_only``, those of a file its producer no longer holds, of a dead
        producer, or unused for ``ttl`` seconds; then, while over ``max_maps`` or ``max_bytes``, those of freed
        files and then the least recently used. Returns how many were unmapped."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if over_cap_only and not self._over_cap():
                return 0
            idle = [(key, m) for key, m in self._maps.items() if not m.users]  # least recently used first
        stale = set()  # the checks read /proc: outside the lock
        alive: Dict[Tuple[int, Optional[int]], bool] = {}
        for key, m in idle:
            who = (m.pid, m.started)
            if who not in alive:
                alive[who] = process_alive(*who)
            if not alive[who] or not m.held() or (not over_cap_only and now - m.last >= self.ttl):
                stale.add(key)
        drop: List[_Mapping] = []
        with self._lock:
            for key, m in idle:  # stale ones (over the cap or not), then by age while over the cap
                if key in stale and (not over_cap_only or self._over_cap()):
                    drop += self._pop_idle(key)
            for key, _ in idle:
                if not self._over_cap():
                    break
                drop += self._pop_idle(key)
        for m in drop:
            _munmap(m.addr, m.size)
        return len(drop)

    def _pop_idle(self, key: Key) -> List[_Mapping]:
        """Forget the mapping at ``key`` if it is still there and unused (caller holds the lock)."""
        m = self._maps.get(key)
        if m is None or m.users:
            return []
        del self._maps[key]
        self._bytes -= m.size
        return [m]

    def close(self) -> None:
        """Unmap every mapping not in use (at shutdown)."""
        self.trim(now=float("inf"))
