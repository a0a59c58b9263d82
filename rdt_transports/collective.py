"""The ``ray.util.collective``-shaped functions: groups by name, ops in place, plus per-call timeouts.

Switching from ``ray.util.collective`` is a change of import. Differences: every call takes ``timeout=`` and an
``algorithm=``, errors are typed (:mod:`rdt_transports.errors`), and gather/scatter/alltoall exist.
"""

from __future__ import annotations

import secrets
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._context import ABORT_KEY, get_context
from ._metrics import Metrics
from ._rendezvous import Rendezvous
from .errors import (BackendUnavailableError, GroupError, GroupNotFoundError, InvalidArgumentError, RdtError,
                     SharedDeviceError)
from .group import CollectiveGroup
from .types import ReduceOp, Timeout, to_seconds

DEFAULT_TIMEOUT_S = 30.0


# ---------------------------------------------------------------------- groups, inside an actor
def init_collective_group(
    world_size: int,
    rank: int,
    backend: str = "gloo",
    group_name: str = "default",
    timeout: Timeout = DEFAULT_TIMEOUT_S,
) -> CollectiveGroup:
    """Join ``group_name`` as ``rank`` of ``world_size`` from inside an actor; blocks until all ranks joined."""
    seconds = to_seconds(timeout, DEFAULT_TIMEOUT_S)
    _preflight(backend, group_name, rank)  # e.g. nccl without cupy/CUDA: fail before the rendezvous
    return get_context().init_group(world_size, rank, backend, group_name, seconds)


def _preflight(backend: str, group_name: str, rank: Optional[int] = None) -> None:
    """Run the backend's own availability check (if it has one) in this process; typed error with the fix."""
    from .backends import backend_class

    try:
        check = getattr(backend_class(backend), "check_available", None)
        if check is not None:
            check()
    except RdtError as e:
        raise type(e)(e.message, group=group_name, rank=rank, op="init_collective_group", hint=e.hint) from None


def _preflight_on_actor(_self: Any, backend: str, group_name: str) -> Dict[str, Any]:
    """Runs in each member before any rendezvous: {"error": None or (class name, message, hint), "device": the
    device this member would run the backend on (backends that own one device per rank, e.g. nccl), or None}."""
    try:
        _preflight(backend, group_name)
    except RdtError as e:
        return {"error": (type(e).__name__, e.message, e.hint), "device": None}
    return {"error": None, "device": _device_identity(backend)}


def _device_identity(backend: str) -> Optional[str]:
    """This process's device for ``backend`` ("node N GPU UUID"), when the backend needs one device per rank."""
    from .backends import backend_class

    identify = getattr(backend_class(backend), "device_identity", None)
    try:
        return identify() if identify is not None else None
    except Exception:  # noqa: BLE001 - no identity: the check is skipped, never the group
        return None


def destroy_collective_group(group: "str | GroupHandle" = "default", *, timeout: Timeout = DEFAULT_TIMEOUT_S) -> None:
    """Destroy a group: by name, this process's membership and the groups this process created under that name
    with create_collective_group (on their members); or by the handle create_collective_group returned."""
    if isinstance(group, GroupHandle):
        group.destroy(timeout=timeout)
        return
    member = get_context().find(group) is not None
    created = _created.take(group)
    if not member and not created:
        raise GroupNotFoundError(
            f"no collective group named {group!r} in this process, and none created here under that name",
            group=group, op="destroy_collective_group",
            hint="destroy it where it lives: by name inside a member (init_collective_group), or in the process "
            "that called create_collective_group (by name, or with the handle it returned)")
    if member:
        get_context().destroy(group)
    for made in created:
        handle = made.live()
        if handle is not None:  # else no handle to any member is left here (see _CreatedGroups)
            handle.destroy(timeout=timeout)


def is_group_initialized(group_name: str = "default") -> bool:
    """Whether this process is a member of ``group_name``."""
    return get_context().find(group_name) is not None


def get_rank(group_name: str = "default") -> int:
    """This process's rank in ``group_name``, or -1 when it is not a member (as in ray.util.collective)."""
    g = get_context().find(group_name)
    return -1 if g is None else g.rank


def get_collective_group_size(group_name: str = "default") -> int:
    """World size of ``group_name``, or -1 when this process is not a member."""
    g = get_context().find(group_name)
    return -1 if g is None else g.world_size


def get_group(group_name: str = "default") -> CollectiveGroup:
    """The group object (for its lifecycle: state, errored(), abort(), destroy())."""
    return get_context().get(group_name)


def local_groups() -> List[CollectiveGroup]:
    """Every collective group this process is a member of now (e.g. for a layer above to find a common one)."""
    return get_context().groups()


def metrics() -> Metrics:
    """This process's metrics recorder (Ray metrics of collective ops; a layer above records its transfers too)."""
    return get_context().metrics


# ---------------------------------------------------------------------- groups, from the driver
@dataclass
class GroupHandle:
    """A group declared from the driver: its name, incarnation, backend and actors in rank order."""

    name: str
    uid: str
    backend: str
    actors: List[Any]
    ranks: List[int]
    timeout: float
    destroyed: bool = field(default=False)

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def rank_of(self, actor: Any) -> int:
        for a, r in zip(self.actors, self.ranks):
            if a == actor:
                return r
        return -1

    def abort(self, reason: str = "aborted from the driver") -> None:
        """Make every member's calls on this group fail with GroupDestroyedError, without waiting for any actor.

        Publishes an abort record in the group's rendezvous: a member blocked in a call sees it within about
        ABORT_CHECK_S and aborts its backend, so its stuck call raises and its actor queue moves on.
        """
        try:
            Rendezvous(self.uid, self.name).put(ABORT_KEY, reason.encode())
        except RdtError:
            pass

    def destroy(self, *, timeout: Timeout = DEFAULT_TIMEOUT_S) -> None:
        """Destroy the group on every live member; dead members are skipped. Idempotent.

        Aborts first (see :meth:`abort`), so members stuck in a collective free their queue for the destroy call;
        returns after ``timeout`` even if a member is busy in a long method (its destroy runs once it is free).
        """
        import ray

        if self.destroyed:
            return
        self.destroyed = True
        _created.forget(self)
        self.abort("the group was destroyed from the driver")
        refs = [a.__ray_call__.remote(_destroy_on_actor, self.name, self.uid) for a in self.actors]
        seconds = to_seconds(timeout, DEFAULT_TIMEOUT_S)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=seconds)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                pass  # a dead member has nothing left to destroy
        if len(ready) < len(refs):
            return  # a member still has to leave; the last one to leave clears the keys (abort record included)
        try:
            Rendezvous(self.uid, self.name).clear()
        except RdtError:
            pass


@dataclass
class _Created:
    """A group this process created, remembered without holding any actor (see :class:`_CreatedGroups`)."""

    handle: "weakref.ref[GroupHandle]"
    name: str
    uid: str
    backend: str
    timeout: float
    members: List[Tuple["weakref.ref[Any]", int]]  # (a weak reference to an actor's handle, its rank)

    @classmethod
    def of(cls, handle: GroupHandle) -> "_Created":
        return cls(weakref.ref(handle), handle.name, handle.uid, handle.backend, handle.timeout,
                   [(weakref.ref(a), r) for a, r in zip(handle.actors, handle.ranks)])

    def gone(self) -> bool:
        """Neither the caller's handle nor any member's handle is left in this process."""
        return self.handle() is None and all(ref() is None for ref, _ in self.members)

    def live(self) -> Optional[GroupHandle]:
        """The caller's handle if it still exists, else one over the members whose handles do; None if none."""
        handle = self.handle()
        if handle is not None:
            return handle
        alive = [(a, r) for a, r in ((ref(), r) for ref, r in self.members) if a is not None]
        if not alive:
            return None
        return GroupHandle(self.name, self.uid, self.backend, [a for a, _ in alive], [r for _, r in alive],
                           self.timeout)


class _CreatedGroups:
    """The groups this process created, by name, so that ``destroy_collective_group(name)`` reaches them.

    Only weak references: an actor lives while the caller keeps a handle to it, never because of this table. A
    group whose handle was dropped is destroyed on the members whose handles the caller still holds (a plain
    actor exits with its last handle, its groups with it; a named or detached one outlives them, so keep the
    group's handle for those). Groups nothing is left of are forgotten at the next create.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: Dict[str, List[_Created]] = {}

    def add(self, handle: GroupHandle) -> None:
        """Remember a group just created; forget those nothing is left of."""
        with self._lock:
            for name in list(self._groups):
                kept = [c for c in self._groups[name] if not c.gone()]
                if kept:
                    self._groups[name] = kept
                else:
                    del self._groups[name]
            self._groups.setdefault(handle.name, []).append(_Created.of(handle))

    def forget(self, handle: GroupHandle) -> None:
        """The group was destroyed (through its handle)."""
        with self._lock:
            kept = [c for c in self._groups.get(handle.name, []) if c.uid != handle.uid]
            if kept:
                self._groups[handle.name] = kept
            else:
                self._groups.pop(handle.name, None)

    def take(self, name: str) -> List[_Created]:
        """Every group created here under ``name`` and not destroyed through its handle (forgotten here now)."""
        with self._lock:
            return self._groups.pop(name, [])


_created = _CreatedGroups()


def _init_on_actor(_self: Any, world_size: int, rank: int, backend: str, name: str, timeout: float, uid: str,
                   secret: bytes, members: List[str]) -> int:
    get_context().init_group(world_size, rank, backend, name, timeout, uid=uid, secret=secret, members=members)
    return rank


def _destroy_on_actor(_self: Any, name: str, uid: str) -> bool:
    group = get_context().find(name)
    if group is not None and group.uid == uid:
        group.destroy()
        return True
    return False


def create_collective_group(
    actors: Sequence[Any],
    world_size: Optional[int] = None,
    ranks: Optional[Sequence[int]] = None,
    backend: str = "gloo",
    group_name: str = "default",
    timeout: Timeout = DEFAULT_TIMEOUT_S,
) -> GroupHandle:
    """Declare a group from the driver: every actor joins it (eagerly, so errors surface here). Returns a handle."""
    import ray

    from .backends import backend_class

    if isinstance(actors, (ray.actor.ActorHandle, str, bytes)) or not hasattr(actors, "__iter__"):
        raise InvalidArgumentError(f"actors must be a list of actor handles, got {type(actors).__name__}",
                                   group=group_name if isinstance(group_name, str) else None,
                                   hint="pass a list, e.g. create_collective_group([a, b])")
    actors = list(actors)
    seconds = to_seconds(timeout, DEFAULT_TIMEOUT_S)
    deadline = time.monotonic() + seconds  # one deadline for the preflight and the join: never waits past it
    try:  # unknown backend / missing package: fail before touching any actor
        backend_cls = backend_class(backend)
    except RdtError as e:
        raise type(e)(e.message, group=group_name, op="create_collective_group", hint=e.hint) from None
    if not actors:
        raise InvalidArgumentError("actors must be a non-empty list of actor handles", group=group_name,
                                   hint="pass the handles of the group's members, e.g. [a, b]")
    ids = []
    for a in actors:
        if not isinstance(a, ray.actor.ActorHandle):
            raise InvalidArgumentError(f"{a!r} is not a Ray actor handle", group=group_name,
                                       hint="pass handles returned by Cls.remote()")
        ids.append(a._actor_id)
    if len(set(ids)) != len(ids):
        raise InvalidArgumentError("the same actor appears twice in actors", group=group_name,
                                   hint="each actor can hold one rank of a group")
    world_size = len(actors) if world_size is None else world_size
    if world_size != len(actors):
        raise InvalidArgumentError(f"world_size={world_size} but {len(actors)} actors were given", group=group_name,
                                   hint="leave world_size=None (it is len(actors)) or pass one actor per rank")
    ranks = list(range(world_size)) if ranks is None else list(ranks)
    if sorted(ranks) != list(range(world_size)):
        raise InvalidArgumentError(f"ranks {ranks} must be a permutation of 0..{world_size - 1}", group=group_name,
                                   op="create_collective_group",
                                   hint=f"pass ranks=None (actor order) or a reordering of {list(range(world_size))}")
    if not isinstance(group_name, str) or not group_name:
        raise InvalidArgumentError(f"group_name must be a non-empty str, got {group_name!r}",
                                   hint="pass a name such as group_name='workers'")
    if getattr(backend_cls, "check_available", None) is not None:
        # Backends with runtime requirements (nccl: cupy, libnccl, a visible GPU) are checked in every member
        # before anything is published, so a CPU-only actor fails fast with the fix instead of a rendezvous hang.
        _check_members(actors, ranks, backend, group_name, seconds, deadline)
    uid = uuid.uuid4().hex
    secret = secrets.token_bytes(32)
    members = [""] * world_size
    for a, r in zip(actors, ranks):
        members[r] = a._actor_id.hex()
    left = max(deadline - time.monotonic(), 0.0)
    # The members' own join timeout ends a little before the driver's, so their typed errors arrive in time.
    member_s = max(left - min(2.0, left * 0.2), 0.05)
    refs = [
        a.__ray_call__.remote(_init_on_actor, world_size, r, backend, group_name, member_s, uid, secret, members)
        for a, r in zip(actors, ranks)
    ]
    handle = GroupHandle(group_name, uid, backend, actors, ranks, seconds)
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=max(deadline - time.monotonic(), 0.0))
    errors: List[str] = []
    starting = False
    for a, r, ref in zip(actors, ranks, refs):
        if ref in pending:
            state = _not_started(a)
            starting = starting or state is not None
            errors.append(f"rank {r} (actor {a._actor_id.hex()}): " + (
                f"had not started within {seconds:.0f}s (Ray's actor state {state})" if state is not None else
                f"did not join within {seconds:.0f}s (actor busy in a long method, or stuck?)"))
            continue
        try:
            ray.get(ref, timeout=max(deadline - time.monotonic(), 1.0))
        except Exception as e:  # noqa: BLE001 - collect every member's failure
            errors.append(f"rank {r}: {type(e).__name__}: {str(e).splitlines()[-1][:300]}")
    if errors:
        handle.destroy(timeout=min(5.0, max(deadline - time.monotonic(), 0.1)))  # never long past the deadline
        raise GroupError(
            "could not create the group: " + "; ".join(errors), group=group_name, op="create_collective_group",
            hint=_STARTING_HINT if starting else
            "fix the failures above (a group name already used by an actor must be destroyed first)",
        )
    _created.add(handle)
    return handle


_STARTING_HINT = ("wait until the actors are up before making the group (ray.get([a.__ray_ready__.remote() for a "
                  "in actors])), or raise timeout=; an actor that never starts asks for resources Ray cannot give "
                  "(see `ray status`)")


def _not_started(actor: Any) -> Optional[str]:
    """Ray's state of ``actor`` when its process has not started (e.g. PENDING_CREATION); None when it is alive,
    or its state is unknown."""
    import ray

    try:
        state = ray._private.state.actors(actor_id=actor._actor_id.hex()).get("State")
    except Exception:  # noqa: BLE001 - unknown: report it as not joined
        return None
    return None if state in (None, "ALIVE") else str(state)


def _check_members(actors: List[Any], ranks: List[int], backend: str, group_name: str, seconds: float,
                   deadline: float) -> None:
    """Every member can run ``backend`` and, for backends with one device per rank, no two share a device; a typed
    error naming the members otherwise, before anything is published (waits until ``deadline`` at most)."""
    import ray

    refs = [a.__ray_call__.remote(_preflight_on_actor, backend, group_name) for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(deadline - time.monotonic(), 0.0))
    silent = [(a, r) for a, r, ref in zip(actors, ranks, refs) if ref not in ready]
    if silent:
        states = [_not_started(a) for a, _ in silent]
        raise GroupError(
            "could not create the group: " + "; ".join(
                f"rank {r} (actor {a._actor_id.hex()}) " + (
                    f"had not started within {seconds:.0f}s (Ray's actor state {state})" if state is not None else
                    f"did not answer within {seconds:.0f}s")
                for (a, r), state in zip(silent, states)),
            group=group_name, op="create_collective_group",
            hint=_STARTING_HINT if any(states) else
            "the actor is busy in a long method or stuck: let it finish, or raise the timeout",
        )
    problems: List[str] = []
    hint: Optional[str] = None
    devices: Dict[str, List[str]] = {}
    for a, r, ref in zip(actors, ranks, refs):
        try:
            res = ray.get(ref, timeout=max(deadline - time.monotonic(), 1.0))
        except Exception:  # noqa: BLE001 - a dead member is reported by the join below
            continue
        if res["error"] is not None:
            problems.append(f"rank {r}: {res['error'][1]}")
            hint = hint or res["error"][2]
        elif res["device"] is not None:
            devices.setdefault(res["device"], []).append(f"rank {r} (actor {a._actor_id.hex()})")
    if problems:
        raise BackendUnavailableError(
            f"backend {backend!r} cannot run on every member: " + "; ".join(problems), group=group_name,
            op="create_collective_group", hint=hint,
        )
    shared = {dev: who for dev, who in devices.items() if len(who) > 1}
    if shared:
        raise SharedDeviceError(
            f"backend {backend!r} needs one GPU per rank, but " + "; ".join(
                f"{' and '.join(who)} share {dev}" for dev, who in shared.items()),
            group=group_name, op="create_collective_group",
            hint="give each rank its own GPU (@ray.remote(num_gpus=1)); for transfers between actors on one GPU "
            "use tensor_transport='cuda_ipc' or 'nixl' instead of an NCCL group",
        )


# ---------------------------------------------------------------------- operations
def send(tensor: Any, dst_rank: int, group_name: str = "default", *, timeout: Timeout = None) -> None:
    """Send ``tensor`` to ``dst_rank``."""
    get_context().get(group_name).send(tensor, dst_rank, timeout=timeout)


def recv(tensor: Any, src_rank: int, group_name: str = "default", *, timeout: Timeout = None) -> None:
    """Receive into ``tensor`` from ``src_rank``."""
    get_context().get(group_name).recv(tensor, src_rank, timeout=timeout)


def broadcast(tensor: Any, src_rank: int = 0, group_name: str = "default", *, algorithm: str = "auto",
              timeout: Timeout = None) -> None:
    """Copy ``src_rank``'s tensor into every rank's tensor."""
    get_context().get(group_name).broadcast(tensor, src_rank, algorithm=algorithm, timeout=timeout)


def allreduce(tensor: Any, group_name: str = "default", op: ReduceOp = ReduceOp.SUM, *, algorithm: str = "auto",
              timeout: Timeout = None) -> None:
    """Reduce ``tensor`` over all ranks; every rank gets the result in place."""
    get_context().get(group_name).allreduce(tensor, op, algorithm=algorithm, timeout=timeout)


def reduce(tensor: Any, dst_rank: int = 0, group_name: str = "default", op: ReduceOp = ReduceOp.SUM, *,
           algorithm: str = "auto", timeout: Timeout = None) -> None:
    """Reduce ``tensor`` over all ranks into ``dst_rank``'s tensor."""
    get_context().get(group_name).reduce(tensor, dst_rank, op, algorithm=algorithm, timeout=timeout)


def allgather(tensor_list: Sequence[Any], tensor: Any, group_name: str = "default", *, algorithm: str = "auto",
              timeout: Timeout = None) -> None:
    """Every rank's ``tensor`` into ``tensor_list[rank]`` on every rank."""
    get_context().get(group_name).allgather(tensor_list, tensor, algorithm=algorithm, timeout=timeout)


def gather(tensor: Any, gather_list: Optional[Sequence[Any]] = None, dst_rank: int = 0, group_name: str = "default",
           *, algorithm: str = "auto", timeout: Timeout = None) -> None:
    """Every rank's ``tensor`` into ``gather_list`` on ``dst_rank``."""
    get_context().get(group_name).gather(tensor, gather_list, dst_rank, algorithm=algorithm, timeout=timeout)


def scatter(tensor: Any, scatter_list: Optional[Sequence[Any]] = None, src_rank: int = 0,
            group_name: str = "default", *, algorithm: str = "auto", timeout: Timeout = None) -> None:
    """``scatter_list[r]`` of ``src_rank`` into rank r's ``tensor``."""
    get_context().get(group_name).scatter(tensor, scatter_list, src_rank, algorithm=algorithm, timeout=timeout)


def reducescatter(tensor: Any, tensor_list: Sequence[Any], group_name: str = "default", op: ReduceOp = ReduceOp.SUM,
                  *, algorithm: str = "auto", timeout: Timeout = None) -> None:
    """Reduce ``tensor_list[r]`` over all ranks into rank r's ``tensor``."""
    get_context().get(group_name).reducescatter(tensor, tensor_list, op, algorithm=algorithm, timeout=timeout)


def alltoall(output_list: Sequence[Any], input_list: Sequence[Any], group_name: str = "default", *,
             algorithm: str = "auto", timeout: Timeout = None) -> None:
    """``input_list[j]`` of rank i lands in ``output_list[i]`` of rank j."""
    get_context().get(group_name).alltoall(output_list, input_list, algorithm=algorithm, timeout=timeout)


def barrier(group_name: str = "default", *, algorithm: str = "auto", timeout: Timeout = None) -> None:
    """Return once every rank of the group has entered the barrier."""
    get_context().get(group_name).barrier(algorithm=algorithm, timeout=timeout)
