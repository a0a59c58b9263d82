"""A consumer that dies while its NIXL READ over UCX/TCP waits on a stuck producer must not take the producer down.

Found by the data-integrity soak (tests/test_soak.py): a wave that stopped a producer (SIGSTOP) and killed a
consumer fetching from it over UCX/TCP lost the producer. Minimized here: real actors, real NIXL agents; the
consumer runs UCX over TCP only (``UCX_TLS=tcp``, what UCX uses between nodes without RDMA), the producer runs
with the defaults. The producer is stopped, the consumer posts a READ, the consumer is killed, the producer
continues: it aborts at once (``ucp_request.inl:356 Fatal: unexpected error: Endpoint timeout``, SIGABRT in
``get_new_notifs``, from the object agent's progress thread). docs/fault-model.md promises that a consumer's death
leaves the producer working.

The defect is in UCX (bundled 1.23.0 in nixl-cu13 1.5.1, unchanged at openucx/ucx master), not in rdt:
``scripts/repro-ucx-sw-get-abort`` shows it with two raw NIXL agents and no rdt or Ray. TCP has no native GET, so
UCP emulates the READ: the consumer sends a GET_REQ active message, and the producer answers it from inside UCX
progress (``ucp_get_req_handler``, src/ucp/rma/rma_sw.c). The answer's send fails once the requester's socket
is gone (uct/tcp reports EPIPE as UCS_ERR_ENDPOINT_TIMEOUT), and ``ucp_request_try_send`` treats any such error
as fatal, whatever the endpoint's error-handling mode. So a producer that reads a dead consumer's GET_REQ aborts:
a stopped producer, or one whose progress lags (0.5 s without any stop is enough); a reply of one TCP segment
(<= 8 KiB), a WRITE (UCT's native TCP put), and UCX's shared-memory transports on one node are not affected.
Nothing rdt can configure reaches that path (error mode none/peer, NIXL's own progress thread, keepalive
settings: all abort the same way); the fix is upstream: drop the reply when its send fails.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, List

import pytest
import ray
import torch

import rdt

from ._stop import freeze
from .conftest import HAS_NIXL

pytestmark = [pytest.mark.skipif(not HAS_NIXL, reason="nixl not installed: pip install 'ray-direct-transport[nixl]'"),
              pytest.mark.timeout(120)]

TCP_ONLY = {"env_vars": {"UCX_TLS": "tcp"}}  # merged with the cluster's env vars (loopback device etc.)


@ray.remote(num_cpus=0)
class Producer:
    @rdt.tensor_method(tensor_transport="nixl")
    def weights(self, numel: int) -> dict:
        return {"w": torch.arange(numel, dtype=torch.float32)}

    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0)
class Consumer:
    def where(self) -> str:
        return rdt.__file__

    def fetch(self, refs: List[Any], timeout: float) -> str:
        """rdt.get of refs[0]: "ok" if every byte is right, else the error's type name."""
        try:
            value = rdt.get(refs[0], timeout=timeout)
        except Exception as e:  # noqa: BLE001 - the test checks which
            return type(e).__name__
        w = value["w"]
        return "ok" if torch.equal(w, torch.arange(w.numel(), dtype=torch.float32)) else "wrong bytes"


@pytest.mark.xfail(strict=True, reason="UCX defect (issue 29 soak finding): UCP's software GET over TCP answers a "
                   "dead consumer's GET_REQ from inside progress and ucs_fatal()s when that reply's send fails "
                   "(ucp_get_req_handler -> ucp_request_try_send, 'Endpoint timeout'); not reachable from rdt, "
                   "needs a UCX fix (scripts/repro-ucx-sw-get-abort)")
def test_producer_survives_a_tcp_consumer_dying_while_it_is_stopped(ray_cluster) -> None:
    p = Producer.remote()
    pid = ray.get(p.pid.remote(), timeout=60)
    victim = Consumer.options(runtime_env=TCP_ONLY).remote()
    assert ray.get(victim.where.remote(), timeout=60) == rdt.__file__
    ref = p.weights.remote(2 << 20)  # 8 MiB
    assert ray.get(victim.fetch.remote([ref], 60.0), timeout=120) == "ok"  # agents connected over TCP
    freeze(pid)
    try:
        victim.fetch.remote([ref], 30.0)  # its READ waits on the stopped producer
        time.sleep(1.0)
        ray.kill(victim)
        time.sleep(0.8)
    finally:
        os.kill(pid, signal.SIGCONT)
    time.sleep(2.0)
    try:
        alive = ray.get(p.pid.remote(), timeout=30) == pid  # ActorDiedError where the producer aborted
        other = Consumer.options(runtime_env=TCP_ONLY).remote()
        assert alive and ray.get(other.fetch.remote([p.weights.remote(1 << 16)], 60.0), timeout=120) == "ok"
    finally:
        ray.kill(p)
