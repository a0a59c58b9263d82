"""Mapped objects (``ipc_map=True``) stay alive while any tensor on a mapped storage lives: the producer's lifetime
token hangs on the storage itself, not on the leaves, so views derived from a leaf and numpy leaves keep it too.

CPU buffers stand for the mapped ones here (the consumer core treats them alike); tests/test_gpu.py maps real ones.
"""

from __future__ import annotations

import gc
import weakref

import torch

from rdt._consumer.resolve import keep_alive
from rdt._objects.flatten import leaf_from_buffer
from rdt._objects.specs import KIND_NUMPY, KIND_TORCH, TensorSpec


class _Token:
    """Stands for the object's lifetime token (an ObjectRef whose death frees the producer's object)."""


def _alive_after_collect(ref: "weakref.ref[_Token]") -> bool:
    gc.collect()
    return ref() is not None


def test_derived_views_and_numpy_leaves_keep_the_object_alive():
    buf = torch.arange(64, dtype=torch.uint8)  # one received (mapped) buffer of 16 float32
    token = _Token()
    ref = weakref.ref(token)
    keep_alive([buf], token)
    del token
    leaves = [leaf_from_buffer(TensorSpec(0, "float32", (4,), (1,), 0, KIND_TORCH), [buf]),
              leaf_from_buffer(TensorSpec(0, "float32", (4,), (1,), 4, KIND_NUMPY), [buf])]
    del buf
    view = leaves[0][1:3].view(torch.int32)  # derived from a leaf
    arr = leaves[1]
    copy = leaves[0] * 2  # a new storage: holds nothing
    del leaves
    assert _alive_after_collect(ref)
    del view
    assert _alive_after_collect(ref)  # the numpy leaf still holds the storage
    del arr
    assert not _alive_after_collect(ref)  # nothing on the mapped storage is left: the object may be freed
    assert copy.sum().item() > 0


def test_each_buffer_of_an_object_holds_the_token():
    bufs = [torch.zeros(8, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)]
    token = _Token()
    ref = weakref.ref(token)
    keep_alive(bufs, token)
    del token
    second = leaf_from_buffer(TensorSpec(1, "uint8", (16,), (1,), 0, KIND_TORCH), bufs)
    del bufs
    assert _alive_after_collect(ref)
    del second
    assert not _alive_after_collect(ref)
