"""The compact leaf and buffer tables ObjectMeta carries: they read as TensorSpec/BufferSpec sequences, survive
pickling unchanged, and rebuild leaves that are views of the buffers they were given."""

from __future__ import annotations

import io
import pickle

import pytest

import torch

from rdt._objects.flatten import flatten, unflatten
from rdt._objects.specs import BufferSpec, BufferTable, SpecTable, TensorSpec
from rdt.transports.receive import BlockViews, padded_offsets

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


def test_plain_leaves_in_one_block_take_the_direct_path_and_match():
    """Plain torch leaves of mixed dtypes and layouts (transposed, strided, 0-d, rows of one shared storage) landed
    in one block are rebuilt by the direct path (a typed view per dtype, one as_strided per leaf), bit-exact."""
    value = {k: v for k, v in many_tensors(120).items() if type(v) is torch.Tensor and v.numel()}
    flat = flatten(value)
    assert len(set(flat.specs.names)) >= 5 and len(flat.table) < len(flat.specs)  # several dtypes, shared storages
    offsets, total = padded_offsets(flat.table.sizes)
    block = BlockViews(torch.empty(total, dtype=torch.uint8), offsets, flat.table.sizes)
    for i, src in enumerate(flat.buffers):
        block[i].copy_(src)
    dtypes = [getattr(torch, n) for n in flat.specs.names]
    direct = flat.specs._rebuild_block(block, dtypes, [torch.empty(0, dtype=d).element_size() for d in dtypes])
    assert direct is not None
    leaves = flat.specs.rebuild(block)
    assert leaf_digests(unflatten(flat.skeleton, leaves)) == leaf_digests(value)
    assert all(a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() for a, b in zip(leaves, direct))
    assert {t.untyped_storage().data_ptr() for t in leaves} == {block.block.untyped_storage().data_ptr()}


def test_packed_messages_cover_every_buffer_once_in_order():
    from rdt.transports.group.protocol import PACK_BELOW, PACK_MAX, messages

    sizes = [4096] * 1500 + [PACK_BELOW, 10, 3, 1 << 24, 7] + [PACK_BELOW - 1] * 40
    plan = messages(sizes)
    covered = [i for a, b in plan for i in range(a, b + 1)]
    assert covered == list(range(len(sizes)))
    for a, b in plan:
        if a != b:
            assert all(sizes[i] < PACK_BELOW for i in range(a, b + 1))
            assert sum(-(-sizes[i] // 64) * 64 for i in range(a, b)) + sizes[b] <= PACK_MAX
    assert (1505, 1505) in plan or any(a <= 1504 <= b for a, b in plan)
    assert len(plan) < len(sizes) // 50  # a thousand small tensors travel in a few messages


def test_gather_copies_many_ranges_within_the_process():
    from rdt_transports._memcopy import copy_parts as gather  # the group transport's packing copy

    src = [torch.arange(i + 1, dtype=torch.uint8) for i in range(3000)]
    dst = torch.zeros(sum(t.numel() for t in src), dtype=torch.uint8)
    parts, at = [], 0
    for t in src:
        parts.append((dst.data_ptr() + at, t.data_ptr(), t.numel()))
        at += t.numel()
    gather(parts)
    assert torch.equal(dst, torch.cat(src))


def test_packed_staging_holds_each_buffer_at_its_block_offset_and_zeros_between():
    from rdt.transports.group.protocol import messages
    from rdt.transports.group.serve import packed_sends as _packed_sends

    leaves = [torch.full((n,), 0xAB, dtype=torch.uint8) for n in (10, 3, 64, 1, 100)]  # gaps after 10, 3, 1, ...
    flat = flatten(leaves)
    (staging,) = _packed_sends(flat)
    assert messages(flat.table.sizes) == [(0, len(leaves) - 1)]
    offsets, _ = padded_offsets(flat.table.sizes)
    expect = torch.zeros(staging.numel(), dtype=torch.uint8)
    for t, o in zip(leaves, offsets):
        expect[o:o + t.numel()] = t
    assert torch.equal(staging, expect)  # the data where the consumer's block has it, and no stale byte elsewhere


def _general(value):
    """flatten() forced onto the general per-leaf pass."""
    import rdt._objects.flatten as F

    keep = F.SEPARATE_MIN
    F.SEPARATE_MIN = 1 << 30
    try:
        return flatten(value)
    finally:
        F.SEPARATE_MIN = keep


def _same(a, b, separate: bool = True) -> None:
    """The same flatten result; only the map pass marks its table ``separate`` (the general pass does not)."""
    assert a.specs.separate == separate and not b.specs.separate
    b.specs.separate = separate
    assert pickle.dumps(a.specs) == pickle.dumps(b.specs)
    assert pickle.dumps(a.table) == pickle.dumps(b.table)
    assert a.ranges == b.ranges
    n = len(a.specs)  # the same value around the leaves (the skeletons' bytes differ for a flat container)
    assert unflatten(a.skeleton, list(range(n))) == unflatten(b.skeleton, list(range(n)))
    assert [(lo, hi) for _, lo, hi in a.spans] == [(lo, hi) for _, lo, hi in b.spans]


def test_separate_leaves_take_the_map_pass_and_match_the_general_pass():
    """A state dict of separate contiguous CPU tensors is flattened by map() over torch's methods; the result is
    the general pass's, byte for byte, with one or several dtypes and any shapes."""
    import rdt._objects.flatten as F

    one = {f"layers.{i}.w": torch.full((4, 8 + i), float(i)) for i in range(40)}
    mixed = [torch.full((i + 1,), i, dtype=(torch.bfloat16, torch.float32, torch.int64)[i % 3]) for i in range(40)]
    tied = mixed + [mixed[5]]  # the same tensor object twice is one leaf
    for value in (one, mixed, tied):
        found = F._Collector()
        F._PlainPickler(io.BytesIO(), found).dump(value)
        assert F._finish_separate(b"", found) is not None  # the map pass served it
        fast = flatten(value)
        _same(fast, _general(value))
        back = unflatten(fast.skeleton, fast.specs.rebuild(fast.buffers))
        pairs = zip(back.values(), value.values()) if isinstance(value, dict) else zip(back, value)
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in pairs)


def test_leaves_the_map_pass_cannot_take_fall_back_to_the_general_pass():
    """Views of one storage, an offset view, a non-contiguous leaf, an empty leaf, a Parameter: the general pass
    (which shares buffers between views and keeps kinds) serves the value, and the result is the same."""
    import rdt._objects.flatten as F

    base = [torch.arange(64, dtype=torch.float32) + i for i in range(20)]
    cases = {
        "views of one storage": base + [base[0][:8]],
        "offset view": base[1:] + [torch.arange(100.0)[3:50]],
        "non-contiguous": base[1:] + [torch.ones(8, 8).t()],
        "empty leaf": base[1:] + [torch.empty(0)],
        "parameter": base[1:] + [torch.nn.Parameter(torch.ones(3))],
    }
    for name, value in cases.items():
        found = F._Collector()
        F._PlainPickler(io.BytesIO(), found).dump(value)
        assert F._finish_separate(b"", found) is None, name
        _same(flatten(value), _general(value), separate=False)
    assert len(flatten(cases["views of one storage"]).spans) == 20  # the view shares its storage's buffer


def _landed(flat):
    """The object's bytes landed the way a consumer lands them: one block (BlockViews) at padded offsets."""
    from rdt.transports.receive import BlockViews

    sizes = list(flat.table.sizes)
    offsets, total = padded_offsets(sizes)
    block = torch.zeros(max(total, 1), dtype=torch.uint8)
    for o, n, buf in zip(offsets, sizes, flat.buffers):
        block[o:o + n] = buf
    return BlockViews(block, offsets, sizes)


def test_a_separate_object_landed_back_to_back_is_cut_in_one_call():
    """Leaves whose sizes are multiples of ALIGN land back to back; the consumer cuts them from the block with one
    split (1-D leaves) plus a view (others): the same values, shapes and dtypes as the per-leaf path, and views of
    the block, not copies."""
    import rdt._objects.specs as S

    value = [torch.arange(1048, dtype=torch.float32) + i for i in range(30)] + \
            [torch.full((4, 8), 2.0), torch.full((2, 2, 2, 2), 3.0), torch.tensor(5.0)]  # 0-d: 4 bytes, see below
    value = value[:-1]  # every size a multiple of 16 bytes: back to back
    flat = flatten(value)
    assert flat.specs.separate
    bufs = _landed(flat)
    calls = []
    keep = S._cut_dense
    S._cut_dense = lambda *a: calls.append(1) or keep(*a)
    try:
        got = flat.specs.rebuild(bufs)
    finally:
        S._cut_dense = keep
    assert calls and len(got) == len(value)
    for a, b in zip(got, value):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) and a.is_contiguous()
        assert a.untyped_storage().data_ptr() == bufs.block.untyped_storage().data_ptr()
    per_leaf = flat.specs
    per_leaf.separate = False
    again = per_leaf.rebuild(bufs)
    assert all(torch.equal(a, b) and a.data_ptr() == b.data_ptr() for a, b in zip(got, again))


def test_a_separate_object_with_gaps_or_several_dtypes_takes_the_per_leaf_path():
    """Sizes that leave padding between buffers, or two dtypes: no cut; the per-leaf path rebuilds it right."""
    import rdt._objects.specs as S

    gaps = [torch.full((3,), float(i)) for i in range(20)]  # 12 bytes each: padded to 16
    mixed = [torch.full((8,), i, dtype=(torch.float32, torch.int64)[i % 2]) for i in range(20)]
    for value in (gaps, mixed):
        flat = flatten(value)
        assert flat.specs.separate
        bufs = _landed(flat)
        got = flat.specs.rebuild(bufs)
        if value is gaps:
            assert S._cut_dense(bufs.block, bufs, bufs.block.untyped_storage(), torch.float32, 4,
                                flat.specs.shape) is None
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, value))


def test_flat_containers_skip_the_pickler_and_come_back_the_same():
    """A list, tuple, dict or OrderedDict (a state_dict() with its _metadata) of distinct plain tensors is
    flattened without a pickler walk; unflatten gives the same type, keys, attributes and tensors."""
    import collections

    import rdt._objects.flatten as F

    ts = [torch.full((3, i + 1), float(i)) for i in range(20)]
    model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(10)])
    state = model.state_dict()  # an OrderedDict with _metadata, 20 tensors
    values = [ts, tuple(ts), {f"w{i}": t for i, t in enumerate(ts)}, state]
    for value in values:
        assert F._flat_container(value) is not None, type(value)
        flat = flatten(value)
        assert flat.skeleton.startswith(F._FLAT) and flat.specs.separate
        back = unflatten(flat.skeleton, flat.specs.rebuild(flat.buffers))
        assert type(back) is type(value)
        if isinstance(value, dict):
            assert list(back) == list(value) and all(torch.equal(back[k], value[k]) for k in value)
        else:
            assert all(torch.equal(a, b) for a, b in zip(back, value)) and len(back) == len(value)
    back = unflatten(flatten(state).skeleton, list(state.values()))
    assert back._metadata == state._metadata
    fresh = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(10)])
    fresh.load_state_dict(back)  # a real state dict, as load_state_dict reads it
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), state.values()))

    tagged = collections.OrderedDict((f"w{i}", t) for i, t in enumerate(ts))
    tagged.extra = torch.ones(2)  # a tensor attribute: must go out of band, so the pickler's walk serves it
    cases = {
        "too few": ts[:SEPARATE_MIN_FOR_TEST - 1],
        "a Parameter": ts + [torch.nn.Parameter(torch.ones(2))],
        "a non-str key": {**{f"w{i}": t for i, t in enumerate(ts)}, 3: torch.ones(1)},
        "a scalar value": ts + [7],
        "a tensor attribute": tagged,
        "a dict subclass": type("D", (dict,), {})((f"w{i}", t) for i, t in enumerate(ts)),
    }
    for name, value in cases.items():
        assert F._flat_container(value) is None, name
        flat = flatten(value)
        assert not flat.skeleton.startswith(F._FLAT), name
        back = unflatten(flat.skeleton, flat.specs.rebuild(flat.buffers))
        assert type(back) is type(value), name
    twice = ts + [ts[0]]  # flat, but one object twice: the pickler's walk keeps it one object
    flat = flatten(twice)
    assert not flat.skeleton.startswith(F._FLAT)
    back = unflatten(flat.skeleton, flat.specs.rebuild(flat.buffers))
    assert back[0] is back[-1] and len(back) == len(twice)
    sparse = ts + [torch.eye(3).to_sparse()]
    with pytest.raises(Exception, match="dense"):
        flatten(sparse)  # the pickler's walk raises its typed error, as before


SEPARATE_MIN_FOR_TEST = 16


def test_conjugate_and_negative_views_travel_as_their_values():
    """A conjugate view (x.conj()) and a negative view (x.conj().imag) keep their bit in the tensor, not in the
    bytes that travel: alone, in a flat container (the map pass) and in a nested value, each arrives with its
    values, and the producer keeps its own views."""
    z = torch.complex(torch.arange(24.0), -torch.arange(24.0) * 2).reshape(4, 6)
    flat = [z[i % 4].conj() if i % 2 else torch.ones(6, dtype=torch.complex64) for i in range(20)]
    values = [z.conj(), z.conj().imag, flat, {f"k{i}": t for i, t in enumerate(flat)},
              {"nested": [z.conj().imag, (z.conj(),)], "step": 3}]
    for value in values:
        f = flatten(value)
        back = unflatten(f.skeleton, f.specs.rebuild(f.buffers))
        pairs = list(zip(_leaves(back), _leaves(value)))
        assert pairs and all(torch.equal(a, b) and not a.is_conj() and not a.is_neg() for a, b in pairs)
        assert all(a is b for a, b in zip(_leaves(unflatten(f.skeleton, f.leaves)), _leaves(value)))


def _leaves(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _leaves(v)]
    return []


@pytest.mark.parametrize("value", [
    pytest.param(lambda: {f"w{i}": torch.arange(i * 1000, i * 1000 + 4096, dtype=torch.int32) for i in range(20)},
                 id="separate"),
    pytest.param(lambda: many_tensors(60), id="general"),
])
def test_cloned_describes_only_the_copies(value):
    """snapshot=True's copy: every address, span, view and leaf is the copies', none the originals' (issue 29:
    the many-tensor pass's address list once survived the copy), and the bytes are the values at the copy."""
    from rdt.transports.group.serve import packed_sends

    value = value()
    flat = flatten(value)
    want = leaf_digests(unflatten(flat.skeleton, flat.leaves))
    staged = [t.clone() for t in packed_sends(flat)]
    snap = flat.cloned()
    originals = {owner.untyped_storage().data_ptr() for owner, _, _ in flat.spans}
    ends = [(a, a + n) for a, n in flat.ranges]
    for b in flat.buffers:
        b.bitwise_not_()  # the producer changes its tensors in place after the return
    assert not originals & {owner.untyped_storage().data_ptr() for owner, _, _ in snap.spans}
    assert not originals & {b.untyped_storage().data_ptr() for b in snap.buffers}
    assert not any(lo <= a < hi for a, _ in snap.ranges for lo, hi in ends)
    assert snap.ranges == [(b.data_ptr(), b.numel()) for b in snap.buffers]
    assert [n for _, n in snap.ranges] == list(snap.table.sizes) == list(flat.table.sizes)
    assert all(torch.equal(snap.view(i), b) for i, b in enumerate(snap.buffers))
    assert leaf_digests(unflatten(snap.skeleton, snap.leaves)) == want
    assert all(torch.equal(a, b) for a, b in zip(packed_sends(snap), staged))
