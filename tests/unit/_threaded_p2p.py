"""An in-process reference P2P for algorithm tests: one thread per rank, transfers matched by (src, dst, step).

Matching is rendezvous-like: the copy happens when both sides have posted, and a send's Work completes only
then, so an algorithm that waits on a send before its peer posts the receive deadlocks here too (and fails
with TimeoutError instead of hanging). Misuse the real group would reject fails loudly: a step reused for the
same (src, dst) pair, a step out of range, a send to self, and size/dtype mismatches.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from rdt_transports.algorithms import P2P
from rdt_transports.backends.base import Work

MAX_STEP = 1 << 14
Key = Tuple[int, int, int]  # (src, dst, step)
POOL_WORKERS = 32


class _Transfer:
    """One (src, dst, step) slot: the posted send buffer and/or receive buffer, completed once both exist."""

    def __init__(self) -> None:
        self.send: Optional[torch.Tensor] = None
        self.recv: Optional[torch.Tensor] = None
        self.done = threading.Event()
        self.error: Optional[BaseException] = None


class _SlotWork(Work):
    """Work that waits for its transfer slot to complete."""

    def __init__(self, slot: _Transfer, what: str) -> None:
        self._slot = slot
        self._what = what

    def wait(self, timeout: float) -> None:
        """Block until both sides posted and the data was copied; TimeoutError otherwise."""
        if not self._slot.done.wait(timeout):
            raise TimeoutError(f"{self._what} did not complete within {timeout}s")
        if self._slot.error is not None:
            raise self._slot.error

    def is_completed(self) -> bool:
        return self._slot.done.is_set()


class Hub:
    """Shared state of one simulated call: the transfer slots of every rank."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._lock = threading.Lock()
        self._slots: Dict[Key, _Transfer] = {}
        self.messages = 0
        self.bytes = 0

    def post(self, key: Key, tensor: torch.Tensor, is_send: bool) -> _SlotWork:
        """Register one side of a transfer; copy the data when the other side is already there."""
        src, dst, step = key
        assert 0 <= step < MAX_STEP, f"step {step} out of range"
        assert src != dst, f"rank {src} talks to itself"
        assert 0 <= src < self.world_size and 0 <= dst < self.world_size, f"bad peer in {key}"
        assert tensor.is_contiguous(), f"non-contiguous tensor posted for {key}"
        with self._lock:
            slot = self._slots.setdefault(key, _Transfer())
            side = "send" if is_send else "recv"
            assert getattr(slot, side) is None, f"{side} posted twice for (src, dst, step)={key}"
            setattr(slot, side, tensor)
            if slot.send is not None and slot.recv is not None:
                self._complete(key, slot)
        return _SlotWork(slot, f"{'isend' if is_send else 'irecv'} {key}")

    def _complete(self, key: Key, slot: _Transfer) -> None:
        """Copy send -> recv (checking that both sides agree) and release both Works."""
        assert slot.send is not None and slot.recv is not None
        if slot.send.numel() != slot.recv.numel() or slot.send.dtype != slot.recv.dtype:
            slot.error = ValueError(
                f"mismatch on {key}: send {slot.send.numel()} x {slot.send.dtype}, "
                f"recv {slot.recv.numel()} x {slot.recv.dtype}"
            )
        else:
            slot.recv.view(-1).copy_(slot.send.view(-1))
            self.messages += 1
            self.bytes += slot.send.numel() * slot.send.element_size()
        slot.done.set()

    def unmatched(self) -> List[Key]:
        """Transfers posted by one side only (a bug: the algorithm's two sides disagree)."""
        with self._lock:
            return [k for k, s in self._slots.items() if not s.done.is_set()]


class ThreadedP2P(P2P):
    """One rank's view of a Hub."""

    def __init__(self, hub: Hub, rank: int, timeout: float) -> None:
        self._hub = hub
        self.rank = rank
        self.world_size = hub.world_size
        self._timeout = timeout

    def isend(self, tensor: torch.Tensor, peer: int, step: int) -> Work:
        return self._hub.post((self.rank, peer, step), tensor, True)

    def irecv(self, tensor: torch.Tensor, peer: int, step: int) -> Work:
        return self._hub.post((peer, self.rank, step), tensor, False)

    def wait(self, *works: Work) -> None:
        for w in works:
            w.wait(self._timeout)


@functools.lru_cache(maxsize=1)
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """Worker threads reused across calls (starting fresh threads dominated the runtime of small tests)."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=POOL_WORKERS, thread_name_prefix="rank")


def run_ranks(world_size: int, fn: Callable[[ThreadedP2P], Any], timeout: float = 10.0) -> Tuple[List[Any], Hub]:
    """Run ``fn(p2p)`` on one thread per rank; return each rank's result (re-raising the first failure)."""
    assert world_size <= POOL_WORKERS // 2, "pool too small: a stuck earlier call could starve this one"
    hub = Hub(world_size)
    futures = [_pool().submit(fn, ThreadedP2P(hub, r, timeout)) for r in range(world_size)]
    done, pending = concurrent.futures.wait(futures, timeout=timeout * 3)
    if pending:
        raise TimeoutError(f"ranks still running after {timeout * 3}s")
    for rank, fut in enumerate(futures):
        e = fut.exception()
        if e is not None:
            raise AssertionError(f"rank {rank} failed: {type(e).__name__}: {e}") from e
    left = hub.unmatched()
    assert not left, f"unmatched transfers: {left}"
    return [f.result() for f in futures], hub
