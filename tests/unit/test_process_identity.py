"""Liveness by (pid, start time), not by pid alone: a pid the kernel gave to a later process must not hide a
peer's death. Real processes: this one (a wrong start time stands for "the pid now names another process"), and
children that are killed (zombie, then reaped). Each watcher of a peer is checked with both."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Iterator, List

import pytest
import torch

from rdt.transports.shm import cma as _cma, shared_maps as _shm_map
from rdt_transports._proc import identity, process_alive, start_time

ME = os.getpid()
MINE = start_time(ME)
assert MINE is not None
OTHER_START = MINE + 1  # (ME, OTHER_START): the pid as if it named a later process


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except FileNotFoundError:
        return "gone"


@pytest.fixture
def child() -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def _kill_unreaped(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and wait until it is a zombie (dead, not reaped yet)."""
    proc.kill()
    deadline = time.monotonic() + 10
    while _state(proc.pid) != "Z":
        assert time.monotonic() < deadline, "the child did not die"
        time.sleep(0.01)


def test_an_identity_with_another_start_time_is_dead() -> None:
    assert identity() == (ME, MINE) and process_alive(ME, MINE)
    assert not process_alive(ME, OTHER_START)
    assert process_alive(ME, None)  # recorded without a start time: by pid alone


def test_a_real_dead_process_is_dead_as_a_zombie_and_once_reaped(child) -> None:
    who = identity(child.pid)
    assert who[1] is not None and process_alive(*who)
    _kill_unreaped(child)
    assert not process_alive(*who)
    child.wait(timeout=10)
    assert not process_alive(*who) and identity(child.pid)[1] is None


def _meta(pid: int, started: int):
    from rdt._objects.meta import ObjectMeta, ProducerInfo
    from rdt._ray.runtime import node_id

    producer = ProducerInfo(b"\0" * 8, pid, node_id(), "127.0.0.1:1", b"k" * 32, None, "", frozenset(), started=started)
    return ObjectMeta(obj_id=b"\1" * 16, transport="shm", producer=producer, skeleton=b"", specs=(), buffers=(),
                      groups=(), token=None)


def test_probe_names_a_producer_dead_when_its_pid_names_another_process(child) -> None:
    from rdt._control.peer import probe

    state, why = probe(None, _meta(ME, OTHER_START))
    assert state == "dead" and f"pid {ME}" in why
    who = identity(child.pid)
    assert who[1] is not None
    child.kill()
    child.wait(timeout=10)
    assert probe(None, _meta(*who))[0] == "dead"


def test_a_cma_denial_is_forgotten_once_its_process_is_gone(child) -> None:
    reader = _cma.CmaReader(1)
    reader._denied.add(ME, OTHER_START)  # what read() records when the process at ME refused us
    assert not reader.denied(ME, MINE)  # the pid now names another process: it is tried afresh
    who = identity(child.pid)
    reader._denied.add(*who)
    assert reader.denied(*who)
    _kill_unreaped(child)
    assert not reader.denied(*who)


@pytest.mark.skipif(not _cma.supported(), reason="no process_vm_readv in this libc")
def test_a_shared_storage_of_a_process_by_a_reused_pid_is_not_mapped() -> None:
    reader = _shm_map.MapReader(_cma.CmaReader(1).spread, 30.0, max_bytes=8 << 30)
    shared = torch.arange(4096, dtype=torch.float32).share_memory_()
    info = _shm_map.describe(_shm_map.spans_of([shared]))
    assert info is not None
    out = torch.empty(shared.nbytes, dtype=torch.uint8)
    with pytest.raises(_shm_map.MapError, match="gone"):
        reader.read(ME, info, [out.data_ptr()], [shared.nbytes], started=OTHER_START)
    assert len(reader) == 0
    reader.read(ME, info, [out.data_ptr()], [shared.nbytes], started=MINE)
    assert torch.equal(out.view(torch.float32), shared) and len(reader) == 1
    reader.close()


_SHARER = r"""
import pickle, sys, torch
from rdt.transports.shm import shared_maps as _shm_map
t = torch.arange(1 << 16, dtype=torch.float32).share_memory_()
sys.stdout.write(pickle.dumps(_shm_map.describe(_shm_map.spans_of([t]))).hex() + "\n")
sys.stdout.flush()
sys.stdin.readline()
"""


@pytest.mark.skipif(not _cma.supported(), reason="no process_vm_readv in this libc")
def test_the_mappings_of_a_dead_producer_are_dropped_at_the_next_trim() -> None:
    import pickle

    proc = subprocess.Popen([sys.executable, "-c", _SHARER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert proc.stdout is not None
        info = pickle.loads(bytes.fromhex(proc.stdout.readline().strip()))
        who = identity(proc.pid)
        reader = _shm_map.MapReader(_cma.CmaReader(1).spread, 30.0, max_bytes=8 << 30)
        out = torch.empty(1 << 18, dtype=torch.uint8)
        reader.read(who[0], info, [out.data_ptr()], [1 << 18], started=who[1])
        assert torch.equal(out.view(torch.float32), torch.arange(1 << 16, dtype=torch.float32))
        assert reader.trim() == 0 and len(reader) == 1  # used just now, its producer runs
        _kill_unreaped(proc)
        assert reader.trim() == 1 and len(reader) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_a_shm_barrier_peer_whose_pid_names_another_process_fails_the_wait_fast() -> None:
    import secrets
    import uuid

    from rdt_transports.backends._shm_barrier import ShmBarrier
    from rdt_transports.errors import PeerUnavailableError

    uid, secret = uuid.uuid4().hex, secrets.token_bytes(32)
    bars: List[ShmBarrier] = [ShmBarrier(uid, r, 2, secret) for r in range(2)]
    try:
        bars[0].connect([ME, ME], [MINE, OTHER_START])  # rank 1's pid names another process than the one that joined
        start = time.monotonic()
        with pytest.raises(PeerUnavailableError, match="died"):
            bars[0].wait(20.0)  # rank 1 never arrives
        assert time.monotonic() - start < 10.0
    finally:
        for b in bars:
            b.close()
