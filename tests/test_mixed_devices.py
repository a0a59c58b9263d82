"""Values that mix CPU and GPU tensors: each buffer keeps its own device, 'auto' never picks a path that cannot
carry every buffer, and transports that cannot carry them all refuse at return time. CPU CI has no CUDA: the
device logic is checked with device strings, and torch's "meta" device stands in for this process's GPU.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import ray
import torch

from rdt._consumer import resolve as _consumer
from rdt._process import context as _context
from rdt.transports.cuda_ipc import shares as _cuda_ipc
from rdt.transports.nixl import agent as nixl_agent
from rdt._producer import produce as _producer
from rdt import transports
from rdt._objects.specs import BufferSpec, BufferTable
from rdt._objects.meta import GroupRef, ObjectMeta, ProducerInfo
from rdt.errors import UnsupportedError
from rdt.transports import Site
from rdt.transports.object_store import ObjectStoreTransport, buffer_devices

MIXED = ("cuda:0", "cpu")


def _meta(devices=MIXED, *, transport: str = "auto", nixl: bool = False, groups=(), store_ref=None,
          node: str = "node-A") -> ObjectMeta:
    producer = ProducerInfo(b"p" * 8, 1234, node, "127.0.0.1:1", b"k" * 32, None, "a" * 32,
                            frozenset() if nixl else frozenset({"nixl"}))
    exports = (("object_store", store_ref),) if store_ref is not None else ()
    return ObjectMeta(b"\x02" * 16, transport, producer, b"", (), tuple(BufferSpec(64, d) for d in devices),
                      tuple(groups), None, exports)


def _site(*, same_node: bool = True, groups=None, cuda=None) -> Site:
    return Site(same_node=same_node, in_actor=True, task_argument=True, groups=groups or {}, cuda_device=cuda)


def test_each_buffer_keeps_its_own_device_pure() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert buffer_devices(["cuda:0", "cpu"], gpu) == [gpu, cpu]
    assert buffer_devices(["cuda:1", "cpu", "cuda:0"], None) == [cpu, cpu, cpu]  # no GPU here
    assert buffer_devices(["cpu"], gpu) == [cpu]
    assert buffer_devices([], gpu) == []


def test_mixed_object_store_value_keeps_each_buffers_device(ray_cluster, monkeypatch) -> None:
    """The real object-store path: the "cuda:0" buffer goes to this process's GPU (here: torch's meta device),
    the "cpu" buffer stays on the CPU."""
    store_ref = ray.put([torch.ones(64, dtype=torch.uint8), torch.full((64,), 7, dtype=torch.uint8)])
    meta = _meta(transport="object_store", store_ref=store_ref)
    fetched = ObjectStoreTransport().fetch(_context.get_context(), meta, _site(cuda=torch.device("meta")),
                                           time.monotonic() + 30)
    assert fetched.label == "object_store"
    assert [b.device.type for b in fetched.buffers] == ["meta", "cpu"]
    assert int(fetched.buffers[1].sum()) == 7 * 64


def test_auto_never_picks_a_path_that_cannot_carry_every_buffer(monkeypatch) -> None:
    monkeypatch.setattr(_cuda_ipc, "visible_devices", lambda: {"GPU-0000": 0})
    monkeypatch.setattr(nixl_agent, "available", lambda: True)
    ref = GroupRef("u" * 32, "g", "gloo", 0)
    groups = {"gloo": (object(), ref)}
    assert _consumer.choose(_meta(groups=[ref], nixl=True), _site(groups=groups)) == "object_store"
    assert _consumer.choose(_meta(("cpu", "cpu"), groups=[ref]), _site(groups=groups)) == "shm"  # all-CPU unchanged
    assert _consumer.choose(_meta(("cpu", "cpu"), groups=[ref]), _site(same_node=False, groups=groups)) == "gloo"


@pytest.mark.parametrize("transport", ["gloo", "shm", "nccl", "cuda_ipc", "nixl"])
def test_transports_that_cannot_carry_a_mixed_value_refuse_at_return(transport: str) -> None:
    """Return-time check on a CPU buffer and a (described) CUDA buffer: no GPU is needed to check devices."""
    with pytest.raises(UnsupportedError, match="cuda"):
        _producer.check_devices(_mixed_flat(), transports.get(transport).capabilities)
    _producer.check_devices(_mixed_flat(), transports.get("object_store").capabilities)  # per buffer


def test_nixl_refuses_a_mixed_value_at_return() -> None:
    with pytest.raises(UnsupportedError, match="one device type per object"):
        _producer.check_devices(_mixed_flat(), transports.get("nixl").capabilities)


def _mixed_flat() -> SimpleNamespace:
    """A flattened value with one CUDA and one CPU buffer, as the producer sees it at return."""
    return SimpleNamespace(table=BufferTable([64, 64], ["cuda:0", "cpu"]))
