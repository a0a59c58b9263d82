"""CUDA IPC shares once per storage for the storage's life, settled once it died: the bookkeeping, without CUDA.

torch's ``_share_cuda_`` and its settling are injected, so this runs on CPU CI; tests/test_gpu.py runs the real
path on a GPU.
"""

from __future__ import annotations

import gc
import threading
from types import SimpleNamespace
from typing import Any, List, Tuple

import torch

from rdt.transports.cuda_ipc import shares as _cuda_ipc


class _Torch:
    """Stands in for torch's share/settle: counts calls and hands out distinct shares."""

    def __init__(self) -> None:
        self.shared: List[Any] = []
        self.settled: List[Tuple[Any, ...]] = []

    def share(self, storage: Any) -> Tuple[Any, ...]:
        self.shared.append(id(storage))  # never the storage itself: holding it would keep it alive
        return ("share", len(self.shared))

    def settle(self, share: Tuple[Any, ...]) -> None:
        self.settled.append(share)


def test_weights_returned_every_step_are_shared_once():
    """10 000 returns of the same storage (objects alive two at a time): one share, kept while the storage lives
    and settled once it dies."""
    fake = _Torch()
    cache = _cuda_ipc.ShareCache(fake.share, fake.settle)
    storage = torch.empty(16).untyped_storage()
    key = (0, storage.data_ptr(), storage.nbytes())
    assert cache.acquire(key, storage) == ("share", 1)
    for _ in range(10_000):
        assert cache.acquire(key, storage) == ("share", 1)  # the next step's object, while the last one lives
        cache.release(key)  # the last step's object is freed
        assert len(cache) == 1
    assert fake.shared == [id(storage)] and fake.settled == []
    cache.release(key)
    assert fake.settled == [] and len(cache) == 0 and cache.exported() == 1  # kept: the storage lives
    del storage
    gc.collect()
    assert cache.exported() == 0 and fake.settled == [("share", 1)]
    cache.release(key)  # a stray release is harmless
    assert fake.settled == [("share", 1)]


def test_each_step_freed_before_the_next_return_shares_once():
    """The trainer's loop (issue 31: 1 997 shares for 2 storages over 1 000 returns on an H100): each step's object
    is freed before the next return. The share outlives the objects while the storage lives; none once it died."""
    fake = _Torch()
    cache = _cuda_ipc.ShareCache(fake.share, fake.settle)
    storages = [torch.empty(16).untyped_storage(), torch.empty(8).untyped_storage()]
    keys = [(0, s.data_ptr(), s.nbytes()) for s in storages]
    for _ in range(1000):
        for k, s in zip(keys, storages):
            cache.acquire(k, s)
        for k in keys:
            cache.release(k)
    assert cache.made == 2 and len(fake.shared) == 2 and fake.settled == []
    assert cache.exported() == 2 and len(cache) == 0 and cache.idle() == 2
    del storages, s
    gc.collect()
    assert cache.exported() == 0 and sorted(fake.settled) == [("share", 1), ("share", 2)]


def test_a_new_storage_at_the_same_key_is_shared_afresh():
    """An idle share is reused only for the very storage it was made for: another storage object under the same
    key (a new allocation at the freed address) gets its own share, and the old one is settled."""
    fake = _Torch()
    cache = _cuda_ipc.ShareCache(fake.share, fake.settle)
    first, second = torch.empty(4).untyped_storage(), torch.empty(4).untyped_storage()
    key = (0, 0x1000, 16)
    assert cache.take(key, first) == (("share", 1), True)
    cache.release(key)
    assert cache.take(key, second) == (("share", 2), True)
    assert fake.settled == [("share", 1)] and cache.exported() == 1


def test_idle_shares_are_bounded():
    fake = _Torch()
    cache = _cuda_ipc.ShareCache(fake.share, fake.settle, max_idle=3)
    storages = [torch.empty(4).untyped_storage() for _ in range(5)]
    for i, s in enumerate(storages):
        cache.acquire((0, i, 16), s)
        cache.release((0, i, 16))
    assert cache.idle() == 3 and fake.settled == [("share", 1), ("share", 2)]


def test_storages_are_counted_apart_and_shared_again_after_they_died():
    fake = _Torch()
    cache = _cuda_ipc.ShareCache(fake.share, fake.settle)
    a, b = torch.empty(8).untyped_storage(), torch.empty(8).untyped_storage()
    ka, kb = (0, a.data_ptr(), a.nbytes()), (0, b.data_ptr(), b.nbytes())
    cache.acquire(ka, a)
    cache.acquire(kb, b)
    cache.release(ka)
    assert fake.settled == [] and len(cache) == 1 and cache.exported() == 2
    assert cache.acquire(ka, a) == ("share", 1)  # the same storage, still alive: its share again
    cache.release(ka)
    del a
    gc.collect()
    assert cache.exported() == 1 and fake.settled == [("share", 1)]
    c = torch.empty(8).untyped_storage()
    assert cache.acquire((0, c.data_ptr(), c.nbytes()), c) == ("share", 3)  # a new storage: a new share
    assert len(fake.shared) == 3


def test_release_with_the_object_returns_every_key_and_a_failing_settle_is_contained():
    fake = _Torch()

    def settle(share: Tuple[Any, ...]) -> None:
        fake.settle(share)
        raise RuntimeError("driver went away")

    cache = _cuda_ipc.ShareCache(fake.share, settle)
    storages = [torch.empty(4).untyped_storage() for _ in range(3)]
    keys = tuple((0, s.data_ptr(), s.nbytes()) for s in storages)
    for k, s in zip(keys, storages):
        cache.acquire(k, s)
    entry = SimpleNamespace(exports={"cuda_ipc": (None, keys)})
    _cuda_ipc.release(entry, cache)  # never raises
    assert "cuda_ipc" not in entry.exports and len(cache) == 0 and cache.idle() == 3
    del storages, s
    gc.collect()
    assert cache.exported() == 0 and len(fake.settled) == 3  # settling failed, and was contained


def test_concurrent_returns_and_frees_share_each_storage_once():
    fake = _Torch()
    cache = _cuda_ipc.ShareCache(fake.share, fake.settle)
    storage = torch.empty(4).untyped_storage()
    key = (0, storage.data_ptr(), storage.nbytes())
    cache.acquire(key, storage)  # one object lives throughout

    def churn() -> None:
        for _ in range(2000):
            cache.acquire(key, storage)
            cache.release(key)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(fake.shared) == 1 and fake.settled == []
    cache.release(key)
    del storage
    gc.collect()
    assert cache.exported() == 0 and len(fake.settled) == 1


def test_take_says_whether_the_share_was_made_now():
    """A reused share carries the event of its first export: export waits for the object's own ready event then."""
    fake = _Torch()
    cache = _cuda_ipc.ShareCache(fake.share, fake.settle)
    s = torch.empty(4).untyped_storage()
    key = (0, s.data_ptr(), s.nbytes())
    assert cache.take(key, s) == (("share", 1), True)
    assert cache.take(key, s) == (("share", 1), False)
    assert cache.users(key) == 2 and cache.made == 1
    cache.release(key)
    cache.release(key)
    assert cache.users(key) == 0 and cache.take(key, s) == (("share", 1), False)  # kept: the storage lives
