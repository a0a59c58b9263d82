"""Ray nodes in separate network namespaces joined by rate-shaped links (tests/_netns.py): what crosses nodes
crosses a real interface, shown by the links' ``tc`` byte counters, and a link cut mid-transfer is a typed error.

Needs root and iproute2 (``ip``, ``tc``); skips with the reason otherwise. Like test_multinode, this module shuts
the shared session cluster down first and leaves Ray shut down at its end.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Tuple

import pytest
import ray

import rdt
from rdt.errors import RdtError

from . import _netns
from ._fault_actors import Caught, _maker, allreduce, checksum, expected_checksum
from .conftest import HAS_NIXL, HAS_UCXX

MiB = 1 << 20
pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]
_reason = _netns.unavailable_reason()
if _reason:
    pytestmark.append(pytest.mark.skip(reason=_reason))


@ray.remote(num_cpus=0)
class NetPeer:
    """Producer and consumer on one node; ``make_<transport>(seed, nbytes)`` as in tests/_fault_actors.Peer."""

    make_gloo = _maker("gloo")
    make_nixl = _maker("nixl")
    make_auto = _maker("auto")
    make_object_store = _maker("object_store")

    def env(self) -> Tuple[str, str, str]:
        return (os.environ.get("GLOO_SOCKET_IFNAME", ""), os.environ.get("UCX_NET_DEVICES", ""),
                ray.util.get_node_ip_address())

    def configure(self, **kw: Any) -> None:
        rdt.configure(**kw)

    def stats(self) -> Dict[str, Any]:
        return rdt.stats()

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Tuple[Any, Any]:
        try:
            return None, fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            return Caught(e), None

    def digest(self, value: Any) -> Tuple[int, str]:
        return value["seed"], checksum(value["t"])

    def try_digest(self, refs: List[Any], timeout: float) -> Tuple[str, Any, float]:
        """Fetch ``refs[0]``: ("ok", digest, s) or ("err", Caught, s)."""
        t0 = time.monotonic()
        try:
            return "ok", self.digest(ray.get(refs[0], timeout=timeout)), time.monotonic() - t0
        except Exception as e:  # noqa: BLE001
            return "err", Caught(e), time.monotonic() - t0


@pytest.fixture(scope="module")
def net():
    ray.shutdown()  # the shared single-node session cluster
    cluster = _netns.NetnsCluster(2, object_store_mib=160)
    try:
        cluster.start()
        # Only settings that name no interface: each node's own GLOO_SOCKET_IFNAME / UCX_NET_DEVICES must win.
        ray.init(address=cluster.address, _node_ip_address=_netns.HOST_IP, log_to_driver=False,
                 runtime_env={"env_vars": {"UCX_WARN_UNUSED_ENV_VARS": "n", "NIXL_LOG_LEVEL": "WARN"}})
        cluster.wait_for_nodes(ray)
        yield cluster
    finally:
        ray.shutdown()
        cluster.stop()


@pytest.fixture(scope="module")
def peers(net):
    """One actor on the head (host namespace) and one on each namespace node."""
    actors = {r: NetPeer.options(resources={r: 1}).remote() for r in ("head", "n1", "n2")}
    envs = ray.get([a.env.remote() for a in actors.values()], timeout=120)
    assert envs == [("rdtbr0", "rdtbr0", "10.77.0.1"), ("rdtv1p", "rdtv1p", "10.77.0.11"),
                    ("rdtv2p", "rdtv2p", "10.77.0.12")]
    yield actors
    for a in actors.values():
        ray.kill(a)


def _moved(net: _netns.NetnsCluster, producer: Any, consumer: Any, make: str, seed: int, nbytes: int
           ) -> Tuple[Dict[str, int], Dict[str, int]]:
    """Move one object n1 -> n2; return (paths the consumer used, bytes each link direction carried)."""
    n1, n2 = net.nodes
    before = (n1.counters(), n2.counters(), ray.get(consumer.stats.remote(), timeout=60)["paths"])
    ref = getattr(producer, make).remote(seed, nbytes)
    assert ray.get(consumer.digest.remote(ref), timeout=120) == (seed, expected_checksum(seed, nbytes))
    after = (n1.counters(), n2.counters(), ray.get(consumer.stats.remote(), timeout=60)["paths"])
    paths = {p: n - before[2].get(p, 0) for p, n in after[2].items() if n - before[2].get(p, 0)}
    link = {"n1_out": after[0]["out"] - before[0]["out"], "n2_into": after[1]["into"] - before[1]["into"]}
    return paths, link


def test_objects_cross_the_link(net, peers):
    """Every network transport (and `auto`) moves a 64 MiB object n1 -> n2 through both shaped link ends."""
    p1, p2 = peers["n1"], peers["n2"]
    nbytes = 64 * MiB
    seen: Dict[str, Dict[str, int]] = {}

    def move(label: str, make: str) -> None:  # one fetch, by the path the label names, through both link ends
        paths, link = _moved(net, p1, p2, make, len(seen), nbytes)
        seen[label] = paths
        assert link["n1_out"] >= nbytes and link["n2_into"] >= nbytes, (label, paths, link)

    group = rdt.create_collective_group([p1, p2], backend="gloo", name="netns-gloo")
    try:
        move("gloo", "make_gloo")
        move("auto+gloo group", "make_auto")
        move("object_store", "make_object_store")
    finally:
        group.destroy(timeout=30)
    if HAS_NIXL:
        move("nixl", "make_nixl")
    move("auto, no group", "make_auto")
    if HAS_UCXX:
        group = rdt.create_collective_group([p1, p2], backend="ucx", name="netns-ucx")
        try:
            move("auto+ucx group", "make_auto")  # ucx is reached through auto: it cannot be named
        finally:
            group.destroy(timeout=30)
    want = {"gloo": "gloo", "auto+gloo group": "gloo", "object_store": "object_store", "nixl": "nixl",
            "auto, no group": "nixl" if HAS_NIXL else "object_store", "auto+ucx group": "ucx"}
    assert seen == {label: {want[label]: 1} for label in seen}, seen  # auto never chose shm or CUDA IPC
