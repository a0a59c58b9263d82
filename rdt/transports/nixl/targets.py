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


class _Reg:
    """One storage's registration: the NIXL handle, the storage it was made for (weakly), and whether it is still
    registered (undone once, by whichever comes first: the storage's death or a stale hit)."""

    __slots__ = ("reg", "storage", "live")

    def __init__(self, reg: Any, storage: Any) -> None:
        self.reg, self.storage, self.live = reg, weakref.ref(storage), True


class TargetRegistrations:
    """storage key -> its NIXL registration, while the storage lives (see the module docstring)."""

    def __init__(self, owner: Any, key: Callable[[torch.Tensor], Any]) -> None:
        self._owner = owner  # the NixlAgent: its .agent registers, its .lock guards the agent
        self._key = key  # a buffer's storage key: (memory type, device id, storage address, storage bytes)
        self._mu = threading.Lock()  # guards the table; never taken by a finalizer (one may run while it is held)
        self._regs: Dict[Any, _Reg] = {}
        self._died: "queue.SimpleQueue[Tuple[Any, _Reg]]" = queue.SimpleQueue()  # (key, entry), from finalizers
        self.made = 0  # registrations made over this table's life (for stats and tests)

    def cover(self, bufs: Sequence[torch.Tensor]) -> List[bool]:
        """Whether each buffer's storage is now registered (registering it now if need be); caller holds the
        agent's lock. An entry is used only for the very storage it was made for: memory at the same address
        whose storage object differs (the old one freed its memory with ``resize_(0)`` and lives on) is
        registered afresh, the stale registration undone (on RDMA it pins the old pages)."""
        self.drain()
        out = []
        for buf in bufs:
            key = self._key(buf)
            storage = buf.untyped_storage()
            stale = None
            with self._mu:
                entry = self._regs.get(key)
                if entry is not None and entry.storage() is not storage:
                    stale, entry = self._regs.pop(key), None
                full = entry is None and len(self._regs) >= MAX_STORAGES
            if stale is not None:
                self._undo(stale)
            known = entry is not None
            if not known and not full:
                mem, dev, addr, nbytes = key
                entry = _Reg(self._owner.agent.register_memory([(addr, nbytes, dev, "")], mem), storage)
                with self._mu:
                    self._regs[key] = entry
                    self.made += 1
                fin = weakref.finalize(storage, self._storage_died, key, entry)
                fin.atexit = False  # at exit the agent goes as a whole
                known = True
            out.append(known)
        return out

    def _storage_died(self, key: Any, entry: _Reg) -> None:
        """Finalizer: enqueue only (SimpleQueue.put is reentrant); no lock, no call into NIXL."""
        self._died.put((key, entry))

    def drain(self) -> None:
        """Deregister the registrations of storages that died; caller holds the agent's lock. Never raises."""
        while True:
            try:
                key, entry = self._died.get_nowait()
            except queue.Empty:
                return
            with self._mu:
                if self._regs.get(key) is entry:
                    del self._regs[key]
            self._undo(entry)

    def _undo(self, entry: _Reg) -> None:
        """Deregister ``entry`` once (caller holds the agent's lock). Never raises."""
        if not entry.live:
            return
        entry.live = False
        try:
            self._owner.agent.deregister_memory(entry.reg)
        except Exception:  # noqa: BLE001 - freeing must never fail
            pass

    def __len__(self) -> int:
        """Registrations held (those of dead storages until drained)."""
        with self._mu:
            return len(self._regs)
