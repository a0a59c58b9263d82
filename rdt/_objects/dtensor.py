"""DTensor leaves: recognised without importing torch.distributed, refused where a plain tensor is expected, and
read as (local shard, global shape, where the shard starts) where a layout is wanted (``rdt.put_shards``).

A DTensor's own storage is a wrapper with no data pointer: moving it as a plain tensor fails deep inside torch
("invalid python storage"). Its bytes are its local shard; its place in the global tensor is in its placements.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..errors import InvalidArgumentError


def is_dtensor(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.distributed.tensor.DTensor`` (checked by type, no import of torch.distributed)."""
    return isinstance(obj, torch.Tensor) and any(
        c.__name__ == "DTensor" and c.__module__.startswith("torch.distributed") for c in type(obj).__mro__)


def leaf_path(value: Any, leaf: Any, depth: int = 0) -> Optional[str]:
    """Where ``leaf`` sits in ``value`` (e.g. ``['layers.0.w']`` or ``[2]``), for error messages; None if not found."""
    if value is leaf:
        return ""
    if depth > 32:
        return None
    items: List[Tuple[Any, Any]] = []
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(enumerate(value))
    for key, item in items:
        sub = leaf_path(item, leaf, depth + 1)
        if sub is not None:
            return f"[{key!r}]{sub}"
    return None


def refuse_leaf(value: Any, leaf: Any) -> InvalidArgumentError:
    """The error for a DTensor returned where rdt moves plain tensors, naming the leaf."""
    where = leaf_path(value, leaf)
    name = f"leaf {where}" if where else "a leaf"
    return InvalidArgumentError(
        f"{name} is a DTensor ({_placements(leaf)}); rdt moves plain tensors, and a DTensor's bytes are only its "
        "local shard", hint="publish shards with rdt.put_shards(state_dict, version=...) (each rank's local shard "
        "with its global layout), or return t.full_tensor() / t.to_local() explicitly")


def _placements(dt: Any) -> str:
    try:
        return ", ".join(repr(p) for p in dt.placements)
    except Exception:  # noqa: BLE001 - only for the message
        return "unknown placements"


def local_layout(name: str, dt: Any) -> Tuple[torch.Tensor, Tuple[int, ...], Tuple[int, ...]]:
    """(local shard, global shape, the shard's first index in the global tensor) of DTensor ``dt``; ``Partial``
    placements (a pending reduction: no rank holds the values) are refused, naming ``name``, and so is a
    ``_StridedShard`` placement (FSDP2 with TP) unless :func:`strided_unproven` proves the shard one box."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(p, Partial) for p in dt.placements):
        raise InvalidArgumentError(
            f"parameter {name!r} is a DTensor with a Partial placement ({_placements(dt)}): no rank holds its values",
            hint="reduce it first (dt.redistribute(placements=[Shard(0)] or [Replicate()])) and publish that")
    shape = tuple(dt.shape)
    local_shape, start = compute_local_shape_and_global_offset(shape, dt.device_mesh, dt.placements)
    if any(type(p).__name__ == "_StridedShard" for p in dt.placements):
        why = strided_unproven(shape, dt.device_mesh, dt.placements, tuple(local_shape), tuple(start))
        if why is not None:
            raise InvalidArgumentError(
                f"parameter {name!r} is a DTensor with a _StridedShard placement ({_placements(dt)}) whose local "
                f"shard is not proven to be one box of the global tensor: {why}",
                hint="publish it with plain Shard placements (dt.redistribute(placements=[Shard(0), ...])), or as a "
                     "plain tensor with an explicit rdt.Layout")
    local = dt.to_local()
    if tuple(local.shape) != tuple(local_shape):
        raise InvalidArgumentError(f"parameter {name!r}: DTensor local shard is {tuple(local.shape)}, its placements "
                                   f"say {tuple(local_shape)}", hint="publish a DTensor whose local shard matches "
                                   "its placements (torch's chunk rule)")
    return local, shape, tuple(int(s) for s in start)


def held_indices(shape: Sequence[int], mesh: Any, placements: Sequence[Any]) -> Optional[List[torch.Tensor]]:
    """Per dimension of a global tensor of ``shape``, the global indices this rank's local shard holds, in order:
    each mesh dimension's placement applied, left to right as DTensor distributes, to an index tensor with torch's
    own split (``_split_tensor``). None when this rank is outside the mesh."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    coord = mesh.get_coordinate()
    if coord is None:
        return None
    idx = [torch.arange(int(n)) for n in shape]
    for i, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            one: Any = _StridedShard(0, split_factor=p.split_factor)
        elif isinstance(p, Shard):
            one = Shard(0)
        else:
            continue  # Replicate: every index of every dimension stays
        pieces, _ = one._split_tensor(idx[p.dim], int(mesh.size(i)), with_padding=False, contiguous=True)
        c = int(coord[i])
        idx[p.dim] = pieces[c] if c < len(pieces) else idx[p.dim][:0]
    return idx


def strided_unproven(shape: Sequence[int], mesh: Any, placements: Sequence[Any], local_shape: Sequence[int],
                     start: Sequence[int]) -> Optional[str]:
    """Why the box ``start`` + ``local_shape`` is not proven to be exactly what this rank holds of a tensor placed
    with ``placements`` (None: proven). The proof: :func:`held_indices` along each dimension is the contiguous
    range the box says."""
    try:
        held = held_indices(shape, mesh, placements)
    except Exception as e:  # noqa: BLE001 - torch's private split changed: unproven, so refused
        return f"torch's split could not be replayed here ({type(e).__name__}: {e})"
    if held is None:
        return "this rank is not part of the mesh"
    for d, (h, lo, n) in enumerate(zip(held, start, local_shape)):
        want = torch.arange(int(lo), int(lo) + int(n))
        if h.numel() != want.numel() or not torch.equal(h, want):
            shown = h[:6].tolist()
            return (f"along dim {d} it holds indices {shown}{' ...' if h.numel() > 6 else ''} ({h.numel()} in all), "
                    f"not [{int(lo)}, {int(lo) + int(n)})")
    return None
