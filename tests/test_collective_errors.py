"""Every error of the collective API on a real local Ray cluster: typed, with group / rank / op and a fix.

Argument errors must be raised before any peer is touched (the group stays HEALTHY and the peer is never
called); transfer errors (size / dtype mismatch, timeout, dead peer) leave the group ERRORED while the actor's
other groups keep working. Kill tests use throwaway actors, never the module's shared ones.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest
import ray
import torch

import rdt_transports as rt
from rdt_transports import (
    CollectiveTimeoutError,
    GroupErroredError,
    GroupError,
    GroupExistsError,
    GroupNotFoundError,
    InvalidArgumentError,
    PeerUnavailableError,
    TensorMismatchError,
    UnsupportedError,
)

from . import _collective_cases as cc
from .conftest import HAS_NIXL, HAS_UCXX

BACKENDS = ("gloo", "nixl", "ucx", "tcp")
SLACK_S = 5.0  # how much later than its timeout a failing call may return on a loaded 2-core machine


def _require(backend: str) -> None:
    if backend == "nixl" and not HAS_NIXL:
        pytest.skip("nixl is not installed (pip install 'ray-direct-transport[nixl]')")
    if backend == "ucx" and not HAS_UCXX:
        pytest.skip("ucxx is not installed (pip install 'ray-direct-transport[ucx]')")


def assert_error(err: Optional[BaseException], cls: type, *, group: Optional[str] = None,
                 rank: Optional[int] = None, op: Optional[str] = None, fix: bool = True,
                 contains: Tuple[str, ...] = ()) -> str:
    """``err`` is exactly ``cls`` and its message names the group, rank, op and a fix (where given)."""
    assert err is not None, f"expected {cls.__name__}, but the call succeeded"
    got = err.cls if isinstance(err, cc.Caught) else type(err)
    assert got is cls, f"expected {cls.__name__}, got {got.__name__}: {err}"
    msg = str(err)
    if group is not None:
        assert repr(group) in msg, f"message does not name group {group!r}: {msg}"
    if rank is not None:
        assert f"rank={rank}" in msg, f"message does not name rank={rank}: {msg}"
    if op is not None:
        assert f"op={op!r}" in msg, f"message does not name op={op!r}: {msg}"
    if fix:
        assert "Fix:" in msg and msg.split("Fix:", 1)[1].strip(), f"message has no fix: {msg}"
    for text in contains:
        assert text in msg, f"message does not contain {text!r}: {msg}"
    return msg


def _one(actor: Any, fn: Any, *args: Any, timeout: float = 60.0, **kwargs: Any) -> Tuple[Any, Any, float]:
    return ray.get(actor.call.remote(fn, *args, **kwargs), timeout=timeout)


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ew(ray_cluster):
    """Three shared workers for this module."""
    actors = [cc.CollectiveWorker.remote() for _ in range(3)]
    ray.get([a.ping.remote() for a in actors], timeout=120)
    yield actors
    for a in actors:
        ray.kill(a)


@pytest.fixture(scope="module")
def pair_groups(ew):
    """A healthy 2-rank group '{backend}-e2' (ew[0] rank 0, ew[1] rank 1) per backend, made on first use."""
    handles: Dict[str, Any] = {}

    def get(backend: str) -> str:
        _require(backend)
        name = f"{backend}-e2"
        if backend not in handles:
            handles[backend] = rt.create_collective_group(ew[:2], backend=backend, group_name=name)
        return name

    yield get
    for h in handles.values():
        h.destroy(timeout=10)


def _state(actor: Any, name: str) -> Optional[str]:
    err, value, _ = _one(actor, cc.group_state, name)
    assert err is None, err
    return value


def _assert_pair_works(actors: List[Any], name: str) -> None:
    out = ray.get([a.call.remote(cc.allreduce_sum, name, r + 1) for r, a in enumerate(actors)], timeout=60)
    total = float(sum(range(1, len(actors) + 1)))
    for err, value, _ in out:
        assert err is None, f"group {name!r} no longer works: {err!r}"
        assert value == [total] * 4


# ---------------------------------------------------------------------------------------------- argument errors
def local_argument_errors(name: str) -> List[Tuple[str, Optional[BaseException]]]:
    """(worker side, rank 0 of a 2-rank group, peer idle) every call that must fail before touching a peer."""
    f = torch.ones(4)
    i = torch.ones(4, dtype=torch.int64)
    calls = {
        "send dst_rank out of range": lambda: rt.send(f, 2, name),
        "send dst_rank negative": lambda: rt.send(f, -1, name),
        "recv src_rank out of range": lambda: rt.recv(f, 5, name),
        "broadcast src_rank out of range": lambda: rt.broadcast(f, 2, name),
        "reduce dst_rank out of range": lambda: rt.reduce(f, 7, name),
        "gather dst_rank out of range": lambda: rt.gather(f, [torch.ones(4), torch.ones(4)], 3, name),
        "scatter src_rank out of range": lambda: rt.scatter(f, [torch.ones(4), torch.ones(4)], 9, name),
        "send to self": lambda: rt.send(f, 0, name),
        "recv from self": lambda: rt.recv(f, 0, name),
        "meta device allreduce": lambda: rt.allreduce(torch.empty(3, device="meta"), name),
        "meta device send": lambda: rt.send(torch.empty(3, device="meta"), 1, name),
        "non-contiguous torch": lambda: rt.allreduce(torch.ones(4, 6).t(), name),
        "non-contiguous numpy": lambda: rt.allreduce(np.ones((4, 6), dtype=np.float32)[:, ::2], name),
        "non-contiguous send": lambda: rt.send(torch.ones(4, 6)[:, 1], 1, name),
        "AVG on int allreduce": lambda: rt.allreduce(i, name, rt.ReduceOp.AVG),
        "AVG on int reduce": lambda: rt.reduce(i, 0, name, rt.ReduceOp.AVG),
        "AVG on int reducescatter": lambda: rt.reducescatter(i, [i.clone(), i.clone()], name, rt.ReduceOp.AVG),
        "allgather list too short": lambda: rt.allgather([torch.ones(4)], f, name),
        "allgather list too long": lambda: rt.allgather([torch.ones(4)] * 3, f, name),
        "unknown group": lambda: rt.allreduce(f, name + "-nope"),
    }
    out = []
    for label, fn in calls.items():
        try:
            fn()
            out.append((label, None))
        except Exception as e:  # noqa: BLE001
            out.append((label, cc.Caught(e)))
    return out


EXPECTED_ARGUMENT_ERRORS: Dict[str, Tuple[type, Optional[str]]] = {
    "send dst_rank out of range": (InvalidArgumentError, "send"),
    "send dst_rank negative": (InvalidArgumentError, "send"),
    "recv src_rank out of range": (InvalidArgumentError, "recv"),
    "broadcast src_rank out of range": (InvalidArgumentError, "broadcast"),
    "reduce dst_rank out of range": (InvalidArgumentError, "reduce"),
    "gather dst_rank out of range": (InvalidArgumentError, "gather"),
    "scatter src_rank out of range": (InvalidArgumentError, "scatter"),
    "send to self": (InvalidArgumentError, "send"),
    "recv from self": (InvalidArgumentError, "recv"),
    "meta device allreduce": (UnsupportedError, "allreduce"),
    "meta device send": (UnsupportedError, "send"),
    "non-contiguous torch": (InvalidArgumentError, "allreduce"),
    "non-contiguous numpy": (InvalidArgumentError, "allreduce"),
    "non-contiguous send": (InvalidArgumentError, "send"),
    "AVG on int allreduce": (UnsupportedError, "allreduce"),
    "AVG on int reduce": (UnsupportedError, "reduce"),
    "AVG on int reducescatter": (UnsupportedError, "reducescatter"),
    "allgather list too short": (InvalidArgumentError, "allgather"),
    "allgather list too long": (InvalidArgumentError, "allgather"),
    "unknown group": (GroupNotFoundError, None),
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_argument_errors_before_any_peer(ew, pair_groups, backend: str) -> None:
    name = pair_groups(backend)
    # only rank 0 calls: every error must come before a peer is touched (otherwise this would time out)
    err, results, seconds = _one(ew[0], local_argument_errors, name)
    assert err is None, err
    assert seconds < 5.0, f"argument checks took {seconds:.1f}s: something waited for a peer"
    assert [label for label, _ in results] == list(EXPECTED_ARGUMENT_ERRORS)
    for label, e in results:
        cls, op = EXPECTED_ARGUMENT_ERRORS[label]
        if cls is GroupNotFoundError:
            assert_error(e, cls, group=name + "-nope")
        else:
            assert_error(e, cls, group=name, rank=0, op=op)
    assert "meta" in str(dict(results)["meta device allreduce"])
    assert "contiguous" in str(dict(results)["non-contiguous numpy"])
    assert "AVG" in str(dict(results)["AVG on int allreduce"])
    # nothing was sent: the group is still healthy on both ranks and still works
    assert _state(ew[0], name) == "healthy"
    _assert_pair_works(ew[:2], name)


# ---------------------------------------------------------------------------------------------- typed across Ray
def _raise_in_actor(_self: Any, cls: type, message: str, ctx: Dict[str, Any]) -> None:
    raise cls(message, **ctx)


def _return_from_actor(_self: Any, cls: type, message: str, ctx: Dict[str, Any]) -> BaseException:
    return cls(message, **ctx)


_ERROR_CLASSES = [
    InvalidArgumentError, UnsupportedError, rt.BackendUnavailableError, GroupNotFoundError, GroupExistsError,
    GroupErroredError, rt.GroupDestroyedError, rt.CommunicationError,
    CollectiveTimeoutError, PeerUnavailableError, TensorMismatchError,
    rt.AuthenticationError,
]


@pytest.mark.parametrize("cls", _ERROR_CLASSES, ids=lambda c: c.__name__)
def test_errors_cross_the_ray_boundary_typed(ew, cls: type) -> None:
    ctx = dict(group="g1", rank=1, peer=0, op="allreduce", hint="do this")
    returned = ray.get(ew[0].__ray_call__.remote(_return_from_actor, cls, "boom", ctx), timeout=30)
    assert type(returned) is cls
    assert (returned.group, returned.rank, returned.peer, returned.op, returned.hint) == ("g1", 1, 0, "allreduce",
                                                                                         "do this")
    assert_error(returned, cls, group="g1", rank=1, op="allreduce", contains=("boom", "do this"))
    with pytest.raises(cls) as info:
        ray.get(ew[0].__ray_call__.remote(_raise_in_actor, cls, "boom", ctx), timeout=30)
    assert "boom" in str(info.value) and "g1" in str(info.value)


def test_rank_out_of_range_at_init(ew) -> None:
    err, _, _ = _one(ew[0], rt.init_collective_group, 2, 5, "gloo", "bad-rank")
    assert_error(err, InvalidArgumentError, group="bad-rank", contains=("rank 5",))
    err, _, _ = _one(ew[0], rt.init_collective_group, 2, -1, "gloo", "bad-rank")
    assert_error(err, InvalidArgumentError, group="bad-rank", contains=("rank -1",))
    assert _state(ew[0], "bad-rank") is None  # nothing was left behind


def test_ranks_not_a_permutation_at_create(ew) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        rt.create_collective_group(ew[:2], ranks=[0, 5], group_name="bad-ranks")
    assert_error(info.value, InvalidArgumentError, group="bad-ranks", contains=("5",))


def test_unknown_backend(ew) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        rt.create_collective_group(ew[:2], backend="bogus", group_name="bogus-group")
    assert_error(info.value, InvalidArgumentError, group="bogus-group", contains=("bogus", "gloo"))
    err, _, _ = _one(ew[0], rt.init_collective_group, 1, 0, "bogus", "bogus-group")
    assert_error(err, InvalidArgumentError, group="bogus-group", contains=("bogus", "gloo"))
    assert _state(ew[0], "bogus-group") is None


def test_duplicate_actors_in_create(ew) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        rt.create_collective_group([ew[0], ew[1], ew[0]], group_name="dup-actors")
    assert_error(info.value, InvalidArgumentError, group="dup-actors", contains=("twice",))


def test_duplicate_group_name_in_one_actor(ew, pair_groups) -> None:
    name = pair_groups("gloo")
    # actor side: joining a second group of the same name
    err, _, _ = _one(ew[0], rt.init_collective_group, 1, 0, "gloo", name)
    assert_error(err, GroupExistsError, group=name, rank=0)
    # driver side: declaring it again over the same actors fails on every member ...
    with pytest.raises(GroupError) as info:
        rt.create_collective_group(ew[:2], backend="gloo", group_name=name, timeout=10)
    assert "GroupExistsError" in str(info.value) and repr(name) in str(info.value) and "Fix:" in str(info.value)
    # ... and the failed create left the existing incarnation alone
    _assert_pair_works(ew[:2], name)


def test_driver_is_not_a_member(pair_groups) -> None:
    name = pair_groups("gloo")
    with pytest.raises(GroupNotFoundError) as info:
        rt.allreduce(torch.ones(3), name)
    assert_error(info.value, GroupNotFoundError, group=name)
    assert rt.get_rank(name) == -1 and not rt.is_group_initialized(name)


@ray.remote(num_cpus=0)
class _SlowStart:
    """An actor whose constructor takes ``seconds`` (a process still importing its model, or a slow node)."""

    def __init__(self, seconds: float) -> None:
        time.sleep(seconds)

    def ping(self) -> int:
        return 1


def test_a_member_still_starting_is_named_as_not_started_with_the_fix(ew) -> None:
    """Before, a member whose process was still starting at the deadline was reported as one that "did not join"
    (busy, stuck, or not scheduled?), the same as a stuck one; it is now named as not started, with the fix (wait
    for the actors first, or raise timeout=). A started member that never joined keeps the old words."""
    slow = _SlowStart.remote(8.0)
    try:
        start = time.monotonic()
        with pytest.raises(GroupError) as info:
            rt.create_collective_group([ew[0], slow], backend="gloo", group_name="slow-start", timeout=2.0)
        assert time.monotonic() - start < 2.0 + SLACK_S
        msg = assert_error(info.value, GroupError, group="slow-start", op="create_collective_group",
                           contains=(f"rank 1 (actor {slow._actor_id.hex()}): had not started within 2s",
                                     "__ray_ready__", "timeout="))
        assert "rank 0" in msg and "had not started" not in msg.split("rank 1", 1)[0], msg
        assert ray.get(slow.ping.remote(), timeout=60) == 1  # it starts later, unharmed
    finally:
        ray.kill(slow)


def test_driver_destroys_the_groups_it_created_by_name(ew) -> None:
    """``destroy_collective_group(name)`` in the driver that created ``name`` destroys it on its members (the
    handle kept or not); the name is free again at once; a name it never created names the group in the error."""
    name = "made-by-name"
    rt.create_collective_group(ew[:2], backend="gloo", group_name=name)  # the handle is not kept
    _assert_pair_works(ew[:2], name)
    rt.destroy_collective_group(name, timeout=30)
    assert _state(ew[0], name) is None and _state(ew[1], name) is None
    handle = rt.create_collective_group([ew[2], ew[0]], backend="gloo", group_name=name)  # the name is free again
    _assert_pair_works([ew[2], ew[0]], name)
    rt.destroy_collective_group(name, timeout=30)
    assert handle.destroyed and _state(ew[2], name) is None and _state(ew[0], name) is None
    handle.destroy(timeout=30)  # already destroyed: a no-op
    with pytest.raises(GroupNotFoundError) as info:
        rt.destroy_collective_group(name)
    assert_error(info.value, GroupNotFoundError, group=name, contains=("create_collective_group",))


# ---------------------------------------------------------------------------------------------- actor-side init
def init_use_destroy(name: str, world_size: int, rank: int) -> Dict[str, Any]:
    """(worker side) the ray.util.collective-style lifecycle: init, query, allreduce, destroy, query."""
    rt.init_collective_group(world_size, rank, "gloo", name, timeout=30)
    info = dict(rank=rt.get_rank(name), size=rt.get_collective_group_size(name),
                init=rt.is_group_initialized(name), state=rt.get_group(name).state.value)
    t = torch.full((3,), float(rank + 1))
    rt.allreduce(t, name)
    info["sum"] = t.tolist()
    rt.barrier(name)
    rt.destroy_collective_group(name)
    info.update(after_init=rt.is_group_initialized(name), after_rank=rt.get_rank(name),
                after_size=rt.get_collective_group_size(name))
    return info


def test_actor_side_init_three_ranks(ew) -> None:
    name = "actor-side-3"
    ranks = [2, 0, 1]  # not in actor order
    out = ray.get([a.call.remote(init_use_destroy, name, 3, r) for a, r in zip(ew, ranks)], timeout=90)
    for (err, info, _), r in zip(out, ranks):
        assert err is None, f"rank {r}: {err!r}"
        assert info == dict(rank=r, size=3, init=True, state="healthy", sum=[6.0] * 3, after_init=False,
                            after_rank=-1, after_size=-1), info
    # the name can be used again right away
    out = ray.get([a.call.remote(init_use_destroy, name, 3, r) for a, r in zip(ew, [0, 1, 2])], timeout=90)
    assert all(err is None for err, _, _ in out), out


# ---------------------------------------------------------------------------------------------- mismatches
def send_n(name: str, n: int, dtype: str, timeout: float) -> None:
    rt.send(torch.ones(n, dtype=cc.DTYPES[dtype]), 1, name, timeout=timeout)


def recv_n(name: str, n: int, dtype: str, timeout: float) -> List[Any]:
    t = torch.zeros(n, dtype=cc.DTYPES[dtype])
    rt.recv(t, 0, name, timeout=timeout)
    return t.tolist()


def _mismatch(actors: List[Any], backend: str, name: str, send: Tuple[int, str], recv: Tuple[int, str]) -> None:
    handle = rt.create_collective_group(actors, backend=backend, group_name=name)
    try:
        out = ray.get([actors[0].call.remote(send_n, name, *send, 10.0),
                       actors[1].call.remote(recv_n, name, *recv, 10.0)], timeout=60)
        (serr, _, st), (rerr, rvalue, rt_) = out
        assert rerr is not None, f"recv of {recv} from a send of {send} succeeded with {rvalue}"
        assert_error(rerr, TensorMismatchError, group=name, rank=1, op="recv")
        assert st < 10.0 + SLACK_S and rt_ < 10.0 + SLACK_S
        if serr is not None:
            assert_error(serr, TensorMismatchError, group=name, rank=0, op="send")
        assert _state(actors[1], name) == "errored"
    finally:
        handle.destroy(timeout=10)


@pytest.mark.parametrize("sizes", [(4, 8), (8, 4)], ids=["send-smaller", "send-larger"])
@pytest.mark.parametrize("backend", ["nixl", "ucx", "tcp"])
def test_p2p_size_mismatch(ew, backend: str, sizes: Tuple[int, int]) -> None:
    _require(backend)
    _mismatch(ew[:2], backend, f"mm-size-{backend}-{sizes[0]}", (sizes[0], "float32"), (sizes[1], "float32"))
    # the errored group was destroyed; a new one over the same actors works
    _mismatch_recovered(ew[:2], backend)


@pytest.mark.parametrize("backend", ["gloo", "nixl", "ucx", "tcp"])
def test_p2p_dtype_mismatch(ew, backend: str) -> None:
    _require(backend)
    _mismatch(ew[:2], backend, f"mm-dtype-{backend}", (4, "float32"), (4, "int32"))


def _mismatch_recovered(actors: List[Any], backend: str) -> None:
    name = f"mm-after-{backend}"
    h = rt.create_collective_group(actors, backend=backend, group_name=name)
    try:
        _assert_pair_works(actors, name)
    finally:
        h.destroy(timeout=10)


@pytest.fixture(scope="module")
def gloo_mismatch_pair(ray_cluster):
    """Two throwaway actors (not the module's shared ones: Gloo may abort the receiver's group mid-message) for
    the Gloo size mismatches; each case forms and destroys a group of its own over them."""
    actors = [cc.CollectiveWorker.remote() for _ in range(2)]
    ray.get([a.ping.remote() for a in actors], timeout=120)
    yield actors
    for a in actors:
        ray.kill(a)


@pytest.mark.parametrize("sizes", [(4, 8), (8, 4)], ids=["send-smaller", "send-larger"])
def test_p2p_size_mismatch_gloo(gloo_mismatch_pair, sizes: Tuple[int, int]) -> None:
    _mismatch(gloo_mismatch_pair, "gloo", f"mm-size-gloo-{sizes[0]}", (sizes[0], "float32"), (sizes[1], "float32"))


@pytest.mark.parametrize("send,recv", [((1 << 18, "float32"), (1 << 17, "float32")),
                                       ((1 << 18, "float32"), (1 << 18, "int32"))], ids=["size", "dtype"])
def test_large_p2p_mismatch_gloo_fails_both_sides_before_sending(ew, send, recv) -> None:
    """From 1 MiB on the receiver's verdict comes before the data: both ranks raise, and no data moves (so the
    module's shared actors serve: Gloo is never left half-way through a message)."""
    actors = ew[:2]
    name = f"mm-large-gloo-{recv[1]}"
    handle = rt.create_collective_group(actors, backend="gloo", group_name=name)
    try:
        out = ray.get([actors[0].call.remote(send_n, name, *send, 10.0),
                       actors[1].call.remote(recv_n, name, *recv, 10.0)], timeout=60)
        (serr, _, st), (rerr, _, rt_) = out
        assert_error(serr, TensorMismatchError, group=name, rank=0, op="send")
        assert_error(rerr, TensorMismatchError, group=name, rank=1, op="recv")
        assert "nothing was sent" in str(serr) and st < 10.0 and rt_ < 10.0
    finally:
        handle.destroy(timeout=10)


# ---------------------------------------------------------------------------------------------- timeouts
def recv_with_timeout(name: str, timeout: float) -> None:
    rt.recv(torch.zeros(4), 1, name, timeout=timeout)


def allreduce_on(name: str) -> None:
    rt.allreduce(torch.ones(4), name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_recv_timeout_errors_only_that_group(ew, pair_groups, backend: str) -> None:
    keep = pair_groups(backend)  # the same two actors share this group, which must survive
    name = f"timeout-{backend}"
    handle = rt.create_collective_group(ew[:2], backend=backend, group_name=name)  # default timeout 30 s
    try:
        err, _, seconds = _one(ew[0], recv_with_timeout, name, 2.0)  # nobody sends
        assert_error(err, CollectiveTimeoutError, group=name, rank=0, op="recv")
        assert 1.5 <= seconds < 2.0 + SLACK_S, f"recv with timeout=2 returned after {seconds:.1f}s"
        assert _state(ew[0], name) == "errored"
        err, _, seconds = _one(ew[0], allreduce_on, name)
        assert_error(err, GroupErroredError, group=name, rank=0, op="allreduce")
        assert seconds < 1.0
        # the other group of the same actors keeps working
        _assert_pair_works(ew[:2], keep)
        assert _state(ew[0], keep) == "healthy"
    finally:
        handle.destroy(timeout=10)
    assert _state(ew[0], name) is None and _state(ew[1], name) is None


# ---------------------------------------------------------------------------------------------- late sends
# A recv that failed never has its tensor written afterwards: rank 1's recv times out (its group errors and aborts),
# rank 0 (whose group has not noticed yet) sends late; its send must fail, and rank 1's tensor keeps its bytes.
# 32 MiB goes by rdt's process_vm_writev on a same-node NIXL group, 1 MiB by a NIXL WRITE.
_HELD: Dict[str, torch.Tensor] = {}  # (worker side) the tensor each failed recv was given
_SENTINEL = -7.0


def recv_into_held(name: str, n: int, timeout: float) -> None:
    """(worker side) recv ``n`` float32 from rank 0 into a sentinel-filled tensor kept after the call."""
    t = _HELD[name] = torch.full((n,), _SENTINEL)
    rt.recv(t, 0, name, timeout=timeout)


def held_written(name: str) -> int:
    """(worker side) how many elements of the failed recv's tensor changed."""
    return int((_HELD[name] != _SENTINEL).sum())


def send_values(name: str, n: int, timeout: float) -> None:
    rt.send(torch.arange(n, dtype=torch.float32), 1, name, timeout=timeout)


@pytest.mark.parametrize("backend,n,destroy", [
    ("nixl", 1 << 18, False), ("nixl", 1 << 18, True), ("nixl", 8 << 20, False), ("nixl", 8 << 20, True),
    ("ucx", 8 << 20, False), ("tcp", 8 << 20, False)])
def test_a_late_send_never_writes_into_a_failed_recv(ew, backend: str, n: int, destroy: bool) -> None:
    _require(backend)
    name = f"late-{backend}-{n}-{int(destroy)}"
    handle = rt.create_collective_group(ew[:2], backend=backend, group_name=name)
    try:
        _assert_pair_works(ew[:2], name)  # the pair has talked: its connections are up
        err, _, _ = _one(ew[1], recv_into_held, name, n, 1.0)
        assert_error(err, CollectiveTimeoutError, group=name, rank=1, op="recv")
        if destroy:
            _one(ew[1], cc.destroy_local, name)
        err, _, seconds = _one(ew[0], send_values, name, n, 5.0)
        time.sleep(0.5)
        written = _one(ew[1], held_written, name)[1]
        assert written == 0, f"{written} of {n} elements were written after the recv failed"
        assert err is not None and issubclass(err.cls, rt.CommunicationError), f"the late send returned {err!r}"
        if backend == "nixl":
            assert "cancelled" in str(err), err
            assert seconds < 2.0, f"the late send failed only after {seconds:.1f}s"
    finally:
        handle.destroy(timeout=10)


# ---------------------------------------------------------------------------------------------- killed peer
# What the survivor observes when its peer is killed while it is blocked (asserted exactly per backend):
# Gloo, UCX and tcp notice the closed connection at once; a same-node NIXL group runs without UCX error handling
# and watches the peer's pid instead, so it notices too (long before the call's timeout).
KILL_ERRORS: Dict[str, type] = {
    "gloo": PeerUnavailableError,
    "nixl": PeerUnavailableError,
    "ucx": PeerUnavailableError,
    "tcp": PeerUnavailableError,
}
KILL_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def survivors(ray_cluster):
    """Two throwaway actors (not the module's shared ones): [0] survives kills, [1] shares a group with it."""
    actors = [cc.CollectiveWorker.remote() for _ in range(2)]
    ray.get([a.ping.remote() for a in actors], timeout=120)
    handles: Dict[str, Any] = {}

    def keep_group(backend: str) -> str:
        name = f"keep-{backend}"
        if backend not in handles:
            handles[backend] = rt.create_collective_group(actors, backend=backend, group_name=name)
        return name

    yield actors, keep_group
    for h in handles.values():
        h.destroy(timeout=10)
    for a in actors:
        ray.kill(a)


def blocked_call(name: str, op: str, timeout: float) -> None:
    if op == "recv":
        rt.recv(torch.zeros(4), 1, name, timeout=timeout)
    elif op == "broadcast":  # the pipelined chain from the victim (root 1), which never sends a chunk
        rt.broadcast(torch.zeros(1 << 20), 1, name, algorithm="ring", timeout=timeout)
    else:
        rt.allreduce(torch.ones(4), name, timeout=timeout)


@pytest.mark.parametrize("backend,op", [
    ("gloo", "recv"), ("gloo", "allreduce"),
    ("nixl", "recv"), ("nixl", "allreduce"),
    ("ucx", "recv"), ("ucx", "allreduce"),
    ("tcp", "recv"), ("tcp", "allreduce"),
    ("gloo", "broadcast"), ("nixl", "broadcast"), ("ucx", "broadcast"), ("tcp", "broadcast"),
])
def test_killed_peer(survivors, backend: str, op: str) -> None:
    _require(backend)
    (survivor, other), keep_group = survivors
    keep = keep_group(backend)
    victim = cc.CollectiveWorker.remote()
    ray.get(victim.ping.remote(), timeout=60)
    name = f"kill-{backend}-{op}"
    handle = rt.create_collective_group([survivor, victim], backend=backend, group_name=name)
    try:
        _assert_pair_works([survivor, victim], name)  # connections are up before the kill
        ref = survivor.call.remote(blocked_call, name, op, KILL_TIMEOUT_S)
        time.sleep(1.0)  # the survivor is now blocked in the call
        ray.kill(victim)
        err, _, seconds = ray.get(ref, timeout=KILL_TIMEOUT_S + 30)
        assert err is not None, f"{op} returned although its peer was killed"
        assert_error(err, KILL_ERRORS[backend], group=name, rank=0)
        assert seconds < KILL_TIMEOUT_S + SLACK_S, f"{op} took {seconds:.1f}s to fail ({err!r})"
        assert _state(survivor, name) == "errored"
        # the survivor's other group keeps working
        _assert_pair_works([survivor, other], keep)
        assert_error(err, KILL_ERRORS[backend], op=op)  # last: the message names the op the caller made
    finally:
        handle.destroy(timeout=10)
        ray.kill(victim)
    assert _state(survivor, name) is None
