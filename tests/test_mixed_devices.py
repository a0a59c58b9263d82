"""Values that mix CPU and GPU tensors: each buffer keeps its own device, 'auto' never picks a path that cannot
carry every buffer, and transports that cannot carry them all refuse at return time. CPU CI has no CUDA: the
device logic is checked with device strings, and torch's "meta" device stands in for this process's GPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray
import torch

from rdt import _context, _cuda_ipc, _fetch
from rdt._flatten import BufferSpec
from rdt._meta import GroupRef, ObjectMeta, ProducerInfo
from rdt.errors import UnsupportedError

MIXED = ("cuda:0", "cpu")


def _meta(devices=MIXED, *, transport: str = "auto", nixl: bool = False, groups=(), store_ref=None,
          node: str = "node-A") -> ObjectMeta:
    producer = ProducerInfo(b"p" * 8, 1234, node, "127.0.0.1:1", b"k" * 32, None, "a" * 32, nixl)
    return ObjectMeta(b"\x02" * 16, transport, producer, b"", (), tuple(BufferSpec(64, d) for d in devices),
                      tuple(groups), None, store_ref=store_ref)


def test_each_buffer_keeps_its_own_device_pure() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert _fetch.buffer_devices(["cuda:0", "cpu"], gpu) == [gpu, cpu]
    assert _fetch.buffer_devices(["cuda:1", "cpu", "cuda:0"], None) == [cpu, cpu, cpu]  # no GPU here
    assert _fetch.buffer_devices(["cpu"], gpu) == [cpu]
    assert _fetch.buffer_devices([], gpu) == []


def test_mixed_object_store_value_keeps_each_buffers_device(ray_cluster, monkeypatch) -> None:
    """The real object-store path: the "cuda:0" buffer goes to this process's GPU (here: torch's meta device),
    the "cpu" buffer stays on the CPU."""
    monkeypatch.setattr(_cuda_ipc, "target_device", lambda: torch.device("meta"))
    store_ref = ray.put([torch.ones(64, dtype=torch.uint8), torch.full((64,), 7, dtype=torch.uint8)])
    meta = _meta(transport="object_store", store_ref=store_ref)
    bufs, path = _fetch.fetch_buffers(_context.get_context(), meta)
    assert path == "object_store"
    assert [b.device.type for b in bufs] == ["meta", "cpu"]
    assert int(bufs[1].sum()) == 7 * 64


def test_auto_never_picks_a_path_that_cannot_carry_every_buffer(monkeypatch) -> None:
    monkeypatch.setattr(_fetch, "_node_id", lambda: "node-A")
    monkeypatch.setattr(_cuda_ipc, "visible_devices", lambda: {"GPU-0000": 0})
    ref = GroupRef("u" * 32, "g", "gloo", 0)
    monkeypatch.setattr(_fetch, "_common_group", lambda meta, backends: (object(), ref) if "gloo" in backends
                        else None)
    monkeypatch.setattr(_fetch._nixl_objects, "available", lambda: True)
    assert _fetch.choose_path(_meta(groups=[ref], nixl=True)) == "object_store"
    assert _fetch.choose_path(_meta(("cpu", "cpu"), groups=[ref])) == "shm"  # all-CPU unchanged
    monkeypatch.setattr(_fetch, "_node_id", lambda: "node-B")
    assert _fetch.choose_path(_meta(("cpu", "cpu"), groups=[ref])) == "gloo"


@pytest.mark.parametrize("transport", ["gloo", "shm", "nccl", "cuda_ipc"])
def test_transports_that_cannot_carry_a_mixed_value_refuse_at_return(transport: str) -> None:
    """Return-time check on real tensors: torch's "meta" device stands in for a GPU (not "cpu")."""
    with pytest.raises(UnsupportedError, match="meta"):
        _context._check_transport_devices(_mixed_flat(), transport)
    _context._check_transport_devices(_mixed_flat(), "auto")  # served per buffer through the control server
    _context._check_transport_devices(_mixed_flat(), "object_store")


def test_nixl_refuses_a_mixed_value_at_return() -> None:
    with pytest.raises(UnsupportedError, match="one memory type"):
        _context._check_transport_devices(_mixed_flat(), "nixl")


def _mixed_flat() -> SimpleNamespace:
    return SimpleNamespace(buffers=[torch.empty(8, dtype=torch.uint8, device="meta"),
                                    torch.empty(8, dtype=torch.uint8)])
