"""Security of what rdt adds to the network: authenticated control frames, no unpickling of network bytes,
private shared-memory segments, per-group secrets. See docs/security.md.

Parts: a hypothesis fuzz of the two binary decoders; a live ControlServer (in-process, and the real one inside an
actor) fed every kind of bad frame; spies proving no network byte is unpickled; shm permissions, naming and
reaping; group secrets. Waits are bounded and nothing asserts on speed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import ray
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rdt_transports as rt
from rdt._control import wire as _control
from rdt._control.client import ControlClient
from rdt._control.server import ControlServer
from rdt.transports.group.protocol import REQ_FETCH_GROUP, REQ_FETCH_RANGES, REQ_RELAY_NEXT
from rdt.transports.nixl.transport import REQ_PREPARE_NIXL
from rdt.transports.shm.transport import REQ_PREPARE_SHM
from rdt.transports.nixl import descriptors as nixl_descriptors
from rdt.transports.shm import segments as _shm
from rdt._control.wire import MAX_FRAME, MAX_SKEW_MS, ProtocolError

from ._object_actors import Node
from .conftest import wait_for

KEY = b"k" * 32
GROUP_KEY = b"g" * 32
FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _key_for(key_id: int, payload: bytes) -> Optional[bytes]:
    return {_control.KEY_PROCESS: KEY, _control.KEY_GROUP: GROUP_KEY}.get(key_id)


def frame(msg_type: int = _control.REQ_PING, key_id: int = _control.KEY_PROCESS, key: bytes = KEY,
          payload: bytes = b"", *, nonce: Optional[bytes] = None, ts_ms: Optional[int] = None,
          magic: bytes = _control.MAGIC, version: int = _control.VERSION) -> bytes:
    """A frame built by hand (so timestamp, nonce, magic can be anything), length prefix included."""
    ts = int(time.time() * 1000) if ts_ms is None else ts_ms
    header = _control._HEADER.pack(magic, version, msg_type, key_id, nonce or os.urandom(16), ts)
    body = header + payload + hmac.new(key, header + payload, hashlib.sha256).digest()
    return struct.pack("!I", len(body)) + body


# ---------------------------------------------------------------------------------------------- fuzzing
def _check_decode(body: bytes, key_for: Callable[[int, bytes], Optional[bytes]]) -> None:
    try:
        msg_type, key_id, nonce, payload = _control.decode(body, key_for)
    except ProtocolError:
        return
    # accepted: then it must really be authentic under the key the decoder picked
    key = key_for(key_id, payload)
    assert key is not None and len(nonce) == 16
    assert hmac.compare_digest(hmac.new(key, body[:-32], hashlib.sha256).digest(), body[-32:])
    assert body[_control._HEADER.size:-32] == payload


@FUZZ
@given(st.binary(max_size=400))
def test_fuzz_decode_random_bytes(body: bytes) -> None:
    _check_decode(body, _key_for)
    # the real key selection of rdt's context (group keys are looked up from the payload before the MAC check)
    from rdt._process.context import RdtContext

    _check_decode(body, lambda k, p: RdtContext._key_for(SimpleNamespace(process_key=KEY), k, p))


@FUZZ
@given(
    payload=st.binary(max_size=64),
    msg_type=st.integers(0, 255),
    key_id=st.integers(0, 3),
    cut=st.integers(0, 200),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), max_size=4),
    extra=st.binary(max_size=8),
    mode=st.sampled_from(["flip", "truncate", "extend", "as-is"]),
)
def test_fuzz_decode_mutated_valid_frames(payload, msg_type, key_id, cut, flips, extra, mode) -> None:
    good = frame(msg_type, key_id, _key_for(key_id, payload) or KEY, payload)[4:]
    body = bytearray(good)
    if mode == "flip":
        for pos, x in flips:
            body[pos % len(body)] ^= x
    elif mode == "truncate":
        del body[len(body) - 1 - cut % len(body):]
    elif mode == "extend":
        body += extra
    body = bytes(body)
    try:
        out = _control.decode(body, _key_for)
    except ProtocolError:
        assert body != good or key_id > 1, "a valid frame was refused"
        return
    assert body == good, "a modified frame was accepted"
    assert out[0] == msg_type and out[1] == key_id and out[3] == payload


def _valid_info(name: str, md: bytes, mem: str, descs: List[Tuple[int, int, int]]) -> bytes:
    return nixl_descriptors.encode_info(nixl_descriptors.NixlInfo(name, md, mem, tuple(descs)))


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_decode_info_random_bytes(data: bytes) -> None:
    try:
        info = nixl_descriptors.decode_info(data)
    except ValueError:
        return
    assert info.mem_type in ("DRAM", "VRAM")


@FUZZ
@given(
    name=st.text(max_size=20),
    md=st.binary(max_size=64),
    mem=st.sampled_from(["DRAM", "VRAM"]),
    descs=st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1)),
                   max_size=4),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), max_size=3),
    cut=st.integers(0, 400),
    mode=st.sampled_from(["flip", "truncate", "as-is"]),
)
def test_fuzz_decode_info_mutated(name, md, mem, descs, flips, cut, mode) -> None:
    good = _valid_info(name, md, mem, descs)
    data = bytearray(good)
    if mode == "flip":
        for pos, x in flips:
            data[pos % len(data)] ^= x
    elif mode == "truncate":
        del data[len(data) - 1 - cut % len(data):]
    try:
        info = nixl_descriptors.decode_info(bytes(data))
    except ValueError:
        assert mode != "as-is"
        return
    if mode == "as-is":
        assert info == nixl_descriptors.NixlInfo(name, md, mem, tuple(descs))


# ---------------------------------------------------------------------------------------------- live server
class _Recorder:
    def __init__(self) -> None:
        self.calls: List[Tuple[int, int, bytes]] = []
        self.lock = threading.Lock()

    def handler(self, msg_type: int) -> Callable[[int, bytes], Tuple[int, bytes]]:
        def run(key_id: int, payload: bytes) -> Tuple[int, bytes]:
            with self.lock:
                self.calls.append((msg_type, key_id, payload))
            return _control.RESP_OK, b"ok:" + payload[:16]

        return run


@pytest.fixture()
def server():
    rec = _Recorder()
    srv = ControlServer("127.0.0.1", _key_for, {
        _control.REQ_PING: rec.handler(_control.REQ_PING),
        REQ_PREPARE_SHM: rec.handler(REQ_PREPARE_SHM),
    })
    yield srv, rec
    srv.close()


def _host_port(address: str) -> Tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def send_raw(address: str, data: bytes, *, close_write: bool = True, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection and return everything the server sent before closing."""
    with socket.create_connection(_host_port(address), timeout=timeout) as s:
        try:
            s.sendall(data)
            if close_write:
                s.shutdown(socket.SHUT_WR)
        except OSError:  # the server already dropped us (reset / not connected)
            return b""
        out = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    return out
                out += chunk
        except (ConnectionResetError, socket.timeout):
            return out


def _valid_ping(address: str, key: bytes = KEY, key_id: int = _control.KEY_PROCESS, payload: bytes = b"",
                msg_type: int = _control.REQ_PING) -> Tuple[int, bytes]:
    client = ControlClient()
    try:
        return client.request(address, msg_type, key_id, key, payload, 10.0)
    finally:
        client.close()


def _bad_frames() -> Dict[str, bytes]:
    now = int(time.time() * 1000)
    good = frame(payload=b"x" * 20)
    return {
        "wrong key": frame(key=b"w" * 32),
        "wrong group key": frame(key_id=_control.KEY_GROUP, key=b"w" * 32, payload=b"p" * 40),
        "unknown key id": frame(key_id=7),
        "truncated frame (EOF mid-frame)": good[: len(good) // 2],
        "truncated length prefix": good[:2],
        "short frame (consistent length)": struct.pack("!I", 10) + b"RDT1" + b"\0" * 6,
        "oversize length prefix": struct.pack("!I", MAX_FRAME + 1) + b"\0" * 64,
        "huge length prefix": b"\xff\xff\xff\xff",
        "garbage": struct.pack("!I", 100) + os.urandom(100),
        "bad magic": frame(magic=b"EVIL"),
        "bad version": frame(version=9),
        "stale timestamp": frame(ts_ms=now - MAX_SKEW_MS - 60_000),
        "future timestamp": frame(ts_ms=now + MAX_SKEW_MS + 60_000),
        "unknown message type": frame(msg_type=77),
        "response type as request": frame(msg_type=_control.RESP_OK),
        "flipped payload bit": good[:40] + bytes([good[40] ^ 1]) + good[41:],
    }


@pytest.mark.parametrize("kind", list(_bad_frames()))
def test_bad_frame_rejected_server_keeps_serving(server, kind: str) -> None:
    srv, rec = server
    before = srv.rejected
    got = send_raw(srv.address, _bad_frames()[kind])
    assert got == b"", f"{kind}: the server answered a bad frame: {got!r}"
    assert wait_for(lambda: srv.rejected == before + 1, timeout=10), (kind, srv.rejected, before)
    assert rec.calls == [], f"{kind}: a handler ran for a rejected frame"
    assert _valid_ping(srv.address) == (_control.RESP_OK, b"ok:")
    assert len(rec.calls) == 1


def test_replayed_nonce_rejected(server) -> None:
    srv, rec = server
    data = frame(msg_type=REQ_PREPARE_SHM, payload=b"o" * 16)
    first = send_raw(srv.address, data)
    assert len(first) > 4 and len(rec.calls) == 1  # answered once
    before = srv.rejected
    assert send_raw(srv.address, data) == b""  # same bytes again, new connection
    assert wait_for(lambda: srv.rejected == before + 1, timeout=10)
    # and on the same connection: second copy kills it after the first answer
    data2 = frame(msg_type=REQ_PREPARE_SHM, payload=b"p" * 16)
    out = send_raw(srv.address, data2 + data2)
    assert len(out) > 4 and len(rec.calls) == 2
    assert wait_for(lambda: srv.rejected == before + 2, timeout=10)


def test_clean_close_between_frames_is_not_a_rejection(server) -> None:
    srv, _ = server
    before = srv.rejected
    assert send_raw(srv.address, b"") == b""
    time.sleep(0.2)
    assert srv.rejected == before


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_no_thread_or_memory_leak_over_many_bad_connections(server) -> None:
    srv, rec = server
    kinds = list(_bad_frames().values())

    def storm(n: int) -> None:
        for i in range(n):
            send_raw(srv.address, kinds[i % len(kinds)] if i % 8 else frame(key=b"w" * 32))

    def others() -> int:  # threads besides the server's own pools, which start lazily up to a fixed bound
        return sum(not t.name.startswith(("rdt-control-worker", "rdt-control-stream"))
                   for t in threading.enumerate())

    storm(200)  # warm-up (allocator, thread stacks)
    assert wait_for(lambda: not srv._conns, timeout=20)
    threads, rss, rejected = others(), _rss_bytes(), srv.rejected
    storm(2000)
    assert wait_for(lambda: not srv._conns and others() <= threads + 1, timeout=30), (
        others(), threads, len(srv._conns), [t.name for t in threading.enumerate()])
    for pool in (srv._pool, srv._streams):  # how many requests ran at once depends on load, but never past this
        assert len(pool._threads) <= pool._max_workers
    assert srv.rejected - rejected >= 1900  # clean closes are not counted, every other frame is
    grown = _rss_bytes() - rss
    assert grown < 32 << 20, f"RSS grew by {grown >> 20} MiB over 2000 bad connections"
    assert rec.calls == []
    assert _valid_ping(srv.address)[0] == _control.RESP_OK


def test_idle_connections_do_not_block_others(server) -> None:
    """A peer that connects and sends nothing holds one thread, never the server."""
    srv, _ = server
    idle = [socket.create_connection(_host_port(srv.address), timeout=5) for _ in range(20)]
    try:
        assert _valid_ping(srv.address)[0] == _control.RESP_OK
    finally:
        for s in idle:
            s.close()


# ---------------------------------------------------------------------------------------------- no unpickling
class _Evil:
    """Unpickling this creates a file: the side effect must never happen."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


@pytest.fixture()
def pickle_spy(monkeypatch):
    """Records every unpickle made on an rdt control thread (other threads, e.g. Ray's, are ignored)."""
    calls: List[str] = []

    def record(what: str) -> None:
        if threading.current_thread().name.startswith("rdt-control") or getattr(record, "all_threads", False):
            calls.append(what)

    import _pickle

    from ray import cloudpickle

    import rdt._objects.flatten as flat

    for mod, name in ((pickle, "loads"), (pickle, "load"), (_pickle, "loads"), (_pickle, "load"),
                      (cloudpickle, "loads"), (cloudpickle, "load"), (flat, "unflatten")):
        real = getattr(mod, name)

        def spy(*a: Any, _real: Any = real, _what: str = f"{mod.__name__}.{name}", **k: Any) -> Any:
            record(_what)
            return _real(*a, **k)

        monkeypatch.setattr(mod, name, spy)

    class SpyUnpickler(pickle.Unpickler):
        def __init__(self, *a: Any, **k: Any) -> None:
            record("pickle.Unpickler")
            super().__init__(*a, **k)

    monkeypatch.setattr(pickle, "Unpickler", SpyUnpickler)
    real_load = flat._Unpickler.load
    monkeypatch.setattr(flat._Unpickler, "load", lambda self: (record("rdt._flatten._Unpickler"), real_load(self))[1])
    return calls, record


def test_control_server_never_unpickles_payloads(ray_cluster, tmp_path, pickle_spy) -> None:
    calls, _ = pickle_spy
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Evil(str(marker)))
    from rdt._process.context import get_context

    ctx = get_context()  # the real handlers, in a server of our own
    srv = ControlServer("127.0.0.1", ctx._key_for, ctx.control_handlers())
    try:
        for msg in (REQ_FETCH_GROUP, REQ_PREPARE_SHM, REQ_PREPARE_NIXL,
                    REQ_RELAY_NEXT, REQ_FETCH_RANGES):
            for payload in (evil, evil[:16], b"\0" * 16 + evil, evil + b"\0" * 40):
                resp_type, resp = _valid_ping(srv.address, ctx.process_key, payload=payload, msg_type=msg)
                assert resp_type == _control.RESP_ERR  # not found / malformed, answered in binary
                assert send_raw(srv.address, frame(msg, key=b"w" * 32, payload=evil)) == b""
        assert send_raw(srv.address, struct.pack("!I", len(evil)) + evil) == b""
        assert send_raw(srv.address, evil) == b""
    finally:
        srv.close()
    assert not marker.exists(), "a network payload was unpickled"
    assert calls == [], f"unpickling on a control thread: {calls}"


def test_decode_info_never_unpickles(tmp_path, pickle_spy) -> None:
    calls, record = pickle_spy
    record.all_threads = True
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Evil(str(marker)))
    with pytest.raises(ValueError):
        nixl_descriptors.decode_info(evil)
    info = nixl_descriptors.decode_info(_valid_info("agent", evil, "DRAM", [(1, 2, 0)]))
    assert info.agent_md == evil  # carried as opaque bytes, for NIXL's binary parser
    assert not marker.exists() and calls == []


def _actor_control(_self: Any) -> Tuple[str, bytes, int]:
    from rdt._process.context import get_context

    ctx = get_context()
    info = ctx.producer_info()
    return info.control_address, info.process_key, ctx._server.rejected


def _marker_exists(_self: Any, path: str) -> bool:
    return os.path.exists(path)


@pytest.fixture(scope="module")
def pair(ray_cluster):
    actors = [Node.remote(), Node.remote()]
    ray.get([a.pid.remote() for a in actors], timeout=120)
    yield actors
    for a in actors:
        ray.kill(a)


def test_real_actor_control_server(pair, tmp_path) -> None:
    a = pair[0]
    address, key, rejected0 = ray.get(a.__ray_call__.remote(_actor_control), timeout=60)
    marker = f"/tmp/rdt-sec-{os.getpid()}-{time.monotonic_ns()}"
    evil = pickle.dumps(_Evil(marker))
    bad = _bad_frames()
    bad["evil payload, wrong key"] = frame(REQ_PREPARE_SHM, key=b"w" * 32, payload=evil)
    for data in bad.values():
        assert send_raw(address, data) == b""
    # evil payloads with the right key: answered (object not found), never unpickled
    for msg in (REQ_PREPARE_SHM, REQ_FETCH_GROUP, REQ_PREPARE_NIXL,
                REQ_RELAY_NEXT, REQ_FETCH_RANGES):
        assert _valid_ping(address, key, payload=evil, msg_type=msg)[0] == _control.RESP_ERR
    assert _valid_ping(address, key) == (_control.RESP_OK, b"")

    def rejected() -> int:
        return ray.get(a.__ray_call__.remote(_actor_control), timeout=30)[2]

    assert wait_for(lambda: rejected() == rejected0 + len(bad), timeout=20), (rejected(), rejected0, len(bad))
    import rdt

    assert rdt.stats(a)["control_rejected"] == rejected0 + len(bad)
    assert not ray.get(a.__ray_call__.remote(_marker_exists, marker), timeout=30)
    # the actor still moves objects
    assert ray.get(pair[1].total.remote(a.make_shm.remote(1 << 16, 1.0)), timeout=60) == float(1 << 16)


# ---------------------------------------------------------------------------------------------- shared memory
def test_segment_mode_owner_and_name() -> None:
    seg = _shm.write_segment([torch.arange(100, dtype=torch.uint8), torch.ones(10, dtype=torch.uint8)])
    try:
        st_ = os.stat(os.path.join(_shm.SHM_DIR, seg.name))
        assert st_.st_mode & 0o777 == 0o600
        assert st_.st_uid == os.getuid()
        assert re.fullmatch(rf"rdt-{os.getpid()}-[0-9a-f]{{32}}", seg.name)
        out = _shm.map_segment(seg.name, seg.layout)
        assert torch.equal(out[0], torch.arange(100, dtype=torch.uint8))
    finally:
        _shm.unlink(seg.name)
    names = set()
    for _ in range(50):
        s = _shm.write_segment([torch.ones(1, dtype=torch.uint8)])
        names.add(s.name)
        _shm.unlink(s.name)
    assert len(names) == 50  # 128 random bits each


@pytest.mark.parametrize("name", [
    "../etc/passwd", "/etc/passwd", "rdt-1-../../etc/passwd", "rdt-1-" + "0" * 31, "rdt-1-" + "0" * 33,
    "rdt-1-" + "G" * 32, "rdt-1-" + "A" * 32, "rdt--" + "0" * 32, "rdt-1-" + "0" * 32 + "\n",
    "rdt-\u0661-" + "0" * 32, "rdt-1-" + "0" * 32 + "/../x", "", "rdt-1-" + "0" * 32 + "\0",
])
def test_map_segment_refuses_bad_names(name: str) -> None:
    with pytest.raises(FileNotFoundError, match="not an rdt segment name"):
        _shm.map_segment(name, [(0, 1)])


def _spawn_owner(tmp_path: Any) -> Tuple[subprocess.Popen, str]:
    out = tmp_path / "name"
    code = (
        "import sys, time, torch\n"
        "from rdt.transports.shm import segments as _shm\n"
        "seg = _shm.write_segment([torch.ones(4096, dtype=torch.uint8)])\n"
        f"open({str(out)!r} + '.tmp', 'w').write(seg.name)\n"
        "import os; os.rename(" + repr(str(out) + ".tmp") + ", " + repr(str(out)) + ")\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        assert wait_for(out.exists, timeout=90), "the owner process did not write its segment"
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return proc, out.read_text()


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)  # reaped: its pid is gone (a zombie would count as dead too)


def test_reaper_removes_segments_of_killed_owner(tmp_path) -> None:
    proc, name = _spawn_owner(tmp_path)
    path = os.path.join(_shm.SHM_DIR, name)
    assert os.path.exists(path) and name.startswith(f"rdt-{proc.pid}-")
    mine = _shm.write_segment([torch.ones(8, dtype=torch.uint8)])
    try:
        _kill(proc)
        assert os.path.exists(path)  # SIGKILL: no chance to clean up
        _shm.reap_dead_owners()
        assert not os.path.exists(path)  # (another rdt process on the node may have reaped it first)
        assert os.path.exists(os.path.join(_shm.SHM_DIR, mine.name))  # live owners' segments stay
    finally:
        _shm.unlink(mine.name)


def test_consumer_unlinks_segment_of_dead_owner(tmp_path) -> None:
    from rdt._objects.meta import ObjectMeta, ProducerInfo
    from rdt.errors import ProducerDiedError
    from rdt.transports import Site
    from rdt.transports.shm.transport import ShmDescriptor, ShmTransport

    proc, name = _spawn_owner(tmp_path)
    _kill(proc)
    producer = ProducerInfo(b"\0" * 8, proc.pid, "node", "127.0.0.1:1", b"k" * 32, None, "", frozenset({"nixl"}))
    desc = ShmDescriptor(segment=_shm.Segment(name, ((0, 4096),), 4096))
    meta = ObjectMeta(obj_id=b"\1" * 16, transport="shm", producer=producer, skeleton=b"", specs=(), buffers=(),
                      groups=(), token=None, exports=(("shm", desc),))
    site = Site(same_node=True, in_actor=True, task_argument=True)
    with pytest.raises(ProducerDiedError, match=f"pid {proc.pid}"):
        ShmTransport().fetch(None, meta, site, time.monotonic() + 5.0)
    assert not os.path.exists(os.path.join(_shm.SHM_DIR, name))


# ---------------------------------------------------------------------------------------------- group secrets
def _group_secret(_self: Any, name: str) -> Tuple[str, bytes]:
    g = rt.get_group(name)
    return g.uid, g.backend.config.secret


def _init(_self: Any, name: str, rank: int) -> str:
    return rt.init_collective_group(2, rank, "gloo", name, timeout=60).uid


def _destroy(_self: Any, name: str) -> None:
    rt.destroy_collective_group(name)


def _meta_fields(_self: Any) -> List[bytes]:
    """Everything an rdt object's metadata carries, as bytes, except Ray handles (token, actor)."""
    from rdt._process.context import get_context
    from rdt._producer.produce import produce

    meta = produce(get_context(), {"w": torch.ones(1 << 16)}, "gloo")
    blobs = [pickle.dumps({k: v for k, v in meta.__dict__.items() if k not in ("token", "producer", "store_ref")})]
    p = meta.producer
    blobs.append(pickle.dumps((p.instance, p.pid, p.node_id, p.control_address, p.process_key, p.actor_id)))
    get_context().table.free(meta.obj_id)
    return blobs


def _kv_get(key: str, namespace: Optional[str]) -> Optional[bytes]:
    import ray.experimental.internal_kv as kv

    return kv._internal_kv_get(key, namespace=namespace)


def test_group_secrets_distinct_and_not_in_metadata(pair) -> None:
    a, b = pair
    h1 = rt.create_collective_group(pair, group_name="sec-1")
    h2 = rt.create_collective_group(pair, group_name="sec-2")
    try:
        (u1, s1), (u1b, s1b) = ray.get([x.__ray_call__.remote(_group_secret, "sec-1") for x in pair], timeout=60)
        (u2, s2), _ = ray.get([x.__ray_call__.remote(_group_secret, "sec-2") for x in pair], timeout=60)
        assert len(s1) == len(s2) == 32 and s1 != s2 and u1 != u2
        assert (u1, s1) == (u1b, s1b)  # both members hold the same secret
        # driver-declared groups hand the secret over in Ray task arguments: it is not in the GCS KV at all
        assert _kv_get(f"rdt/{u1}/secret", "rdt") is None
        for blob in ray.get(a.__ray_call__.remote(_meta_fields), timeout=60):
            assert s1 not in blob and s2 not in blob  # object metadata names groups by uid only
        # the control channel's group key: a fetch request for group sec-1 must be MACed with its secret
        address, _, rejected0 = ray.get(a.__ray_call__.remote(_actor_control), timeout=60)
        payload = b"\0" * 16 + bytes.fromhex(u1) + struct.pack("!IIIB", 1, 0, 1000, 0)  # rank, tags, ms, packed
        assert send_raw(address, frame(REQ_FETCH_GROUP, _control.KEY_GROUP, s2, payload)) == b""
        assert wait_for(lambda: ray.get(a.__ray_call__.remote(_actor_control), timeout=30)[2] == rejected0 + 1,
                        timeout=20)
        resp_type, resp = _valid_ping(address, s1, _control.KEY_GROUP, payload, REQ_FETCH_GROUP)
        assert resp_type == _control.RESP_ERR and struct.unpack("!H", resp[:2])[0] == _control.ERR_NOT_FOUND
        # whom a chained consumer forwards to: asked with the group's secret only, answered from the producer's
        # own chain table only (a chain that object has not in that group: refused, never told apart from
        # another group's chain)
        nxt = b"\0" * 16 + bytes.fromhex(u1) + struct.pack("!IQIB", 1, 12345, 10, 0)  # rank, chain, ms, final
        assert send_raw(address, frame(REQ_RELAY_NEXT, _control.KEY_GROUP, s2, nxt)) == b""
        assert wait_for(lambda: ray.get(a.__ray_call__.remote(_actor_control), timeout=30)[2] == rejected0 + 2,
                        timeout=20)
        resp_type, resp = _valid_ping(address, s1, _control.KEY_GROUP, nxt, REQ_RELAY_NEXT)
        assert resp_type == _control.RESP_ERR and struct.unpack("!H", resp[:2])[0] == _control.ERR_BAD_REQUEST
    finally:
        h1.destroy(timeout=30)
        h2.destroy(timeout=30)


def test_actor_side_group_secret_lives_in_gcs_namespace_rdt(pair) -> None:
    name = "sec-actor"
    uids = ray.get([x.__ray_call__.remote(_init, name, r) for r, x in enumerate(pair)], timeout=120)
    try:
        assert uids[0] == uids[1]
        uid = uids[0]
        _, secret = ray.get(pair[0].__ray_call__.remote(_group_secret, name), timeout=60)
        assert len(secret) == 32
        assert _kv_get(f"rdt/{uid}/secret", "rdt") == secret
        assert _kv_get(f"rdt/{uid}/secret", None) is None  # not in the default namespace
    finally:
        ray.get([x.__ray_call__.remote(_destroy, name) for x in pair], timeout=60)


# ---------------------------------------------------------------------------------------------- range requests
# A consumer's range requests name byte ranges of an object by (buffer, offset, length). The producer serves
# only ranges inside the object's buffers, and a range set sent with a key is cached under that key only when the
# key is the set's digest (see docs/security.md, "Range reads: who can read which bytes").
N_FLOATS = 1 << 15  # the published shard: one buffer of 128 KiB (past the inline threshold: held here)
SIZE = 4 * N_FLOATS


def _put_shards(self_: Any) -> Any:
    """Publish one parameter of N_FLOATS floats (0, 1, 2, ...) as version 1 of rank 0; the actor keeps it."""
    import rdt

    w = torch.arange(N_FLOATS, dtype=torch.float32)
    shards = rdt.put_shards({"w": w}, version=1, layouts={"w": rdt.Layout.whole((N_FLOATS,))}, rank=0,
                            tensor_transport="shm")
    self_._sec_shards = (w, shards)
    return shards


def _drop_shards(self_: Any) -> None:
    self_._sec_shards = None


def _sum_request(shards: Any, key: bytes, ranges: bytes, count: Optional[int] = None) -> Tuple[int, bytes]:
    """REQ_RANGE_SUMS of ``shards``' object under plan key ``key`` with ``ranges`` (b"": the key alone), sent
    straight to its producer's control server with the producer's process key."""
    meta = shards.meta
    n = len(ranges) // 24 if count is None else count
    payload = struct.pack("!16s16sI", meta.obj_id, key, n) + ranges
    return _valid_ping(meta.producer.control_address, meta.producer.process_key, payload=payload,
                       msg_type=_control.REQ_RANGE_SUMS)


def _honest_sums(shards: Any, ranges: bytes) -> Dict[int, int]:
    """What a consumer's verify=True gets: ask by the ranges' digest; send the ranges when the producer asks."""
    from rdt._process.versions import decode_sums, plan_key

    key = plan_key(ranges)
    resp_type, resp = _sum_request(shards, key, b"")
    assert resp_type == _control.RESP_OK, resp
    if resp[:1] != b"\x01":
        resp_type, resp = _sum_request(shards, key, ranges)
        assert resp_type == _control.RESP_OK, resp
    return decode_sums(resp[1:])


def _ranges(*runs: Tuple[int, int, int, int]) -> bytes:
    """A range set on the wire from (group, buffer, offset, length) runs (any u32/u64 values)."""
    import numpy as np

    from rdt._process.versions import encode_ranges

    cols = [np.array([r[i] for r in runs], dtype=np.uint64) for i in range(4)]
    return encode_ranges(*cols)


def _crc(lo: int, hi: int) -> int:
    """CRC-32C (verify's checksum) of bytes [lo, hi) of the published parameter."""
    import crc32c

    return crc32c.crc32c(torch.arange(N_FLOATS, dtype=torch.float32).numpy().tobytes()[lo:hi])


def _refused(resp: Tuple[int, bytes], *words: str) -> None:
    resp_type, body = resp
    assert resp_type == _control.RESP_ERR, f"answered: {body[:40]!r}"
    code, text = struct.unpack("!H", body[:2])[0], body[2:].decode()
    assert code == _control.ERR_BAD_REQUEST, (code, text)
    assert all(w in text for w in words), text


@pytest.fixture()
def published(pair):
    shards = ray.get(pair[0].__ray_call__.remote(_put_shards), timeout=60)
    yield shards
    ray.get(pair[0].__ray_call__.remote(_drop_shards), timeout=60)


def test_a_checksum_request_whose_key_is_not_its_ranges_digest_is_refused(published) -> None:
    """Failed before: the producer cached the ranges (and their checksums) under whatever key came with them, so a
    holder of the process key could file other ranges under the digest of an honest consumer's range set; that
    consumer's verify=True then compared its bytes with checksums of the wrong bytes (a false mismatch, or a real
    one hidden). Now such a request is refused, nothing is cached, and the honest answer stays right."""
    from rdt._process.versions import plan_key

    honest = _ranges((0, 0, 0, 32))  # group 0: bytes [0, 32) of the shard
    forged = _ranges((0, 0, 32, 32))  # the same group over other bytes, filed under the honest set's digest
    forging = _sum_request(published, plan_key(honest), forged)
    assert _honest_sums(published, honest) == {0: _crc(0, 32)}  # before: the forged bytes' checksum
    _refused(forging, "key")
    _refused(_sum_request(published, plan_key(honest), forged), "key")  # and not once the honest set is cached
    assert _honest_sums(published, honest) == {0: _crc(0, 32)}


@pytest.mark.parametrize("runs, words", [
    ([(0, 0, SIZE - 6, 8)], "outside"),  # straddles the end of the buffer
    ([(0, 0, SIZE, 1)], "outside"),  # starts at the end
    ([(0, 0, 1 << 40, 8)], "outside"),  # far past it
    ([(0, 0, (1 << 64) - 8, 8)], "outside"),  # an offset that wraps to -8 in a signed 64-bit
    ([(0, 0, 8, (1 << 64) - 4)], "outside"),  # a length that wraps to -4
    ([(0, 1, 0, 8)], "outside"),  # a buffer the object does not have
    ([(0, 0, 0, 8), (1, 0, SIZE - 50, 100)], "outside"),  # one bad range among good ones
])
def test_a_checksum_request_past_the_objects_buffers_is_refused(published, runs, words) -> None:
    """Failed before: ranges past the end were cut short silently (the CRC of fewer bytes, or of none), a wrapped
    offset was read from the end of the buffer, an unknown buffer failed with an internal error; all were
    answered or cached as if valid. Now each is refused as a bad request, and the honest answer stays right."""
    from rdt._process.versions import plan_key

    bad = _ranges(*runs)
    first = _sum_request(published, plan_key(bad), bad)
    if first[0] == _control.RESP_OK:  # before: say what it answered (a checksum of fewer bytes, or of none)
        from rdt._process.versions import decode_sums

        first = (first[0], first[1][:1] + repr(decode_sums(first[1][1:])).encode())
    _refused(first, words)
    _refused(_sum_request(published, plan_key(bad), bad), words)  # nothing was cached the first time
    assert _honest_sums(published, _ranges((0, 0, 0, SIZE))) == {0: _crc(0, SIZE)}


def test_a_checksum_request_whose_count_is_not_its_ranges_is_refused(published) -> None:
    """The count in the header must match the ranges that follow it (24 bytes each)."""
    from rdt._process.versions import plan_key

    ranges = _ranges((0, 0, 0, 8), (1, 0, 8, 8))
    _refused(_sum_request(published, plan_key(ranges), ranges, count=1), "count")
    _refused(_sum_request(published, plan_key(ranges + b"\0"), ranges + b"\0", count=2), "count")
    assert _honest_sums(published, ranges) == {0: _crc(0, 8), 1: _crc(8, 16)}


def _gloo_object(_self: Any) -> bytes:
    """An object of one CPU buffer (N_FLOATS floats) held by this process for the gloo transport; its id."""
    from rdt._process.context import get_context
    from rdt._producer.produce import produce

    meta = produce(get_context(), {"w": torch.arange(N_FLOATS, dtype=torch.float32)}, "gloo")
    _self._sec_meta = meta  # its lifetime token: the object is held while it lives
    return meta.obj_id


def _free_object(_self: Any, obj_id: bytes) -> None:
    from rdt._process.context import get_context

    get_context().table.free(obj_id)
    _self._sec_meta = None


def _rows(*runs: Tuple[int, int, int, int, int]) -> bytes:
    """A gloo range plan on the wire from (buffer, offset, length, count, stride) rows."""
    from rdt.transports.group.ranges import ROW

    return b"".join(ROW.pack(*r) for r in runs)


def test_a_gloo_range_request_past_the_objects_buffers_is_refused(pair) -> None:
    """A group member's REQ_FETCH_RANGES may name only bytes inside the object's buffers: a range past the end, in
    a buffer the object does not have, or whose end overflows a signed 64-bit sum, is refused before a byte is
    sent and before the plan is cached; a key that is not the plan's digest is refused too. Failed before for the
    overflowing range (offset 2**63 - 8, length 16): its end wrapped negative, so it passed the bound and the
    producer was set to send from an address past its object; the other cases were refused already."""
    from rdt.transports.group.ranges import HEAD, NEED_PLAN, plan_key

    a, _ = pair
    handle = rt.create_collective_group(pair, group_name="sec-ranges")
    obj_id = ray.get(a.__ray_call__.remote(_gloo_object), timeout=60)
    try:
        uid, secret = ray.get(a.__ray_call__.remote(_group_secret, "sec-ranges"), timeout=60)
        address = ray.get(a.__ray_call__.remote(_actor_control), timeout=60)[0]

        def ask(rows: bytes, key: Optional[bytes] = None) -> Tuple[int, bytes]:
            head = HEAD.pack(1, 0, 1000, plan_key(rows) if key is None else key)  # consumer rank 1, tags, ms
            return _valid_ping(address, secret, _control.KEY_GROUP, obj_id + bytes.fromhex(uid) + head + rows,
                               REQ_FETCH_RANGES)

        cases = {
            "straddles the end": _rows((0, SIZE - 8, 16, 1, 0)),
            "starts at the end": _rows((0, SIZE, 1, 1, 0)),
            "a strided row's second run ends past it": _rows((0, 0, 8, 2, SIZE - 4)),
            "a buffer the object does not have": _rows((1, 0, 8, 1, 0)),
            "2**62 bytes after a good run": _rows((0, 0, 8, 1, 0), (0, 1 << 62, 1 << 62, 1, 0)),
            "end 2**63 + 8 (wraps negative in int64)": _rows((0, (1 << 63) - 8, 16, 1, 0)),  # last: before, the
            # producer went on to send from an address past its object
        }
        wrong = []
        for what, rows in cases.items():
            answer = ask(rows)
            if answer[0] != _control.RESP_ERR or "a range lies outside the object's buffers" not in answer[1].decode():
                wrong.append(f"{what}: answered {answer}")
            elif ask(b"", plan_key(rows)) != (_control.RESP_OK, NEED_PLAN):
                wrong.append(f"{what}: refused, but its plan was cached")
        assert not wrong, wrong
        good = _rows((0, 0, 8, 1, 0))
        _refused(ask(_rows((0, 8, 8, 1, 0)), plan_key(good)), "key")  # other rows under a good plan's key
        assert ask(b"", plan_key(good)) == (_control.RESP_OK, NEED_PLAN)  # ... were not cached under it
    finally:
        ray.get(a.__ray_call__.remote(_free_object, obj_id), timeout=60)
        handle.destroy(timeout=30)
