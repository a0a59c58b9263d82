"""A barrier for the ranks of one group that share a node, on POSIX named semaphores (futex-based, no busy spin).

Rank ``r`` owns one semaphore per peer ``j`` ("``j`` arrived", posted by ``j``, waited on by ``r``) and one
"failed" semaphore that it posts when it gives up on a barrier (timeout, abort, dead peer), so that peers stop
waiting for it. A barrier is: post one token to every peer (:meth:`ShmBarrier.arrive`), then take one token from
each peer's semaphore, all at once (:meth:`~ShmBarrier.complete`) or peer by peer as the caller needs them
(:meth:`~ShmBarrier.take`, :meth:`~ShmBarrier.take_any`), so that work that depends on one peer only can start
as soon as that peer has arrived.

Counting is correct across consecutive barriers: ``j`` posts its token for barrier ``k+1`` only after it took my
token for barrier ``k``, which I post when I arrive at ``k``; so at most two of ``j``'s tokens are pending at
``r``, and since ``r`` takes exactly one per barrier from each peer, the ``k``-th token taken from ``j`` is ``j``'s
arrival at barrier ``k``. The post/wait pair (atomics with release/acquire order, plus a futex) orders memory:
whatever ``j`` wrote before arriving is visible to a rank once it took ``j``'s token.

Waits run in short slices; between slices the barrier checks the call's deadline, the backend's abort flag, the
peers' "failed" semaphores and whether every peer's pid still lives (a killed rank is found in about one slice,
not at the timeout). Semaphores live at ``/dev/shm/sem.rdt-<owner pid>-<32 hex>``, the hex an HMAC of the group
secret, so names are unguessable; the owner holds its owner lock (``rdt_transports._proc``) meanwhile, so a
reaper removes them only once no process with that pid holds one (and none runs with it in the reaper's namespace).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import hmac
import os
import threading
import time
from typing import Dict, List, Optional, Set

from .._proc import hold_owner_lock, process_alive
from ..errors import CollectiveTimeoutError, GroupDestroyedError, PeerUnavailableError

SLICE_S = 0.05  # how often a blocked wait looks at the deadline, abort, failed and dead peers
_CLOCK_MONOTONIC = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_NEEDED = ("sem_open", "sem_post", "sem_trywait", "sem_timedwait", "sem_getvalue", "sem_close", "sem_unlink")


def _load_libc() -> ctypes.CDLL:
    """libc (or, before glibc 2.34, libpthread) with the sem_* functions typed; OSError where they are missing."""
    last: Optional[BaseException] = None
    for name in (None, ctypes.util.find_library("c"), "libc.so.6", ctypes.util.find_library("pthread")):
        try:
            lib = ctypes.CDLL(name, use_errno=True)
            for fn in _NEEDED:
                getattr(lib, fn)  # AttributeError when absent (e.g. no sem_timedwait on macOS)
            break
        except (OSError, AttributeError) as e:
            last = e
    else:
        raise OSError(f"POSIX named semaphores are not available: {last}")
    sem = ctypes.c_void_p
    lib.sem_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_uint]
    lib.sem_open.restype = sem
    for fn in ("sem_post", "sem_trywait", "sem_close"):
        getattr(lib, fn).argtypes = [sem]
        getattr(lib, fn).restype = ctypes.c_int
    lib.sem_unlink.argtypes = [ctypes.c_char_p]
    lib.sem_unlink.restype = ctypes.c_int
    lib.sem_getvalue.argtypes = [sem, ctypes.POINTER(ctypes.c_int)]
    lib.sem_getvalue.restype = ctypes.c_int
    lib.sem_timedwait.argtypes = [sem, ctypes.POINTER(_Timespec)]
    lib.sem_timedwait.restype = ctypes.c_int
    if hasattr(lib, "sem_clockwait"):  # glibc >= 2.30: a monotonic deadline
        lib.sem_clockwait.argtypes = [sem, ctypes.c_int, ctypes.POINTER(_Timespec)]
        lib.sem_clockwait.restype = ctypes.c_int
    return lib


_libc: Optional[ctypes.CDLL] = None


def _lib() -> ctypes.CDLL:
    """The typed libc, loaded on first use."""
    global _libc
    if _libc is None:
        _libc = _load_libc()
    return _libc


def sem_name(pid: int, secret: bytes, label: str) -> str:
    """Semaphore name ``rdt-<pid>-<32 hex>`` (file ``/dev/shm/sem.<name>``); the hex is HMAC(secret, label)."""
    tag = hmac.new(secret, label.encode(), hashlib.sha256).hexdigest()[:32]
    return f"rdt-{pid}-{tag}"


def _open(name: str, create: bool) -> int:
    """sem_open ``name``: create it (O_EXCL, 0600, value 0) or open an existing one; raise OSError on failure."""
    lib = _lib()
    flags = (os.O_CREAT | os.O_EXCL) if create else 0
    handle = lib.sem_open(("/" + name).encode(), flags, 0o600, 0)
    if not handle:  # SEM_FAILED is NULL in glibc
        err = ctypes.get_errno()
        raise OSError(err, f"sem_open({name!r}) failed: {os.strerror(err)}")
    return handle


class ShmBarrier:
    """Barrier among the same-node ranks of one group; ``wait`` raises the backend's typed errors."""

    def __init__(self, uid: str, rank: int, world_size: int, secret: bytes,
                 aborted: Optional[threading.Event] = None, op: str = "allreduce") -> None:
        """Create my semaphores (before the rendezvous publishes my pid, so peers can open them after it)."""
        self._uid = uid
        self._rank = rank
        self._world = world_size
        self._secret = secret
        self._aborted = aborted if aborted is not None else threading.Event()
        self._op = op
        self._peers = [j for j in range(world_size) if j != rank]
        self._lock = threading.RLock()  # held while the semaphores are used; close() unmaps only under it
        self._closed = False
        self._failed = False
        self._own_names: List[str] = []
        self._handles: List[int] = []  # everything sem_open returned, for sem_close
        self._arrived: Dict[int, int] = {}  # peer -> my semaphore that peer posts
        self._post: Dict[int, int] = {}  # peer -> the peer's semaphore I post
        self._peer_failed: Dict[int, int] = {}
        self._pids: List[int] = []
        self._starts: List[Optional[int]] = []  # with the pids: each rank's process for good (see _proc)
        self._my_failed: Optional[int] = None
        self._got: Optional[Set[int]] = None  # peers whose token for the current barrier I hold
        self.count = 0  # barriers entered
        pid = hold_owner_lock()  # reapers in any pid namespace see this pid's semaphores as live while we run
        try:
            for j in self._peers:
                self._arrived[j] = self._create(sem_name(pid, secret, f"{uid}/barrier/{rank}/{j}"))
            self._my_failed = self._create(sem_name(pid, secret, f"{uid}/barrier-failed/{rank}"))
        except BaseException:
            self.close()
            raise

    def _create(self, name: str) -> int:
        handle = _open(name, create=True)
        self._own_names.append(name)
        self._handles.append(handle)
        return handle

    def connect(self, pids: List[int], starts: Optional[List[Optional[int]]] = None) -> None:
        """Open every peer's semaphores; ``pids[r]`` is rank r's pid, published after it created them, with its
        start time ``starts[r]`` (a peer is dead once its pid no longer names that process)."""
        self._pids = list(pids)
        self._starts = list(starts) if starts is not None else [None] * len(self._pids)
        for j in self._peers:
            handle = _open(sem_name(pids[j], self._secret, f"{self._uid}/barrier/{j}/{self._rank}"), create=False)
            self._handles.append(handle)
            self._post[j] = handle
            handle = _open(sem_name(pids[j], self._secret, f"{self._uid}/barrier-failed/{j}"), create=False)
            self._handles.append(handle)
            self._peer_failed[j] = handle

    @property
    def names(self) -> List[str]:
        """Names of the semaphores this rank created (files ``/dev/shm/sem.<name>``)."""
        return list(self._own_names)

    def wait(self, timeout: float) -> None:
        """Return when every rank has entered this barrier; raise on timeout, abort, a failed or dead peer."""
        self.arrive()
        self.complete(time.monotonic() + timeout)

    def arrive(self) -> None:
        """Enter the next barrier: post my token to every peer (the previous barrier must be complete)."""
        with self._lock:
            self._check_usable()
            if self._got is not None and len(self._got) != len(self._peers):
                raise RuntimeError("ShmBarrier.arrive() before the previous barrier was complete")
            self.count += 1
            self._got = set()
            post = _lib().sem_post
            for j in self._peers:
                post(self._post[j])

    def take(self, peer: int, deadline: float) -> None:
        """Return once ``peer`` has entered the current barrier (monotonic ``deadline``); raise as ``wait``."""
        if peer in self._got:  # type: ignore[operator]
            return
        with self._lock:
            self._check_usable()
            if not self._try(peer):
                self._block(peer, deadline)

    def take_any(self, pending: List[int], deadline: float) -> int:
        """One peer of ``pending`` that has entered the current barrier (one that already has if any)."""
        with self._lock:
            self._check_usable()
            for j in pending:
                if self._try(j):
                    return j
            self._block(pending[0], deadline)
            return pending[0]

    def complete(self, deadline: float) -> None:
        """Return once every peer has entered the current barrier."""
        with self._lock:
            self._check_usable()
            for j in self._peers:
                if not self._try(j):
                    self._block(j, deadline)

    def _try(self, j: int) -> bool:
        """Whether I hold ``j``'s token for the current barrier, taking it now if it is there."""
        got = self._got
        if j in got:  # type: ignore[operator]
            return True
        if _lib().sem_trywait(self._arrived[j]) == 0:
            got.add(j)  # type: ignore[union-attr]
            return True
        return False

    def _block(self, j: int, deadline: float) -> None:
        """Take ``j``'s token in slices, checking deadline, abort and peers in between (caller holds the lock)."""
        self._check_usable()
        lib = _lib()
        clockwait = getattr(lib, "sem_clockwait", None)
        ts = _Timespec()
        start = time.monotonic()
        while True:
            now = time.monotonic()
            end = min(deadline, now + SLICE_S)
            if clockwait is not None:
                ts.tv_sec, ts.tv_nsec = int(end), min(int((end % 1) * 1e9), 999_999_999)
                rc = clockwait(self._arrived[j], _CLOCK_MONOTONIC, ctypes.byref(ts))
            else:
                wall = time.time() + (end - now)
                ts.tv_sec, ts.tv_nsec = int(wall), min(int((wall % 1) * 1e9), 999_999_999)
                rc = lib.sem_timedwait(self._arrived[j], ctypes.byref(ts))
            if rc == 0:
                self._got.add(j)  # type: ignore[union-attr]
                return
            err = ctypes.get_errno()
            if err not in (errno.ETIMEDOUT, errno.EINTR, errno.EAGAIN):
                self.fail()
                raise PeerUnavailableError(f"{self._op} failed: shared-memory barrier wait: {os.strerror(err)}",
                                           op=self._op)
            if self._try(j):
                return
            self._check_between_slices(deadline, time.monotonic() - start)

    def _check_between_slices(self, deadline: float, waited: float) -> None:
        """Raise if the group was aborted or closed, a peer failed or died, or the deadline passed."""
        if self._aborted.is_set() or self._closed:
            self.fail()
            raise GroupDestroyedError(f"{self._op} ended: the group was aborted", op=self._op,
                                      hint="destroy the group and create it again")
        dead = [j for j in self._peers if not process_alive(self._pids[j], self._starts[j])]
        if dead:
            self.fail()
            raise PeerUnavailableError(
                f"{self._op} failed: rank(s) {dead} (pid {[self._pids[j] for j in dead]}) died during the "
                "shared-memory collective", peer=dead[0], op=self._op,
                hint="a member of the group died; re-form the group with live members",
            )
        failed = [j for j in self._peers if self._value(self._peer_failed[j]) > 0]
        if failed:
            self.fail()
            raise PeerUnavailableError(
                f"{self._op} failed: rank(s) {failed} gave up on the shared-memory collective (timed out, aborted "
                "or lost a peer)", peer=failed[0], op=self._op,
                hint="see the error on those ranks; destroy the group and create it again",
            )
        if time.monotonic() >= deadline:
            missing = [j for j in self._peers if not self._try(j)]
            self.fail()
            raise CollectiveTimeoutError(
                f"{self._op} did not complete in time: rank(s) {missing} did not reach the shared-memory barrier "
                f"(waited {waited:.2f}s)", peer=missing[0] if len(missing) == 1 else None, op=self._op,
                hint="check that every rank makes the same call and none is dead or stuck; raise the timeout for "
                "large transfers",
            )

    def _check_usable(self) -> None:
        if self._closed:
            raise GroupDestroyedError(f"{self._op} refused: the group's shared-memory barrier is closed",
                                      op=self._op, hint="create the group again")
        if self._failed:
            raise PeerUnavailableError(f"{self._op} refused: an earlier shared-memory barrier failed", op=self._op,
                                       hint="destroy the group and create it again")
        if len(self._post) != len(self._peers):
            raise PeerUnavailableError(f"{self._op} refused: the barrier is not connected to its peers",
                                       op=self._op, hint="call connect() with every rank's pid first")

    @staticmethod
    def _value(handle: int) -> int:
        out = ctypes.c_int(0)
        _lib().sem_getvalue(handle, ctypes.byref(out))
        return out.value

    def fail(self) -> None:
        """Mark this rank failed (once) so that peers blocked on it stop at their next slice."""
        with self._lock:  # never post to a semaphore close() has unmapped
            if not self._failed and self._my_failed is not None:
                self._failed = True
                _lib().sem_post(self._my_failed)

    def close(self) -> None:
        """Unlink my semaphores and unmap all; idempotent. A wait in flight elsewhere ends within one slice."""
        self._closed = True
        names, self._own_names = self._own_names, []
        for name in names:
            try:
                _lib().sem_unlink(("/" + name).encode())
            except OSError:
                pass
        # sem_close unmaps; a thread still inside sem_clockwait would then fault, so only close under the lock
        # (a wait notices _closed within one slice). If it cannot be taken, leave the few pages mapped.
        if self._lock.acquire(timeout=4 * SLICE_S + 1.0):
            try:
                handles, self._handles = self._handles, []
                self._arrived, self._post, self._peer_failed, self._my_failed = {}, {}, {}, None
                for handle in handles:
                    _lib().sem_close(handle)
            finally:
                self._lock.release()
