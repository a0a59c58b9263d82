"""UCX groups hold no memory across steps or group cycles: finished operations are dropped as they finish.

A 4-rank UCX group is created and destroyed 20 times; each cycle runs every allreduce algorithm (ring, bde, tree)
at 16 MiB. After every step the backend's tables hold no finished operation (the pending table is empty, the
progress engine has no user operation left, no peer's last send keeps a tensor), and each worker's resident memory
after a heap trim stays within 300 MiB of what it was after the first cycle, both while a group is alive and after
it is destroyed. The opt-in soak (RDT_SOAK=1) runs 1 000 steps at 128 MiB in one group, then more cycles.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List

import pytest
import ray
import torch

import rdt_transports as rt

from . import _collective_cases as cc
from .conftest import HAS_UCXX

pytestmark = pytest.mark.skipif(not HAS_UCXX, reason="ucxx is not installed (pip install 'rdt[ucx]')")

MiB = 1 << 20
WORLD = 4
ALGORITHMS = ("ring", "bde", "tree")
RSS_SLACK = 300 * MiB
CALL_TIMEOUT = 120.0


@pytest.fixture(scope="module")
def four(ray_cluster):
    actors = [cc.CollectiveWorker.remote() for _ in range(WORLD)]
    ray.get([a.ping.remote() for a in actors], timeout=120)
    yield actors
    for a in actors:
        ray.kill(a)


def _held(name: str) -> Dict[str, int]:
    """(actor side) what the group's UCX backend still holds of its operations."""
    from rdt_transports.backends._ucx_ops import P2POp

    backend = rt.get_group(name).backend
    engine = backend._engine
    peers = list(backend._peers.values())
    return {
        "pending": len(backend._pending),
        "engine_ops": sum(isinstance(op, P2POp) for op in list(engine._ops)),
        "zombies": len(engine._zombies),
        "tensors_held_by_last_sends": sum(getattr(s.unverified, "tensor", None) is not None for s in peers),
    }


def _steps(name: str, nbytes: int, steps: int) -> Dict[str, Any]:
    """(actor side) ``steps`` allreduces per algorithm; after each, what the backend holds; then the trimmed RSS."""
    rank = rt.get_rank(name)
    t = torch.empty(nbytes // 4, dtype=torch.float32)
    want = float(sum(range(1, WORLD + 1)))
    held: List[Dict[str, int]] = []
    wrong = 0
    for algorithm in ALGORITHMS:
        for _ in range(steps):
            t.fill_(rank + 1)
            rt.allreduce(t, name, algorithm=algorithm, timeout=CALL_TIMEOUT)
            wrong += int((t != want).sum())
            held.append(_held(name))
    del t
    return {"held": held, "wrong": wrong, "rss": _trimmed_rss()}


def _trimmed_rss() -> int:
    """(actor side) resident bytes after a collection and a heap trim."""
    import ctypes
    import gc

    import psutil

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


def _cycle(actors: List[Any], name: str, nbytes: int, steps: int) -> Dict[str, Any]:
    """Create a group, run the steps, destroy it; per rank: what was held, RSS alive and after destroy."""
    handle = rt.create_collective_group(actors, backend="ucx", group_name=name, timeout=CALL_TIMEOUT)
    try:
        replies = ray.get([a.call.remote(_steps, name, nbytes, steps) for a in actors], timeout=600)
    finally:
        handle.destroy(timeout=60)
    errors = [c for c, _, _ in replies if c is not None]
    assert not errors, f"{name}: {errors}"
    out = [v for _, v, _ in replies]
    after = [v for _, v, _ in ray.get([a.call.remote(_trimmed_rss) for a in actors], timeout=60)]
    return {"held": [r["held"] for r in out], "wrong": sum(r["wrong"] for r in out),
            "alive": [r["rss"] for r in out], "after": after}


def _check(label: str, res: Dict[str, Any], base: List[int]) -> None:
    problems = [f"{res['wrong']} wrong elements"] if res["wrong"] else []
    for what in ("alive", "after"):
        grown = [(r - b) / MiB for r, b in zip(res[what], base)]
        if max(grown) >= RSS_SLACK / MiB:
            problems.append(f"RSS ({what}) grew by {[round(g) for g in grown]} MiB")
    for rank, held in enumerate(res["held"]):
        left = [h for h in held if any(h.values())]
        if left:
            problems.append(f"rank {rank}: operations held after {len(left)} steps, e.g. {left[-1]}")
    assert not problems, f"{label}: " + "; ".join(problems)


def test_cycles_of_a_4_rank_group_hold_nothing(four) -> None:
    """20 create/destroy cycles, each running ring, bde and tree allreduces of 16 MiB (2 steps each; the last
    cycle 8 each, so that memory kept per step would show in the RSS too)."""
    first = _cycle(four, "ucx-mem-0", 16 * MiB, 2)
    base = first["after"]
    _check("cycle 0", first, base)
    for c in range(1, 20):
        _check(f"cycle {c}", _cycle(four, f"ucx-mem-{c}", 16 * MiB, 8 if c == 19 else 2), base)


@pytest.mark.soak
@pytest.mark.timeout(7200)
@pytest.mark.skipif(os.environ.get("RDT_SOAK") != "1", reason="soak test: opt in with RDT_SOAK=1 (takes minutes)")
def test_soak_128mib_1000_steps_then_cycles(four) -> None:
    """1 000 allreduce steps of 128 MiB in one group (a third per algorithm; RDT_SOAK_STEPS changes the count), then
    5 more cycles of 4 steps per algorithm."""
    first = _cycle(four, "ucx-soak-warm", 128 * MiB, 1)
    base = first["after"]
    _check("warm-up", first, base)
    steps = int(os.environ.get("RDT_SOAK_STEPS", "1000")) // len(ALGORITHMS)
    start = time.monotonic()
    long = _cycle(four, "ucx-soak-long", 128 * MiB, steps)
    print(f"\nucx soak: {steps * len(ALGORITHMS)} steps of 128 MiB in {time.monotonic() - start:.0f}s; RSS growth "
          f"(MiB) alive {[round((r - b) / MiB) for r, b in zip(long['alive'], base)]}, after destroy "
          f"{[round((r - b) / MiB) for r, b in zip(long['after'], base)]}")
    _check("1 000 steps", long, base)
    for c in range(5):
        _check(f"soak cycle {c}", _cycle(four, f"ucx-soak-{c}", 128 * MiB, 4), base)
