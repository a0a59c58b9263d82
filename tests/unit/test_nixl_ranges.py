"""NIXL range reads for DRAM and VRAM: the descriptor lists (one per memory type of the producer's buffers, each
range at the same position locally and remotely, with its device ids) as NIXL's own builder takes them (VRAM lists
are built without a GPU), and a real DRAM READ of ranges between two agents in this process."""

from __future__ import annotations

import secrets

import numpy as np
import pytest
import torch

from rdt._objects.flatten import flatten
from rdt._objects.table import Entry
from rdt.transports import Ranges
from rdt.transports.nixl import export as nixl_export
from rdt.transports.nixl.descriptors import NixlInfo
from rdt.transports.nixl.ranges import descriptor_lists, local_memory, read_ranges

from .._bare_context import BareContext
from ..conftest import HAS_NIXL

INFO = NixlInfo("producer", b"md", "VRAM", ((0x10000, 4096, 0), (0x90000, 512, 0), (0x200000, 8192, 1)),
                ("VRAM", "DRAM", "VRAM"), (b"md-dram",))
RANGES = Ranges(np.array([0, 1, 2, 0]), np.array([16, 0, 100, 2048]),
                np.array([0x7000, 0x7100, 0x7200, 0x8000], np.uint64), np.array([64, 32, 128, 1024]))


def test_vram_and_dram_ranges_are_one_descriptor_list_per_remote_memory_type():
    assert local_memory(torch.device("cuda", 3)) == ("VRAM", 3) and local_memory(torch.device("cpu")) == ("DRAM", 0)
    lists = descriptor_lists(INFO, RANGES, "VRAM", 3)
    assert lists == [
        ([(0x7000, 64, 3), (0x7200, 128, 3), (0x8000, 1024, 3)],
         [(0x10000 + 16, 64, 0), (0x200000 + 100, 128, 1), (0x10000 + 2048, 1024, 0)], "VRAM", "VRAM"),
        ([(0x7100, 32, 3)], [(0x90000, 32, 0)], "VRAM", "DRAM"),
    ]
    assert descriptor_lists(INFO, Ranges(np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0)), "DRAM", 0) == []


@pytest.mark.skipif(not HAS_NIXL, reason="nixl not installed")
def test_nixl_builds_the_lists_and_reads_dram_ranges():
    from rdt.transports.nixl.agent import agent

    producer, consumer = BareContext(), BareContext()
    try:
        ag = agent(consumer)
        for local, remote, lt, rt in descriptor_lists(INFO, RANGES, "VRAM", 0):
            built = [ag.agent.get_xfer_descs(local, lt), ag.agent.get_xfer_descs(remote, rt)]
            assert [d.descCount() for d in built] == [len(local), len(remote)]
        value = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.arange(100, dtype=torch.int64)}
        flat = flatten(value)
        entry = Entry(secrets.token_bytes(16), flat, "nixl")
        info = nixl_export.register(producer, entry)
        targets = [torch.zeros(64, dtype=torch.float32), torch.zeros(10, dtype=torch.int64)]
        # rows 3..4 of w as a 64-wide matrix' column 8..40, and b[90:100]
        off = np.array([(3 * 64 + 8) * 4, (4 * 64 + 8) * 4, 90 * 8])
        n = np.array([32 * 4, 32 * 4, 80])
        dst = np.array([targets[0].data_ptr(), targets[0].data_ptr() + 128, targets[1].data_ptr()], np.uint64)
        buf = np.array([0, 0, 1]) if flat.table.sizes[0] == 4096 * 4 else np.array([1, 1, 0])
        assert read_ranges(consumer, info, Ranges(buf, off, dst, n, targets), 30.0) == "nixl"
        w = value["w"].view(64, 64)
        assert torch.equal(targets[0], torch.cat([w[3, 8:40], w[4, 8:40]]))
        assert torch.equal(targets[1], value["b"][90:])
        nixl_export.release(producer, entry)
    finally:
        for ctx in (producer, consumer):
            if ctx.nixl is not None:
                assert ctx.nixl.stop()
