"""The per-process object table: objects this process produced, by id, until their last reference dies."""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch

from .flatten import Flattened


def _enqueue_dead(dead: "queue.SimpleQueue[Tuple[int, ...]]", key: Tuple[int, ...], _ref: Any) -> None:
    dead.put(key)


class _WeakLeaves:
    """Weak references to one set of leaves, and the inline object ids that stand for it."""

    __slots__ = ("key", "refs", "ids")

    def __init__(self, key: Tuple[int, ...], refs: List["weakref.ref[Any]"]) -> None:
        self.key = key  # the leaves' ids when recorded
        self.refs = refs
        self.ids: Set[bytes] = set()

    def alive(self) -> bool:
        return all(r() is not None for r in self.refs)

    def holds(self, leaves: List[Any]) -> bool:
        """Whether this record is about exactly these objects (ids alone can be reused after a death)."""
        return len(leaves) == len(self.refs) and all(r() is x for r, x in zip(self.refs, leaves))


@dataclass
class Entry:
    """One produced object: its flattened value and whatever transports attached to it."""

    obj_id: bytes
    flat: Flattened
    transport: str
    created: float = field(default_factory=time.monotonic)
    # Per-transport state attached by export/serve (a segment, a registration, a guard), released with the entry
    exports: Dict[str, Any] = field(default_factory=dict)
    options: Dict[str, Any] = field(default_factory=dict)  # per-object producer options (e.g. ipc_map)
    ready: Optional[Any] = None  # _ready.Ready: events recorded at return, waited on before the bytes are read
    lock: threading.Lock = field(default_factory=threading.Lock)  # held while an export is attached on demand
    freed: bool = False  # set before its exports are released; no export is attached from then on

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

    MAX_WEAK = 4096  # inline ids remembered at most (each costs a dict slot; records are shared)

    def __init__(self, release: Callable[[Entry], None]) -> None:
        self._entries: Dict[bytes, Entry] = {}
        self._weak: "OrderedDict[bytes, _WeakLeaves]" = OrderedDict()  # obj_id -> record, oldest first
        self._by_leaves: Dict[Tuple[int, ...], _WeakLeaves] = {}  # ids of the leaves -> their one record
        self._dead: "queue.SimpleQueue[Tuple[int, ...]]" = queue.SimpleQueue()  # records a leaf of which died
        self._lock = threading.Lock()
        self._release = release
        self.freed = 0
        self._bytes = 0
        self.on_change: Optional[Callable[[int, int], None]] = None  # (objects, bytes) -> None, e.g. a gauge

    def add_weak(self, obj_id: bytes, leaves: List[Any]) -> None:
        """Remember ``leaves`` under ``obj_id`` while they live; one weak record per distinct set of leaves, so a
        long-lived tensor returned inline at every step costs one record, and at most ``MAX_WEAK`` ids are kept
        (the oldest are forgotten: such a ref passed back gets a copy from its inline bytes, not the same tensor).
        """
        key = tuple(id(x) for x in leaves)
        with self._lock:
            self._drain_dead()
            rec = self._by_leaves.get(key)
            if rec is not None and not rec.holds(leaves):
                self._forget(key, rec)  # the ids were reused by new objects before the callback was drained
                rec = None
        if rec is None:
            try:
                # The callback may run on any thread at any point, this table's locked regions included (a leaf
                # freed by a GC pass there): it only enqueues, and the queue is drained under the lock.
                rec = _WeakLeaves(key, [weakref.ref(x, functools.partial(_enqueue_dead, self._dead, key))
                                       for x in leaves])
            except TypeError:
                return
        with self._lock:
            rec = self._by_leaves.setdefault(key, rec)
            rec.ids.add(obj_id)
            self._weak[obj_id] = rec
            while len(self._weak) > self.MAX_WEAK:
                old_id, old = self._weak.popitem(last=False)
                old.ids.discard(old_id)
                if not old.ids and self._by_leaves.get(old.key) is old:
                    del self._by_leaves[old.key]

    def _forget(self, key: Tuple[int, ...], rec: "_WeakLeaves") -> None:
        """Drop a record and every id that pointed at it (caller holds the lock)."""
        if self._by_leaves.get(key) is rec:
            del self._by_leaves[key]
        for oid in rec.ids:
            self._weak.pop(oid, None)
        rec.ids.clear()

    def _drain_dead(self) -> None:
        """Forget weak records one of whose leaves died (caller holds the lock)."""
        while True:
            try:
                key = self._dead.get_nowait()
            except queue.Empty:
                return
            rec = self._by_leaves.get(key)
            if rec is not None and not rec.alive():
                self._forget(key, rec)

    def get_weak(self, obj_id: bytes) -> Optional[List[Any]]:
        with self._lock:
            self._drain_dead()
            rec = self._weak.get(obj_id)
        if rec is None:
            return None
        leaves = [r() for r in rec.refs]
        return leaves if all(x is not None for x in leaves) else None

    def weak_count(self) -> int:
        """Ids with a live weak record."""
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
            self._free(entry)

    def _free(self, entry: Entry) -> None:
        """Release the entry's exports now, or leave that to the request attaching one (never waits for it: this
        runs on Ray's callback thread)."""
        entry.freed = True
        if entry.lock.acquire(blocking=False):
            try:
                self._release(entry)
            finally:
                entry.lock.release()

    @contextlib.contextmanager
    def exporting(self, obj_id: bytes) -> Iterator[Optional[Entry]]:
        """The live entry, held while a request attaches an export to it on demand; None if it was freed. An export
        attached while the object was being freed is released on the way out (by whichever side comes second)."""
        entry = self.get(obj_id)
        if entry is None:
            yield None
            return
        try:
            with entry.lock:
                yield None if entry.freed else entry
        finally:
            if entry.freed:  # freed meanwhile: its release found the lock taken and left the exports to us
                with entry.lock:
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
            self._free(e)
