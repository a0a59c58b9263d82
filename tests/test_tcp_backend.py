"""The tcp backend (the shared matcher over sockets, NCCL's p2p logic on CPU) in a group over real Ray actors.

Issue 13's race at the group level: each actor sends to and receives from the other at the same time from two
threads, with tensors below and above the size where the Gloo-style handshake waits for a verdict. On an
ordered wire without (peer, tag) matching this hung or raised; here it must move every byte, and leave the
matching tables empty.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List

import pytest
import ray
import torch

import rdt_transports as rt

from . import _collective_cases as cc

SIZES = [3, 1 << 10, (1 << 20) // 4 + 5, 1 << 19]  # elements of float32: up to 2 MiB
TIMEOUT = 30.0


def _both_ways(name: str) -> Dict[str, Any]:
    """(actor side) send SIZES to the other rank on one thread while receiving them on another."""
    group = rt.get_group(name)
    me, other = group.rank, 1 - group.rank
    errors: List[str] = []
    got: List[torch.Tensor] = [torch.zeros(n) for n in SIZES]

    def send() -> None:
        try:
            for i, n in enumerate(SIZES):
                rt.send(torch.arange(n, dtype=torch.float32) + 100 * i + me, other, name, timeout=TIMEOUT)
        except Exception as e:  # noqa: BLE001 - reported to the driver
            errors.append(f"send: {e!r}")

    def recv() -> None:
        try:
            for t in got:
                rt.recv(t, other, name, timeout=TIMEOUT)
        except Exception as e:  # noqa: BLE001
            errors.append(f"recv: {e!r}")

    threads = [threading.Thread(target=send), threading.Thread(target=recv)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT + 5)
    ok = all(torch.equal(got[i], torch.arange(n, dtype=torch.float32) + 100 * i + other)
             for i, n in enumerate(SIZES))
    return dict(errors=errors, ok=ok, pending=group.backend.matcher.pending(), state=group.state.value,
                rejected=group.backend.stats["rejected_connections"])


@pytest.fixture(scope="module")
def pair(ray_cluster):
    actors = [cc.CollectiveWorker.remote() for _ in range(2)]
    ray.get([a.ping.remote() for a in actors], timeout=120)
    handle = rt.create_collective_group(actors, backend="tcp", group_name="tcp-both-ways")
    yield actors
    handle.destroy(timeout=10)
    for a in actors:
        ray.kill(a)


def test_send_and_recv_both_ways_from_two_threads_per_actor(pair: List[Any]) -> None:
    for _ in range(3):
        out = ray.get([a.__ray_call__.remote(lambda _self: _both_ways("tcp-both-ways")) for a in pair],
                      timeout=TIMEOUT * 3)
        for rank, r in enumerate(out):
            assert r["errors"] == [], f"rank {rank}: {r['errors']}"
            assert r["ok"], f"rank {rank} received wrong bytes"
            assert r["pending"] == 0 and r["state"] == "healthy" and r["rejected"] == 0
