"""StorageCache's bookkeeping with injected make/undo (no GPU, no NIXL): counted per object, and with
keep_while_alive kept while the storage lives, never reused for another storage at the same key, bounded."""

from __future__ import annotations

import gc
from typing import List

import torch

from rdt.transports.storage_cache import StorageCache


class _Log:
    def __init__(self) -> None:
        self.made: List[str] = []
        self.undone: List[str] = []

    def make(self, key: str, storage: object) -> str:
        self.made.append(key)
        return f"export-{len(self.made)}"

    def undo(self, export: str) -> None:
        self.undone.append(export)


def test_counted_per_object_without_keep():
    log = _Log()
    cache = StorageCache(log.make, log.undo)
    s = torch.ones(4).untyped_storage()
    cache.acquire("k", s)
    cache.acquire("k", s)
    cache.release("k")
    assert log.undone == [] and len(cache) == 1
    cache.release("k")
    assert log.undone == ["export-1"] and len(cache) == 0 and cache.idle() == 0


def test_kept_while_the_storage_lives_then_undone_when_it_dies():
    log = _Log()
    cache = StorageCache(log.make, log.undo, keep_while_alive=True)
    t = torch.ones(4)
    for _ in range(3):  # a step's object uses the storage, dies, and the next step's object comes
        cache.acquire("k", t.untyped_storage())
        cache.release("k")
    assert log.made == ["k"] and log.undone == [] and cache.idle() == 1 and len(cache) == 0
    del t
    gc.collect()
    assert cache.sweep() == 1 and log.undone == ["export-1"] and cache.idle() == 0


def test_an_idle_export_is_never_reused_for_another_storage_at_the_same_key():
    log = _Log()
    cache = StorageCache(log.make, log.undo, keep_while_alive=True)
    a, b = torch.ones(4), torch.ones(4)
    cache.acquire("k", a.untyped_storage())
    cache.release("k")
    export, fresh = cache.take("k", b.untyped_storage())  # same key (say, a reused address), other storage
    assert fresh and export == "export-2" and log.undone == ["export-1"]


def test_idle_exports_are_bounded():
    log = _Log()
    cache = StorageCache(log.make, log.undo, keep_while_alive=True, max_idle=2)
    ts = [torch.ones(4) for _ in range(5)]
    for i, t in enumerate(ts):
        cache.acquire(f"k{i}", t.untyped_storage())
        cache.release(f"k{i}")
    assert cache.idle() == 2 and log.undone == ["export-1", "export-2", "export-3"]  # oldest undone first
    cache.clear_idle()
    assert cache.idle() == 0 and len(log.undone) == 5


def test_many_at_once_count_alike_and_a_failed_make_acquires_none():
    log = _Log()
    cache = StorageCache(log.make, log.undo, keep_while_alive=True)
    ts = [torch.ones(4) for _ in range(3)]
    items = [(f"k{i}", t.untyped_storage()) for i, t in enumerate(ts)]
    assert cache.acquire_many(items) == ["export-1", "export-2", "export-3"]
    assert cache.acquire_many(items[:2]) == ["export-1", "export-2"]  # a second object on two of them
    assert [cache.users(k) for k, _ in items] == [2, 2, 1]
    cache.release_many([k for k, _ in items])
    assert [cache.users(k) for k, _ in items] == [1, 1, 0] and cache.idle() == 1
    cache.release_many([k for k, _ in items[:2]])
    assert len(cache) == 0 and cache.idle() == 3 and log.undone == []

    def failing(key: str, storage: object) -> str:
        if key == "bad":
            raise RuntimeError("registration refused")
        return log.make(key, storage)

    strict = StorageCache(failing, log.undo)
    other = torch.ones(4)
    try:
        strict.acquire_many([("ok", ts[0].untyped_storage()), ("bad", other.untyped_storage())])
    except RuntimeError:
        pass
    else:
        raise AssertionError("a failed registration must raise")
    assert len(strict) == 0 and strict.users("ok") == 0 and log.undone[-1:] == ["export-4"]
