"""Wrong uses of rdt and rdt_transports: each gives a typed error whose message says how to fix it.

docs/bad-input.md lists every row with the test that covers it. A row is (wrong use, error class, a fragment of
the message that tells the user what to do). Driver-side rows run here; actor-side rows run inside one actor
(rank 0 of a 2-rank Gloo group whose peer stays idle, so an argument error that touched the peer would hang
and be caught by the bounded ray.get); object rows use real producer and consumer actors.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
import ray
import torch

import rdt
import rdt_transports as rt
from rdt.errors import (
    GroupDestroyedError,
    GroupNotFoundError,
    InvalidArgumentError,
    NoCollectiveGroupError,
    ObjectFetchError,
    ObjectFreedError,
    UnsupportedError,
)


N = 1 << 16  # above the inline threshold: tensors move out of band


# ---------------------------------------------------------------------------------------------- actors
@ray.remote(num_cpus=0)
class BadNode:
    """Producers of wrong values, and a consumer."""

    @rdt.tensor_method(tensor_transport="nccl")
    def nccl_on_cpu(self) -> Any:
        return torch.ones(N)

    @rdt.tensor_method(tensor_transport="shm")
    def shm_on_meta(self) -> Any:
        return torch.empty(N, device="meta")

    @rdt.tensor_method(tensor_transport="shm")
    def sparse(self) -> Any:
        return {"s": torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (N,))}

    @rdt.tensor_method(tensor_transport="shm")
    def misaligned(self) -> Any:
        x = torch.zeros(N, dtype=torch.uint8)
        return {"a": x[1:], "b": x[4:12].view(torch.float32)}

    @rdt.tensor_method(tensor_transport="shm")
    def unpicklable(self) -> Any:
        return {"w": torch.ones(N), "lock": threading.Lock()}

    @rdt.tensor_method(tensor_transport="gloo")
    def make_gloo(self) -> Any:
        return {"w": torch.ones(N)}

    def freed(self, transport: str) -> List[Any]:
        """An object whose producer-side entry is already gone (test hook simulating the free/fetch race)."""
        from rdt._process.context import get_context
        from rdt._producer.produce import produce

        ctx = get_context()
        meta = produce(ctx, {"w": torch.ones(N)}, transport)
        ctx.table.free(meta.obj_id)
        return [ray.put(meta)]

    def total(self, values: List[Any]) -> float:
        return float(ray.get(values[0], timeout=60)["w"].sum())

    def total_direct(self, value: Any) -> float:
        return float(value["w"].sum())

    def pid(self) -> int:
        import os

        return os.getpid()


@ray.remote
@rdt.tensor_method(tensor_transport="gloo")
def task_producer() -> Any:
    return {"w": torch.ones(N)}


@ray.remote
def task_put() -> Any:
    return rdt.put({"w": torch.ones(N)})


@pytest.fixture(scope="module")
def nodes(ray_cluster):
    p, c, other = BadNode.remote(), BadNode.remote(), BadNode.remote()
    ray.get([a.pid.remote() for a in (p, c, other)], timeout=120)
    group = rdt.create_collective_group([p, c], backend="gloo", name="bad-input")
    yield {"p": p, "c": c, "other": other, "group": group}
    rdt.destroy_collective_group(group, timeout=30)
    for a in (p, c, other):
        ray.kill(a)


def check(err: BaseException, cls: type, fragment: str) -> None:
    """``err`` is a ``cls`` (Ray's RayTaskError wrapper allowed) whose message contains ``fragment``."""
    assert isinstance(err, cls), f"expected {cls.__name__}, got {type(err).__name__}: {err}"
    assert fragment in str(err), f"message lacks {fragment!r}: {err}"


# ---------------------------------------------------------------------------------------------- driver side
DRIVER_CASES: Dict[str, Tuple[Callable[[], Any], type, str]] = {
    "tensor_method unknown transport": (lambda: rdt.tensor_method(tensor_transport="carrier-pigeon"),
                                        InvalidArgumentError, "use one of 'gloo'"),
    "tensor_method transport not a str": (lambda: rdt.tensor_method(tensor_transport=5), InvalidArgumentError,
                                          "use one of"),
    "tensor_method without parentheses": (lambda: rdt.tensor_method(lambda self: None), InvalidArgumentError,
                                          "@rdt.tensor_method(tensor_transport="),
    "tensor_method on a non-callable": (lambda: rdt.tensor_method("shm")(5), InvalidArgumentError,
                                        "right above an actor method"),
    "tensor_method negative timeout": (lambda: rdt.tensor_method("shm", timeout=-1), InvalidArgumentError,
                                       "timeout=30.0"),
    "tensor_method timeout as str": (lambda: rdt.tensor_method("shm", timeout="10"), InvalidArgumentError,
                                     "timeout=30.0"),
    "tensor_method snapshot not bool": (lambda: rdt.tensor_method("shm", snapshot="yes"), InvalidArgumentError,
                                        "snapshot=True"),
    "tensor_method num_returns streaming": (lambda: rdt.tensor_method("shm", num_returns="streaming"),
                                            InvalidArgumentError, "num_returns=2"),
    "rdt.put on the driver": (lambda: rdt.put({"w": torch.ones(3)}), InvalidArgumentError, "use ray.put on the driver"),
    "rdt.put unknown transport": (lambda: rdt.put(torch.ones(3), "bogus"), InvalidArgumentError, "use one of"),
    "configure transfer_timeout=0": (lambda: rdt.configure(transfer_timeout=0), InvalidArgumentError,
                                     "transfer_timeout=120.0"),
    "configure transfer_timeout as str": (lambda: rdt.configure(transfer_timeout="abc"), InvalidArgumentError,
                                          "transfer_timeout=120.0"),
    "configure inline_threshold negative": (lambda: rdt.configure(inline_threshold=-1), InvalidArgumentError,
                                            "inline_threshold=0"),
    "configure inline_threshold float": (lambda: rdt.configure(inline_threshold=1.5), InvalidArgumentError,
                                         "inline_threshold=0"),
    "configure shm_cma not bool": (lambda: rdt.configure(shm_cma="no"), InvalidArgumentError, "shm_cma=False"),
    "configure shm_map not bool": (lambda: rdt.configure(shm_map=1), InvalidArgumentError, "shm_map=False"),
    "stats of a non-actor": (lambda: rdt.stats("actor"), InvalidArgumentError, "Cls.remote()"),
    "destroy_collective_group with a name": (lambda: rdt.destroy_collective_group("g"), InvalidArgumentError,
                                             "GroupHandle"),
    "create_collective_group with no actors": (lambda: rdt.create_collective_group([]), InvalidArgumentError,
                                               "[a, b]"),
    "create_collective_group with non-actors": (lambda: rdt.create_collective_group(["x", "y"]),
                                                InvalidArgumentError, "Cls.remote()"),
    "init_collective_group world_size=0": (lambda: rt.init_collective_group(0, 0, "gloo", "w0"),
                                           InvalidArgumentError, "world_size=2"),
    "init_collective_group empty name": (lambda: rt.init_collective_group(1, 0, "gloo", ""), InvalidArgumentError,
                                         "group_name='workers'"),
    "init_collective_group timeout as str": (lambda: rt.init_collective_group(1, 0, "gloo", "t", timeout="soon"),
                                             InvalidArgumentError, "timeout=30.0"),
}


@pytest.mark.parametrize("label", list(DRIVER_CASES))
def test_driver_side(ray_cluster, label: str) -> None:
    fn, cls, fragment = DRIVER_CASES[label]
    with pytest.raises(cls) as info:
        fn()
    check(info.value, cls, fragment)
    assert "Fix:" in str(info.value)


def _group_cases(nodes: Dict[str, Any]) -> Dict[str, Tuple[Callable[[], Any], type, str]]:
    p, c = nodes["p"], nodes["c"]
    return {
        "create_collective_group with one handle, not a list": (lambda: rdt.create_collective_group(p),
                                                                InvalidArgumentError, "create_collective_group([a, b])"),
        "create_collective_group unknown backend": (lambda: rdt.create_collective_group([p, c], backend="bogus"),
                                                    InvalidArgumentError, "use one of 'gloo'"),
        "create_collective_group negative timeout": (lambda: rdt.create_collective_group([p, c], timeout=-1),
                                                     InvalidArgumentError, "timeout=30.0"),
        "create_collective_group world_size mismatch": (
            lambda: rt.create_collective_group([p, c], world_size=3, group_name="ws"), InvalidArgumentError,
            "leave world_size=None"),
        "create_collective_group empty name": (lambda: rt.create_collective_group([p, c], group_name=""),
                                               InvalidArgumentError, "group_name='workers'"),
    }


@pytest.mark.parametrize("label", ["create_collective_group with one handle, not a list",
                                   "create_collective_group unknown backend",
                                   "create_collective_group negative timeout",
                                   "create_collective_group world_size mismatch",
                                   "create_collective_group empty name"])
def test_driver_side_group_creation(nodes, label: str) -> None:
    fn, cls, fragment = _group_cases(nodes)[label]
    with pytest.raises(cls) as info:
        fn()
    check(info.value, cls, fragment)
    assert "Fix:" in str(info.value)


def test_stats_of_dead_actor(ray_cluster) -> None:
    victim = BadNode.remote()
    ray.get(victim.pid.remote(), timeout=60)
    ray.kill(victim)
    with pytest.raises(ray.exceptions.RayActorError) as info:
        rdt.stats(victim, timeout=30)
    assert "died" in str(info.value).lower() or "dead" in str(info.value).lower()


# ---------------------------------------------------------------------------------------------- actor side
def actor_cases(name: str) -> List[Tuple[str, Any, str]]:
    """(runs in rank 0 of ``name``; the peer is idle) every call that must fail before touching the peer."""
    t = torch.ones(4)
    ro = np.ones(4, dtype=np.float32)
    ro.flags.writeable = False
    calls: Dict[str, Callable[[], Any]] = {
        "complex dtype": lambda: rt.allreduce(torch.ones(3, dtype=torch.complex64), name),
        "bool dtype": lambda: rt.send(torch.ones(3, dtype=torch.bool), 1, name),
        "not a tensor": lambda: rt.allreduce([1.0, 2.0], name),
        "reduce op as str": lambda: rt.allreduce(t, name, "sum"),
        "read-only numpy": lambda: rt.allreduce(ro, name),
        "allgather shape mismatch": lambda: rt.allgather([torch.ones(4), torch.ones(5)], t, name),
        "allgather dtype mismatch": lambda: rt.allgather([torch.ones(4), torch.ones(4, dtype=torch.int64)], t, name),
        "allgather list not a list": lambda: rt.allgather(torch.ones(4), t, name),
        "alltoall empty input": lambda: rt.alltoall([t, t], [], name),
        "unknown algorithm": lambda: rt.allreduce(t, name, algorithm="magic"),
        "per-call timeout as str": lambda: rt.allreduce(t, name, timeout="soon"),
        "per-call negative timeout": lambda: rt.barrier(name, timeout=-5),
        "gather without gather_list on dst": lambda: rt.gather(t, None, 0, name),
        "scatter without scatter_list on src": lambda: rt.scatter(t, None, 0, name),
        "rank as float": lambda: rt.send(t, 1.0, name),
        "rdt.configure in actor, bad value": lambda: rdt.configure(transfer_timeout=-1),
    }
    out = []
    for label, fn in calls.items():
        try:
            fn()
            out.append((label, None, "succeeded"))
        except Exception as e:  # noqa: BLE001 - the driver checks the type
            out.append((label, type(e), str(e)))
    out.append(("state after", None, rt.get_group(name).state.value))
    return out


ACTOR_CASES: Dict[str, Tuple[type, str]] = {
    "complex dtype": (InvalidArgumentError, "use one of torch."),
    "bool dtype": (InvalidArgumentError, "use one of torch."),
    "not a tensor": (InvalidArgumentError, "torch.as_tensor"),
    "reduce op as str": (InvalidArgumentError, "ReduceOp.SUM"),
    "read-only numpy": (InvalidArgumentError, "writeable copy"),
    "allgather shape mismatch": (InvalidArgumentError, "input's number of elements"),
    "allgather dtype mismatch": (InvalidArgumentError, "same dtype and device"),
    "allgather list not a list": (InvalidArgumentError, "list of world_size (2) tensors"),
    "alltoall empty input": (InvalidArgumentError, "list of world_size (2) tensors"),
    "unknown algorithm": (InvalidArgumentError, "choose one of auto, native"),
    "per-call timeout as str": (InvalidArgumentError, "timeout=30.0"),
    "per-call negative timeout": (InvalidArgumentError, "timeout=30.0"),
    "gather without gather_list on dst": (InvalidArgumentError, "pass world_size output tensors"),
    "scatter without scatter_list on src": (InvalidArgumentError, "pass world_size input tensors"),
    "rank as float": (InvalidArgumentError, "use a rank in 0..1"),
    "rdt.configure in actor, bad value": (InvalidArgumentError, "transfer_timeout=120.0"),
}


def _run_cases(_self: Any, name: str) -> List[Tuple[str, Any, str]]:
    return actor_cases(name)


def test_actor_side_argument_errors(nodes) -> None:
    name = nodes["group"].name
    start = time.monotonic()
    results = ray.get(nodes["p"].__ray_call__.remote(_run_cases, name), timeout=120)
    by_label = {label: (cls, msg) for label, cls, msg in results}
    assert by_label.pop("state after") == (None, "healthy")  # nothing reached the peer
    assert list(by_label) == list(ACTOR_CASES)
    for label, (cls, fragment) in ACTOR_CASES.items():
        got, msg = by_label[label]
        assert got is cls, f"{label}: expected {cls.__name__}, got {got}: {msg}"
        assert fragment in msg and "Fix:" in msg, f"{label}: {msg}"
    assert time.monotonic() - start < 110  # bounded (a call that waited for the peer would hit the ray.get limit)


def _destroyed_group_use(_self: Any) -> List[Tuple[str, Any, str]]:
    rt.init_collective_group(1, 0, "gloo", "bad-destroyed", timeout=30)
    g = rt.get_group("bad-destroyed")
    g.destroy()
    out = []
    for label, fn in (("held group object", lambda: g.allreduce(torch.ones(3))),
                      ("by name", lambda: rt.allreduce(torch.ones(3), "bad-destroyed"))):
        try:
            fn()
            out.append((label, None, "succeeded"))
        except Exception as e:  # noqa: BLE001
            out.append((label, type(e), str(e)))
    return out


def test_group_destroyed_then_used(nodes) -> None:
    (l1, c1, m1), (l2, c2, m2) = ray.get(nodes["other"].__ray_call__.remote(_destroyed_group_use), timeout=120)
    assert c1 is GroupDestroyedError and "create the group again" in m1, (c1, m1)
    assert c2 is GroupNotFoundError and "init_collective_group()" in m2, (c2, m2)


def _recv_then_abort(_self: Any, name: str) -> Tuple[Any, str, float]:
    g = rt.get_group(name)
    threading.Timer(0.5, g.abort).start()
    start = time.monotonic()
    try:
        rt.recv(torch.zeros(4), 1, name, timeout=5)
        return None, "succeeded", time.monotonic() - start
    except Exception as e:  # noqa: BLE001
        return type(e), str(e), time.monotonic() - start


def test_group_aborted_mid_use(nodes) -> None:
    p, c = nodes["p"], nodes["c"]
    handle = rt.create_collective_group([p, c], group_name="bad-abort")
    try:
        cls, msg, seconds = ray.get(p.__ray_call__.remote(_recv_then_abort, "bad-abort"), timeout=90)
        assert cls is GroupDestroyedError, (cls, msg)  # the pending call fails at once, typed
        assert "aborted" in msg and seconds < 5, (msg, seconds)
    finally:
        handle.destroy(timeout=30)


# ---------------------------------------------------------------------------------------------- object layer
@pytest.mark.parametrize("method,cls,fragment", [
    ("nccl_on_cpu", UnsupportedError, "tensor_transport='gloo'"),
    ("shm_on_meta", UnsupportedError, "moves CPU tensors only"),
    ("sparse", InvalidArgumentError, "to_dense()"),
    ("misaligned", InvalidArgumentError, ".clone()"),
    ("unpicklable", InvalidArgumentError, "picklable objects only"),
])
def test_bad_returned_value(nodes, method: str, cls: type, fragment: str) -> None:
    with pytest.raises(cls) as info:
        ray.get(getattr(nodes["p"], method).remote(), timeout=60)
    check(info.value, cls, fragment)
    assert ray.get(nodes["c"].total_direct.remote(nodes["p"].make_gloo.remote()), timeout=60) == N  # still fine


@pytest.mark.parametrize("transport,consumer", [("shm", "c"), ("gloo", "c"), ("shm", "p")])
def test_freed_ref(nodes, transport: str, consumer: str) -> None:
    refs = ray.get(nodes["p"].freed.remote(transport), timeout=60)
    with pytest.raises(ObjectFreedError) as info:
        ray.get(nodes[consumer].total.remote(refs), timeout=60)
    check(info.value, ObjectFreedError, "keep a reference to the ObjectRef")


def test_group_destroyed_before_fetch(ray_cluster) -> None:
    p, c = BadNode.remote(), BadNode.remote()
    try:
        group = rdt.create_collective_group([p, c], backend="gloo")
        ref = p.make_gloo.remote()
        ray.wait([ref], timeout=60)
        rdt.destroy_collective_group(group, timeout=30)
        with pytest.raises(NoCollectiveGroupError) as info:
            ray.get(c.total_direct.remote(ref), timeout=60)
        check(info.value, NoCollectiveGroupError, "rdt.create_collective_group([producer, consumer")
    finally:
        ray.kill(p)
        ray.kill(c)


def test_tensor_method_on_a_task(ray_cluster) -> None:
    with pytest.raises(ObjectFetchError) as info:
        ray.get(task_producer.remote(), timeout=60)
    check(info.value, ObjectFetchError, "produce objects inside actors")


def test_rdt_put_in_a_task(ray_cluster) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        ray.get(task_put.remote(), timeout=60)
    check(info.value, InvalidArgumentError, "inside an actor")


def test_plain_ray_ref_is_not_special(nodes) -> None:
    """Not an error: a plain ObjectRef where an rdt ref could be is just Ray's (rdt adds nothing)."""
    ref = ray.put({"w": torch.ones(N)})
    assert ray.get(nodes["c"].total.remote([ref]), timeout=60) == N
    assert ray.get(nodes["c"].total_direct.remote(ref), timeout=60) == N
