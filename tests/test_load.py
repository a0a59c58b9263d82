"""Load: 8 actors, over 1000 transfers in flight at once between random pairs, mixed sizes and transports, every
payload checksummed; then every table drains. Plus an opt-in soak (RDT_SOAK=1): 10 000 transfers, RSS per actor.
"""

from __future__ import annotations

import gc
import os
import random
import time
from typing import Any, Dict, List, Tuple

import psutil
import pytest
import ray

import rdt

from ._fault_actors import Peer, expected_checksum
from .conftest import HAS_NIXL, wait_for

N_ACTORS = 8
KiB = 1 << 10
MiB = 1 << 20
# (bytes, weight): 1 KiB travels inline, 256 KiB and 4 MiB out of band.
SIZES = ((1 * KiB, 40), (256 * KiB, 45), (4 * MiB, 15))
TRANSPORTS = ("gloo", "shm", "auto") + (("nixl",) if HAS_NIXL else ())


@pytest.fixture(scope="module")
def eight(ray_cluster):
    actors = [Peer.remote() for _ in range(N_ACTORS)]
    ray.get([a.ping.remote() for a in actors], timeout=180)
    group = rdt.create_collective_group(actors, backend="gloo", name="load-8", timeout=120)
    yield actors
    group.destroy(timeout=30)
    for a in actors:
        ray.kill(a)


def _plan(count: int, seed: int) -> List[Tuple[int, int, str, int, int]]:
    """(producer, consumer, transport, bytes, payload seed) per transfer; producer != consumer."""
    rng = random.Random(seed)
    sizes = [s for s, _ in SIZES]
    weights = [w for _, w in SIZES]
    plan = []
    for i in range(count):
        p, c = rng.sample(range(N_ACTORS), 2)
        plan.append((p, c, rng.choice(TRANSPORTS), rng.choices(sizes, weights)[0], seed * 100_000 + i))
    return plan


def _submit(actors: List[Any], plan: List[Tuple[int, int, str, int, int]]) -> List[Any]:
    """Every producer call and every consumer call submitted before waiting on any: all in flight at once."""
    out = []
    for p, c, transport, nbytes, seed in plan:
        ref = getattr(actors[p], f"make_{transport}").remote(seed, nbytes)
        out.append(actors[c].digest.remote(ref))
    return out


def _drained(actors: List[Any]) -> bool:
    gc.collect()
    stats = ray.get([a.stats.remote() for a in actors], timeout=60)
    return all(s["objects"] == 0 and s["shm_segments"] == 0 for s in stats)


def _check(plan: List[Tuple[int, int, str, int, int]], results: List[Tuple[int, str]]) -> Tuple[int, int]:
    lost = sum(1 for r in results if r is None)
    corrupt = sum(1 for (_, _, _, nbytes, seed), r in zip(plan, results)
                  if r is not None and r != (seed, expected_checksum(seed, nbytes)))
    return lost, corrupt


@pytest.mark.timeout(300)
def test_thousand_transfers_in_flight(eight):
    plan = _plan(1200, seed=1)
    start = time.monotonic()
    outs = _submit(eight, plan)
    results = ray.get(outs, timeout=240)
    seconds = time.monotonic() - start
    lost, corrupt = _check(plan, results)
    assert (lost, corrupt) == (0, 0), f"{lost} lost, {corrupt} corrupted of {len(plan)}"
    per_transport: Dict[str, int] = {}
    for s in ray.get([a.stats.remote() for a in eight]):
        for t, d in s["transfers"].items():
            per_transport[t] = per_transport.get(t, 0) + d.get("in", 0)
    assert sum(per_transport.values()) >= len(plan), per_transport
    for t in ("gloo", "shm", "inline") + (("nixl",) if HAS_NIXL else ()):
        assert per_transport.get(t, 0) > 0, per_transport
    print(f"\n{len(plan)} transfers in {seconds:.1f}s, in per path: {per_transport}")
    del outs, results
    assert wait_for(lambda: _drained(eight), timeout=60), ray.get([a.stats.remote() for a in eight])


def _rss(pids: List[int]) -> List[int]:
    return [psutil.Process(p).memory_info().rss for p in pids]


@pytest.mark.soak
@pytest.mark.timeout(3600)
@pytest.mark.skipif(os.environ.get("RDT_SOAK") != "1", reason="soak test: opt in with RDT_SOAK=1 (takes minutes)")
def test_soak_random_pairs_mixed_transports(eight):
    """10 000 transfers, 8 actors, random pairs, mixed sizes and transports, in waves of 500 in flight; prints
    the resident-memory growth of every actor (after a warm-up wave) for docs/benchmarks.md."""
    total, wave = int(os.environ.get("RDT_SOAK_COUNT", 10_000)), 500
    pids = ray.get([a.pid.remote() for a in eight])
    warm = _plan(wave, seed=99)
    assert _check(warm, ray.get(_submit(eight, warm), timeout=600)) == (0, 0)
    assert wait_for(lambda: _drained(eight), timeout=60)
    base = _rss(pids)
    start = time.monotonic()
    done = lost = corrupt = 0
    for w in range(0, total, wave):
        plan = _plan(min(wave, total - w), seed=1000 + w)
        res = ray.get(_submit(eight, plan), timeout=600)
        lo, co = _check(plan, res)
        lost, corrupt, done = lost + lo, corrupt + co, done + len(plan)
    seconds = time.monotonic() - start
    drained = wait_for(lambda: _drained(eight), timeout=120)
    grow = [(b - a) / MiB for a, b in zip(base, _rss(pids))]
    print(f"\nsoak: {done} transfers in {seconds:.1f}s ({done / seconds:.0f}/s), lost {lost}, corrupted {corrupt}, "
          f"drained {'yes' if drained else 'no'}; RSS growth per actor (MiB): "
          + ", ".join(f"{g:+.1f}" for g in grow))
    assert (lost, corrupt) == (0, 0) and drained
    assert max(grow) < 50, grow
