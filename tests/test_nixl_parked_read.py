"""A NIXL READ that timed out may still land: ``rdt.get(..., into=...)`` targets it was given stay busy until it ends.

Real actors, real NIXL agents over UCX. The actors run UCX over TCP only (``UCX_TLS=tcp``), where a READ needs the
producer's agent to progress: holding the producer agent's lock (what its progress thread takes every 2 ms) keeps
the READ's bytes from moving until the lock is let go, so step k's READ times out deterministically and lands when
the stall ends. Every check compares bytes.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any, Dict, List, Tuple

import pytest
import ray
import torch

import rdt

from ._nixl_stall import stall_agent
from .conftest import HAS_NIXL, wait_for

pytestmark = [pytest.mark.skipif(not HAS_NIXL, reason="nixl not installed: pip install 'ray-direct-transport[nixl]'"),
              pytest.mark.timeout(120)]

TCP_ONLY = {"env_vars": {"UCX_TLS": "tcp"}}  # merged with the cluster's env vars (loopback device etc.)
MiB = 1 << 20


def _state(fill: float) -> Dict[str, torch.Tensor]:
    """Three tensors of 2 MiB each (not packed: each lands straight in its target)."""
    return {"w": torch.full((MiB // 2,), fill), "b": torch.full((512, 1024), fill + 1),
            "ids": torch.full((MiB // 4,), int(fill * 10), dtype=torch.int64)}


def _digest(state: Dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].numpy().tobytes())
    return h.hexdigest()


@ray.remote
class Producer:
    @rdt.tensor_method(tensor_transport="nixl")
    def weights(self, fill: float) -> Dict[str, torch.Tensor]:
        return _state(fill)

    def stall(self, seconds: float) -> float:
        """Hold this process's NIXL agent lock for ``seconds`` (its READs make no progress meanwhile); returns the
        wall-clock time the stall ends."""
        return stall_agent(seconds)


@ray.remote
class Consumer:
    def __init__(self) -> None:
        self.params = _state(0.0)

    def where(self) -> str:
        return rdt.__file__

    def load(self, refs: List[Any], timeout: float) -> Tuple[str, str, float]:
        """rdt.get into the parameters: ("ok" or the error's type name, the message, seconds taken)."""
        start = time.monotonic()
        try:
            value = rdt.get(refs[0], into=self.params, timeout=timeout)
            assert all(value[k] is self.params[k] for k in self.params)
            return "ok", "", time.monotonic() - start
        except Exception as e:  # noqa: BLE001 - the test checks which
            return type(e).__name__, str(e), time.monotonic() - start

    def fetch(self, refs: List[Any], timeout: float) -> Tuple[str, str, float]:
        """rdt.get into fresh tensors: ("ok" or the error's type name, the message, seconds taken)."""
        start = time.monotonic()
        try:
            rdt.get(refs[0], timeout=timeout)
            return "ok", "", time.monotonic() - start
        except Exception as e:  # noqa: BLE001 - the test checks which
            return type(e).__name__, str(e), time.monotonic() - start

    def digest(self) -> str:
        return _digest(self.params)

    def parked(self) -> int:
        """NIXL READs of this process that timed out and are still in flight."""
        from rdt._process.context import get_context
        from rdt.transports.nixl.agent import agent

        ag = agent(get_context())
        with ag.lock:
            return len(ag.parked)

    def busy(self) -> int:
        """Entries of this process's table of busy into= targets."""
        from rdt._process.context import get_context

        return len(get_context().busy_targets)

    def release_parked(self) -> int:
        """Release the handles of this process's parked READs now, as a cancel would (their memory kept alive)."""
        from rdt._process.context import get_context
        from rdt.transports.nixl.agent import agent

        ag = agent(get_context())
        with ag.lock:
            reads, ag.parked = ag.parked, []
            for read in reads:
                for handle in read.handles:
                    handle.release()  # NIXL: "if the transfer is active, NIXL will attempt to cancel it"
        for read in reads:
            ag.busy.clear(read.hold)
        self.released = reads
        return len(reads)

    def set_max_parked(self, n: int) -> None:
        from rdt._process.context import get_context
        from rdt.transports.nixl.agent import agent

        agent(get_context()).max_parked = n


@pytest.fixture(scope="module")
def trio(ray_cluster):
    """A producer to stall, a healthy producer and a consumer, all on UCX/TCP, their agents connected."""
    stalled, healthy = Producer.options(runtime_env=TCP_ONLY).remote(), Producer.options(runtime_env=TCP_ONLY).remote()
    c = Consumer.options(runtime_env=TCP_ONLY).remote()
    for p in (stalled, healthy):  # connect first: a stalled first READ would wait in the connection instead
        assert ray.get(c.load.remote([p.weights.remote(0.5)], 60.0), timeout=120)[0] == "ok"
    yield stalled, healthy, c
    for a in (stalled, healthy, c):
        ray.kill(a)


def _stall_and_time_out(stalled: Any, c: Any, fill: float, stall_s: float,
                        timeout: float) -> Tuple[str, float, Any]:
    """Stall the producer, then let a fetch of its object time out; (its error message, when the stall ends, the
    ref: the caller keeps it while the READ may run, or the producer frees the memory that READ still reads)."""
    ref = stalled.weights.remote(fill)
    ray.wait([ref], timeout=60)
    ends = ray.get(stalled.stall.remote(stall_s), timeout=30)
    kind, msg, took = ray.get(c.load.remote([ref], timeout), timeout=60)
    assert kind == "TransferTimeoutError", (kind, msg)
    assert took < timeout + 3.0
    return msg, ends, ref


def test_parked_read_never_overwrites_a_later_successful_fetch(trio) -> None:
    """Step k's READ times out (its producer stalled); step k+1 from another producer into the same targets
    succeeds (it waits for step k's READ to end); afterwards the targets hold step k+1's bytes."""
    stalled, healthy, c = trio
    assert ray.get(c.where.remote(), timeout=30).startswith(rdt.__file__.rsplit("/rdt/", 1)[0])
    _, ends, ref = _stall_and_time_out(stalled, c, 1.0, 5.0, 0.5)
    assert ray.get(c.parked.remote(), timeout=30) == 1
    assert time.time() < ends - 1.0, "the stall nearly ended before step k+1 started: the test would prove nothing"
    kind, msg, _ = ray.get(c.load.remote([healthy.weights.remote(2.0)], 30.0), timeout=60)
    assert kind == "ok", msg
    time.sleep(max(ends - time.time(), 0) + 0.5)
    assert wait_for(lambda: ray.get(c.parked.remote(), timeout=30) == 0, timeout=20), "step k's READ never ended"
    time.sleep(0.5)
    assert ray.get(c.digest.remote(), timeout=30) == _digest(_state(2.0)), "step k's late READ overwrote step k+1"
    assert ray.get(c.busy.remote(), timeout=30) == 0  # the busy table drains with the parked READ
    del ref  # alive until step k's READ ended: it read live memory


def test_fetch_into_busy_targets_fails_naming_the_parked_read_and_moves_nothing(trio) -> None:
    """While step k's READ is stuck, a fetch into its targets waits its timeout, then raises IntoBusyError naming
    step k's object; it writes nothing, then or later (re-checked after twice its timeout). With room for one
    parked READ a further NIXL fetch starts no READ and says why. Once step k's READ ends (its bytes land: the
    documented cost of a timed-out NIXL fetch into targets) the table drains to zero and the targets take new
    fetches."""
    stalled, healthy, c = trio
    before = ray.get(c.digest.remote(), timeout=30)
    msg_k, ends, ref = _stall_and_time_out(stalled, c, 3.0, 7.0, 0.5)
    assert "may write into the 3 into= target(s)" in msg_k, msg_k
    old = re.search(r"object='([0-9a-f]{32})'", msg_k).group(1)
    kind, msg, took = ray.get(c.load.remote([healthy.weights.remote(4.0)], 1.0), timeout=60)
    assert kind == "IntoBusyError", msg
    assert old[:16] in msg and "still in flight" in msg and "nothing was moved" in msg and "Fix:" in msg, msg
    assert 1.0 <= took < 4.0
    raised = time.monotonic()
    ray.get(c.set_max_parked.remote(1), timeout=30)
    try:
        kind, msg, took = ray.get(c.fetch.remote([healthy.weights.remote(5.0)], 10.0), timeout=60)
        assert kind == "ObjectFetchError" and "still in flight" in msg and took < 5.0, (kind, msg, took)
    finally:
        ray.get(c.set_max_parked.remote(64), timeout=30)
    time.sleep(max(raised + 2 * 1.0 - time.monotonic(), 0))  # twice the failed fetch's timeout after it raised
    assert time.time() < ends - 0.5, "the stall ended too early: the check below would prove nothing"
    assert ray.get(c.digest.remote(), timeout=30) == before, "the failed fetch (or the stuck READ) wrote the targets"
    assert wait_for(lambda: ray.get(c.parked.remote(), timeout=30) == 0, timeout=max(ends - time.time(), 0) + 20)
    assert ray.get(c.busy.remote(), timeout=30) == 0
    # Step k's own READ landed at its end (its object still alive: ``ref``; a freed one lands whatever its memory
    # holds by then, so the targets of a failed fetch hold nothing defined until a later fetch into them succeeds).
    assert ray.get(c.digest.remote(), timeout=30) == _digest(_state(3.0))
    del ref
    kind, msg, took = ray.get(c.load.remote([healthy.weights.remote(4.0)], 30.0), timeout=60)
    assert kind == "ok" and took < 5.0, msg
    time.sleep(0.5)
    assert ray.get(c.digest.remote(), timeout=30) == _digest(_state(4.0))


def test_killing_a_stuck_producer_ends_its_parked_read_and_frees_the_targets(trio) -> None:
    """The fix the error names: once the stuck producer dies, its parked READ fails (nothing lands) and the
    targets take the next fetch at once."""
    _, healthy, c = trio
    victim = Producer.options(runtime_env=TCP_ONLY).remote()
    assert ray.get(c.load.remote([victim.weights.remote(0.5)], 60.0), timeout=120)[0] == "ok"
    before = ray.get(c.digest.remote(), timeout=30)
    _stall_and_time_out(victim, c, 6.0, 60.0, 0.5)
    ray.kill(victim)
    assert wait_for(lambda: ray.get(c.busy.remote(), timeout=30) == 0, timeout=15)
    assert ray.get(c.parked.remote(), timeout=30) == 0
    assert ray.get(c.digest.remote(), timeout=30) == before
    kind, msg, took = ray.get(c.load.remote([healthy.weights.remote(7.0)], 30.0), timeout=60)
    assert kind == "ok" and took < 5.0, msg
    assert ray.get(c.digest.remote(), timeout=30) == _digest(_state(7.0))


def test_releasing_an_in_flight_read_does_not_stop_its_bytes(trio) -> None:
    """Why a timed-out READ is parked rather than released: releasing its handle returns success, yet the bytes
    still land once the producer progresses (NIXL 1.5.1 over UCX/TCP), and nothing tells when. If this ever
    fails, releasing cancels and parked READs could be released at once."""
    stalled, _, c = trio
    before = ray.get(c.digest.remote(), timeout=30)
    _, ends, ref = _stall_and_time_out(stalled, c, 8.0, 3.0, 0.5)
    assert ray.get(c.release_parked.remote(), timeout=30) == 1
    assert ray.get(c.digest.remote(), timeout=30) == before
    time.sleep(max(ends - time.time(), 0) + 1.0)
    assert wait_for(lambda: ray.get(c.digest.remote(), timeout=30) == _digest(_state(8.0)), timeout=10)
    del ref
