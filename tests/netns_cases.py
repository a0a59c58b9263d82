"""Ray nodes in separate network namespaces joined by rate-shaped links (benchmarks/_netns.py): what crosses nodes
crosses a real interface, shown by the links' ``tc`` byte counters, and a link cut mid-transfer is a typed error.

Needs root and iproute2 (``ip``, ``tc``); skips with the reason otherwise. tests/test_netns.py runs this module in
a pytest process of its own.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Tuple

import pytest
import ray

import rdt
from rdt.errors import ProducerDiedError, RdtError

from benchmarks import _netns
from ._fault_actors import Caught, _maker, checksum, group_state, expected_checksum
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
    auth = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # as on the nodes; an earlier ray.init in this process set "token"
    try:
        cluster.start()
        # No job runtime_env: each node's workers inherit its own environment (_netns sets GLOO_SOCKET_IFNAME and
        # UCX_NET_DEVICES per node over this process's), and a runtime_env would start every worker twice.
        ray.init(address=cluster.address, _node_ip_address=_netns.HOST_IP, log_to_driver=False)
        cluster.wait_for_nodes(ray)
        yield cluster
    finally:
        ray.shutdown()
        if auth is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = auth
        cluster.stop()
        assert not _netns.leftovers(cluster.pgids()), _netns.leftovers(cluster.pgids())


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
    ray.wait([ref], timeout=60, fetch_local=False)
    t0 = time.monotonic()
    assert ray.get(consumer.digest.remote(ref), timeout=120) == (seed, expected_checksum(seed, nbytes))
    print(f"{make}: {nbytes / MiB:.0f} MiB n1 -> n2 in {time.monotonic() - t0:.2f} s (fetch + checksum)")
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


def test_fan_out_costs_the_producers_link_one_object(net, peers):
    """A 64 MiB gloo object on n1 fetched at once by n2 and the head: the consumers are chained, so n1's link
    carries it once (n1's outbound counter grows by less than 1.5x the object), and both get it intact."""
    p1, p2, head = peers["n1"], peers["n2"], peers["head"]
    nbytes = 64 * MiB
    n1, _ = net.nodes
    group = rdt.create_collective_group([p1, p2, head], backend="gloo", name="netns-fanout")
    try:
        ref = p1.make_gloo.remote(21, nbytes)
        ray.wait([ref], timeout=60, fetch_local=False)
        before, served = n1.counters(), ray.get(p1.stats.remote(), timeout=60)["relay"]["served_bytes"]
        t0 = time.monotonic()
        got = ray.get([c.digest.remote(ref) for c in (p2, head)], timeout=120)
        elapsed = time.monotonic() - t0
        assert got == [(21, expected_checksum(21, nbytes))] * 2
        out = n1.counters()["out"] - before["out"]
        served = ray.get(p1.stats.remote(), timeout=60)["relay"]["served_bytes"] - served
        relayed = sum(ray.get(c.stats.remote(), timeout=60)["relay"]["relayed_bytes"] for c in (p2, head))
        print(f"fan-out: 64 MiB n1 -> n2 + head in {elapsed:.2f} s; n1 sent {out / MiB:.1f} MiB, "
              f"served {served / MiB:.1f} MiB, relayed {relayed / MiB:.1f} MiB")
        assert nbytes <= out < 1.5 * nbytes, out
        assert served < 1.5 * nbytes and relayed >= nbytes, (served, relayed)
        del ref
    finally:
        group.destroy(timeout=30)


COLLECTIVE_OPS = ["send", "broadcast", "allreduce", "reduce", "allgather", "gather", "scatter", "reducescatter",
                  "alltoall", "barrier"]  # with recv (the other side of send): every collective rdt_transports has


def _case(op: str, i: int) -> Dict[str, Any]:
    """One case of tests/_collective_cases.py for two ranks: 1 MiB float32 per tensor, root and sender n2."""
    if op == "barrier":
        return dict(op=op, late=1, algorithm="auto", id=i)
    return dict(op=op, dtype="float32", shape=(256, 1024), lib="torch", rop="SUM", root=1, src=1, dst=0,
                algorithm="auto", base=i, id=i)


def _checked(group: str, case: Dict[str, Any], timeout: float) -> bool:
    """(worker side) run one collective and check this rank's result here: a result sent back to the driver
    would cross the shaped link too and blur its counters."""
    import rdt_transports as rt

    from tests._collective_cases import _run_case, check_output, expected

    rank, world = rt.get_rank(group), rt.get_collective_group_size(group)
    out = _run_case(rank, world, group, case, timeout)
    check_output(case, rank, out, expected(case, world)[rank], f"netns {group}")
    return True


def _link_bytes(net: _netns.NetnsCluster) -> List[int]:
    return [c for node in net.nodes for c in node.counters().values()]


@pytest.mark.parametrize("backend", ["gloo", "nixl", "ucx", "tcp"])
def test_collectives_cross_the_link(net, peers, backend):
    """Every collective (and send/recv) between n1 and n2 on each backend: each rank's result checked on the rank,
    and the bytes leaving the two nodes grew by at least half a tensor per operation (a path through shared memory
    or CMA between the namespaces would move none)."""
    if backend == "nixl" and not HAS_NIXL or backend == "ucx" and not HAS_UCXX:
        pytest.skip(f"{backend} is not installed")
    p1, p2 = peers["n1"], peers["n2"]
    name = f"netns-coll-{backend}"
    tensor_bytes = 256 * 1024 * 4
    group = rdt.create_collective_group([p1, p2], backend=backend, name=name)
    try:
        for i, op in enumerate(COLLECTIVE_OPS):
            case = _case(op, i)
            before = _link_bytes(net)  # n1 into, n1 out, n2 into, n2 out
            results = ray.get([p.call.remote(_checked, name, case, 60.0) for p in (p1, p2)], timeout=120)
            grew = [a - b for a, b in zip(_link_bytes(net), before)]
            for caught, ok in results:
                assert caught is None and ok, (backend, op, caught)
            if op != "barrier":
                assert grew[1] + grew[3] >= tensor_bytes // 2, (backend, op, grew)
            print(backend, op, "link bytes", grew)
    finally:
        group.destroy(timeout=30)


def test_sharded_replicas_cross_the_link_once(net, peers):
    """rdt-bench's cross-node replicas row (``rdt-bench --suites xnode``) at a tiny scale: 4 trainer ranks on n1,
    2 engines x TP 2 on n2, engine 0's ranks load their slices from the trainers over NIXL and share them, engine
    1's ranks load the offers. Every timed step, n1's outbound link carries the distinct slices (engine 0's
    targets) at least once and at most 1.02x, n2's inbound link at least once, and every byte of every engine's
    targets equals the trainers'; the row meets its target in the suite's report."""
    from benchmarks import _sharded_sync as ss
    from benchmarks import _xnode

    transport = "nixl" if HAS_NIXL else "gloo"
    impl = f"rdt-sharded-replicas-{transport}"
    t0 = time.monotonic()
    (row,) = _xnode.sharded_rows(net, 0.02, 1, 2, 60.0, chosen=[impl])
    assert "error" not in row, row["error"]
    distinct = row["distinct_slice_bytes"]
    print(f"{impl} n1 -> n2 in {time.monotonic() - t0:.1f} s: n1 out per step {row['n1_out_payload_bytes']} "
          f"payload, {row['n1_out_bytes']} wire; n2 in {row['n2_into_bytes']}; distinct {distinct}; ratio "
          f"{row['link_ratio']:.4f} (wire {row['link_wire_ratio']:.4f})")
    assert (row["trainer_node"], row["engine_node"], len(row["n1_out_bytes"])) == ("n1", "n2", 2), row
    assert distinct == sum(row["target_bytes"][:ss.TP]) > 4 * MiB, row["target_bytes"]
    # the payload is the wire bytes less 66 B of headers per packet: at least the slices (the header estimate is
    # not too large), at most 1.02x (what the row's target requires)
    assert all(distinct <= b <= _xnode.REPLICA_LINK_NEED * distinct for b in row["n1_out_payload_bytes"]), row
    assert all(b >= distinct for b in row["n2_into_bytes"]), row["n2_into_bytes"]
    assert row["bytes_checked"] == sum(row["target_bytes"]), (row["bytes_checked"], row["target_bytes"])
    # rdt's own counters agree: what left the trainer ranks is the distinct slices; engine 1 read the replicas.
    assert distinct <= row["trainer_sent_bytes"] <= 1.01 * distinct, (row["trainer_sent_bytes"], distinct)
    assert any(m.startswith("replica:") for m in row["mechanism"].split("/")), row["mechanism"]
    targets = _xnode.xnode_targets([row])
    assert [(t["value"], t["met"]) for t in targets] == [(round(row["link_ratio"], 4), True)], targets
    assert f"| {impl} | " in _xnode.xnode_markdown([row], targets)


def test_link_cut_mid_transfer_is_a_typed_error(net, peers):
    """n2's link goes down while n1 fetches 256 MiB from n2 over Gloo: n1 gets a typed rdt error within its
    transfer timeout, the driver does not hang, a group without n2 works, and after the link is back the group with
    n2 forms again and moves data."""
    h, p1, p2 = peers["head"], peers["n1"], peers["n2"]
    n2 = net.nodes[1]
    nbytes = 256 * MiB
    group = rdt.create_collective_group([h, p1, p2], backend="gloo", name="netns-cut")
    timeout = 6.0
    ray.get(p1.configure.remote(transfer_timeout=timeout), timeout=60)
    ref = p2.make_gloo.remote(100, nbytes)
    ray.wait([ref], timeout=60, fetch_local=False)
    start_out = n2.counters()["out"]
    pending = p1.try_digest.remote([ref], timeout)
    try:
        deadline = time.monotonic() + 30
        while n2.counters()["out"] - start_out < 16 * MiB and time.monotonic() < deadline:
            time.sleep(0.02)
        sent = n2.counters()["out"] - start_out
        n2.link(up=False)
        assert 16 * MiB <= sent < nbytes, f"the cut came {'too early' if sent < 16 * MiB else 'too late'}: {sent}"
        t0 = time.monotonic()
        status, caught, seconds = ray.get(pending, timeout=timeout + 30)  # n1's own link is up: its answer arrives
        assert status == "err" and issubclass(caught.cls, RdtError), (status, caught)
        assert seconds < timeout + 5 and time.monotonic() - t0 < timeout + 10, (seconds, caught)
        # The consumer's view of the group turns ERRORED; a member the transfer did not involve stays HEALTHY.
        assert ray.get([a.call.remote(group_state, "netns-cut") for a in (h, p1)], timeout=30) == [
            (None, "healthy"), (None, "errored")]
        # The nodes the cut did not touch keep working, in a new group.
        other = rdt.create_collective_group([h, p1], backend="gloo", name="netns-rest")
        try:
            ref2 = h.make_gloo.remote(101, 4 * MiB)
            assert ray.get(p1.digest.remote(ref2), timeout=60) == (101, expected_checksum(101, 4 * MiB))
        finally:
            other.destroy(timeout=30)
    finally:
        n2.link(up=True)
        group.destroy(timeout=30)
    del ref
    # The link is back: a group with n2 forms again and moves data across it.
    again = rdt.create_collective_group([p1, p2], backend="gloo", name="netns-again")
    try:
        ref3 = p2.make_gloo.remote(102, 4 * MiB)
        assert ray.get(p1.digest.remote(ref3), timeout=60) == (102, expected_checksum(102, 4 * MiB))
    finally:
        again.destroy(timeout=30)


def test_removed_node_is_a_typed_error(net, peers):
    """n2 goes away (its processes killed, its link deleted): fetches from it fail typed within the consumer's
    timeout, the driver does not hang, and a group over the head and n1 forms and works. Runs last: n2 is gone."""
    h, p1, p2 = peers["head"], peers["n1"], peers["n2"]
    timeout = 8.0
    ray.get([c.configure.remote(transfer_timeout=timeout) for c in (p1, h)], timeout=60)
    group = rdt.create_collective_group([h, p1, p2], backend="gloo", name="netns-remove")
    transports = ["gloo"] + (["nixl"] if HAS_NIXL else [])
    refs = {t: getattr(p2, f"make_{t}").remote(200 + i, 4 * MiB) for i, t in enumerate(transports)}
    ray.wait(list(refs.values()), num_returns=len(refs), timeout=60, fetch_local=False)
    net.nodes[1].remove()
    try:
        # Both fetches wait out their timeout at once (gloo on n1, nixl on the head), not one after the other.
        t0 = time.monotonic()
        fetches = {t: (p1 if t == "gloo" else h).try_digest.remote([ref], timeout) for t, ref in refs.items()}
        for t, fetch in fetches.items():
            status, caught, seconds = ray.get(fetch, timeout=timeout + 30)
            assert status == "err", (t, caught)
            assert issubclass(caught.cls, (RdtError, ray.exceptions.RayActorError)), (t, caught)
            assert seconds < timeout + 5 and time.monotonic() - t0 < timeout + 10, (t, seconds, caught)
            if t == "nixl":  # the error says where to look: the producer's node, not only NIXL's backend code
                assert "does not answer" in caught.message and "node may be unreachable" in caught.message \
                    or issubclass(caught.cls, ProducerDiedError), caught
            print("removed:", t, caught.cls.__name__, f"after {seconds:.1f} s")
    finally:
        # n2's member never answers (Ray declares its node dead only after ~20 s of failed health checks): the destroy
        # returns at its timeout, with the live members' sides destroyed (they answer in milliseconds; a slower one
        # still runs its destroy after the driver's wait ends).
        group.destroy(timeout=2)
    rest = rdt.create_collective_group([h, p1], backend="gloo", name="netns-after-remove")
    try:
        ref = p1.make_gloo.remote(210, 4 * MiB)
        assert ray.get(h.digest.remote(ref), timeout=60) == (210, expected_checksum(210, 4 * MiB))
    finally:
        rest.destroy(timeout=30)
