"""A busy machine makes calls slower, never makes them fail: every backend, with a CPU hog running beside it.

Each round runs, in both ranks at once: allreduce, broadcast, send/recv of 0-d and
empty tensors (torch and numpy, both directions, ending with rank 0 sending an empty int64 tensor), an allreduce of
non-contiguous views (refused up front with InvalidArgumentError, the group left healthy). 20 rounds in all, in
fresh groups of a few rounds each; after a group's last round each rank leaves it at once, as a member that is done
does. A peer leaving right after a transfer that completed must
not turn that transfer into a failure (on UCX, rank 0's send used to fail with PeerUnavailableError "the peer
aborted or shut down" when the peer's BYE was read in the same progress as the verdict it had sent first).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any, Dict, List, Tuple

import pytest
import ray
import torch

import rdt_transports as rt

from .test_p2p_checks import pair  # noqa: F401 - the module's two collective workers
from .conftest import HAS_NIXL, HAS_UCXX

GROUPS, ROUNDS_PER_GROUP = 4, 5
CALL_TIMEOUT = 30.0
HOG_MAX_S = 300  # the hog ends by itself even if this process dies before killing it
# (shape, dtype) sent in order, each as torch then numpy; the last one is rank 0's empty int64 send of the report.
P2P_CASES: Tuple[Tuple[Tuple[int, ...], torch.dtype], ...] = (
    ((), torch.float32), ((), torch.int64), ((0,), torch.float32), ((0, 3), torch.float64), ((0,), torch.int64))




def _hog() -> subprocess.Popen:
    """One CPU-bound process (bounded in time by itself as well)."""
    code = f"import time\nend = time.monotonic() + {HOG_MAX_S}\nwhile time.monotonic() < end:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


def _p2p(name: str, rank: int, src: int, shape: Tuple[int, ...], dtype: torch.dtype, lib: str,
         seed: int) -> Any:
    """src sends a tensor of ``shape``/``dtype`` to the other rank; the receiver returns what it got."""
    if rank == src:
        x = torch.full(shape, seed, dtype=dtype)
        rt.send(x.numpy().copy() if lib == "numpy" else x, 1 - src, name, timeout=CALL_TIMEOUT)
        return None
    buf = torch.full(shape, -1, dtype=dtype)
    buf = buf.numpy().copy() if lib == "numpy" else buf
    rt.recv(buf, src, name, timeout=CALL_TIMEOUT)
    return torch.as_tensor(buf).clone()


def _rounds(name: str, rounds: int) -> List[Dict[str, Any]]:
    """(actor side) ``rounds`` rounds of the sequence on group ``name``, then leave the group at once."""
    outs: List[Dict[str, Any]] = []
    try:
        for _ in range(rounds):
            outs.append(_sequence(name))
            if "error" in outs[-1]:
                break
    finally:
        rt.destroy_collective_group(name)  # a member that is done leaves at once
    return outs


def _sequence(name: str) -> Dict[str, Any]:
    """(actor side) one round of the sequence on group ``name``; what was received, or the error."""
    rank = rt.get_rank(name)
    out: Dict[str, Any] = {"rank": rank}
    try:
        t = torch.arange(1000, dtype=torch.float32) + rank
        rt.allreduce(t, name, timeout=CALL_TIMEOUT)
        out["allreduce"] = t
        b = torch.full((300,), float(rank + 5))
        rt.broadcast(b, 0, name, timeout=CALL_TIMEOUT)
        out["broadcast"] = b
        got = []
        k = 0
        for src in (1, 0):
            for shape, dtype in P2P_CASES:
                for lib in ("torch", "numpy"):
                    k += 1
                    got.append(_p2p(name, rank, src, shape, dtype, lib, k))
        out["p2p"] = got
        views = torch.arange(20, dtype=torch.float32).reshape(4, 5)
        for view in (views[:, 1], views.t()):
            try:
                rt.allreduce(view, name, timeout=CALL_TIMEOUT)
                out["noncontiguous"] = "accepted"
            except rt.InvalidArgumentError as e:
                out.setdefault("noncontiguous", str(e))
        out["state"] = rt.get_group(name).state.value
    except Exception as e:  # noqa: BLE001 - reported to the driver, with the step it reached
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _check(backend: str, rnd: int, replies: List[Dict[str, Any]]) -> None:
    by_rank = sorted(replies, key=lambda r: r["rank"])
    for r in by_rank:
        assert "error" not in r, f"{backend} round {rnd} rank {r['rank']}: {r['error']}"
        assert torch.equal(r["allreduce"], torch.arange(1000, dtype=torch.float32) * 2 + 1)
        assert torch.equal(r["broadcast"], torch.full((300,), 5.0))
        assert "not contiguous" in r["noncontiguous"], r["noncontiguous"]
        assert r["state"] == "healthy"
    k = 0
    for src in (1, 0):
        for shape, dtype in P2P_CASES:
            for _lib in ("torch", "numpy"):
                k += 1
                got = by_rank[1 - src]["p2p"][k - 1]
                assert got.dtype == dtype and tuple(got.shape) == shape
                assert torch.equal(got, torch.full(shape, k, dtype=dtype)), (backend, rnd, k, got)


@pytest.mark.parametrize("backend", ["gloo", "ucx", "nixl", "tcp"])
def test_sequence_with_a_cpu_hog_beside_it(pair, backend: str) -> None:
    if backend == "ucx" and not HAS_UCXX:
        pytest.skip("ucxx is not installed (pip install 'rdt[ucx]')")
    if backend == "nixl" and not HAS_NIXL:
        pytest.skip("nixl is not installed (pip install 'rdt[nixl]')")
    hog = _hog()
    try:
        for g in range(GROUPS):
            name = f"busy-{backend}-{g}"
            handle = rt.create_collective_group(pair, backend=backend, group_name=name, timeout=CALL_TIMEOUT)
            try:
                replies = ray.get([a.call.remote(_rounds, name, ROUNDS_PER_GROUP) for a in pair], timeout=120)
            finally:
                handle.destroy(timeout=30)
            errors = [c for c, _, _ in replies if c is not None]
            assert not errors, f"{backend} group {g}: {errors}"
            per_rank = [v for _, v, _ in replies]
            for rnd in range(ROUNDS_PER_GROUP):  # a rank that failed stopped there: its last entry holds the error
                _check(backend, g * ROUNDS_PER_GROUP + rnd, [outs[min(rnd, len(outs) - 1)] for outs in per_rank])
    finally:
        hog.kill()
        hog.wait()

