"""The compact leaf and buffer tables ObjectMeta carries: they read as TensorSpec/BufferSpec sequences, survive
pickling unchanged, and rebuild leaves that are views of the buffers they were given."""

from __future__ import annotations

import pickle

import torch

from rdt._flatten import flatten, unflatten
from rdt._specs import BufferSpec, BufferTable, SpecTable, TensorSpec
from rdt.transports.base import BlockViews, padded_offsets

from .._object_actors import leaf_digests, many_tensors


def test_tables_read_as_specs_and_survive_pickling():
    flat = flatten(many_tensors(120))
    specs, table = pickle.loads(pickle.dumps((flat.specs, flat.table)))
    assert isinstance(specs, SpecTable) and isinstance(table, BufferTable)
    assert list(specs) == list(flat.specs) and all(isinstance(s, TensorSpec) for s in specs)
    assert list(table) == [BufferSpec(b.numel(), str(b.device)) for b in flat.buffers]
    assert table.total == sum(b.numel() for b in flat.buffers) and table.device_types == {"cpu"}
    assert SpecTable.of(list(specs)) == specs and BufferTable.of(list(table)) == table
    assert specs[-1] == list(specs)[-1] and specs[2:4] == list(specs)[2:4]


def test_rebuild_from_one_block_and_from_separate_buffers():
    value = many_tensors(120)
    flat = flatten(value)
    offsets, total = padded_offsets(flat.table.sizes)
    block = BlockViews(torch.empty(total, dtype=torch.uint8), offsets, flat.table.sizes)
    separate = [torch.empty(n, dtype=torch.uint8) for n in flat.table.sizes]
    for landing in (block, separate):
        for i, src in enumerate(flat.buffers):
            landing[i].copy_(src)
        leaves = flat.specs.rebuild(landing)
        assert leaf_digests(unflatten(flat.skeleton, leaves)) == leaf_digests(value)
        storages = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor) and t.numel()}
        owners = {block.block.untyped_storage().data_ptr()} if landing is block else \
            {b.untyped_storage().data_ptr() for b in separate}
        assert storages <= owners  # views of what was received: nothing copied
