"""Consumer side of NIXL: registrations of ``rdt.get(into=...)`` targets, one per storage, kept across fetches.

A trainer's weights land in the same parameters every step; registering them with NIXL at every fetch costs a
registration (milliseconds for GPUDirect) per storage per step. So a target storage is registered on its first
fetch and deregistered when the storage itself dies (a finalizer on torch's storage object, which torch keeps for
as long as the storage lives). At most ``MAX_STORAGES`` are kept; beyond that a fetch registers per fetch as before.

A storage can die anywhere, in particular in a GC pass on a thread that holds this table's lock or the agent's
lock (the progress thread drains under both). So its finalizer only enqueues the registration on a lock-free queue;
whoever holds the agent's lock next (the progress thread every few ms, or the next fetch) deregisters it.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

MAX_STORAGES = 4096  # cached target storages per process (each costs one NIXL registration)


class TargetRegistrations:
    """storage key -> its NIXL registration, while the storage lives (see the module docstring)."""

    def __init__(self, owner: Any, key: Callable[[torch.Tensor], Any]) -> None:
        self._owner = owner  # the NixlAgent: its .agent registers, its .lock guards the agent
        self._key = key  # a buffer's storage key: (memory type, device id, storage address, storage bytes)
        self._mu = threading.Lock()  # guards the table; never taken by a finalizer (one may run while it is held)
        self._regs: Dict[Any, Any] = {}
        self._died: "queue.SimpleQueue[Tuple[Any, Any]]" = queue.SimpleQueue()  # (key, registration), from finalizers
        self.made = 0  # registrations made over this table's life (for stats and tests)

    def cover(self, bufs: Sequence[torch.Tensor]) -> List[bool]:
        """Whether each buffer's storage is now registered (registering it now if need be); caller holds the
        agent's lock."""
        self.drain()
        out = []
        for buf in bufs:
            key = self._key(buf)
            with self._mu:
                known = key in self._regs
                full = len(self._regs) >= MAX_STORAGES
            if not known and not full:
                mem, dev, addr, nbytes = key
                reg = self._owner.agent.register_memory([(addr, nbytes, dev, "")], mem)
                with self._mu:
                    self._regs[key] = reg
                    self.made += 1
                fin = weakref.finalize(buf.untyped_storage(), self._storage_died, key, reg)
                fin.atexit = False  # at exit the agent goes as a whole
                known = True
            out.append(known)
        return out

    def _storage_died(self, key: Any, reg: Any) -> None:
        """Finalizer: enqueue only (SimpleQueue.put is reentrant); no lock, no call into NIXL."""
        self._died.put((key, reg))

    def drain(self) -> None:
        """Deregister the registrations of storages that died; caller holds the agent's lock. Never raises."""
        while True:
            try:
                key, reg = self._died.get_nowait()
            except queue.Empty:
                return
            with self._mu:
                if self._regs.get(key) is reg:
                    del self._regs[key]
            try:
                self._owner.agent.deregister_memory(reg)
            except Exception:  # noqa: BLE001 - freeing must never fail
                pass

    def __len__(self) -> int:
        """Registrations held (those of dead storages until drained)."""
        with self._mu:
            return len(self._regs)
