"""The object layer's control plane under load and abuse: the control server's connection cap and timeouts, the
control client's bounded pool. Real sockets on loopback, a real ControlServer/ControlClient in-process, and one real
Ray actor producer. Every wait is bounded; nothing asserts on speed.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any, List, Tuple

import pytest
import ray

from rdt._control import wire as _control
from rdt._control.client import ControlClient
from rdt._control.server import ControlServer
from rdt.transports.shm.transport import REQ_PREPARE_SHM

from ._object_actors import Node
from .conftest import wait_for
from .test_security import KEY, _key_for, frame

FLOOD = 400  # raw loopback connections, half idle, half stopped mid-frame


def _host_port(address: str) -> Tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _flood(address: str, n: int) -> List[socket.socket]:
    """``n`` connections that never finish a frame: even ones send nothing, odd ones half a frame."""
    half = frame(payload=b"x" * 64)
    socks = []
    for i in range(n):
        s = socket.create_connection(_host_port(address), timeout=5)
        if i % 2:
            try:
                s.sendall(half[: len(half) // 2])
            except OSError:  # already closed by the server (over the cap)
                pass
        socks.append(s)
    return socks


def _closed_by_peer(s: socket.socket) -> bool:
    """Whether the server closed this connection (EOF or reset), without waiting."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _ping(client: ControlClient, address: str) -> Tuple[int, bytes]:
    return client.request(address, _control.REQ_PING, _control.KEY_PROCESS, KEY, b"", 5.0)


def test_flood_of_idle_and_half_frame_connections_is_capped_and_timed_out() -> None:
    threads0 = threading.active_count()
    srv = ControlServer("127.0.0.1", _key_for, {_control.REQ_PING: lambda _k, _p: (_control.RESP_OK, b"pong")},
                                 max_conns=64, idle_timeout=3.0, frame_timeout=1.0)
    client = ControlClient()
    socks: List[socket.socket] = []
    try:
        socks = _flood(srv.address, FLOOD)
        # real requests are served during the flood, on fresh connections each time
        for _ in range(20):
            fresh = ControlClient()
            try:
                assert _ping(fresh, srv.address) == (_control.RESP_OK, b"pong")
            finally:
                fresh.close()
        assert threading.active_count() - threads0 <= 1 + srv.workers, (threading.active_count(), threads0)
        assert len(srv._conns) <= 64
        assert srv.rejected >= FLOOD - 64  # connections over the cap are closed and counted
        # half frames are dropped after the frame timeout, idle connections after the idle timeout
        assert wait_for(lambda: all(_closed_by_peer(s) for s in socks[1::2]), timeout=15)
        assert wait_for(lambda: all(_closed_by_peer(s) for s in socks), timeout=15)
        assert _ping(client, srv.address) == (_control.RESP_OK, b"pong")
    finally:
        for s in socks:
            s.close()
        client.close()
        srv.close()


def test_slow_peer_frame_timeout_counts_as_rejected() -> None:
    srv = ControlServer("127.0.0.1", _key_for, {_control.REQ_PING: lambda _k, _p: (_control.RESP_OK, b"")},
                                 frame_timeout=0.5)
    try:
        before = srv.rejected
        with socket.create_connection(_host_port(srv.address), timeout=5) as s:
            s.sendall(struct.pack("!I", 100) + b"R")  # a frame started and never finished
            s.settimeout(10)
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
        assert wait_for(lambda: srv.rejected == before + 1, timeout=5)
    finally:
        srv.close()


def test_client_pool_stays_bounded_over_10000_requests_to_many_addresses() -> None:
    srv = ControlServer("0.0.0.0", _key_for, {_control.REQ_PING: lambda _k, _p: (_control.RESP_OK, b"")},
                                 max_conns=512)
    port = _host_port(srv.address)[1]
    addresses = [f"127.0.0.{i}:{port}" for i in range(1, 201)]  # all of 127/8 is loopback on Linux
    client = ControlClient(max_idle_per_address=2, max_idle_total=32, idle_ttl=0.5)
    try:
        peak = 0
        for step in range(10_000):
            assert _ping(client, addresses[step % len(addresses)])[0] == _control.RESP_OK
            peak = max(peak, client.idle_count())
        assert peak <= 32, peak
        time.sleep(0.8)  # past the TTL: the next request drops every stale idle connection
        assert _ping(client, addresses[0])[0] == _control.RESP_OK
        assert client.idle_count() <= 1
    finally:
        client.close()
        srv.close()


def test_client_retries_once_when_a_pooled_connection_was_closed_by_the_server() -> None:
    srv = ControlServer("127.0.0.1", _key_for, {_control.REQ_PING: lambda _k, _p: (_control.RESP_OK, b"")},
                                 idle_timeout=0.5)
    client = ControlClient()
    try:
        assert _ping(client, srv.address)[0] == _control.RESP_OK
        assert wait_for(lambda: not srv._conns, timeout=10)  # the server dropped the pooled connection
        assert _ping(client, srv.address)[0] == _control.RESP_OK
    finally:
        client.close()
        srv.close()


# ---------------------------------------------------------------------------------------------- a real producer
def _control_state(_self: Any) -> Tuple[str, int, int]:
    import threading as th

    from rdt._process.context import get_context

    ctx = get_context()
    info = ctx.producer_info()
    return info.control_address, ctx._server.rejected, th.active_count()


@pytest.fixture(scope="module")
def producer(ray_cluster):
    a = Node.remote()
    ray.get(a.configure.remote(shm_cma=False), timeout=120)  # same-node "auto" fetches ask the control server
    yield a
    ray.kill(a)


def test_real_producer_serves_fetches_during_a_flood(producer) -> None:
    address, _, threads0 = ray.get(producer.__ray_call__.remote(_control_state), timeout=60)
    socks = _flood(address, FLOOD)
    try:
        for fill in (1.0, 2.0, 3.0):
            value = ray.get(producer.make_auto.remote(1 << 16, fill), timeout=60)
            assert float(value["w"].sum()) == fill * (1 << 16)
        _, rejected, threads = ray.get(producer.__ray_call__.remote(_control_state), timeout=60)
        assert rejected > 0
        assert threads - threads0 <= 64, (threads, threads0)  # not one thread per connection
    finally:
        for s in socks:
            s.close()


# ---------------------------------------------------------------------------------------------- not in the actor queue
@pytest.fixture()
def fresh_node(ray_cluster):
    a = Node.remote()
    ray.get(a.pid.remote(), timeout=120)
    yield a
    ray.kill(a)


def _not_done(ref: Any) -> bool:
    return not ray.wait([ref], timeout=0)[0]


def test_driver_get_and_stats_do_not_wait_for_the_producers_running_method(fresh_node) -> None:
    import rdt

    p = fresh_node
    ref = p.make_gloo.remote(1 << 16, 3.0)
    assert ray.wait([ref], timeout=60)[0]
    busy = p.busy.remote(6.0)
    value = ray.get(ref, timeout=30)
    assert _not_done(busy), "ray.get returned only after the producer's running method ended"
    assert float(value["w"].sum()) == 3.0 * (1 << 16)
    stats = rdt.stats(p, timeout=30)
    assert _not_done(busy), "rdt.stats returned only after the producer's running method ended"
    assert stats["objects"] >= 1
    assert stats["transfers"]["object_store"]["out"] >= 1
    assert ray.get(busy, timeout=30) == "done"
    assert rdt.stats(p, timeout=30)["transfers"]["object_store"]["out"] == stats["transfers"]["object_store"]["out"]


def test_stats_of_an_actor_that_never_used_rdt_is_empty_without_calling_it(fresh_node) -> None:
    import rdt

    busy = fresh_node.busy.remote(6.0)
    stats = rdt.stats(fresh_node, timeout=30)
    assert _not_done(busy), "rdt.stats waited for the actor's running method"
    assert stats["objects"] == 0 and stats["transfers"] == {}
    # the same keys as a process that uses rdt (code reading stats()["sharded"]["readers"] works for any actor),
    # every count zero
    mine = rdt.stats()
    assert _shape(stats) == _shape(mine), (sorted(stats), sorted(mine))
    assert not any(_numbers(stats)), stats
    assert ray.get(busy, timeout=30) == "done"


def _shape(d):
    """The nested keys of a stats dict (its per-transport transfer and path tables left out: they name what ran)."""
    return {k: _shape(v) if isinstance(v, dict) and k not in ("transfers", "paths") else None for k, v in d.items()}


def _numbers(d):
    """Every number in a nested stats dict."""
    for v in d.values():
        if isinstance(v, dict):
            yield from _numbers(v)
        elif isinstance(v, (int, float)):
            yield v


# ---------------------------------------------------------------------------------------------- outside the group
@pytest.fixture(scope="module")
def grouped(ray_cluster):
    """A producer and a member of its gloo group, and an outsider that shares no group with it."""
    import rdt

    p, member, outsider = Node.remote(), Node.remote(), Node.remote()
    ray.get([a.pid.remote() for a in (p, member, outsider)], timeout=120)
    group = rdt.create_collective_group([p, member], backend="gloo")
    yield p, member, outsider
    rdt.destroy_collective_group(group)
    for a in (p, member, outsider):
        ray.kill(a)


def test_ray_get_inside_an_actor_outside_the_group_falls_back(grouped) -> None:
    p, member, outsider = grouped
    ref = p.make_gloo.remote(1 << 16, 2.0)
    assert ray.get(outsider.try_total.remote([ref]), timeout=60) == ("ok", 2.0 * (1 << 16))
    assert ray.get(member.try_total.remote([ref]), timeout=60) == ("ok", 2.0 * (1 << 16))  # over gloo
    # a ref passed as a task argument still fails fast, naming the fix
    from rdt.errors import NoCollectiveGroupError

    with pytest.raises(NoCollectiveGroupError, match="rdt.create_collective_group"):
        ray.get(outsider.total.remote(ref), timeout=60)


def test_producer_waiting_on_a_consumer_that_fetches_from_it_does_not_deadlock(grouped) -> None:
    p, _, outsider = grouped
    assert ray.get(p.put_and_ask.remote(outsider, "gloo"), timeout=90) == ("ok", 5.0 * (1 << 16))


def _deserialization_kinds(_self: Any) -> Tuple[bool, bool]:
    """In an actor: what rdt's probe says while Ray deserializes a ray.get value and a task argument."""
    from rdt._ray import runtime as _runtime

    class Probe:
        def __reduce__(self) -> Any:
            return (_runtime.called_by_ray_get, ())

    got = ray.get(ray.put(Probe()))

    @ray.remote(num_cpus=0)
    def as_argument(value: bool) -> bool:
        return value

    return got, ray.get(as_argument.remote(ray.put(Probe())))


def test_ray_deserialization_probe_still_tells_get_from_task_arguments(grouped) -> None:
    """Fails loudly when Ray changes the private detail rdt relies on (see rdt/_runtime.py::called_by_ray_get)."""
    got, arg = ray.get(grouped[2].__ray_call__.remote(_deserialization_kinds), timeout=60)
    assert got is True, "Ray's ray.get path changed: rdt can no longer tell ray.get from task arguments"
    assert arg is False, "Ray's task-argument path changed: rdt takes task arguments for ray.get"



def test_streamed_bytes_arrive_whole_and_are_authenticated() -> None:
    """A handler's raw bytes land in the caller's buffers; bytes changed on the wire fail the trailing MAC."""
    data = [bytes(range(256)) * 4096, b"", b"tail" * 1000]

    def serve(_k: int, _p: bytes) -> Tuple:
        return _control.RESP_OK, b"hdr", _control.Stream([memoryview(d) for d in data], time.monotonic() + 10)

    srv = ControlServer("127.0.0.1", _key_for, {REQ_PREPARE_SHM: serve})
    client = ControlClient()
    try:
        dest = [bytearray(len(d)) for d in data]
        resp = client.request(srv.address, REQ_PREPARE_SHM, _control.KEY_PROCESS, KEY, b"", 10.0,
                              alloc=lambda t, h: [memoryview(b) for b in dest])
        assert resp == (_control.RESP_OK, b"hdr") and [bytes(b) for b in dest] == data
    finally:
        client.close()
        srv.close()
    # a peer (or the wire) that changes one byte: a valid answer frame, the bytes, the MAC of other bytes
    lsock = socket.create_server(("127.0.0.1", 0))

    def fake_server() -> None:
        conn, _ = lsock.accept()
        with conn:
            conn.settimeout(10)
            _, _, nonce, _ = _control.decode(_control.read_frame(conn), _key_for)
            good = b"".join(data)
            bad = bytearray(good)
            bad[100] ^= 1
            import hashlib
            import hmac

            conn.sendall(_control.encode(_control.RESP_OK, _control.KEY_PROCESS, KEY, b"hdr", nonce) + bytes(bad)
                         + hmac.new(KEY, nonce + good, hashlib.sha256).digest())
            conn.recv(1)

    t = threading.Thread(target=fake_server, daemon=True)
    t.start()
    client = ControlClient()
    try:
        with pytest.raises(_control.ProtocolError, match="bad MAC"):
            client.request(f"127.0.0.1:{lsock.getsockname()[1]}", REQ_PREPARE_SHM, _control.KEY_PROCESS,
                           KEY, b"", 10.0, alloc=lambda t, h: [memoryview(bytearray(len(d))) for d in data])
    finally:
        client.close()
        t.join(10)
        lsock.close()
