"""One export per storage, counted per object: the bookkeeping under CUDA IPC shares and NIXL registrations.

Exporting a storage (an IPC share, a GPUDirect registration) costs from microseconds to milliseconds and leaves state
in the driver or NIC, and weights returned every step are the same storages every time. So a storage is exported on
its first use, each object that uses it counts as one user, and the last user's release undoes the export. The
storage object is held while exported, so its address cannot be reused for another allocation meanwhile. ``make`` and
``undo`` are injected (torch's or NIXL's calls in production), so the bookkeeping runs and is tested without a GPU.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, Generic, Hashable, List, Tuple, TypeVar

logger = logging.getLogger("rdt")

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class StorageCache(Generic[K, V]):
    """key (a storage's device and address range) -> its export, while at least one live object uses it."""

    def __init__(self, make: Callable[[K, Any], V], undo: Callable[[V], None]) -> None:
        self._make = make
        self._undo = undo
        self._lock = threading.Lock()
        self._live: Dict[K, List[Any]] = {}  # key -> [export, users, storage]
        self.made = 0  # exports made over this cache's life (for stats and tests)

    def take(self, key: K, storage: Any) -> Tuple[V, bool]:
        """The export of ``storage`` (made now if it has none) and whether it was made by this call; one user more."""
        with self._lock:
            known = self._live.get(key)
            fresh = known is None
            if known is None:
                known = [self._make(key, storage), 0, storage]
                self._live[key] = known
                self.made += 1
            known[1] += 1
            return known[0], fresh

    def acquire(self, key: K, storage: Any) -> V:
        """The export of ``storage`` (made now if it has none); one user more."""
        return self.take(key, storage)[0]

    def release(self, key: K) -> None:
        """One user fewer; the last one undoes the export. Never raises."""
        with self._lock:
            known = self._live.get(key)
            if known is None:
                return
            known[1] -= 1
            if known[1] > 0:
                return
            del self._live[key]
        try:
            self._undo(known[0])
        except Exception:  # noqa: BLE001 - freeing must never fail
            logger.debug("rdt: undoing a storage export failed", exc_info=True)

    def users(self, key: K) -> int:
        """Live objects using ``key``'s export (0 when it has none)."""
        with self._lock:
            known = self._live.get(key)
            return 0 if known is None else known[1]

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)
