"""Per-process state stays bounded over a long job: 10 000 steps of each component, driven directly (10 000 Ray
round trips would not fit the suite's time)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import weakref

import pytest
import torch

from rdt.transports.shm import cma as _cma
from rdt.transports.nixl import export as nixl_export, read as nixl_read
from rdt._objects.flatten import flatten
from rdt._objects.table import Entry, ObjectTable

from ._bare_context import BareContext
from .conftest import HAS_NIXL

STEPS = 10_000
NIXL_STEPS = 3_000  # real NIXL fetches (~2 ms each)


# ------------------------------------------------------------------------------------------------ weak table
def test_inline_returns_of_one_long_lived_tensor_keep_the_weak_table_bounded() -> None:
    table = ObjectTable(lambda _e: None)
    weights = torch.arange(64, dtype=torch.float32)  # lives for the whole job, returned inline at every step
    ids = []
    for _ in range(STEPS):
        obj_id = secrets.token_bytes(16)
        table.add_weak(obj_id, flatten(weights).leaves)
        ids.append(obj_id)
    assert weakref.getweakrefcount(weights) <= 2, "one weak reference per return"
    assert table.weak_count() <= 4096
    # The newest refs still map back to the very same tensor; only the oldest lost their identity.
    got = table.get_weak(ids[-1])
    assert got is not None and got[0] is weights
    del weights, got
    assert table.weak_count() == 0


def test_weak_table_is_bounded_for_many_distinct_live_tensors() -> None:
    table = ObjectTable(lambda _e: None)
    keep = [torch.zeros(1) for _ in range(STEPS)]
    for t in keep:
        table.add_weak(secrets.token_bytes(16), [t])
    assert table.weak_count() <= 4096
    del keep, t
    assert table.weak_count() == 0


# ------------------------------------------------------------------------------------------------ cma
def test_cma_denied_pids_stay_bounded() -> None:
    reader = _cma.CmaReader()
    for pid in range(1_000_000, 1_000_000 + STEPS):  # what read() records for each producer the kernel refuses
        reader._denied.add(pid)
    assert len(reader._denied) <= 1024


_FORGET = r"""
import os, signal, sys, time
from rdt.transports.shm import cma as _cma
target = int(sys.argv[1])
os.setgid(65534); os.setuid(65534)  # another user than the target, without CAP_SYS_PTRACE
r = _cma.CmaReader()
try:
    r.read(target, _cma.CmaInfo(4096, ((4096, 16),)), [4096], bytes(16))
    print("read")
except _cma.CmaDenied:
    pass
print("denied", r.denied(target), flush=True)
sys.stdin.readline()  # the parent kills the target, then says go
print("after", r.denied(target), flush=True)
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a reader as another user")
def test_cma_forgets_a_denied_pid_once_that_process_died() -> None:
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    reader = subprocess.Popen([sys.executable, "-c", _FORGET, str(target.pid)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline().strip() == "denied True"
        target.send_signal(signal.SIGKILL)
        target.wait(timeout=10)
        reader.stdin.write("go\n")
        reader.stdin.flush()
        assert reader.stdout.readline().strip() == "after False"  # a reused pid must not inherit the denial
    finally:
        for p in (target, reader):
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


# ------------------------------------------------------------------------------------------------ NIXL
def _nixl_ctx() -> BareContext:
    """The parts of an RdtContext the NIXL object path uses: its agent slot, identity and receive pool."""
    return BareContext()


@pytest.mark.skipif(not HAS_NIXL, reason="nixl not installed")
def test_nixl_consumer_keeps_bounded_remote_metadata_over_3000_fetches() -> None:
    """3 000 fetches of distinct objects pass the agent's reset (every MAX_LOADS_PER_REMOTE = 256 loads) 11 times;
    unbounded metadata would hold all 3 000, three times the bound checked (10 000 fetches took 22 s of CI)."""
    producer, consumer = _nixl_ctx(), _nixl_ctx()
    try:
        # One distinct region per object, each its own storage (the producer registers whole storages), all kept
        # alive so that no two objects' addresses coincide.
        arena = torch.arange(NIXL_STEPS * 16, dtype=torch.int32).to(torch.uint8)
        regions = [arena[i * 16:(i + 1) * 16].clone() for i in range(NIXL_STEPS)]
        descs = []
        for i in range(NIXL_STEPS):
            region = regions[i]
            entry = Entry(secrets.token_bytes(16), flatten(region), "nixl")
            info = nixl_export.register(producer, entry)
            descs.append(info.descs)
            got = nixl_read.read_object(consumer, info, torch.device("cpu"), timeout=10.0)
            assert torch.equal(got[0], region)
            nixl_export.release(producer, entry)
        ag, name = consumer.nixl, producer.nixl.name
        with ag.lock:
            loaded = sum(ag.agent.check_remote_metadata(name, ag.agent.get_xfer_descs(list(d), "DRAM")) for d in descs)
        assert loaded <= 1024, f"{loaded} freed objects' remote metadata still loaded after {NIXL_STEPS} fetches"
        assert 1 <= ag.remote_loads(name) <= ag.MAX_LOADS_PER_REMOTE
        # The agent still READs after its many resets (the newest object's registration is loaded and used).
        assert loaded >= 1
    finally:
        for ctx in (producer, consumer):  # progress threads must end before the interpreter finalizes
            if ctx.nixl is not None:
                assert ctx.nixl.stop()
