"""Per-process state: the groups this process belongs to. One ProcessContext per process, made on first use."""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from typing import Dict, List, Optional, Tuple

from . import _lifecycle
from ._rendezvous import Rendezvous, delete_incarnation, publish_incarnation, read_incarnation
from .backends import BackendConfig, backend_class
from .errors import (
    CollectiveTimeoutError,
    GroupExistsError,
    GroupNotFoundError,
    InvalidArgumentError,
    RdtError,
)
from ._metrics import Metrics
from .group import ABORT_KEY, ERRORED_KEY, CollectiveGroup, _actor_state

logger = logging.getLogger("rdt_transports")

_INCARNATION_WAIT_POLL = 0.01
ABORT_CHECK_S = 1.0  # a call blocked this long looks for an abort record, then at most once per this period
_WATCH_PERIOD_S = 0.25


class ProcessContext:
    """Holds this process's collective groups by name; thread-safe."""

    def __init__(self) -> None:
        self._groups: Dict[str, CollectiveGroup] = {}
        self._lock = threading.RLock()
        self.metrics = Metrics()
        self._watcher: Optional[threading.Thread] = None
        self._watch_stop = threading.Event()

    def names(self) -> List[str]:
        with self._lock:
            return list(self._groups)

    def groups(self) -> List[CollectiveGroup]:
        with self._lock:
            return list(self._groups.values())

    def get(self, name: str) -> CollectiveGroup:
        group = self._groups.get(name)  # one dict read is atomic: no lock on every call's path
        if group is None:
            known = ", ".join(repr(n) for n in self.names()) or "none"
            raise GroupNotFoundError(
                f"no collective group named {name!r} in this process (known: {known})",
                group=name,
                hint="call init_collective_group() in this actor, or create_collective_group([...]) from the driver "
                "with this actor in the list",
            )
        return group

    def find(self, name: str) -> Optional[CollectiveGroup]:
        with self._lock:
            return self._groups.get(name)

    def init_group(
        self,
        world_size: int,
        rank: int,
        backend: str,
        group_name: str,
        timeout: float,
        uid: Optional[str] = None,
        secret: Optional[bytes] = None,
        members: Optional[List[str]] = None,
    ) -> CollectiveGroup:
        """Join group ``group_name`` as ``rank``; blocks until every rank has joined or the timeout passes."""
        _check_membership(world_size, rank, group_name)
        try:
            cls = backend_class(backend)
        except RdtError as e:
            raise type(e)(e.message, group=group_name, rank=rank, op="init_collective_group", hint=e.hint) from None
        with self._lock:
            if group_name in self._groups:
                raise GroupExistsError(
                    f"this process is already in a group named {group_name!r}", group=group_name, rank=rank,
                    hint="destroy it first or pick another group_name",
                )
            self._groups[group_name] = None  # type: ignore[assignment]  # reserve the name
        record = None
        impl = None
        deadline = time.monotonic() + timeout
        try:
            if uid is None:
                uid, secret, record = _agree_on_incarnation(world_size, rank, cls.capabilities.name, group_name,
                                                             timeout)
            assert secret is not None
            rdv = Rendezvous(uid, group_name)
            rdv.put(f"member/{rank}", _my_actor_id().encode())
            config = BackendConfig(group_name, uid, rank, world_size, timeout, secret, rdv)
            try:
                impl = cls(config)
            except CollectiveTimeoutError as e:  # name who never came (each rank announced itself first)
                raise _join_timeout(rdv, "member", world_size, rank, group_name, timeout, e) from e
            _join_barrier(rdv, world_size, rank, group_name, timeout, deadline)

            def on_destroy() -> None:
                with self._lock:
                    if self._groups.get(group_name) is group:
                        del self._groups[group_name]
                _leave(group, rdv, record)

            group = CollectiveGroup(group_name, uid, impl, timeout, on_destroy, members)
            group.metrics = self.metrics
        except BaseException:
            with self._lock:
                self._groups.pop(group_name, None)
            if impl is not None:  # a half-made backend: close its connections and registrations
                try:
                    impl.shutdown()
                except Exception:  # noqa: BLE001 - the original error matters more
                    pass
            if record is not None and rank == 0:
                delete_incarnation(group_name, record)
            raise
        with self._lock:
            self._groups[group_name] = group
            if self._watcher is None and not self._watch_stop.is_set():
                self._watcher = _lifecycle.spawn(self._watch, "rdt-group-abort-watch")
        return group

    def _watch(self) -> None:
        """Abort a group whose driver asked for it while a call on it is blocked (a blocked actor cannot run the
        destroy call queued behind it), or error it when another member's call timed out (ERRORED_KEY). Reads the GCS only for calls blocked over ABORT_CHECK_S, at most once per
        ABORT_CHECK_S per group, never per call; exits when this process has no group left, or on stop."""
        last: Dict[str, float] = {}
        while not self._watch_stop.wait(_WATCH_PERIOD_S):
            with self._lock:
                groups = [g for g in self._groups.values() if g is not None]
                if not groups and all(n is not None for n in self._groups.values()):
                    self._watcher = None
                    return
            now = time.monotonic()
            last = {uid: t for uid, t in last.items() if any(g.uid == uid for g in groups)}
            for g in groups:
                if g.blocked_for(now) < ABORT_CHECK_S or now - last.get(g.uid, 0.0) < ABORT_CHECK_S:
                    continue
                last[g.uid] = now
                try:
                    reason = g.backend.config.rendezvous.try_get(ABORT_KEY)
                    failed = None if reason is not None else g.backend.config.rendezvous.try_get(ERRORED_KEY)
                except Exception:  # noqa: BLE001 - GCS unreachable or Ray shut down: try again later
                    continue
                if reason is not None:
                    logger.warning("rdt_transports: group=%s rank=%d: aborting a blocked call: %s", g.name, g.rank,
                                   reason.decode(errors="replace"))
                    g.abort(reason.decode(errors="replace"))
                elif failed is not None:
                    g.peer_failed(failed)
        with self._lock:
            self._watcher = None

    def stop_watcher(self, timeout: float = 2.0) -> None:
        """Stop the abort watcher thread (at exit); bounded by ``timeout``. New groups start no watcher after."""
        self._watch_stop.set()
        with self._lock:
            thread = self._watcher
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def destroy(self, name: str) -> None:
        self.get(name).destroy()

    def close_all(self) -> None:
        """Abort and destroy every group of this process (at exit): pending waits end, backend threads stop."""
        for group in [g for g in self.groups() if g is not None]:
            try:
                group.abort("the process is exiting")
                group.destroy()
            except Exception:  # noqa: BLE001 - best effort at exit; the others must still be closed
                pass
        self.stop_watcher(_lifecycle.JOIN_TIMEOUT_S)


def _join_barrier(rdv: Rendezvous, world_size: int, rank: int, group_name: str, timeout: float,
                  deadline: float) -> None:
    """Return once every rank has built its backend (a backend may connect lazily, so its constructor alone does
    not prove the peers exist); raise CollectiveTimeoutError naming the ranks that never joined."""
    rdv.put(f"joined/{rank}", b"1")
    poll = 0.0005
    while True:
        missing = [r for r in range(world_size) if r != rank and rdv.try_get(f"joined/{r}") is None]
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise _join_timeout(rdv, "joined", world_size, rank, group_name, timeout, None)
        time.sleep(poll)
        poll = min(poll * 2, 0.02)


def _join_timeout(rdv: Rendezvous, key: str, world_size: int, rank: int, group_name: str, timeout: float,
                  cause: Optional[BaseException]) -> CollectiveTimeoutError:
    """The typed error for ranks that did not join within the timeout, naming them."""
    try:
        missing = [r for r in range(world_size) if r != rank and rdv.try_get(f"{key}/{r}") is None]
    except RdtError:
        missing = []
    who = f"rank(s) {missing} did not join" if missing else "not every rank finished joining"
    detail = f" ({cause})" if cause is not None and not missing else ""
    return CollectiveTimeoutError(
        f"init_collective_group timed out after {timeout:.1f}s: {who}{detail}", group=group_name, rank=rank,
        peer=missing[0] if len(missing) == 1 else None, op="init_collective_group",
        hint="call init_collective_group on every rank (same group_name, world_size and backend) within the "
        "timeout, or pass every actor to create_collective_group; check that none died or is busy",
    )


def _my_actor_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_actor_id() or ""
    except Exception:
        return ""


def _check_membership(world_size: object, rank: object, group_name: object) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError(f"world_size must be a positive int, got {world_size!r}", group=str(group_name),
                                   hint="pass the number of ranks in the group, e.g. world_size=2")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidArgumentError(
            f"rank {rank!r} is out of range for world_size {world_size}", group=str(group_name),
            hint=f"use a rank in 0..{world_size - 1}",
        )
    if not isinstance(group_name, str) or not group_name:
        raise InvalidArgumentError(f"group_name must be a non-empty str, got {group_name!r}",
                                   hint="pass a name such as group_name='workers'")


def _agree_on_incarnation(world_size: int, rank: int, backend: str, group_name: str,
                          timeout: float) -> Tuple[str, bytes, bytes]:
    """Actor-side init: rank 0 mints the incarnation id and secret; the others read them from Ray's GCS.

    The name record carries rank 0's actor id, so a joiner skips the record of an incarnation whose rank 0 died
    (a group re-created after a crash) and waits for the fresh one instead of joining the dead one.
    """
    if rank == 0:
        uid = uuid.uuid4().hex
        secret = secrets.token_bytes(32)
        Rendezvous(uid, group_name).put("secret", secret)
        record = f"{uid}|{world_size}|{backend}|{_my_actor_id()}".encode()
        publish_incarnation(group_name, record)  # replaces any earlier incarnation's record, dead or alive
        return uid, secret, record
    deadline = time.monotonic() + timeout
    dead_owner: Dict[bytes, bool] = {}  # records already checked: one GCS lookup per record seen
    while True:
        record = read_incarnation(group_name)
        if record is not None:
            uid, ws, be, owner = (record.decode().split("|") + [""])[:4]
            if int(ws) == world_size and be == backend:
                if record not in dead_owner:
                    dead_owner[record] = bool(owner) and _actor_state(owner) == "DEAD"
                if not dead_owner[record]:
                    secret = Rendezvous(uid, group_name).get("secret", max(deadline - time.monotonic(), 0.01))
                    return uid, secret, record
        if time.monotonic() >= deadline:
            stale = record is not None and dead_owner.get(record, False)
            raise CollectiveTimeoutError(
                f"rank 0 of group {group_name!r} did not initialise within {timeout:.1f}s"
                + (" (the only record found belongs to an incarnation whose rank 0 is dead)" if stale else
                   f" (found a {record.decode()!r} incarnation that does not match world_size={world_size}, "
                   f"backend={backend!r})" if record else ""),
                group=group_name, rank=rank, peer=0, op="init_collective_group",
                hint="call init_collective_group on every rank with the same world_size and backend",
            )
        time.sleep(_INCARNATION_WAIT_POLL)


def _leave(group: CollectiveGroup, rdv: Rendezvous, record: Optional[bytes]) -> None:
    """On destroy: mark this rank gone; the last member (dead ones count as gone) clears the incarnation's keys.

    Rank 0 drops the name record at once, so that the name can be reused while other members still leave.
    """
    try:
        if record is not None and group.rank == 0:
            delete_incarnation(group.name, record)
        rdv.put(f"left/{group.rank}", b"1")
        members = group.members or [""] * group.world_size
        for r in range(group.world_size):
            if r == group.rank or rdv.try_get(f"left/{r}") is not None:
                continue
            actor_id = members[r] if r < len(members) and members[r] else (rdv.try_get(f"member/{r}") or b"").decode()
            if not actor_id or _actor_state(actor_id) != "DEAD":
                return  # a live member has still to leave: it clears
        rdv.clear()
        if record is not None:
            delete_incarnation(group.name, record)
    except Exception as e:  # noqa: BLE001 - Ray already shut down, or the GCS is unreachable: nothing to do
        logger.debug("rdt_transports: group=%s rank=%d: rendezvous cleanup failed: %s", group.name, group.rank, e)


_process_context: Optional[ProcessContext] = None
_process_context_lock = threading.Lock()


def get_context() -> ProcessContext:
    """This process's context (created on first use)."""
    global _process_context
    if _process_context is None:
        with _process_context_lock:
            if _process_context is None:
                _process_context = ProcessContext()
                _lifecycle.at_exit(_process_context.close_all)
    return _process_context


def _forget_after_fork() -> None:
    """A forked child is in none of its parent's groups: it starts with an empty context, and a fresh lock
    (another thread of the parent may have held it at the fork)."""
    global _process_context, _process_context_lock
    _process_context, _process_context_lock = None, threading.Lock()


_lifecycle.at_fork_child(_forget_after_fork)
