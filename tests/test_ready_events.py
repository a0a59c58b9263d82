"""Producer-side stream discipline (rdt/_ready.py), proven on CPU through every export and serve path.

In production a returned GPU tensor's kernels may still be queued on the stream current at return; rdt records one
event per device then, and every path that reads the bytes waits on it first. Here the producer's discipline treats
CPU buffers as if they lived on such a device, and its "event" is a deferred write: the value a method queued lands
only when the event recorded after it is waited on (as a kernel completes when its event is synchronised). A path
that read the bytes without waiting would hand out zeros, so each assertion below fails if its path skips the wait.
The device calls themselves (torch.cuda.Event) run only on a GPU (tests/test_gpu.py).
"""

from __future__ import annotations

from typing import Any, List, Tuple

import pytest
import ray
import torch

import rdt
from rdt._objects import stream_ready as _ready

from .conftest import HAS_NIXL

N = 1 << 16  # 256 KiB of float32: out of band (above the inline threshold)


class _DeferredWrites:
    """A CPU stand-in for a device's stream: writes queued by a method land when an event recorded after them is
    synchronised."""

    def __init__(self) -> None:
        self.queued: List[Tuple[torch.Tensor, float]] = []
        self.recorded = 0
        self.synchronised = 0

    def event(self, _device: torch.device) -> "_Event":
        self.recorded += 1
        pending, self.queued = self.queued, []
        return _Event(self, pending)


class _Event:
    def __init__(self, owner: _DeferredWrites, pending: List[Tuple[torch.Tensor, float]]) -> None:
        self.owner = owner
        self.pending = pending

    def synchronize(self) -> None:
        for t, v in self.pending:
            t.fill_(v)
        self.pending = []
        self.owner.synchronised += 1


def _maker(transport: str):
    @rdt.tensor_method(tensor_transport=transport)
    def make(self, fill: float, numel: int = N) -> Any:
        t = torch.zeros(numel)
        self.writes.queued.append((t, fill))  # "a kernel still running at return"
        return {"w": t}

    return make


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self) -> None:
        from rdt._process.context import get_context

        self.writes = _DeferredWrites()
        get_context().stream_discipline = _ready.Discipline(frozenset({"cpu"}), self.writes.event)

    make_gloo = _maker("gloo")
    make_shm = _maker("shm")
    make_nixl = _maker("nixl")
    make_store = _maker("object_store")
    make_auto = _maker("auto")

    def counts(self) -> dict:
        from rdt._process.context import get_context

        entries = get_context().table.entries()
        return {"recorded": self.writes.recorded, "synchronised": self.writes.synchronised,
                "held": len(entries), "unwaited": sum(1 for e in entries if e.ready is None or not e.ready.waits)}


@ray.remote(num_cpus=0)
class Consumer:
    def total(self, x: Any) -> float:
        return float(x["w"].sum().item())


@pytest.fixture(scope="module")
def pair(ray_cluster):
    a, b = Producer.remote(), Consumer.remote()
    group = rdt.create_collective_group([a, b], backend="gloo")
    yield a, b
    rdt.destroy_collective_group(group)
    ray.kill(a)
    ray.kill(b)


CASES = ["make_gloo", "make_shm", "make_store", "make_auto"] + (["make_nixl"] if HAS_NIXL else [])


@pytest.mark.parametrize("method", CASES)
def test_a_consumer_actor_gets_the_bytes_written_after_return(pair, method):
    a, b = pair
    ref = getattr(a, method).remote(2.0)
    assert ray.get(b.total.remote(ref), timeout=60) == 2.0 * N


@pytest.mark.parametrize("method", ["make_gloo", "make_nixl", "make_store"])
def test_the_driver_gets_the_bytes_written_after_return(pair, method):
    """ray.get on the driver: the producer streams the bytes (or ray.put them at return) after waiting."""
    if method == "make_nixl" and not HAS_NIXL:
        pytest.skip("nixl not installed")
    a, _ = pair
    ref = getattr(a, method).remote(3.0)
    assert float(ray.get(ref, timeout=60)["w"].sum()) == 3.0 * N


def test_small_objects_inlined_at_return_wait_too(pair):
    a, b = pair
    ref = a.make_gloo.remote(5.0, numel=16)  # inline: the bytes travel in the metadata
    assert ray.get(b.total.remote(ref), timeout=60) == 5.0 * 16


def test_one_event_per_object_and_every_held_object_was_waited_on(pair):
    a, b = pair
    before = ray.get(a.counts.remote(), timeout=30)
    refs = [a.make_gloo.remote(1.0) for _ in range(5)]
    assert [ray.get(b.total.remote(r), timeout=60) for r in refs] == [1.0 * N] * 5
    after = ray.get(a.counts.remote(), timeout=30)
    assert after["recorded"] - before["recorded"] == 5  # once per object, however often it is served
    for r in refs:
        ray.get(b.total.remote(r), timeout=60)  # served again: nothing recorded again
    assert ray.get(a.counts.remote(), timeout=30)["recorded"] == after["recorded"]
    assert after["held"] >= 5 and after["unwaited"] == 0


def test_cpu_objects_record_nothing_in_production():
    """The production discipline records events only for CUDA buffers: a CPU object costs no device call."""
    assert _ready.record(_ready.Discipline(), [torch.zeros(4, dtype=torch.uint8)]) is None
    seen: List[torch.device] = []
    ready = _ready.record(_ready.Discipline(frozenset({"cpu"}), lambda d: seen.append(d) or _Event(
        _DeferredWrites(), [])), [torch.zeros(4), torch.zeros(8)])
    assert ready is not None and seen == [torch.device("cpu")]  # one event per device, not per buffer
