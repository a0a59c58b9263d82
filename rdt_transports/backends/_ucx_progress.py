"""Caller-thread progress for the ucx backend: who drives the UCX worker, and how a waiting thread sleeps.

UCX's own progress thread (ucxx ``thread`` mode) wakes up for shared-memory traffic only on its 1 ms epoll timeout
when the machine is busy, and every completion then crosses ucxx's notifier thread and an asyncio loop before the
caller sees it: about 1 ms per 4 KiB transfer. Measured with raw ucxx between two processes on the 2-core CI
machine (4 KiB ping-pong over same-node worker-address endpoints, one way): the caller polling ``progress()``
3.4 us, the caller blocking on the worker's epoll fd 20 us, a progress thread plus the caller polling 62 us, a
progress thread with the caller only watching the request 3.3 ms.

So the worker runs in blocking mode with no progress thread, and whoever waits progresses it:

* a thread in ``Work.wait`` progresses the worker and advances every pending operation (:class:`Op`), first
  busily for a few tens of microseconds, then arms the worker and sleeps on its epoll fd (plus a wake-up eventfd)
  for at most a short slice;
* when no thread waits, a pump thread does the same, so handshakes, control messages and operations nobody waits
  on keep moving; it steps aside (sleeps on a condition) while callers drive, so each message wakes one thread.

UCX calls that submit or progress run under one lock (the worker is thread-safe in UCX, this keeps ucxx's own
bookkeeping single-threaded too); sleeping happens outside it. ``wake()`` (abort, peer failure, a connection that
became ready, an operation finished for another waiting thread) makes every sleeper look again at once.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from typing import Any, Callable, List, Optional, Tuple

from .. import _spin

logger = logging.getLogger(__name__)

_WAIT_SLICE_S = 0.02  # longest sleep of a waiting caller between looks at abort / peer state / deadline
_PUMP_SLICE_S = 0.1  # longest sleep of the pump thread
_PUMP_IDLE_S = 0.02  # the pump takes over only after callers have stopped driving for this long
# Progress without sleeping first, per wait: a reply often comes within tens of us, and each sleep costs a wake-up
# that queues behind the busy peer. How long depends on the machine (rdt_transports/_spin.py): 1 ms when quiet
# (rdt-bench 4 KiB back to back / after a barrier, load ~1 on 2 cores: 30 us 201-324 / 175-180 us, 1 ms 133-141 /
# 142-149 us; 1 MiB 424-527 / 528-757 -> 328-334 / 349-359 us), 30 us when busy (load 5-8: 30 us -> barrier 143-145
# us, back-to-back 223-237 us; 0 -> 165-386 / 256-351 us; 300 us in ping-pong: 2x worse). RDT_UCX_SPIN_US fixes it.
_SPIN_BUSY_S = 30e-6
_SPIN_FIXED_S = float(os.environ["RDT_UCX_SPIN_US"]) * 1e-6 if os.environ.get("RDT_UCX_SPIN_US") else None
_MAX_ZOMBIES = 4096  # failed operations whose UCX requests are still posted (their buffers must stay alive)


class Op:
    """One operation driven by progress: ``start`` posts its first UCX requests, ``advance`` moves it on after
    each progress (both under the engine lock). It ends with ``finish`` (error or None)."""

    done = False
    error: Optional[BaseException] = None

    def start(self) -> None:
        """Post the first requests (engine lock held)."""

    def advance(self) -> None:
        """Look at the requests after a progress and take the next step (engine lock held)."""

    def requests(self) -> List[Any]:
        """UCX requests this operation posted that may still be in flight (kept alive with their buffers)."""
        return []

    def finish(self, error: Optional[BaseException] = None) -> None:
        """Mark the operation done, with ``error`` when it failed."""
        if not self.done:
            self.error = error
            self.done = True


class ProgressEngine:
    """Drives one ucxx worker from the threads that wait on it, and from a pump thread when none does."""

    def __init__(self, worker: Any, name: str, map_error: Callable[[Op, BaseException], BaseException]) -> None:
        self._worker = worker
        self._map_error = map_error
        worker.init_blocking_progress_mode()
        self.lock = threading.Lock()  # UCX submission and progress
        self._ops: List[Op] = []
        self._background: List[Tuple[Any, Any]] = []  # (request, its buffer) nobody waits for (ACK / NACK sends)
        self._zombies: List[Op] = []
        self._cond = threading.Condition()
        self._driving = 0  # threads in wait()
        self._last_drive = 0.0  # when the last caller stopped driving
        self._stopped = False
        self._woken = False  # set by wake() before it writes the eventfd
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(worker.epoll_file_descriptor, select.EPOLLIN)
        self._epoll.register(self._wake_fd, select.EPOLLIN)
        self._pump = threading.Thread(target=self._pump_loop, name=f"{name}-progress", daemon=True)
        self._pump.start()

    # ------------------------------------------------------------------ posting
    def post(self, op: Op) -> None:
        """Start ``op`` and keep advancing it until it finishes (the caller holds no lock)."""
        with self.lock:
            self._start(op)

    def _start(self, op: Op) -> None:
        try:
            op.start()
        except BaseException as e:  # noqa: BLE001 - reported through the op
            op.finish(self._map_error(op, e))
        if not op.done:
            self._ops.append(op)
        elif op.error is not None:
            self._bury(op)

    def background(self, request: Any, keep: Any = None) -> None:
        """Keep a request nobody waits for, and ``keep`` (its buffer), until it completes (engine lock held)."""
        self._background.append((request, keep))

    def fail_all(self, error: BaseException) -> None:
        """Finish every pending operation with ``error`` (abort / shutdown) and wake every waiter."""
        with self.lock:
            ops, self._ops = self._ops, []
            for op in ops:
                op.finish(error)
                self._bury(op)
        self.wake()

    def _bury(self, op: Op) -> None:
        """Keep a failed operation whose requests are still posted: UCX may still write into its buffers."""
        if any(not r.completed for r in op.requests()):
            self._zombies.append(op)
            if len(self._zombies) > _MAX_ZOMBIES:
                self._zombies = [z for z in self._zombies if any(not r.completed for r in z.requests())]

    # ------------------------------------------------------------------ progress
    def _cycle(self, arm: bool) -> bool:
        """Progress, advance every operation; then arm the worker when asked. True when it is armed (sleeping is
        safe); False when there is more to progress."""
        with self.lock:
            if self._woken:  # drain the wake-up eventfd only when someone wrote it (saves a syscall per cycle)
                self._woken = False
                try:
                    os.eventfd_read(self._wake_fd)
                except OSError:  # BlockingIOError: another cycle drained it
                    pass
            if self._stopped:
                return False
            self._worker.progress()
            finished = False
            if self._ops:
                still: List[Op] = []
                for op in self._ops:
                    try:
                        op.advance()
                    except BaseException as e:  # noqa: BLE001 - reported through the op
                        op.finish(self._map_error(op, e))
                    if op.done:
                        finished = True
                        if op.error is not None:
                            self._bury(op)
                    else:
                        still.append(op)
                self._ops = still
            if self._background:
                self._background = [rk for rk in self._background if not _settled(rk[0])]
            if self._zombies and len(self._zombies) % 64 == 0:
                self._zombies = [z for z in self._zombies if any(not r.completed for r in z.requests())]
            if finished and self._driving > 1:
                self.wake()  # another waiting thread's operation may be the one that finished
            return arm and bool(self._worker.arm())

    def _sleep(self, seconds: float) -> None:
        """Sleep until a UCX event, a wake() or ``seconds``."""
        if seconds > 0:
            try:
                self._epoll.poll(seconds)
            except (OSError, ValueError):  # closed at shutdown
                time.sleep(min(seconds, 0.001))

    def wait(self, op: Op, deadline: float, aborted: threading.Event) -> None:
        """Drive progress in this thread until ``op`` is done, ``aborted`` is set or ``deadline`` passes."""
        with self._cond:
            self._driving += 1
        try:
            now = time.monotonic()
            spin_until = now + (_SPIN_FIXED_S if _SPIN_FIXED_S is not None else _spin.window(_SPIN_BUSY_S, now=now))
            while True:
                now = time.monotonic()
                spinning = now < spin_until
                armed = self._cycle(arm=not spinning)
                if op.done or aborted.is_set() or self._stopped:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                if armed:
                    self._sleep(min(_WAIT_SLICE_S, remaining))
        finally:
            with self._cond:
                self._driving -= 1
                self._last_drive = time.monotonic()

    def _pump_loop(self) -> None:
        """Progress while no caller does (handshakes, control messages, operations nobody waits for)."""
        while not self._stopped:
            with self._cond:  # callers drive: stay out of their way (each message would wake two threads)
                while not self._stopped:
                    idle = time.monotonic() - self._last_drive
                    if not self._driving and idle >= _PUMP_IDLE_S:
                        break
                    self._cond.wait(_PUMP_IDLE_S if self._driving else _PUMP_IDLE_S - idle)
            if self._stopped:
                return
            try:
                armed = self._cycle(arm=True)
            except Exception as e:  # noqa: BLE001 - keep pumping; a broken worker fails the ops elsewhere
                logger.debug("ucx progress pump: %s: %s", type(e).__name__, e)
                armed = True
            if armed:
                self._sleep(_PUMP_SLICE_S)

    def wake(self) -> None:
        """Make every sleeping waiter (and the pump) look again now."""
        self._woken = True
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:  # closed at shutdown
            pass

    def stop(self, timeout: float = 2.0) -> bool:
        """Stop the pump thread (bounded) and release the fds; True when the thread ended."""
        self._stopped = True
        with self._cond:
            self._cond.notify_all()
        self.wake()
        self._pump.join(timeout)
        alive = self._pump.is_alive()
        if not alive:
            with self.lock:
                self._epoll.close()
                os.close(self._wake_fd)
                self._wake_fd = -1
                # Nothing progresses the worker from here on, so no request can still touch a buffer: drop the
                # requests and the worker now. Each request holds the worker, and a worker kept until garbage
                # collection (or interpreter exit) keeps UCX's async thread running into finalization.
                self._ops, self._background, self._zombies = [], [], []
                self._worker = None
        return not alive

    @property
    def pump_alive(self) -> bool:
        return self._pump.is_alive()


def _settled(request: Any) -> bool:
    """True when a background request completed (its error, if any, is consumed and ignored)."""
    if not request.completed:
        return False
    try:
        request.check_error()
    except Exception:  # noqa: BLE001 - nobody waits for it; the peer's failure is reported elsewhere
        pass
    return True


class AwaitOp(Op):
    """One UCX request for the asyncio side (handshakes, control messages): the engine completes ``future`` on
    ``loop`` when the request completes, so the loop never polls (ucxx would otherwise spin it with sleep(0))."""

    def __init__(self, factory: Callable[[], Any], keep: Any, loop: Any, future: Any) -> None:
        self._factory = factory
        self._keep = keep  # the buffer, alive while UCX may touch it
        self._loop = loop
        self._future = future
        self._req: Any = None

    def requests(self) -> List[Any]:
        return [self._req] if self._req is not None else []

    def start(self) -> None:
        try:
            self._req = self._factory()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            self._settle(e)
            return
        self.advance()

    def advance(self) -> None:
        if self._req is None or not self._req.completed:
            return
        try:
            self._req.check_error()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            self._settle(e)
            return
        self._settle(None)

    def _settle(self, error: Optional[BaseException]) -> None:
        self.finish()
        try:
            self._loop.call_soon_threadsafe(_set_future, self._future, error)
        except RuntimeError:  # loop closed at shutdown: nobody awaits any more
            pass


def _set_future(future: Any, error: Optional[BaseException]) -> None:
    """Loop thread: complete an AwaitOp's future unless its awaiter gave up."""
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
