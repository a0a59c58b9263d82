"""The per-process object table: objects this process produced, by id, until their last reference dies."""

from __future__ import annotations

import functools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from ._flatten import Flattened


def _enqueue_dead(dead: "queue.SimpleQueue[bytes]", obj_id: bytes, _ref: Any) -> None:
    dead.put(obj_id)


@dataclass
class Entry:
    """One produced object: its flattened value and whatever transports attached to it."""

    obj_id: bytes
    flat: Flattened
    transport: str
    created: float = field(default_factory=time.monotonic)
    shm: Optional[Any] = None  # _shm.Segment once written
    nixl: Optional[Any] = None  # transport-specific registration handle
    guard: Optional[Any] = None  # _cma guard (numpy array) while consumers may read the buffers directly
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    @property
    def buffers(self) -> List[torch.Tensor]:
        return self.flat.buffers


class ObjectTable:
    """Thread-safe map obj_id -> Entry, plus weak entries for inlined objects (their bytes travel with the ref).

    A weak entry only remembers the producer's own leaf objects while the producer itself keeps them alive, so a
    small object passed back to its producer is still the very same tensors, yet nothing is held for it.
    """

    def __init__(self, release: Callable[[Entry], None]) -> None:
        self._entries: Dict[bytes, Entry] = {}
        self._weak: Dict[bytes, List[Any]] = {}
        self._dead: "queue.SimpleQueue[bytes]" = queue.SimpleQueue()  # weak entries whose leaves died
        self._lock = threading.Lock()
        self._release = release
        self.freed = 0
        self._bytes = 0
        self.on_change: Optional[Callable[[int, int], None]] = None  # (objects, bytes) -> None, e.g. a gauge

    def add_weak(self, obj_id: bytes, leaves: List[Any]) -> None:
        import weakref

        # The callback may run on any thread at any point, this table's locked regions included (a leaf freed
        # by a GC pass there): it only enqueues, and the queue is drained under the lock.
        drop = functools.partial(_enqueue_dead, self._dead, obj_id)
        try:
            refs = [weakref.ref(x, drop) for x in leaves]
        except TypeError:
            return
        with self._lock:
            self._drain_dead()
            self._weak[obj_id] = refs

    def _drain_dead(self) -> None:
        """Forget weak entries whose leaves died (caller holds the lock)."""
        while True:
            try:
                self._weak.pop(self._dead.get_nowait(), None)
            except queue.Empty:
                return

    def get_weak(self, obj_id: bytes) -> Optional[List[Any]]:
        with self._lock:
            self._drain_dead()
            refs = self._weak.get(obj_id)
        if refs is None:
            return None
        leaves = [r() for r in refs]
        return leaves if all(x is not None for x in leaves) else None

    def weak_count(self) -> int:
        with self._lock:
            self._drain_dead()
            return len(self._weak)

    def add(self, entry: Entry) -> None:
        with self._lock:
            self._entries[entry.obj_id] = entry
            self._bytes += entry.nbytes
            n, b = len(self._entries), self._bytes
        if self.on_change is not None:
            self.on_change(n, b)

    def get(self, obj_id: bytes) -> Optional[Entry]:
        with self._lock:
            return self._entries.get(obj_id)

    def pop(self, obj_id: bytes) -> Optional[Entry]:
        with self._lock:
            entry = self._entries.pop(obj_id, None)
            if entry is not None:
                self.freed += 1
                self._bytes -= entry.nbytes
            n, b = len(self._entries), self._bytes
        if entry is not None and self.on_change is not None:
            self.on_change(n, b)
        return entry

    def free(self, obj_id: bytes) -> None:
        entry = self.pop(obj_id)
        if entry is not None:
            self._release(entry)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def entries(self) -> List[Entry]:
        with self._lock:
            return list(self._entries.values())

    def clear(self) -> None:
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
            self._bytes = 0
        for e in entries:
            self._release(e)
