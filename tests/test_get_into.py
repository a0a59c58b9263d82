"""rdt.get(ref, into=...), rdt.get([...]), rdt.get_async and rdt.wait_tensor_freed on a real local Ray cluster.

Every transport receives into the caller's tensors: the returned leaves ARE the targets, the values are right,
and for the transports that land bytes in given buffers no receive buffer is taken from the pool. Every mismatch
is refused before a byte moves, naming the leaf by its path, with the targets untouched.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

import pytest
import ray
import torch

import rdt
from rdt.transports import Capabilities, Fetched, Site, Transport

from .conftest import HAS_NIXL

N = 1 << 15  # 128 KiB of float32 per tensor: above the inline threshold


# ---------------------------------------------------------------------------------------------- a gate transport
@dataclass(frozen=True)
class _GateDesc:
    data: bytes


class GateTransport(Transport):
    """Carries the bytes in the descriptor, but each fetch waits until ``expected`` fetches of this process have
    started: a list of refs fetched one after another would time out here; fetched all at once, it passes."""

    capabilities = Capabilities(name="gate", devices=frozenset({"cpu"}), one_sided=True)
    expected = 0
    started = 0
    finished = 0
    patience = 10.0  # seconds a fetch waits for the others to start
    fail_marker: Optional[bytes] = None  # a fetch whose bytes contain this fails (after passing the gate)
    ticks = 0  # advanced by an async actor's ticker coroutine (test_async_ref_arguments_...)
    ticks_needed = 0  # a fetch also waits until its process's event loop has ticked this often meanwhile
    _cv = threading.Condition()

    def export(self, ctx: Any, entry: Any, chosen: str) -> Optional[_GateDesc]:
        return _GateDesc(b"".join(b.numpy().tobytes() for b in entry.buffers))

    def fetch(self, ctx: Any, meta: Any, site: Site, deadline: float) -> Fetched:
        cls = type(self)
        with cls._cv:
            cls.started += 1
            cls._cv.notify_all()
            if not cls._cv.wait_for(lambda: cls.started >= cls.expected, timeout=cls.patience):
                raise TimeoutError(f"only {cls.started} of {cls.expected} fetches started")
            first_tick = cls.ticks
            if not cls._cv.wait_for(lambda: cls.ticks >= first_tick + cls.ticks_needed, timeout=cls.patience):
                raise TimeoutError(f"the event loop ticked {cls.ticks - first_tick} times during the fetch")
            early = cls.finished
            cls.finished += 1
        assert early == 0 or cls.started >= cls.expected
        data = meta.export("gate").data
        if cls.fail_marker is not None and cls.fail_marker in data:
            raise RuntimeError("the gate was told to fail this object")
        bufs, at = [], 0
        for b in meta.buffers:
            bufs.append(torch.frombuffer(bytearray(data[at:at + b.nbytes]), dtype=torch.uint8))
            at += b.nbytes
        return Fetched(bufs, "gate")


rdt.register_transport(GateTransport())  # in the driver, and in every worker that imports this module


def _state(fill: float) -> Dict[str, torch.Tensor]:
    return {"layer.0.weight": torch.full((N,), fill), "layer.0.bias": torch.full((64, 512), fill + 1),
            "ids": torch.arange(N, dtype=torch.int64)}


def _flat_state(fill: float) -> Dict[str, torch.Tensor]:
    return {f"model.layers.{i}.w": torch.full((4, 32 + i), fill + i) for i in range(20)}


@ray.remote
class Producer:
    def __init__(self) -> None:
        rdt.configure(inline_threshold=0)
        self.tied = torch.full((N,), 5.0)

    def ping(self) -> int:
        return 1

    def pid(self) -> int:
        import os

        return os.getpid()

    @rdt.tensor_method(tensor_transport="shm")
    def shm(self, fill: float) -> Dict[str, Any]:
        return {**_state(fill), "step": 7}

    @rdt.tensor_method(tensor_transport="gloo")
    def gloo(self, fill: float) -> Dict[str, Any]:
        return {**_state(fill), "step": 7}

    @rdt.tensor_method(tensor_transport="nixl")
    def nixl(self, fill: float) -> Dict[str, Any]:
        return {**_state(fill), "step": 7}

    @rdt.tensor_method(tensor_transport="object_store")
    def object_store(self, fill: float) -> Dict[str, Any]:
        return {**_state(fill), "step": 7}

    @rdt.tensor_method(tensor_transport="shm")
    def state_dict(self, fill: float) -> Dict[str, torch.Tensor]:
        """A state dict proper: a flat dict of 20 tensors and nothing else (flattened without a pickler walk)."""
        return _flat_state(fill)

    @rdt.tensor_method(tensor_transport="gate")
    def gate(self, fill: float) -> Dict[str, Any]:
        return {**_state(fill), "step": 7}

    @rdt.tensor_method(tensor_transport="shm")
    def tied_weights(self) -> Dict[str, Any]:
        return {"embed": self.tied, "lm_head": self.tied}  # one storage, two leaves

    @rdt.tensor_method(tensor_transport="shm")
    def kept(self) -> Dict[str, Any]:
        self.w = torch.full((N,), 3.0)
        return {"w": self.w}

    @rdt.tensor_method(tensor_transport="shm")
    def shared(self, fill: float) -> Dict[str, Any]:
        """Weights in shared memory (model.share_memory()), updated in place and returned every step."""
        if getattr(self, "shared_state", None) is None:
            self.shared_state = {k: v.share_memory_() for k, v in _state(0.0).items()}
        for k, v in _state(fill).items():
            self.shared_state[k].copy_(v)
        return {**self.shared_state, "step": 7}

    def wait_freed(self, timeout: float) -> str:
        try:
            rdt.wait_tensor_freed(self.w, timeout=timeout)
            return "freed"
        except rdt.TensorInUseError as e:
            return f"{type(e).__name__}: {e}"

    def self_into(self, refs: List[Any]) -> bool:
        target = {k: torch.zeros_like(v) for k, v in _state(0.0).items()}
        value = rdt.get(refs[0], into=target)
        return value["layer.0.weight"] is target["layer.0.weight"] and float(target["layer.0.weight"][0]) == 4.0


@ray.remote
class Consumer:
    def __init__(self) -> None:
        self.params = {k: torch.zeros_like(v) for k, v in _state(0.0).items()}

    def ping(self) -> int:
        return 1

    def load(self, refs: List[Any], fill: float, flat: bool = False) -> Dict[str, Any]:
        from rdt._process.context import get_context

        pool = get_context().buffers
        before = (pool.hits, pool.misses)
        into = list(self.params.values()) if flat else self.params
        value = rdt.get(refs[0], into=into, timeout=60)
        return {
            "same": all(value[k] is self.params[k] for k in self.params),
            "values": all(bool((value[k] == v).all()) for k, v in _state(fill).items()),
            "step": value["step"],
            "pool_takes": (pool.hits + pool.misses) - sum(before),
        }

    def configure(self, **kw: Any) -> None:
        rdt.configure(**kw)

    def load_shared(self, refs: List[Any], fill: float, into: bool) -> Dict[str, Any]:
        """Load a same-node object of shared weights; which path served it and the mappings kept afterwards."""
        from rdt._process.context import get_context
        from rdt.transports.shm.state import state as shm_state

        ctx = get_context()
        before = ctx.stats.paths_snapshot()
        value = rdt.get(refs[0], into=self.params if into else None, timeout=60)
        after = ctx.stats.paths_snapshot()
        return {"values": all(bool((value[k] == v).all()) for k, v in _state(fill).items()),
                "same": all(value[k] is self.params[k] for k in self.params),
                "paths": {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)},
                "maps": len(shm_state(ctx).maps)}

    def try_load_shared(self, refs: List[Any], fill: float) -> str:
        """load_shared, or the name of the error it raised."""
        try:
            return "ok" if self.load_shared(refs, fill, True)["values"] else "wrong values"
        except Exception as e:  # noqa: BLE001 - the test checks which
            return f"{type(e).__name__}: {e}"

    def trim_maps(self, after_s: float) -> int:
        """Unmap idle mappings as the reaper would ``after_s`` seconds from now; the count left."""
        import time

        from rdt._process.context import get_context
        from rdt.transports.shm.state import state as shm_state

        maps = shm_state(get_context()).maps
        maps.trim(now=time.monotonic() + after_s)
        return len(maps)

    def load_bad(self, refs: List[Any], case: str) -> Dict[str, Any]:
        p = {k: torch.full_like(v, -1) for k, v in _state(0.0).items()}
        into: Any = p
        if case == "shape":
            p["layer.0.bias"] = torch.full((512, 64), -1.0)
        elif case == "dtype":
            p["ids"] = torch.full((N,), -1, dtype=torch.int32)
        elif case == "contiguity":
            p["layer.0.bias"] = torch.full((512, 64), -1.0).t()
        elif case == "partial":
            del p["ids"]
        elif case == "count":
            into = list(p.values())[:2]
        elif case == "alias":  # two different leaves into one tensor's bytes: one would overwrite the other
            p["layer.0.bias"] = p["layer.0.weight"].view(64, 512)
        try:
            rdt.get(refs[0], into=into, timeout=30)
            return {"error": None}
        except Exception as e:  # noqa: BLE001
            return {"error": type(e).__name__, "msg": str(e),
                    "untouched": all(bool((t == -1).all()) for t in p.values())}

    def load_tied(self, refs: List[Any]) -> bool:
        a, b = torch.zeros(N), torch.zeros(N)
        value = rdt.get(refs[0], into={"embed": a, "lm_head": b})
        separate = value["embed"] is a and value["lm_head"] is b and bool((a == 5).all()) and bool((b == 5).all())
        one = torch.zeros(N)  # leaves tied in the producer may share one target too: the same bytes land twice
        value = rdt.get(refs[0], into={"embed": one, "lm_head": one})
        return separate and value["embed"] is one and value["lm_head"] is one and bool((one == 5).all())

    def load_many(self, refs: List[Any], n: int) -> Dict[str, Any]:
        GateTransport.expected = n
        GateTransport.started = GateTransport.finished = 0
        targets = [{k: torch.zeros_like(v) for k, v in _state(0.0).items()} for _ in range(n)]
        values = rdt.get(list(refs), into=targets, timeout=60)
        return {"ok": all(v["layer.0.weight"] is t["layer.0.weight"] and float(t["layer.0.weight"][0]) == i
                          for i, (v, t) in enumerate(zip(values, targets))), "started": GateTransport.started}

    def nixl_targets(self) -> Dict[str, int]:
        """The NIXL target registrations this process made and still holds (rdt.get(into=...) over NIXL)."""
        import gc

        from rdt._process.context import get_context
        from rdt.transports.nixl.agent import agent

        gc.collect()
        ag = agent(get_context())
        with ag.lock:  # dead storages' registrations go at the next drain (the progress thread's, within ms)
            ag.targets.drain()
        return {"made": ag.targets.made, "live": len(ag.targets)}

    def load_other(self, refs: List[Any], fill: float) -> bool:
        """rdt.get into a second set of parameters (made on first use, dropped by drop_other)."""
        if not hasattr(self, "other"):
            self.other = {k: torch.zeros_like(v) for k, v in _state(0.0).items()}
        value = rdt.get(refs[0], into=self.other, timeout=60)
        return value["layer.0.weight"] is self.other["layer.0.weight"] and float(self.other["layer.0.weight"][0]) == fill

    def drop_other(self) -> None:
        del self.other

    def arm_gate(self, n: int, patience: float) -> None:
        _arm_gate(n, patience)

    def take_args(self, a: Any, b: Any, c: Any, d: Any) -> Dict[str, Any]:
        return {"fills": [float(v["layer.0.weight"][0]) for v in (a, b, c, d)], "started": GateTransport.started}

    def take_list(self, refs: List[Any], n: int, patience: float) -> Dict[str, Any]:
        _arm_gate(n, patience)
        values = ray.get(list(refs), timeout=60)
        return {"fills": [float(v["layer.0.weight"][0]) for v in values], "started": GateTransport.started}


def _arm_gate(n: int, patience: float, fail_fill: Optional[float] = None) -> None:
    with GateTransport._cv:
        GateTransport.expected, GateTransport.patience = n, patience
        GateTransport.started = GateTransport.finished = 0
        GateTransport.fail_marker = None if fail_fill is None else torch.full((16,), fail_fill).numpy().tobytes()


@ray.remote
class AsyncConsumer:
    def __init__(self) -> None:
        self.params = {k: torch.zeros_like(v) for k, v in _state(0.0).items()}
        self.pings = 0

    async def ping(self) -> int:
        self.pings += 1
        return self.pings

    async def start_ticker(self) -> None:
        """A coroutine that keeps advancing GateTransport.ticks while this actor's event loop runs."""
        GateTransport.ticks_needed, GateTransport.patience = 5, 3.0
        GateTransport.expected = 0

        async def tick() -> None:
            while True:
                with GateTransport._cv:
                    GateTransport.ticks += 1
                    GateTransport._cv.notify_all()
                await asyncio.sleep(0.001)

        self.ticker = asyncio.ensure_future(tick())

    async def take_args(self, a: Any, b: Any) -> List[float]:
        return [float(a["layer.0.weight"][0]), float(b["layer.0.weight"][0])]

    async def same_twice(self, a: Any, *, b: Any) -> Dict[str, Any]:
        return {"fill": float(b["layer.0.weight"][0]), "same": a["layer.0.weight"] is b["layer.0.weight"],
                "step": b["step"], "started": GateTransport.started}

    def take_sync(self, a: Any) -> float:
        return float(a["layer.0.weight"][0])

    async def stream(self, a: Any) -> Any:
        for key in ("layer.0.weight", "layer.0.bias"):
            yield float(a[key].flatten()[0])

    async def arm_failure(self, fill: float) -> None:
        _arm_gate(0, 10.0, fail_fill=fill)

    async def cancel_then_load(self, stuck: List[Any], other: List[Any], numpy: bool = False) -> str:
        """Give up on a fetch of ``stuck`` into the params after 0.5 s (asyncio.wait_for cancels it), then fetch
        ``other`` into them: "ok", or the error. Shared memory is read from a segment the producer writes on
        request (no direct reads, no mappings), so a fetch from a stopped producer waits. ``numpy``: the abandoned
        fetch lands in numpy views of the params."""
        rdt.configure(shm_cma=False, shm_map=False)
        into = {k: v.numpy() for k, v in self.params.items()} if numpy else self.params
        try:
            await asyncio.wait_for(rdt.get_async(stuck[0], into=into, timeout=30.0), 0.5)
            return "the stuck fetch finished"
        except asyncio.TimeoutError:
            pass
        try:
            await rdt.get_async(other[0], into=self.params, timeout=30.0)
        except rdt.RdtError as e:
            return f"{type(e).__name__}: {e}"
        return "ok"

    async def params_now(self) -> Dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.params.items()}

    async def await_ref(self, refs: List[Any]) -> float:
        value = await refs[0]
        return float(value["layer.0.weight"][0])

    async def load(self, refs: List[Any]) -> bool:
        value = await rdt.get_async(refs[0], into=self.params)
        return value["layer.0.weight"] is self.params["layer.0.weight"]

    async def load_while_serving(self, refs: List[Any]) -> int:
        """Fetches a 64 MiB object while counting how often the loop ran a ticker meanwhile."""
        ticks = 0
        done = False

        async def ticker() -> None:
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.ensure_future(ticker())
        big = torch.zeros(16 << 20)
        await rdt.get_async(refs[0], into={"w": big})
        done = True
        await task
        return ticks if float(big[0]) == 2.0 else -1


class _Holder:
    """An async actor made with an rdt ref as its constructor argument. Its body never names rdt, so Ray loads
    the class in a fresh worker before rdt is imported there (rdt comes in with the first argument): rdt did not
    wrap its executors, and its arguments must still arrive as values (fetched on the loop, as before)."""

    def __init__(self, state: Dict[str, Any]) -> None:
        self.fill = float(state["layer.0.weight"][0])

    async def fill_of(self, extra: Any) -> List[float]:
        return [self.fill, float(extra["layer.0.weight"][0])]


class _HolderUsingRdt(_Holder):
    """The same, with a method that names rdt: loading the class imports rdt first, so its executors are rdt's."""

    async def stats(self) -> Any:
        return rdt.stats()


AsyncHolder = ray.remote(_Holder)
AsyncHolderUsingRdt = ray.remote(_HolderUsingRdt)


@ray.remote
class BigProducer:
    @rdt.tensor_method(tensor_transport="object_store")
    def big(self) -> Dict[str, Any]:
        return {"w": torch.full((16 << 20,), 2.0)}


@pytest.fixture(scope="module")
def actors(ray_cluster):
    p, c = Producer.remote(), Consumer.remote()
    ray.get([p.ping.remote(), c.ping.remote()], timeout=120)
    group = rdt.create_collective_group([p, c], backend="gloo")
    yield p, c
    rdt.destroy_collective_group(group)
    ray.kill(p)
    ray.kill(c)


TRANSPORTS = ["shm", "gloo", "object_store"] + (["nixl"] if HAS_NIXL else [])
DIRECT = {"shm", "gloo", "object_store", "nixl"}  # land the bytes in the targets: no pooled receive buffer


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("flat", [False, True], ids=["shaped", "flat"])
def test_into_every_transport_nested_ref(actors, transport: str, flat: bool) -> None:
    p, c = actors
    ref = getattr(p, transport).remote(2.0)
    out = ray.get(c.load.remote([ref], 2.0, flat), timeout=120)
    assert out["same"] and out["values"] and out["step"] == 7, out
    if transport in DIRECT:
        assert out["pool_takes"] == 0, f"{transport} took {out['pool_takes']} receive buffers from the pool"


def test_into_on_the_driver(actors) -> None:
    p, _ = actors
    params = {k: torch.zeros_like(v) for k, v in _state(0.0).items()}
    value = rdt.get(p.object_store.remote(3.0), into=params)
    assert value["layer.0.weight"] is params["layer.0.weight"] and value["step"] == 7
    assert all(bool((params[k] == v).all()) for k, v in _state(3.0).items())
    plain = rdt.get(p.shm.remote(4.0))  # no into, on the driver: the value itself
    assert float(plain["layer.0.bias"][0, 0]) == 5.0


def test_into_a_state_dict_takes_the_keys_fast_path_and_still_refuses_every_mismatch(actors, monkeypatch) -> None:
    """A flat state dict into a dict of targets (extra keys allowed): the leaves are the targets, by key, with no
    walk of the value's structure. A wrong shape, dtype or a missing key is refused naming the key, every target
    untouched."""
    import rdt._consumer.receive_into as receive_into

    p, _ = actors
    want = _flat_state(2.0)
    params = {k: torch.zeros_like(v) for k, v in reversed(list(want.items()))}  # another key order
    params["extra.buffer"] = torch.ones(3)
    with monkeypatch.context() as m:
        m.setattr(receive_into, "leaf_paths", lambda meta: pytest.fail("the structure was walked"))
        value = rdt.get(p.state_dict.remote(2.0), into=params)
    assert list(value) == list(want) and all(value[k] is params[k] for k in want)
    assert all(torch.equal(params[k], v) for k, v in want.items()) and torch.equal(params["extra.buffer"], torch.ones(3))

    def refused(bad: Dict[str, torch.Tensor], *words: str) -> None:
        before = {k: v.clone() for k, v in bad.items()}
        with pytest.raises(rdt.IntoMismatchError) as info:
            rdt.get(p.state_dict.remote(5.0), into=bad)
        assert all(w in str(info.value) for w in words), str(info.value)
        assert all(torch.equal(bad[k], before[k]) for k in bad)  # nothing moved

    wrong_shape = {k: torch.zeros_like(v) for k, v in want.items()}
    wrong_shape["model.layers.7.w"] = torch.zeros(4, 30)
    refused(wrong_shape, "['model.layers.7.w']", "(4, 39) != (4, 30)")
    wrong_dtype = {k: torch.zeros_like(v) for k, v in want.items()}
    wrong_dtype["model.layers.3.w"] = torch.zeros(4, 35, dtype=torch.float64)
    refused(wrong_dtype, "['model.layers.3.w']", "float64")
    missing = {k: torch.zeros_like(v) for k, v in want.items() if k != "model.layers.11.w"}
    refused(missing, "['model.layers.11.w']", "partial into is refused")
    shared = {k: torch.zeros_like(v) for k, v in want.items()}
    block = torch.zeros(4 * 33)
    shared["model.layers.0.w"], shared["model.layers.1.w"] = block[:128].view(4, 32), block.view(4, 33)
    refused(shared, "['model.layers.0.w']", "['model.layers.1.w']", "share bytes")


@pytest.mark.parametrize("kind", ["tensor", "numpy"])
def test_refs_fetched_into_the_same_tensors_are_refused_before_any_byte(actors, kind: str) -> None:
    """Before: rdt.get([a, b], into=[params, params]) fetched both at once into the same bytes (a mix of the two
    objects, returned as both values). Refused naming both entries, the targets untouched. numpy targets (which
    into= accepts) were not seen by the check at all."""
    p, _ = actors
    params = {k: torch.full_like(v, -1) for k, v in _state(0.0).items()}
    into = params if kind == "tensor" else {k: v.numpy() for k, v in params.items()}
    with pytest.raises(rdt.IntoMismatchError, match=r"into\[0\] and into\[1\] share bytes"):
        rdt.get([p.shm.remote(1.0), p.object_store.remote(2.0)], into=[into, into])
    assert all(bool((v == -1).all()) for v in params.values())
    other = {k: torch.zeros_like(v) for k, v in _state(0.0).items()}
    one, two = rdt.get([p.shm.remote(1.0), p.object_store.remote(2.0)], into=[params, other])
    assert one["layer.0.weight"] is params["layer.0.weight"] and float(two["layer.0.weight"][0]) == 2.0


def test_into_in_the_producer_copies(actors) -> None:
    p, _ = actors
    assert ray.get(p.self_into.remote([p.shm.remote(4.0)]), timeout=60)


@pytest.mark.parametrize("case", ["shape", "dtype", "contiguity", "partial", "count", "alias"])
def test_into_mismatch_refused_before_any_byte(actors, case: str) -> None:
    p, c = actors
    out = ray.get(c.load_bad.remote([p.shm.remote(1.0)], case), timeout=60)
    assert out["error"] == "IntoMismatchError" and out["untouched"], out
    if case in ("shape", "contiguity"):
        assert "['layer.0.bias']" in out["msg"], out["msg"]
    if case == "dtype":
        assert "['ids']" in out["msg"] and "int64" in out["msg"] and "int32" in out["msg"], out["msg"]
    if case == "alias":  # before: accepted, and both leaves came back as one tensor holding one of them
        assert "['layer.0.weight']" in out["msg"] and "['layer.0.bias']" in out["msg"], out["msg"]
    assert "Fix:" in out["msg"]


def test_shared_weights_are_copied_from_mappings_kept_across_syncs(actors) -> None:
    """A producer whose weights live in shared memory: consumers copy from mappings of its storages (path
    'shm-map'), one per storage, kept across syncs and seeing each in-place update; freed after the ttl."""
    p, c = actors
    for step in range(1, 4):
        out = ray.get(c.load_shared.remote([p.shared.remote(float(step))], float(step), True), timeout=60)
        assert out["values"] and out["same"] and out["paths"] == {"shm-map": 1}, out
        assert out["maps"] == 3, out  # the state's three storages, mapped once
    plain = ray.get(c.load_shared.remote([p.shared.remote(9.0)], 9.0, False), timeout=60)
    assert plain["values"] and not plain["same"] and plain["paths"] == {"shm-map": 1} and plain["maps"] == 3
    ray.get(c.configure.remote(shm_map=False), timeout=30)
    try:
        off = ray.get(c.load_shared.remote([p.shared.remote(4.0)], 4.0, True), timeout=60)
        assert off["values"] and off["paths"] == {"shm-direct": 1}, off
    finally:
        ray.get(c.configure.remote(shm_map=True), timeout=30)
    assert rdt.stats(c)["shm_maps"]["files"] == 3
    assert ray.get(c.trim_maps.remote(0.0), timeout=30) == 3
    assert ray.get(c.trim_maps.remote(3600.0), timeout=30) == 0  # idle beyond the ttl: unmapped
    assert rdt.stats(c)["shm_maps"] == {"files": 0, "bytes": 0}


def test_a_kept_mapping_of_a_dead_producer_never_serves(actors) -> None:
    """The consumer still maps a producer's shared storages (its mapping keeps the files alive) when the producer
    dies: a later fetch copies from the mapping, then finds the guard unreadable and raises the typed error,
    never handing out the dead producer's bytes; the reaper's trim drops the dead producer's mappings."""
    import time

    from rdt_transports._proc import pid_alive

    _, c = actors
    victim = Producer.remote()
    pid = ray.get(victim.pid.remote(), timeout=60)
    before = ray.get(c.trim_maps.remote(0.0), timeout=30)
    out = ray.get(c.load_shared.remote([victim.shared.remote(2.0)], 2.0, True), timeout=60)
    assert out["values"] and out["paths"] == {"shm-map": 1} and out["maps"] == before + 3, out
    ref = victim.shared.remote(3.0)
    ray.wait([ref], timeout=30)
    ray.kill(victim)
    deadline = time.monotonic() + 30
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid)
    got = ray.get(c.try_load_shared.remote([ref], 3.0), timeout=60)
    assert got.startswith(("ProducerDiedError", "ActorDiedError", "OwnerDiedError")), got
    assert ray.get(c.trim_maps.remote(0.0), timeout=30) == before  # the dead producer's mappings are gone


def test_tied_weights_into_separate_targets(actors) -> None:
    p, c = actors
    assert ray.get(c.load_tied.remote([p.tied_weights.remote()]), timeout=60)


def test_several_refs_start_before_any_is_waited_on(actors) -> None:
    p, c = actors
    refs = [p.gate.remote(float(i)) for i in range(4)]
    out = ray.get(c.load_many.remote(refs, 4), timeout=120)
    assert out == {"ok": True, "started": 4}, out


def test_ray_get_of_several_refs_starts_all_on_the_driver(actors) -> None:
    p, _c = actors
    refs = [p.gate.remote(float(i)) for i in range(4)]
    ray.wait(refs, num_returns=4, timeout=60)
    _arm_gate(4, 3.0)
    values = ray.get(refs, timeout=120)
    assert [float(v["layer.0.weight"][0]) for v in values] == [0.0, 1.0, 2.0, 3.0]
    assert GateTransport.started == 4


def test_ray_get_of_several_refs_one_failing_fails_alone(actors, fresh_async_consumer) -> None:
    """The failed object surfaces as its own typed error; the others were fetched (not cancelled) and still get."""
    p, _c = actors
    refs = [p.gate.remote(float(i)) for i in (0, 1, 9, 3)]
    ray.wait(refs, num_returns=4, timeout=60)
    _arm_gate(4, 3.0, fail_fill=9.0)
    try:
        with pytest.raises(rdt.ObjectFetchError) as info:
            ray.get(refs, timeout=120)
        assert "told to fail" in str(info.value)
        assert GateTransport.started == 4 and GateTransport.finished == 4
        _arm_gate(3, 3.0)
        good = ray.get([refs[0], refs[1], refs[3]], timeout=120)
        assert [float(v["layer.0.weight"][0]) for v in good] == [0.0, 1.0, 3.0]
    finally:
        _arm_gate(0, 10.0)


def test_several_ref_arguments_start_before_any_is_waited_on(actors, fresh_async_consumer) -> None:
    p, c = actors
    refs = [p.gate.remote(float(i)) for i in range(4)]
    ray.get(c.arm_gate.remote(4, 3.0), timeout=60)
    out = ray.get(c.take_args.remote(*refs), timeout=120)
    assert out == {"fills": [0.0, 1.0, 2.0, 3.0], "started": 4}, out


def test_ray_get_of_a_list_argument_starts_all_in_an_actor(actors, fresh_async_consumer) -> None:
    p, c = actors
    refs = [p.gate.remote(float(i)) for i in range(4)]
    out = ray.get(c.take_list.remote(refs, 4, 3.0), timeout=120)
    assert out == {"fills": [0.0, 1.0, 2.0, 3.0], "started": 4}, out


@pytest.mark.skipif(not HAS_NIXL, reason="NIXL is not installed")
def test_nixl_registers_into_targets_once_per_storage(actors, fresh_async_consumer) -> None:
    """Repeated rdt.get(into=params) over NIXL registers each target storage once; deleting the params drains."""
    p, c = actors
    before = ray.get(c.nixl_targets.remote(), timeout=60)
    for i in range(4):
        assert ray.get(c.load_other.remote([p.nixl.remote(float(i))], float(i)), timeout=60)
    during = ray.get(c.nixl_targets.remote(), timeout=60)
    assert during["made"] - before["made"] == 3, (before, during)  # three target storages, four fetches
    assert during["live"] - before["live"] == 3, (before, during)
    ray.get(c.drop_other.remote(), timeout=60)
    after = ray.get(c.nixl_targets.remote(), timeout=60)
    assert after == {"made": during["made"], "live": before["live"]}, (before, during, after)


def test_wait_tensor_freed(actors, fresh_async_consumer) -> None:
    p, c = actors
    ref = p.kept.remote()
    ray.get(ref)  # the object exists (driver fallback fetch)
    assert ray.get(p.wait_freed.remote(0.5), timeout=60).startswith("TensorInUseError")
    del ref
    assert ray.get(p.wait_freed.remote(30.0), timeout=60) == "freed"


@pytest.fixture
def fresh_async_consumer() -> Iterator[Any]:
    """A new AsyncConsumer actor for one test (its gate counters and ticker start from zero), killed after it."""
    a = AsyncConsumer.remote()
    yield a
    ray.kill(a)


def test_async_ref_arguments_are_fetched_off_the_event_loop(actors, fresh_async_consumer) -> None:
    """The gate passes a fetch only once the actor's event loop has ticked 5 times during it: a fetch of an
    ``async def`` method's ref arguments that ran on the loop would time out."""
    p, _c = actors
    a = fresh_async_consumer
    ray.get(a.start_ticker.remote(), timeout=60)
    refs = [p.gate.remote(1.0), p.gate.remote(2.0)]
    assert ray.get(a.take_args.remote(*refs), timeout=120) == [1.0, 2.0]


def test_async_ref_keyword_arguments_too_and_one_ref_twice_is_fetched_once(actors, fresh_async_consumer) -> None:
    p, _c = actors
    a = fresh_async_consumer
    ray.get(a.start_ticker.remote(), timeout=60)  # the gate passes only while the loop keeps ticking
    ref = p.gate.remote(4.0)
    out = ray.get(a.same_twice.remote(ref, b=ref), timeout=120)
    assert out == {"fill": 4.0, "same": True, "step": 7, "started": 1}, out


def test_async_ref_argument_whose_fetch_fails_raises_the_typed_error(actors, fresh_async_consumer) -> None:
    """The failed fetch fails that call with rdt's typed error; the actor and its loop keep serving."""
    p, _c = actors
    a = fresh_async_consumer
    ray.get(a.arm_failure.remote(9.0), timeout=60)
    with pytest.raises(rdt.ObjectFetchError) as info:
        ray.get(a.take_args.remote(p.gate.remote(9.0), p.gate.remote(1.0)), timeout=120)
    assert "told to fail" in str(info.value)
    assert ray.get(a.take_args.remote(p.gate.remote(2.0), p.gate.remote(3.0)), timeout=120) == [2.0, 3.0]
    assert ray.get(a.ping.remote(), timeout=60) == 1


def test_sync_and_streaming_methods_of_an_async_actor_get_their_ref_arguments(actors, fresh_async_consumer) -> None:
    p, _c = actors
    a = fresh_async_consumer
    assert ray.get(a.take_sync.remote(p.gate.remote(5.0)), timeout=120) == 5.0
    gen = a.stream.options(num_returns="streaming").remote(p.gate.remote(5.0))
    assert [ray.get(r, timeout=120) for r in gen] == [5.0, 6.0]


@pytest.mark.parametrize("holder", ["loaded before rdt", "loaded after rdt"])
def test_async_actor_constructed_with_a_ref_argument(actors, holder: str) -> None:
    p, _c = actors
    cls = AsyncHolder if holder == "loaded before rdt" else AsyncHolderUsingRdt
    h = cls.remote(p.gate.remote(6.0))
    try:
        assert ray.get(h.fill_of.remote(p.gate.remote(7.0)), timeout=120) == [6.0, 7.0]
    finally:
        ray.kill(h)


def test_await_ref_in_an_async_actor_fetches_off_the_event_loop(actors, fresh_async_consumer) -> None:
    """``await ref`` on an rdt ref: Ray deserializes the value off the event loop (the ticker keeps running)."""
    p, _c = actors
    a = fresh_async_consumer
    ray.get(a.start_ticker.remote(), timeout=60)
    assert ray.get(a.await_ref.remote([p.gate.remote(3.0)]), timeout=120) == 3.0


def test_async_consumer_keeps_its_loop_serving(ray_cluster) -> None:
    a, big = AsyncConsumer.remote(), BigProducer.remote()
    try:
        ray.get(a.ping.remote(), timeout=60)
        ticks = ray.get(a.load_while_serving.remote([big.big.remote()]), timeout=120)
        assert ticks > 5, f"the event loop ran {ticks} times during a 64 MiB receive"
    finally:
        ray.kill(a)
        ray.kill(big)


@pytest.mark.parametrize("numpy", [False, True])
def test_a_cancelled_get_async_keeps_its_targets_busy_until_its_fetch_ends(actors, fresh_async_consumer,
                                                                            numpy: bool) -> None:
    """Before: cancelling the task awaiting rdt.get_async(into=) left its fetch running unmarked, so a later fetch
    into the same tensors landed at once and the abandoned one overwrote it when its producer went on (the targets
    held the older object's bytes). The later fetch now waits until the abandoned one ended, then lands. numpy
    targets were not marked at all."""
    import os
    import signal

    from ._stop import freeze

    p, _ = actors
    other = Producer.remote()
    try:
        stuck, fresh = p.shm.remote(1.0), other.shm.remote(2.0)
        assert len(ray.wait([stuck, fresh], num_returns=2, timeout=120)[0]) == 2
        pid = ray.get(p.pid.remote(), timeout=60)
        freeze(pid)  # the fetch from it waits for its segment while it is stopped
        try:
            call = fresh_async_consumer.cancel_then_load.remote([stuck], [fresh], numpy)
            time.sleep(3.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert ray.get(call, timeout=120) == "ok"
        time.sleep(1.0)  # had the abandoned fetch not been waited for, it would land by now
        got = ray.get(fresh_async_consumer.params_now.remote(), timeout=60)
        assert all(torch.equal(got[k], v) for k, v in _state(2.0).items()), {k: float(v.flatten()[-1])
                                                                              for k, v in got.items()}
    finally:
        ray.kill(other)
