"""Work that lands bytes in a caller's targets on another thread, and what happens when the caller stops waiting.

A caller may stop waiting before such work ends: an interrupt (Ctrl-C, ``ray.cancel``), an error raised in the
waiting thread, a cancelled ``rdt.get_async``, or a guard that ran out. The work itself cannot be stopped (a
posted receive, a READ in flight, a copy loop). Where the caller can wait, it does (:func:`run_all`: jobs not begun
never begin, the running ones end by their deadline) before it raises, so nothing the caller was told failed writes
into its tensors afterwards. Where it cannot (a cancelled coroutine, a second interrupt) the work is *abandoned*:
a running job keeps its targets marked busy (``ctx.busy_targets``), and their memory alive, until it ends, and
every fetch or load into targets first waits for them to be free (:func:`wait_free`). Whole fetches
(``get_async``) and range reads (sharded loads) share this.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait as futures_wait
from typing import Any, Callable, Generic, Iterable, List, Optional, Sequence, TypeVar

import numpy as np
import torch

from ..errors import IntoBusyError, TransferTimeoutError
from .receive_into import as_tensor

T = TypeVar("T")

GUARD_S = 30.0  # past a job's own deadline, how long a waiter waits before it gives the job up (a bug guard)


class Abandoned(Exception):
    """Raised in place of a job's result when its caller gave it up before it began (it never ran)."""


class Job(Generic[T]):
    """``fn`` landing bytes in ``targets``, run once on some thread; ``what`` names it in busy marks; ``instead``
    runs in its place when the caller gave it up before it began (e.g. to end what was set up for it)."""

    def __init__(self, ctx: Any, fn: Callable[[], T], targets: Sequence[Any], what: str,
                 instead: Optional[Callable[[], Any]] = None) -> None:
        self.ctx, self.fn, self.targets, self.what, self.instead = ctx, fn, targets, what, instead
        self._lock = threading.Lock()
        self._started = self._ended = self._abandoned = False
        self._hold: Optional[int] = None
        self._kept: List[Any] = []  # the targets' memory while an abandoned job may still land in it

    def __call__(self) -> T:
        with self._lock:
            abandoned = self._abandoned
            self._started = True
            self._ended = abandoned
        if abandoned:
            if self.instead is not None:
                self.instead()
            raise Abandoned(f"{self.what}: given up by its caller before it began")
        try:
            return self.fn()
        finally:
            with self._lock:
                self._ended = True
                hold, self._hold, self._kept = self._hold, None, []
            self.ctx.busy_targets.clear(hold)

    def skip(self) -> None:
        """A job not begun never begins (one running goes on)."""
        with self._lock:
            if not self._started:
                self._abandoned = True

    def abandon(self) -> None:
        """The caller stops waiting: a job not begun never begins; a running one marks its targets busy until it
        ends."""
        with self._lock:
            if not self._started:
                self._abandoned = True
            elif not self._ended and self._hold is None:
                tensors = tensors_of(self.targets)
                self._hold = self.ctx.busy_targets.mark(
                    tensors, f"{self.what}, whose caller stopped waiting (it cannot be stopped; it ends within "
                    "its own timeout)")
                self._kept = [t.untyped_storage() for t in tensors]  # not freed if param.data is swapped


async def run_async(job: Job[T]) -> T:
    """Run ``job`` on the event loop's executor and await it (an async actor's loop keeps serving). A cancelled
    awaiter abandons it: not begun, it never begins; running, it goes on with its targets busy until it ends."""
    try:
        return await asyncio.get_running_loop().run_in_executor(None, job)
    except asyncio.CancelledError:
        job.abandon()
        raise


def run_all(pool: ThreadPoolExecutor, jobs: Sequence[Job[T]], deadline: float) -> List[Any]:
    """Run ``jobs`` on ``pool`` at once and wait for all: per job its result or the exception it raised.

    When the wait is cut short (an interrupt such as Ctrl-C, an error raised in this thread), jobs not begun never
    begin and the running ones are waited for, at most until ``deadline`` (they end by then), before the exception
    is raised: nothing writes into the targets after the caller is told the work failed. A second interrupt during
    that wait, or the guard ``GUARD_S`` past ``deadline``, gives them up at once: their targets stay busy until they
    end (see the module docstring)."""
    futures: List["Future[T]"] = []
    try:
        futures = [pool.submit(job) for job in jobs]
        out: List[Any] = []
        for f in futures:
            left = max(deadline - time.monotonic(), 0.0) + GUARD_S
            try:
                out.append(f.result(timeout=left))
            except BaseException as e:  # noqa: BLE001 - the job's own error is handed back, the rest raised
                if f.done() and not f.cancelled() and f.exception() is e:
                    out.append(e)
                    continue
                if isinstance(e, TimeoutError) and not f.done():
                    raise _Stuck(f"{jobs[len(out)].what} did not end {GUARD_S:.0f}s past its deadline",
                                 hint="a bug in rdt: please report it with the log; its targets stay busy until it "
                                      "ends") from e
                raise
        return out
    except BaseException as e:
        for job in jobs:
            job.skip()
        if not isinstance(e, _Stuck):
            try:
                futures_wait(futures, max(deadline - time.monotonic(), 0.0) + 1.0)
            except BaseException:  # noqa: BLE001 - a second interrupt: give the running jobs up now
                pass
        for job in jobs:
            job.abandon()
        raise


class _Stuck(TransferTimeoutError):
    """A job that outlived its deadline by the guard (raised as a TransferTimeoutError)."""


def tensors_of(targets: Iterable[Any]) -> List[torch.Tensor]:
    """The targets as tensors over the same memory (numpy arrays included), for busy marks and overlap checks."""
    out = []
    for t in targets:
        try:
            tensor = as_tensor(t)
        except (TypeError, ValueError):  # a numpy array torch cannot wrap (negative strides, a dtype it lacks)
            tensor = _span(t)
        if tensor is not None:
            out.append(tensor)
    return out


def _span(a: np.ndarray) -> torch.Tensor:
    """The bytes a numpy array reaches, as one uint8 tensor over the same memory."""
    lo = hi = a.__array_interface__["data"][0]
    for n, stride in zip(a.shape, a.strides):
        reach = (n - 1) * stride if n else 0
        lo, hi = lo + min(reach, 0), hi + max(reach, 0)
    size = hi - lo + a.itemsize if a.size else 0
    return torch.frombuffer((ctypes.c_char * size).from_address(lo), dtype=torch.uint8) if size else \
        torch.empty(0, dtype=torch.uint8)


def wait_free(ctx: Any, targets: Iterable[Any], timeout: float, subject: str,
              object_id: Optional[str] = None) -> float:
    """Wait, at most ``timeout``, until nothing that failed for its caller may still write into ``targets``; the
    time left. Raises IntoBusyError naming what still writes into them (``subject``: the fetch or load asking),
    having moved nothing."""
    start = time.monotonic()
    holds = ctx.busy_targets.wait_free(tensors_of(targets), timeout)
    if not holds:
        return max(timeout - (time.monotonic() - start), 1e-3)
    first = holds[0]
    more = f" (and {len(holds) - 1} more)" if len(holds) > 1 else ""
    raise IntoBusyError(
        f"{subject}: the targets are still being written by {first.what}{more}, which failed for its caller "
        f"{time.monotonic() - first.since:.1f}s ago and is still in flight (it cannot be stopped); waited "
        f"{time.monotonic() - start:.1f}s, nothing was moved", object_id=object_id,
        hint="fetch or load into other tensors meanwhile, or retry later: that transfer ends when its producer "
             "serves it or dies (kill a stuck producer and it fails at once, leaving the targets free)")
