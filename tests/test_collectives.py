"""Every collective op x backend (gloo, nixl, ucx, tcp) x world size (2, 3, 4) on a real local Ray cluster.

Four actors are started once for the module and put in one group per (backend, world size) at the same time
(``{backend}-{n}`` holds the first n actors), so every actor is a member of up to nine groups at once. Each
test runs one batch of cases inside every rank concurrently: every dtype (float16, bfloat16, float32, float64,
int32, int64, uint8), torch and numpy inputs, shapes (), (5,), (3, 4), (1000,), every applicable ReduceOp and
rotating (mostly non-zero) roots. The driver rebuilds every rank's deterministic inputs and checks the results
against torch; numpy results must land in the caller's arrays. Every p2p algorithm runs on every case: on Gloo
it must match Gloo's native result on the same inputs, on nixl/ucx/tcp (with 'auto' too) the torch
result. tcp is the reference ordered-wire backend: it runs the NCCL backend's matching logic on CPU.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import pytest
import ray

import rdt_transports as rt
from rdt_transports.algorithms import algorithms_for

from . import _collective_cases as cc
from .conftest import HAS_NIXL, HAS_UCXX

BACKENDS = ("gloo", "nixl", "ucx", "tcp")
WORLD_SIZES = (2, 3, 4)
OPS = ("send", "broadcast", "allreduce", "reduce", "allgather", "gather", "scatter", "reducescatter", "alltoall",
       "barrier")
CALL_TIMEOUT = 30.0  # per collective call inside the actors
BATCH_TIMEOUT = 240.0  # per ray.get of one batch
# Every algorithm on every case, on every backend. RDT_TEST_ROTATE_ALGORITHMS=1 rotates the nixl/ucx
# algorithms over the cases instead (each still sees several dtypes, shapes and reduce ops) for a quicker run.
ROTATE_P2P_ALGORITHMS = os.environ.get("RDT_TEST_ROTATE_ALGORITHMS", "0") == "1"


def _require(backend: str) -> None:
    if backend == "nixl" and not HAS_NIXL:
        pytest.skip("nixl is not installed (pip install 'ray-direct-transport[nixl]')")
    if backend == "ucx" and not HAS_UCXX:
        pytest.skip("ucxx is not installed (pip install 'ray-direct-transport[ucx]')")


class Groups:
    """The module's groups, created eagerly; a group left errored by a failed test is re-formed on next use."""

    def __init__(self, workers: List[Any]) -> None:
        self.workers = workers
        self.handles: Dict[Tuple[str, int], Any] = {}
        self.broken: set = set()

    def create_all(self) -> None:
        for b in BACKENDS:
            if (b == "nixl" and not HAS_NIXL) or (b == "ucx" and not HAS_UCXX):
                continue
            for n in WORLD_SIZES:
                self._create(b, n)

    def _create(self, b: str, n: int) -> None:
        try:
            self.handles[(b, n)] = rt.create_collective_group(self.workers[:n], backend=b, group_name=f"{b}-{n}")
        except Exception as e:  # noqa: BLE001 - reported by the tests that need the group
            self.handles[(b, n)] = e

    def get(self, b: str, n: int) -> str:
        _require(b)
        if (b, n) in self.broken:
            self.broken.discard((b, n))
            h = self.handles.get((b, n))
            if isinstance(h, rt.GroupHandle):
                h.destroy(timeout=10)
            self._create(b, n)
        h = self.handles.get((b, n))
        if isinstance(h, Exception):
            pytest.fail(f"create_collective_group(backend={b!r}, {n} actors) failed: {type(h).__name__}: {h}")
        return f"{b}-{n}"

    def destroy_all(self) -> None:
        for h in self.handles.values():
            if isinstance(h, rt.GroupHandle):
                h.destroy(timeout=10)


@pytest.fixture(scope="module")
def workers(ray_cluster):
    actors = [cc.CollectiveWorker.remote() for _ in range(4)]
    ray.get([a.ping.remote() for a in actors], timeout=120)
    yield actors
    for a in actors:
        ray.kill(a)


@pytest.fixture(scope="module")
def groups(workers):
    g = Groups(workers)
    g.create_all()
    yield g
    g.destroy_all()


def _run_batch(groups: Groups, name: str, n: int, cases: List[Dict[str, Any]]) -> List[List[Any]]:
    """Run ``cases`` on ranks 0..n-1 of group ``name`` concurrently; return results[rank][case]."""
    refs = [groups.workers[r].run_cases.remote(name, cases, CALL_TIMEOUT) for r in range(n)]
    replies = ray.get(refs, timeout=BATCH_TIMEOUT)
    failures = [r for r in replies if r["error"] is not None]
    if failures:
        groups.broken.add((name.rsplit("-", 1)[0], n))  # re-formed before its next use
        f = failures[0]
        pytest.fail(f"rank {f['rank']} failed on case {f['case']}: {f['error']!r}")
    by_rank = sorted(replies, key=lambda r: r["rank"])
    assert [r["rank"] for r in by_rank] == list(range(n))
    return [r["results"] for r in by_rank]


def _algorithms(backend: str, op: str) -> List[str]:
    if op == "send":
        return ["p2p"]
    if backend == "gloo":
        return ["native", *algorithms_for(op)]
    return ["auto", *algorithms_for(op)]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_collective(groups: Groups, backend: str, world_size: int, op: str) -> None:
    name = groups.get(backend, world_size)
    algos = _algorithms(backend, op)
    full = backend == "gloo" or not ROTATE_P2P_ALGORITHMS
    cases = cc.with_algorithms(cc.build_cases(op, world_size), algos, full=full)
    assert {c["algorithm"] for c in cases} == set(algos)  # every algorithm runs on this backend
    results = _run_batch(groups, name, world_size, cases)

    if op == "barrier":
        for c in cases:
            entered = [results[r][c["id"]][0] for r in range(world_size)]
            left = [results[r][c["id"]][1] for r in range(world_size)]
            assert min(left) >= max(entered), f"{c['algorithm']} barrier released a rank before all entered"
        return

    for c in cases:
        want = cc.expected(c, world_size)
        for r in range(world_size):
            cc.check_output(c, r, results[r][c["id"]], want[r], f"{name}")

    if backend == "gloo" and op != "send":
        # every algorithm against Gloo's native result on the same inputs
        native = {c["base"]: c["id"] for c in cases if c["algorithm"] == "native"}
        for c in cases:
            if c["algorithm"] == "native":
                continue
            ref_id = native[c["base"]]
            for r in range(world_size):
                ref = results[r][ref_id]
                if ref is None:
                    continue
                cc.check_output(c, r, results[r][c["id"]], _as_torch(ref), f"{name} vs native")


def _as_torch(x: Any) -> Any:
    if isinstance(x, list):
        return [cc.as_tensor(v) for v in x]
    return cc.as_tensor(x)


# ---------------------------------------------------------------------------------------------- many groups
def interleave(steps: List[Tuple[str, int]]) -> List[Tuple[str, int, List[float]]]:
    """(worker side) for each (group, k) this process is a member of, in order: allreduce rank*10 + k."""
    out = []
    for name, k in steps:
        if not rt.is_group_initialized(name):
            continue
        rank = rt.get_rank(name)
        out.append((name, k, cc.allreduce_sum(name, rank * 10 + k, n=3)))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_actor_in_several_groups_interleaved(groups: Groups, backend: str) -> None:
    names = [groups.get(backend, n) for n in WORLD_SIZES]
    steps = [(names[(k + j) % 3], k) for k in range(4) for j in range(3)]
    replies = cc.call_all(groups.workers, interleave, [steps] * 4)
    for w, (err, value, _) in enumerate(replies):
        assert err is None, f"worker {w}: {err!r}"
        member_steps = [(nm, k) for nm, k in steps if int(nm.rsplit("-", 1)[1]) > w]
        assert [(nm, k) for nm, k, _ in value] == member_steps
        for nm, k, got in value:
            n = int(nm.rsplit("-", 1)[1])
            want = float(sum(r * 10 + k for r in range(n)))
            assert got == [want] * 3, f"worker {w} group {nm} step {k}: {got} != {want}"


def leave_and_check(name: str) -> Tuple[bool, int]:
    """(worker side) destroy ``name`` here; return (still initialised?, rank afterwards)."""
    rt.destroy_collective_group(name)
    return rt.is_group_initialized(name), rt.get_rank(name)


def rank_and_sum(name: str) -> Tuple[int, int, List[float]]:
    rank = rt.get_rank(name)
    return rank, rt.get_collective_group_size(name), cc.allreduce_sum(name, rank + 1, n=3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_leave_group_and_join_another_with_other_peers(groups: Groups, backend: str) -> None:
    groups.get(backend, 2)  # skips when the backend is not installed
    w = groups.workers
    name = f"rejoin-{backend}"
    first = rt.create_collective_group([w[0], w[1]], backend=backend, group_name=name)
    try:
        out = cc.call_all([w[0], w[1]], rank_and_sum, [name, name])
        assert [o[1] for o in out] == [(0, 2, [3.0] * 3), (1, 2, [3.0] * 3)], out
        # both members leave (actor-side destroy) ...
        out = cc.call_all([w[0], w[1]], leave_and_check, [name, name])
        assert [o[1] for o in out] == [(False, -1), (False, -1)], out
    finally:
        first.destroy(timeout=10)
    # ... and worker 0 joins a new incarnation of the same name with other peers, now as rank 2
    second = rt.create_collective_group([w[2], w[3], w[0]], backend=backend, group_name=name)
    try:
        out = cc.call_all([w[2], w[3], w[0]], rank_and_sum, [name] * 3)
        assert [o[0] for o in out] == [None] * 3, out
        assert [o[1] for o in out] == [(r, 3, [6.0] * 3) for r in range(3)], out
        assert second.rank_of(w[0]) == 2 and second.rank_of(w[1]) == -1
    finally:
        second.destroy(timeout=10)
    # worker 1 is in no incarnation of it any more
    err, value, _ = ray.get(w[1].call.remote(rt.is_group_initialized, name))
    assert err is None and value is False


# ---------------------------------------------------------------------------------------------- large broadcast
# Large enough for the pipelined chain ('auto' above the size threshold), and an odd number of elements so that
# no chunk size divides it.
BIG_NUMEL = 1_500_001  # int32: 6,000,004 bytes


def big_broadcast(name: str, root: int, timeout: float) -> Tuple[int, bool, int]:
    """(worker side) broadcast a large odd-sized tensor with 'auto'; return (rank, bit-exact?, bytes this rank sent).

    Bytes are counted by wrapping this group's backend ``isend`` for the one call (data still moves for real).
    """
    import torch

    backend = rt.get_group(name).backend
    sent = [0]
    real_isend = backend.isend

    def counting_isend(tensor: Any, peer: int, tag: int) -> Any:
        sent[0] += tensor.numel() * tensor.element_size()
        return real_isend(tensor, peer, tag)

    backend.isend = counting_isend  # type: ignore[method-assign]
    try:
        rank = rt.get_rank(name)
        want = torch.arange(BIG_NUMEL, dtype=torch.int32) * 7 + 3
        t = want.clone() if rank == root else torch.zeros(BIG_NUMEL, dtype=torch.int32)
        rt.broadcast(t, root, name, timeout=timeout)
        return rank, bool(torch.equal(t, want)), sent[0]
    finally:
        del backend.isend  # the class's method again


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_large_broadcast_root_sends_each_byte_once(groups: Groups, backend: str, world_size: int) -> None:
    """Every rank gets the root's bits; the root's link carries the tensor about once, not n-1 times (issue 15)."""
    name = groups.get(backend, world_size)
    root = world_size - 1
    nbytes = BIG_NUMEL * 4
    replies = cc.call_all(groups.workers[:world_size], big_broadcast, [name] * world_size, [root] * world_size,
                          [CALL_TIMEOUT] * world_size)
    for w, (err, _, _) in enumerate(replies):
        if err is not None:
            groups.broken.add((backend, world_size))
        assert err is None, f"worker {w}: {err!r}"
    by_rank = {rank: (ok, sent) for rank, ok, sent in (v for _, v, _ in replies)}
    assert all(ok for ok, _ in by_rank.values()), f"{name}: not bit-exact on {by_rank}"
    root_sent = by_rank[root][1]
    assert nbytes <= root_sent <= 1.05 * nbytes, f"{name}: root sent {root_sent} B for a {nbytes} B tensor"
    total = sum(sent for _, sent in by_rank.values())
    assert total <= 1.05 * (world_size - 1) * nbytes, f"{name}: {total} B sent in all"
