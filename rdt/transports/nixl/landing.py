"""Consumer side of NIXL: a fetch's fresh buffers land in registered blocks, reused once the caller drops them.

A fetch without ``into=`` targets used to register its fresh tensors with NIXL for one READ and deregister them
after it. Over TCP that costs ~10 µs, but a GPUDirect or InfiniBand registration pins the memory and costs
milliseconds, at every fetch. So the fresh buffers of one fetch on one device are byte ranges of one block that
stays registered. The tensors handed to the caller alias the block through a small holder (a numpy view for
CPU memory, a ``__cuda_array_interface__`` object for VRAM) whose finalizer gives the block back when the
caller's last view of it dies; the block's memory itself stays owned by this pool, so it is never freed under
a READ. A READ that timed out keeps its tensors parked, and with them its block.

Bounds: reads below ``MIN_BYTES`` register per read as before (a block would waste more than it saves); at most
``max_lent_bytes`` of blocks are registered while callers hold them (beyond that a read registers per read
again: registered memory is pinned); at most ``max_idle`` idle blocks of ``max_idle_bytes`` in all wait for
reuse, each for at most ``ttl`` seconds; the rest are deregistered.

Finalizers may run on any thread, also one that holds the agent's lock, so they only enqueue the block's key;
whoever holds the agent's lock next (the progress thread every few ms, or the next fetch) takes it back.

A VRAM block given up (past ``ttl``, beyond the bounds) is deregistered at once, but its memory is let go only after
a sync of its device, outside the agent's lock and off the progress thread (:meth:`LandingPool.retire`): by the
next fetch, or by the context's periodic trim (``NixlAgent.trim``), whichever comes first, so that a process that
stops fetching does not keep it.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import weakref
from typing import Any, Dict, List, Optional

import torch

from ..receive import fresh_bytes


class _Block:
    """A registered landing block: its memory (kept by the pool), size, NIXL registration and idle time."""

    __slots__ = ("tensor", "array", "size", "reg", "since")

    def __init__(self, tensor: torch.Tensor, reg: Any) -> None:
        self.tensor = tensor
        self.array = tensor.numpy() if tensor.device.type == "cpu" else None  # CPU: aliases are numpy views
        self.size = tensor.numel()
        self.reg = reg
        self.since = 0.0


class _CudaSpan:
    """The first ``nbytes`` of a VRAM block, as CUDA's array interface describes memory: torch keeps this object
    alive as long as a tensor made from it lives, so its finalizer marks the end of the caller's use."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 2}


class LandingPool:
    """Registered landing blocks for fresh READ destinations (see the module docstring). Every method but
    :meth:`stats` runs with the agent's lock held."""

    MIN_BYTES = 64 << 10
    SMALL_UNIT = 64 << 10  # blocks below BIG_BYTES round to 64 KiB, above to 2 MiB (huge pages for CPU memory)
    BIG_BYTES = 4 << 20
    BIG_UNIT = 2 << 20

    def __init__(self, owner: Any, max_idle: int = 8, max_idle_bytes: int = 1 << 30,
                 max_lent_bytes: int = 4 << 30, ttl: float = 30.0) -> None:
        self._owner = owner  # the NixlAgent: its .agent registers
        self.max_idle, self.max_idle_bytes, self.max_lent_bytes, self.ttl = max_idle, max_idle_bytes, max_lent_bytes, ttl
        self._idle: List[_Block] = []
        self._lent: Dict[int, _Block] = {}
        self._lent_bytes = 0
        self._returned: "queue.SimpleQueue[int]" = queue.SimpleQueue()  # keys of blocks whose aliases died
        self._next = 0
        self._cuda_alias = True  # until torch fails to alias a VRAM block once: then VRAM reads register per read
        self.hits = 0  # fetches that landed in an idle block
        self.made = 0  # blocks registered over the pool's life
        # VRAM of blocks given up, deregistered: freed by retire() (a fetching thread, or the context's trim) after
        # its device finished what the callers queued on it (never under the agent's lock, never on the progress
        # thread); one retire at a time, so that a fetch that retires to make room waits for one in progress
        self._retiring: "collections.deque[torch.Tensor]" = collections.deque()
        self._retire_lock = threading.Lock()

    def take(self, ctx: Any, nbytes: int, device: torch.device) -> Optional[torch.Tensor]:
        """A fresh uint8 tensor of ``nbytes`` on ``device`` whose memory is registered with NIXL until the caller
        drops it; None when the read should register its own memory (too small, or the lent bound is reached)."""
        self.drain()
        if nbytes < self.MIN_BYTES or (device.type == "cuda" and not self._cuda_alias):
            return None
        block = self._pick(nbytes, device)
        if block is None:
            if self._lent_bytes + nbytes > self.max_lent_bytes:
                return None
            block = self._new(ctx, nbytes, device)
        alias = self._alias(block, nbytes)
        if alias is None:  # torch could not alias VRAM here: this process's VRAM reads register per read
            self._cuda_alias = False
            self._deregister(block)
            return None
        tensor, holder = alias
        self._next += 1
        key = self._next
        self._lent[key] = block
        self._lent_bytes += block.size
        fin = weakref.finalize(holder, self._returned.put, key)  # SimpleQueue.put is reentrant: safe anywhere
        fin.atexit = False  # at exit the agent goes as a whole
        return tensor

    def _pick(self, nbytes: int, device: torch.device) -> Optional[_Block]:
        """The smallest idle block on ``device`` that holds ``nbytes`` and wastes at most as much again."""
        fits = [b for b in self._idle if b.tensor.device == device and nbytes <= b.size <= 2 * nbytes]
        if not fits:
            return None
        best = min(fits, key=lambda b: b.size)
        self._idle.remove(best)
        self.hits += 1
        return best

    def _new(self, ctx: Any, nbytes: int, device: torch.device) -> _Block:
        """A new block for ``nbytes``; out of memory, the idle blocks on ``device`` are given up and it is tried
        once more (they hold memory the caching allocator cannot free)."""
        unit = self.BIG_UNIT if nbytes >= self.BIG_BYTES else self.SMALL_UNIT
        size = -(-nbytes // unit) * unit
        try:
            tensor = fresh_bytes(ctx, size, device)
        except torch.OutOfMemoryError:
            idle = [b for b in self._idle if b.tensor.device == device]
            if not idle:
                raise
            self._idle = [b for b in self._idle if b.tensor.device != device]
            self._drop(idle)
            if device.type == "cuda":
                raise  # their VRAM is freed by retire(), outside the agent's lock; the fetch retries then
            tensor = fresh_bytes(ctx, size, device)
        reg = self._owner.agent.register_memory([tensor])
        self.made += 1
        return _Block(tensor, reg)

    @staticmethod
    def _alias(block: _Block, nbytes: int) -> Optional[tuple]:
        """(a tensor of the block's first ``nbytes``, the holder whose death means the tensor died), or None."""
        if block.array is not None:
            holder = block.array[:nbytes]  # a new ndarray over the block's memory; torch keeps it with the tensor
            return torch.from_numpy(holder), holder
        ptr = block.tensor.data_ptr()
        span = _CudaSpan(ptr, nbytes)
        try:
            tensor = torch.as_tensor(span, device=block.tensor.device)
        except Exception:  # noqa: BLE001 - an older torch without the interface: the caller registers per read
            return None
        if tensor.data_ptr() != ptr or tensor.device != block.tensor.device or tensor.dtype != torch.uint8:
            return None
        return tensor, span

    def drain(self) -> None:
        """Take back blocks whose aliases died, then deregister idle blocks beyond the bounds or past ``ttl``.
        Never raises."""
        now = time.monotonic()
        while True:
            try:
                key = self._returned.get_nowait()
            except queue.Empty:
                break
            block = self._lent.pop(key, None)
            if block is not None:
                self._lent_bytes -= block.size
                block.since = now
                self._idle.append(block)
        if not self._idle:
            return
        drop = [b for b in self._idle if now - b.since > self.ttl]
        keep = [b for b in self._idle if now - b.since <= self.ttl]
        while keep and (len(keep) > self.max_idle or sum(b.size for b in keep) > self.max_idle_bytes):
            drop.append(keep.pop(0))  # the longest idle first
        self._idle = keep
        self._drop(drop)

    def close(self) -> None:
        """Deregister every idle block (lent ones go with the agent); at shutdown no device is waited for."""
        self.drain()
        idle, self._idle = self._idle, []
        self._drop(idle)
        self._retiring.clear()

    def _drop(self, blocks: List[_Block]) -> None:
        """Deregister ``blocks`` and let their memory go: CPU memory now, VRAM through :meth:`retire` (torch's
        caching allocator orders its reuse only after the stream that allocated it, while kernels the callers
        queued on other streams on the tensors that aliased it may still read it; waiting for the device here,
        under the agent's lock or on the progress thread, could wait on a collective that needs this agent)."""
        for b in blocks:
            self._deregister(b)
            if b.tensor.device.type == "cuda":
                self._retiring.append(b.tensor)

    def retire(self) -> None:
        """Free the VRAM of given-up blocks once their devices finished what was queued on them. Called without the
        agent's lock, by a fetching thread and by the context's trim (``NixlAgent.trim``); cheap when there is
        none. One at a time: a caller that finds another retire under way waits for it, so that a fetch retrying
        after running out of memory finds that memory freed."""
        if not self._retiring and not self._retire_lock.locked():
            return
        with self._retire_lock:
            tensors = []
            while True:
                try:
                    tensors.append(self._retiring.popleft())
                except IndexError:
                    break
            for dev in {t.device for t in tensors}:
                try:
                    torch.cuda.synchronize(dev)
                except Exception:  # noqa: BLE001 - a broken context: nothing more runs on it
                    pass
            tensors.clear()

    def _deregister(self, block: _Block) -> None:
        try:
            self._owner.agent.deregister_memory(block.reg)
        except Exception:  # noqa: BLE001 - the agent is gone: nothing left to deregister
            pass

    def stats(self) -> Dict[str, int]:
        """Blocks lent to callers and idle (with their bytes), idle hits and blocks made (a snapshot, no lock)."""
        idle = list(self._idle)
        return {"lent": len(self._lent), "lent_bytes": self._lent_bytes, "idle": len(idle),
                "idle_bytes": sum(b.size for b in idle), "hits": self.hits, "made": self.made}

    @staticmethod
    def empty_stats() -> Dict[str, int]:
        """:meth:`stats` of a process that has no NIXL agent yet."""
        return dict.fromkeys(("lent", "lent_bytes", "idle", "idle_bytes", "hits", "made"), 0)
