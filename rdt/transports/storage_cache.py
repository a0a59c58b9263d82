"""One export per storage, counted per object: the bookkeeping under CUDA IPC shares and NIXL registrations.

Exporting a storage (an IPC share, a GPUDirect registration) costs from microseconds to milliseconds and leaves state
in the driver or NIC, and weights returned every step are the same storages every time. So a storage is exported on
its first use, each object that uses it counts as one user, and the last user's release undoes the export. The
storage object is held while exported, so its address cannot be reused for another allocation meanwhile. ``make`` and
``undo`` are injected (torch's or NIXL's calls in production), so the bookkeeping runs and is tested without a GPU.

With ``keep_while_alive`` (NIXL registrations), the last user's release keeps the export while the storage itself
lives (a trainer returns the same weights every step, each step's object dies before the next one is returned, and
registering every storage again each step is what dominates NIXL's cost): the storage is then held only weakly, its
death (a finalizer) queues the export for undoing, and at most ``max_idle`` such exports are kept (oldest undone
first). An idle entry is reused only for the very storage object it was made for, never for a new allocation at the
same address.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict, deque
from typing import Any, Callable, Deque, Dict, Generic, Hashable, List, Optional, Tuple, TypeVar

logger = logging.getLogger("rdt")

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class StorageCache(Generic[K, V]):
    """key (a storage's device and address range) -> its export, while at least one live object uses it (and, with
    ``keep_while_alive``, while the storage lives)."""

    def __init__(self, make: Callable[[K, Any], V], undo: Callable[[V], None], *, keep_while_alive: bool = False,
                 max_idle: int = 4096) -> None:
        self._make = make
        self._undo = undo
        self._keep = keep_while_alive
        self._max_idle = max_idle
        self._lock = threading.Lock()
        # key -> [export, users, storage (held while users > 0), weak ref to the storage]
        self._live: Dict[K, List[Any]] = {}
        self._idle: "OrderedDict[K, None]" = OrderedDict()  # keys with no user, oldest first (keep_while_alive)
        self._died: Deque[K] = deque()  # keys whose storage died (appended by finalizers: no lock taken there)
        self.made = 0  # exports made over this cache's life (for stats and tests)

    def take(self, key: K, storage: Any) -> Tuple[V, bool]:
        """The export of ``storage`` (made now if it has none) and whether it was made by this call; one user more."""
        self.sweep()
        stale: List[Any] = []
        try:
            with self._lock:
                return self._take_locked(key, storage, stale)
        finally:
            for export in stale:
                self._undo_quietly(export)

    def _take_locked(self, key: K, storage: Any, stale: List[Any]) -> Tuple[V, bool]:
        known = self._live.get(key)
        if known is not None and known[1] == 0 and known[3] is not None and known[3]() is not storage:
            stale.append(self._live.pop(key)[0])  # another allocation at the same address: never reuse its export
            self._idle.pop(key, None)
            known = None
        fresh = known is None
        if known is None:
            known = [self._make(key, storage), 0, storage, self._watch(key, storage)]
            self._live[key] = known
            self.made += 1
        elif known[1] == 0:
            self._idle.pop(key, None)
            known[2] = storage
        known[1] += 1
        return known[0], fresh

    def _watch(self, key: K, storage: Any) -> Optional[Any]:
        """A weak reference to ``storage`` whose death queues ``key`` for :meth:`sweep` (keep_while_alive only)."""
        if not self._keep:
            return None
        try:
            ref = weakref.ref(storage)
            fin = weakref.finalize(storage, self._died.append, key)
        except TypeError:  # a storage kind without weak references: plain counting
            return None
        fin.atexit = False  # at exit the owner goes as a whole
        return ref

    def acquire(self, key: K, storage: Any) -> V:
        """The export of ``storage`` (made now if it has none); one user more."""
        return self.take(key, storage)[0]

    def acquire_many(self, items: List[Tuple[K, Any]]) -> List[V]:
        """:meth:`acquire` for each distinct (key, storage) of one object, under one lock: a state dict of
        hundreds of storages costs one sweep and one lock, not one each. On error none is acquired."""
        self.sweep()
        out: List[V] = []
        stale: List[Any] = []
        try:
            with self._lock:
                for key, storage in items:
                    out.append(self._take_locked(key, storage, stale)[0])
        except BaseException:
            self.release_many([key for key, _ in items[:len(out)]])
            raise
        finally:
            for export in stale:
                self._undo_quietly(export)
        return out

    def release(self, key: K) -> None:
        """One user fewer; the last one undoes the export (or keeps it while the storage lives). Never raises."""
        self.release_many([key])

    def release_many(self, keys: List[K]) -> None:
        """One user fewer of each key, under one lock; a last user undoes the export (or, with
        ``keep_while_alive``, keeps it while the storage lives, at most ``max_idle`` such). Never raises."""
        undo: List[Any] = []
        with self._lock:
            for key in keys:
                known = self._live.get(key)
                if known is None:
                    continue
                known[1] -= 1
                if known[1] > 0:
                    continue
                known[2] = None  # from now on only the users' tensors keep the storage alive
                if known[3] is not None and known[3]() is not None:
                    self._idle[key] = None
                else:
                    del self._live[key]
                    undo.append(known[0])
            while len(self._idle) > self._max_idle:
                old, _ = self._idle.popitem(last=False)
                undo.append(self._live.pop(old)[0])
        for export in undo:
            self._undo_quietly(export)
        self.sweep()

    def sweep(self) -> int:
        """Undo the idle exports whose storage died; how many. Never raises."""
        if not self._died:
            return 0
        undo: List[Any] = []
        with self._lock:
            while self._died:
                key = self._died.popleft()
                known = self._live.get(key)
                if known is not None and known[1] == 0 and known[3] is not None and known[3]() is None:
                    del self._live[key]
                    self._idle.pop(key, None)
                    undo.append(known[0])
        for export in undo:
            self._undo_quietly(export)
        return len(undo)

    def clear_idle(self) -> None:
        """Undo every export no live object uses (e.g. to free registrations on request). Never raises."""
        with self._lock:
            undo = [self._live.pop(k)[0] for k in list(self._idle)]
            self._idle.clear()
        for export in undo:
            self._undo_quietly(export)

    def _undo_quietly(self, export: Any) -> None:
        try:
            self._undo(export)
        except Exception:  # noqa: BLE001 - freeing must never fail
            logger.debug("rdt: undoing a storage export failed", exc_info=True)

    def users(self, key: K) -> int:
        """Live objects using ``key``'s export (0 when it has none)."""
        with self._lock:
            known = self._live.get(key)
            return 0 if known is None else known[1]

    def __len__(self) -> int:
        """Exports in use by live objects."""
        with self._lock:
            return len(self._live) - len(self._idle)

    def idle(self) -> int:
        """Exports kept with no live object using them, while their storage lives (keep_while_alive)."""
        self.sweep()
        with self._lock:
            return len(self._idle)
