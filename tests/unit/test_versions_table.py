"""The producer's table of sharded publications and reads in flight (rdt._process.versions): it drains to zero,
gives up on readers at their deadline, caps what it holds, and frees a kept copy once no longer kept and drained."""

from __future__ import annotations

import struct
import time

import pytest

from rdt._control import wire
from rdt._process import versions as V


def _begin(table: V.Versions, obj: bytes, version: int, reader: bytes, wait_ms: int = 10_000):
    return table.handle_begin(struct.pack("!16sQ16sI", obj, version, reader, wait_ms) + b"test")


def _end(table: V.Versions, obj: bytes, reader: bytes) -> bool:
    return table.handle_end(struct.pack("!16s16s", obj, reader))[1] == b"\x01"


def test_reads_drain_to_zero_and_a_fence_makes_the_version_gone():
    table = V.Versions(lambda _o: None, lambda _o: None)
    obj = b"a" * 16
    table.publish(obj, ("s",), 0, 3, 0, 0)
    for i in range(100):
        assert _begin(table, obj, 3, bytes([i]) * 16)[0] == wire.RESP_OK
    assert table.stats()["readers"] == 100
    assert all(_end(table, obj, bytes([i]) * 16) for i in range(100))
    assert table.stats() == {"publications": 1, "readers": 0, "kept_versions": 0, "kept_bytes": 0, "delta_versions": 0, "delta_bytes": 0, "delta_base_bytes": 0}
    table.fence(obj, 0, 3, 1.0)
    kind, payload = _begin(table, obj, 3, b"z" * 16)
    assert kind == wire.RESP_ERR and struct.unpack_from("!H", payload)[0] == wire.ERR_VERSION_GONE
    assert b"fenced" in payload and table.stats()["publications"] == 0


def test_a_fence_gives_up_on_a_reader_at_its_deadline_and_the_reader_is_told(monkeypatch):
    table = V.Versions(lambda _o: None, lambda _o: None)
    obj = b"b" * 16
    table.publish(obj, ("s",), 1, 0, 0, 0)
    _begin(table, obj, 0, b"r" * 16, wait_ms=10_000)
    start = time.monotonic()
    with pytest.raises(V.FenceTimeoutError, match="1 read.*still in flight.*test") as info:
        table.fence(obj, 1, 0, 0.3)
    assert 0.3 <= time.monotonic() - start < 2 and info.value.readers == ["test"]
    assert not _end(table, obj, b"r" * 16) and table.stats()["readers"] == 0
    table.publish(obj, ("s",), 1, 1, 0, 0)
    monkeypatch.setattr(V, "GRACE_S", 0.1)
    _begin(table, obj, 1, b"q" * 16, wait_ms=0)  # past its deadline and grace: the fence does not wait for it
    time.sleep(0.2)
    start = time.monotonic()
    table.fence(obj, 1, 1, 10.0)
    assert time.monotonic() - start < 5.0 and table.stats()["readers"] == 0
    assert not _end(table, obj, b"q" * 16)


def test_kept_copies_beyond_n_are_freed_once_drained_and_the_reader_cap_holds(monkeypatch):
    freed = []
    table = V.Versions(lambda _o: None, freed.append)
    ids = [bytes([i]) * 16 for i in range(4)]
    table.publish(ids[0], ("s",), 0, 0, 100, 2)
    table.publish(ids[1], ("s",), 0, 1, 100, 2)
    assert _begin(table, ids[0], 0, b"r" * 16)[0] == wire.RESP_OK
    table.publish(ids[2], ("s",), 0, 2, 100, 2)  # version 0 is no longer kept, but is read: not freed yet
    assert freed == [] and table.stats()["kept_bytes"] == 300
    assert _end(table, ids[0], b"r" * 16) and freed == [ids[0]]
    assert table.stats() == {"publications": 2, "readers": 0, "kept_versions": 2, "kept_bytes": 200, "delta_versions": 0, "delta_bytes": 0, "delta_base_bytes": 0}
    monkeypatch.setattr(V, "MAX_READERS", 3)
    assert [_begin(table, ids[1], 1, bytes([i]) * 16)[0] for i in range(4)] == [wire.RESP_OK] * 3 + [wire.RESP_ERR]
