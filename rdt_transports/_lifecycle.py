"""The process lifecycle of everything rdt runs in the background: stopped before exit, forgotten after fork.

Why: a daemon thread still inside a C++ extension (NIXL, torch's Gloo, UCX, Ray) when the interpreter finalizes
is killed on its way back into Python (``pthread_exit`` unwinding through a ``noexcept`` destructor), which aborts
the whole process with SIGABRT after the user's program has finished. And a forked child inherits the parent's
objects but not its threads: if it ran the parent's clean-up at its own exit it would clear the parent's
shared-memory headers and shut its sockets.

So every component that owns threads or process-shared resources registers a *stopper* here. Stoppers run once,
newest first, in the process that registered them, from ``threading``'s exit hook (before the interpreter joins
non-daemon threads, so a thread-pool worker blocked in a Gloo wait is aborted instead of joined forever, and long
before finalization). Each stopper must be bounded in time. After ``os.fork()`` the child drops every stopper
without running it and runs the registered fork resets, so it starts with fresh, empty state.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook (joining pool threads) must run after ours
import logging
import os
import threading
import weakref
from typing import Callable, List, Optional, Tuple

logger = logging.getLogger("rdt_transports")

JOIN_TIMEOUT_S = 2.0  # how long the exit hook waits for one stopped thread

_lock = threading.Lock()
_stoppers: List[Tuple[int, Callable[[], None]]] = []  # (owner pid, stopper)
_fork_resets: List[Callable[[], None]] = []
_threads: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_exiting = threading.Event()
_installed_pid: Optional[int] = None


def at_exit(stopper: Callable[[], None]) -> Callable[[], None]:
    """Run ``stopper`` (bounded in time, never raising) before this process exits; returns it (decorator-friendly)."""
    _install()
    with _lock:
        _stoppers.append((os.getpid(), stopper))
    return stopper


def cancel(stopper: Callable[[], None]) -> None:
    """Forget a stopper registered with :func:`at_exit` (its owner was shut down early); no-op if unknown."""
    with _lock:
        _stoppers[:] = [(pid, s) for pid, s in _stoppers if s is not stopper]


def at_fork_child(reset: Callable[[], None]) -> None:
    """Run ``reset`` in a forked child (to drop inherited singletons); registered once per call site."""
    _install()
    with _lock:
        _fork_resets.append(reset)


def exiting() -> bool:
    """Whether the exit hook has started (background loops should stop rather than start new work)."""
    return _exiting.is_set()


def spawn(target: Callable[..., None], name: str, *args: object) -> threading.Thread:
    """Start a daemon thread that the exit hook joins (its owner's stopper must make ``target`` return)."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    with _lock:
        _threads.add(thread)
    thread.start()
    return thread


def live_threads() -> List[str]:
    """Names of rdt threads still running (threads made by :func:`spawn`), for tests and diagnostics."""
    with _lock:
        threads = list(_threads)
    return sorted(t.name for t in threads if t.is_alive())


def run_exit_hooks() -> None:
    """Stop everything this process registered, newest first; idempotent. Called automatically at exit."""
    if _exiting.is_set():
        return
    _exiting.set()
    me = os.getpid()
    with _lock:
        mine = [s for pid, s in reversed(_stoppers) if pid == me]
        _stoppers.clear()
        threads = list(_threads)
    for stopper in mine:
        try:
            stopper()
        except BaseException:  # noqa: BLE001 - one component's failure must not keep the others running
            logger.debug("rdt: an exit stopper failed", exc_info=True)
    current = threading.current_thread()
    for t in threads:
        if t is not current and t.is_alive():
            t.join(JOIN_TIMEOUT_S)
    left = [t.name for t in threads if t.is_alive() and t is not current]
    if left:
        logger.warning("rdt: threads still running at exit: %s", ", ".join(sorted(left)))


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork: it never releases here
    with _lock:
        _stoppers.clear()  # the parent's: its threads do not exist here, its resources are not ours
        _threads.clear()
        resets = list(_fork_resets)
    _exiting.clear()
    for reset in resets:
        try:
            reset()
        except BaseException:  # noqa: BLE001
            logger.debug("rdt: a fork reset failed", exc_info=True)


def _install() -> None:
    """Hook into interpreter exit and fork, once (a forked child inherits both hooks, and they check the pid)."""
    global _installed_pid
    with _lock:
        if _installed_pid is not None:
            return
        _installed_pid = os.getpid()
    # threading's exit hooks run before non-daemon threads (thread pools included) are joined, and before
    # atexit; the plain atexit hook is the fallback (and a no-op when the first already ran).
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(run_exit_hooks)
        except RuntimeError:  # already shutting down
            pass
    atexit.register(run_exit_hooks)
    os.register_at_fork(after_in_child=_after_fork_in_child)
