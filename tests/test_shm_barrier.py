"""The same-node semaphore barrier behind the shared-memory allreduce, with real processes (Ray actors): it orders
memory across many consecutive rounds, names the ranks missing at a timeout, stops at once when a peer gives up,
dies or the group is aborted, and leaves no semaphore or segment behind."""

from __future__ import annotations

import mmap
import os
import secrets
import threading
import time
from typing import Any, List, Optional, Tuple

import pytest
import ray
import torch

import rdt_transports as rt
from rdt_transports.errors import (
    CollectiveTimeoutError,
    CommunicationError,
    GroupDestroyedError,
    PeerUnavailableError,
)

from .conftest import wait_for

SLOTS_BYTES = 4096


class Caught:
    """An exception raised in an actor, carried back as data (class, message, peer)."""

    def __init__(self, exc: BaseException) -> None:
        self.cls = type(exc)
        self.message = str(exc)
        self.peer = getattr(exc, "peer", None)

    def __repr__(self) -> str:
        return f"{self.cls.__name__}({self.message!r})"


def _files_of(pid: int) -> List[str]:
    """/dev/shm entries (segments and semaphores) whose names say ``pid`` owns them."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith((f"rdt-{pid}-", f"sem.rdt-{pid}-")))


@ray.remote(num_cpus=0)
class Rank:
    """One process holding a bare ShmBarrier and/or a member of a Gloo group."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.aborted = threading.Event()

    def pid(self) -> int:
        return os.getpid()

    def files(self) -> List[str]:
        return _files_of(os.getpid())

    def make(self, uid: str, rank: int, world: int, secret: bytes) -> List[str]:
        from rdt_transports.backends._shm_barrier import ShmBarrier

        self.aborted = threading.Event()
        self.rank = rank
        self.bar = ShmBarrier(uid, rank, world, secret, self.aborted)
        return self.bar.names

    def connect(self, pids: List[int]) -> None:
        self.bar.connect(pids)

    def rounds(self, n: int, path: str) -> int:
        """``n`` barriers; before round i write i to my slot, after it every slot must hold i or i+1."""
        with open(path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), SLOTS_BYTES)
        slots = memoryview(mm).cast("q")
        world = self.bar._world
        try:
            for i in range(1, n + 1):
                slots[self.rank] = i
                if i % (world + 2) == self.rank:  # vary who arrives last
                    time.sleep(0.002)
                self.bar.wait(20.0)
                seen = [slots[j] for j in range(world)]
                assert all(i <= s <= i + 1 for s in seen), (i, seen)
            return n
        finally:
            slots.release()
            mm.close()

    def wait(self, timeout: float, abort_after: Optional[float] = None) -> Tuple[Optional[Caught], float]:
        if abort_after is not None:
            threading.Timer(abort_after, self.aborted.set).start()
        t0 = time.monotonic()
        try:
            self.bar.wait(timeout)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            return Caught(e), time.monotonic() - t0
        return None, time.monotonic() - t0

    def close(self) -> None:
        self.bar.close()
        self.bar.close()  # idempotent

    # ---- through a real Gloo group
    def allreduce(self, name: str, numel: int, timeout: float,
                  abort_after: Optional[float] = None) -> Tuple[Optional[Caught], float]:
        if abort_after is not None:
            group = rt.get_group(name)
            threading.Timer(abort_after, group.abort).start()
        t = torch.ones(numel)
        t0 = time.monotonic()
        try:
            rt.allreduce(t, name, timeout=timeout)
        except Exception as e:  # noqa: BLE001
            return Caught(e), time.monotonic() - t0
        assert torch.all(t == rt.get_collective_group_size(name)), "wrong allreduce result"
        return None, time.monotonic() - t0

    def mixed_sequence(self, name: str, calls: int) -> int:
        """Back-to-back allreduces of changing size and dtype with skewed arrivals; every result is checked."""
        rank, world = rt.get_rank(name), rt.get_collective_group_size(name)
        shapes = [(100_003, torch.float32), (300_000, torch.int64), (70_000, torch.float64), (100_003, torch.float32)]
        for i in range(calls):
            numel, dtype = shapes[i % len(shapes)]
            t = torch.arange(numel, dtype=dtype) * (rank + 1) + i
            if (i + rank) % 3 == 0:
                time.sleep(0.003)
            rt.allreduce(t, name, timeout=30)
            want = torch.arange(numel, dtype=dtype) * sum(range(1, world + 1)) + i * world
            assert torch.equal(t, want), (i, numel, dtype)
        return calls

    def destroy(self, name: str) -> None:
        rt.destroy_collective_group(name)


@pytest.fixture(scope="module")
def ranks(ray_cluster):
    actors = [Rank.remote() for _ in range(3)]
    ray.get([a.pid.remote() for a in actors])
    yield actors
    for a in actors:
        ray.kill(a)


def _barrier(actors: List[Any]) -> List[int]:
    """A fresh barrier over ``actors``: create (before publishing pids), then connect; returns the pids."""
    uid, secret = secrets.token_hex(8), secrets.token_bytes(32)
    ray.get([a.make.remote(uid, r, len(actors), secret) for r, a in enumerate(actors)])
    pids = ray.get([a.pid.remote() for a in actors])
    ray.get([a.connect.remote(pids) for a in actors])
    return pids


def test_barrier_orders_memory_over_many_rounds(ranks, tmp_path):
    path = tmp_path / "slots"
    path.write_bytes(bytes(SLOTS_BYTES))
    pids = _barrier(ranks)
    try:
        assert ray.get([a.rounds.remote(1500, str(path)) for a in ranks], timeout=60) == [1500] * 3
        names = ray.get([a.files.remote() for a in ranks])
        assert all(len(n) == 3 and all(x.startswith("sem.rdt-") for x in n) for n in names), names
    finally:
        ray.get([a.close.remote() for a in ranks])
    assert not any(_files_of(p) for p in pids), "semaphores left after close()"


def test_timeout_names_the_missing_rank_and_the_peer_stops_early(ranks):
    _barrier(ranks)
    try:
        # rank 0 gives up after 1.5 s; rank 1 would wait 30 s but sees rank 0 give up; rank 2 never comes
        r1 = ranks[1].wait.remote(30.0)
        r0 = ranks[0].wait.remote(1.5)
        (e0, t0), (e1, t1) = ray.get([r0, r1], timeout=60)
    finally:
        ray.get([a.close.remote() for a in ranks])
    assert e0 is not None and e0.cls is CollectiveTimeoutError, e0
    assert "rank(s) [2] did not reach" in e0.message and e0.peer == 2, e0
    assert 1.4 < t0 < 5.0, t0
    assert e1 is not None and e1.cls is PeerUnavailableError and e1.peer == 0, e1
    assert t1 < 8.0, t1


def test_abort_ends_a_barrier_wait(ranks):
    _barrier(ranks)
    try:
        err, took = ray.get(ranks[0].wait.remote(30.0, abort_after=0.3), timeout=30)
    finally:
        ray.get([a.close.remote() for a in ranks])
    assert err is not None and err.cls is GroupDestroyedError, err
    assert took < 2.0, took


def test_abort_ends_a_shm_allreduce_and_the_peer_follows(ranks):
    name = "shm-barrier-abort"
    rt.create_collective_group(ranks, backend="gloo", group_name=name)
    try:
        assert ray.get([a.allreduce.remote(name, 1 << 16, 30) for a in ranks])[0][0] is None
        # rank 2 stays away; rank 0 aborts its group after 0.3 s; rank 1 must not wait for its 30 s timeout
        (e0, t0), (e1, t1) = ray.get([ranks[0].allreduce.remote(name, 1 << 16, 30, abort_after=0.3),
                                      ranks[1].allreduce.remote(name, 1 << 16, 30)], timeout=60)
    finally:
        ray.get([a.destroy.remote(name) for a in ranks])
    assert e0 is not None and e0.cls is GroupDestroyedError and t0 < 3.0, (e0, t0)
    assert e1 is not None and issubclass(e1.cls, CommunicationError) and t1 < 15.0, (e1, t1)  # not its 30 s: the abort reached it (5.6 s seen at load 10)
    assert e1.peer == 0, e1


def test_consecutive_allreduces_of_changing_shape_stay_correct(ranks):
    name = "shm-barrier-seq"
    rt.create_collective_group(ranks, backend="gloo", group_name=name)
    pids = ray.get([a.pid.remote() for a in ranks])
    try:
        assert ray.get([a.mixed_sequence.remote(name, 40) for a in ranks], timeout=120) == [40] * 3
        assert all(any(n.startswith("sem.") for n in _files_of(p)) for p in pids)
    finally:
        ray.get([a.destroy.remote(name) for a in ranks])
    assert wait_for(lambda: not any(_files_of(p) for p in pids), timeout=10), [_files_of(p) for p in pids]


def test_killed_rank_is_detected_long_before_the_timeout(ranks):
    victim = Rank.remote()
    actors = [ranks[0], ranks[1], victim]
    pids = ray.get([a.pid.remote() for a in actors])
    name = "shm-barrier-kill"
    rt.create_collective_group(actors, backend="gloo", group_name=name)
    try:
        assert all(e is None for e, _ in ray.get([a.allreduce.remote(name, 1 << 16, 30) for a in actors]))
        ray.kill(victim)
        outs = ray.get([a.allreduce.remote(name, 1 << 16, 60) for a in actors[:2]], timeout=90)
        for err, took in outs:
            assert err is not None and issubclass(err.cls, CommunicationError), err
            assert not issubclass(err.cls, CollectiveTimeoutError), err
            assert err.peer == 2 and "[2]" in err.message, err
            assert took < 8.0, took  # the timeout was 60 s
    finally:
        ray.get([a.destroy.remote(name) for a in actors[:2]])
        ray.kill(victim)
        for n in _files_of(pids[2]):  # the killed owner's files: the node reaper's job, done here by hand
            try:
                os.unlink(os.path.join("/dev/shm", n))
            except FileNotFoundError:
                pass
    assert wait_for(lambda: not any(_files_of(p) for p in pids[:2]), timeout=10)
