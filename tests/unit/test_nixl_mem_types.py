"""NIXL memory types per buffer: an object mixing CPU and CUDA tensors is registered and described per buffer
(NIXL takes one memory type per registration and per descriptor list, so buffers are grouped by type)."""

from __future__ import annotations

import secrets

import pytest
import torch

from rdt.transports.nixl import descriptors as nixl_descriptors, export as nixl_export, read as nixl_read
from rdt._objects.flatten import flatten
from rdt._objects.table import Entry

from .._bare_context import BareContext
from ..conftest import HAS_NIXL


def test_buffers_are_grouped_by_memory_type_in_order() -> None:
    group = nixl_descriptors.group_by_mem_type
    assert group(["VRAM", "DRAM", "VRAM", "DRAM", "DRAM"]) == [("VRAM", [0, 2]), ("DRAM", [1, 3, 4])]
    assert group(["DRAM"] * 3) == [("DRAM", [0, 1, 2])]
    assert group([]) == []
    assert group([("DRAM", "VRAM"), ("DRAM", "DRAM"), ("DRAM", "VRAM")]) == [
        (("DRAM", "VRAM"), [0, 2]), (("DRAM", "DRAM"), [1])]


def test_each_buffer_gets_its_own_memory_type() -> None:
    cpu = torch.ones(4, dtype=torch.uint8)
    assert nixl_descriptors.mem_type_of(cpu) == "DRAM"
    assert [nixl_descriptors.mem_type_of(t) for t in (cpu, torch.empty(2, device="meta"))] == ["DRAM", "DRAM"]


def test_mixed_info_round_trips_with_per_buffer_types() -> None:
    info = nixl_descriptors.NixlInfo("agent", b"md-vram", "VRAM", ((1, 2, 0), (3, 4, 0), (5, 6, 1)),
                                  ("VRAM", "DRAM", "VRAM"), (b"md-dram",))
    back = nixl_descriptors.decode_info(nixl_descriptors.encode_info(info))
    assert back == info and back.mem_types == ("VRAM", "DRAM", "VRAM") and back.extra_md == (b"md-dram",)
    uniform = nixl_descriptors.NixlInfo("a", b"m", "DRAM", ((1, 2, 0), (3, 4, 0)))
    assert uniform.mem_types == ("DRAM", "DRAM")  # one type given: every buffer has it


@pytest.mark.skipif(not HAS_NIXL, reason="nixl not installed")
@pytest.mark.parametrize("cuda", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_read_of_an_object_keeps_each_buffer_on_its_device(cuda: bool) -> None:
    if cuda and not torch.cuda.is_available():
        pytest.skip("needs CUDA for the VRAM half")  # the DRAM-only case always runs
    ctxs = [BareContext() for _ in range(2)]
    producer, consumer = ctxs
    try:
        value = {"w": torch.arange(1000, dtype=torch.float32, device="cuda" if cuda else "cpu"),
                 "step": torch.tensor([7], dtype=torch.int64)}
        flat = flatten(value)
        entry = Entry(secrets.token_bytes(16), flat, "nixl")
        info = nixl_export.register(producer, entry)
        want = [nixl_descriptors.mem_type_of(b) for b in flat.buffers]
        assert list(info.mem_types) == want
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        got = nixl_read.read_object(consumer, info, device, timeout=30.0)
        assert [nixl_descriptors.mem_type_of(g) for g in got] == want
        for g, b in zip(got, flat.buffers):
            assert torch.equal(g.cpu(), b.cpu())
        nixl_export.release(producer, entry)
    finally:
        for ctx in ctxs:
            if ctx.nixl is not None:
                assert ctx.nixl.stop()
