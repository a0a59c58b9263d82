"""Several Ray nodes on one machine (ray.cluster_utils.Cluster): objects cross nodes over network transports only,
and a node that goes away fails only the transfers that needed it.

This module shuts the shared session cluster down first and leaves Ray shut down at its end; the next module's
``ray_cluster`` fixture starts the shared cluster again.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Dict

import pytest
import ray

import rdt
from rdt.errors import ProducerDiedError

from ._fault_actors import Peer, checksum, expected_checksum, pid_gone
from .conftest import HAS_NIXL, wait_for

MiB = 1 << 20
DIED = (ProducerDiedError, ray.exceptions.ActorDiedError)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    ray.shutdown()  # the shared single-node session cluster
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node_a": 8}, "object_store_memory": 256 * MiB,
        # notice a removed node within ~2 s instead of ~15 s
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                           "health_check_timeout_ms": 500},
    })
    nodes = {"node_a": c.head_node}
    for name in ("node_b", "node_c"):
        nodes[name] = c.add_node(num_cpus=2, resources={name: 8}, object_store_memory=256 * MiB)
    c.wait_for_nodes()
    # The nodes' processes inherit this process's loopback variables (tests/conftest.py): no job runtime_env, which
    # would start every worker through Ray's setup_worker (an extra interpreter per actor).
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()


def _on(node: str) -> Any:
    return Peer.options(resources={node: 1}).remote()


def _in(actor: Any) -> Dict[str, int]:
    return {t: d.get("in", 0) for t, d in rdt.stats(actor)["transfers"].items()}


def _delta(before: Dict[str, int], after: Dict[str, int]) -> Dict[str, int]:
    return {t: n - before.get(t, 0) for t, n in after.items() if n - before.get(t, 0)}


def test_objects_cross_nodes_over_network_transports(cluster):
    a1, a2, b1, c1 = _on("node_a"), _on("node_a"), _on("node_b"), _on("node_c")
    nodes = ray.get([x.node_id.remote() for x in (a1, a2, b1, c1)], timeout=120)
    assert nodes[0] == nodes[1] and len({nodes[0], nodes[2], nodes[3]}) == 3
    group = rdt.create_collective_group([a1, a2, b1], backend="gloo", name="mn-gloo")
    try:
        def moved(producer: Any, transport: str, consumer: Any, seed: int) -> Dict[str, int]:
            before = _in(consumer)
            ref = getattr(producer, f"make_{transport}").remote(seed, MiB)
            assert ray.get(consumer.digest.remote(ref), timeout=120) == (seed, expected_checksum(seed, MiB))
            return _delta(before, _in(consumer))

        assert moved(a1, "auto", a2, 1) == {"shm": 1}  # same node: shared memory
        assert moved(a1, "auto", b1, 2) == {"gloo": 1}  # other node, common group: the group's backend
        assert moved(a1, "gloo", b1, 3) == {"gloo": 1}
        assert moved(a1, "shm", b1, 4) == {"object_store": 1}  # shared memory cannot cross nodes
        assert moved(a1, "auto", c1, 5) == ({"nixl": 1} if HAS_NIXL else {"object_store": 1})  # no common group
        if HAS_NIXL:
            assert moved(b1, "nixl", c1, 6) == {"nixl": 1}
        # No cross-node transfer ever used shared memory.
        for consumer in (b1, c1):
            assert "shm" not in rdt.stats(consumer)["transfers"], rdt.stats(consumer)["transfers"]
        value = ray.get(b1.make_auto.remote(7, MiB))  # the driver (node_a) is outside the group
        assert value["seed"] == 7 and checksum(value["t"]) == expected_checksum(7, MiB)
    finally:
        group.destroy(timeout=30)
        for x in (a1, a2, b1, c1):
            ray.kill(x)


def test_removed_node_fails_only_its_transfers(cluster):
    """Node C (a producer) goes away: the consumer on node B gets a typed error in time; A and B keep working."""
    c, nodes = cluster
    a1, b1, c1 = _on("node_a"), _on("node_b"), _on("node_c")
    cpid = ray.get(c1.pid.remote(), timeout=120)
    group = rdt.create_collective_group([a1, b1, c1], backend="gloo", name="mn-remove")
    ray.get(b1.configure.remote(transfer_timeout=10.0))
    transports = ["gloo", "auto"] + (["nixl"] if HAS_NIXL else [])
    try:
        refs = {t: getattr(c1, f"make_{t}").remote(i, 4 * MiB) for i, t in enumerate(transports)}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=60)
        c.remove_node(nodes["node_c"])
        assert wait_for(lambda: pid_gone(cpid), timeout=30)
        for t, ref in refs.items():
            start = time.monotonic()
            with pytest.raises(DIED):
                ray.get(b1.digest.remote(ref), timeout=120)
            assert time.monotonic() - start < 20, t
        # A and B keep working, over their group and without it.
        for i, t in enumerate(["gloo", "shm", "auto"]):
            ref = getattr(a1, f"make_{t}").remote(20 + i, MiB)
            assert ray.get(b1.digest.remote(ref), timeout=60) == (20 + i, expected_checksum(20 + i, MiB))
        del refs, ref
        gc.collect()
        assert wait_for(lambda: rdt.stats(a1)["objects"] == 0 and rdt.stats(b1)["objects"] == 0, timeout=30)
    finally:
        group.destroy(timeout=30)
        for x in (a1, b1):
            ray.kill(x)
