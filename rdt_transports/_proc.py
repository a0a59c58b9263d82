"""Process liveness on this node, shared by the transports and the object layer: by (pid, start time) within one
pid namespace, and by owner lock (across pid namespaces sharing /dev/shm).

A pid alone does not name a process: once it exits, the kernel hands its number to a later process, and a watch
by pid would then see the dead peer as alive. Whoever records a peer's pid records its start time with it
(:func:`identity`, published beside the pid) and asks :func:`process_alive` with both.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import re
import secrets
import threading
import time
from typing import Dict, List, Optional, Tuple


def ray_node_id() -> str:
    """This process's Ray node id, '' outside Ray or when it is unknown (callers then assume other nodes)."""
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id() or "") if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 - no Ray context
        return ""


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs; a killed process its parent has not reaped yet (zombie) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


Proc = Tuple[int, Optional[int]]  # (pid, start time): one process for good (start None: unknown, pid alone)


def identity(pid: Optional[int] = None) -> Proc:
    """(pid, start time) of ``pid`` (default: this process) as it runs now."""
    pid = os.getpid() if pid is None else pid
    return pid, start_time(pid)


def process_alive(pid: int, started: Optional[int]) -> bool:
    """Whether the process ``(pid, started)`` still runs: ``pid`` runs (not as a zombie) and started at
    ``started`` (a later process given the same pid has another start time). ``started`` None: by pid alone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:  # /proc unreadable here: by signal 0, without the start time
        return pid_alive(pid)
    try:
        return fields[0] not in (b"Z", b"X") and (started is None or int(fields[19]) == started)
    except (IndexError, ValueError):
        return False


def start_time(pid: int) -> Optional[int]:
    """When ``pid`` started (clock ticks after boot, /proc/<pid>/stat field 22), or None if it does not run: with
    the pid, names one process for good (a reused pid has another start time)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------- owner locks
# A pid says nothing across pid namespaces that share /dev/shm (containers with host IPC): another process may
# have the same number, or the owner may have none in ours. So each process that puts files in /dev/shm first
# holds an exclusive flock on its own lock file there, ``rdt.owner-<pid>-<16 hex token>.lock`` (not named
# ``rdt-<pid>-...``, which tools read as that pid's segments and semaphores), until it exits; the
# kernel drops the lock when the process dies, in whatever namespace. Files name their owner
# (``rdt-<pid>-<token><random>``), and a reaper deletes them only once it can take the owner's lock.

SHM_DIR = "/dev/shm"
LOCK_RE = re.compile(r"rdt\.owner-([0-9]+)-([0-9a-f]{16})\.lock(\.new)?")  # fullmatch; .new: not yet published

_owner: Optional[Tuple[int, str, int]] = None  # (pid, token, fd) of this process's held lock
_owner_mutex = threading.Lock()
_at_exit_registered = False


def lock_path(pid: int, token: str) -> str:
    return os.path.join(SHM_DIR, f"rdt.owner-{pid}-{token}.lock")


def owner_token() -> str:
    """The 16-hex token naming this process (with its pid) as an owner of /dev/shm files; takes its lock on
    first use (and again in a forked child, which must not pass as its parent)."""
    global _owner, _at_exit_registered
    pid = os.getpid()
    with _owner_mutex:
        if _owner is None or _owner[0] != pid:
            _owner = _take_owner_lock(pid)
            if not _at_exit_registered:
                atexit.register(release_owner)
                _at_exit_registered = True
        return _owner[1]


def current_owner_token() -> Optional[str]:
    """:func:`owner_token` if this process took its lock already, else None (takes nothing)."""
    own = _owner
    return own[1] if own is not None and own[0] == os.getpid() else None


def hold_owner_lock() -> int:
    """This process's pid, for names that carry only a pid, with its owner lock held (see :func:`owner_token`)."""
    owner_token()
    return os.getpid()


def _take_owner_lock(pid: int) -> Tuple[int, str, int]:
    """Create, lock, then publish (rename) a fresh lock file: it is never visible unlocked."""
    token = secrets.token_hex(8)
    final = lock_path(pid, token)
    fd = os.open(final + ".new", os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(final + ".new", final)
    except BaseException:
        os.close(fd)
        _unlink(final + ".new")
        raise
    return pid, token, fd


def release_owner() -> None:
    """Unlink and unlock this process's lock file (at exit); its files count as an exited owner's from now."""
    global _owner
    with _owner_mutex:
        if _owner is None or _owner[0] != os.getpid():
            return
        pid, token, fd = _owner
        _owner = None
    _unlink(lock_path(pid, token))
    os.close(fd)


def _forget_owner_in_child() -> None:
    """After fork: the child's copy of the descriptor shares the parent's lock; drop it without unlocking."""
    global _owner, _owner_mutex
    _owner_mutex = threading.Lock()
    if _owner is not None:
        try:
            os.close(_owner[2])  # closing one duplicate does not release a flock the parent still holds
        except OSError:
            pass
        _owner = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_owner_in_child)


def lock_held(pid: int, token: str) -> Optional[bool]:
    """Whether lock ``rdt.owner-<pid>-<token>.lock`` is held, i.e. its owner still runs (in any pid namespace);
    None if there is no such lock file (never an owner token, or its owner is gone and was reaped)."""
    own = _owner
    if own is not None and own[0] == pid == os.getpid() and own[1] == token:
        return True
    try:
        fd = os.open(lock_path(pid, token), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return True  # cannot tell: count it as live
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: held
        return True
    finally:
        os.close(fd)  # also drops the lock we may have just taken
    return False


def owner_alive(pid: int, token: str) -> bool:
    """Whether the owner ``(pid, token)`` still runs; an owner without a lock file is gone."""
    return bool(lock_held(pid, token))


def lock_states(names: List[str], pid: Optional[int] = None, probe: bool = True) -> Dict[Tuple[int, str], bool]:
    """(pid, token) -> held, for the published lock files among /dev/shm ``names`` (only ``pid``'s if given);
    without ``probe`` the values are all True and no lock is tried."""
    out: Dict[Tuple[int, str], bool] = {}
    for n in names:
        m = LOCK_RE.fullmatch(n)
        if m is None or m.group(3) or (pid is not None and int(m.group(1)) != pid):
            continue
        key = (int(m.group(1)), m.group(2))
        out[key] = bool(lock_held(*key)) if probe else True
    return out


def reap_lock(name: str, unpublished_grace: float = 60.0) -> bool:
    """Unlink lock file ``name`` (in SHM_DIR) if its owner is gone; True if it was removed. An unpublished
    (``.new``) one is left alone for ``unpublished_grace`` seconds: its owner may be between open and flock."""
    path = os.path.join(SHM_DIR, name)
    try:
        if name.endswith(".new") and time.time() - os.stat(path).st_mtime < unpublished_grace:
            return False
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # held: the owner lives (or is still publishing it)
        _unlink(os.path.join(SHM_DIR, name))  # unlinked while we hold it: no owner can have it any more
        return True
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
