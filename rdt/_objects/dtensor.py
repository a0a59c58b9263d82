"""DTensor leaves: recognised without importing torch.distributed, refused where a plain tensor is expected, and
read as (local shard, global shape, where the shard starts) where a layout is wanted (``rdt.put_shards``).

A DTensor's own storage is a wrapper with no data pointer: moving it as a plain tensor fails deep inside torch
("invalid python storage"). Its bytes are its local shard; its place in the global tensor is in its placements.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

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
    placements (a pending reduction: no rank holds the values) are refused, naming ``name``."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(p, Partial) for p in dt.placements):
        raise InvalidArgumentError(
            f"parameter {name!r} is a DTensor with a Partial placement ({_placements(dt)}): no rank holds its values",
            hint="reduce it first (dt.redistribute(placements=[Shard(0)] or [Replicate()])) and publish that")
    shape = tuple(dt.shape)
    local_shape, start = compute_local_shape_and_global_offset(shape, dt.device_mesh, dt.placements)
    local = dt.to_local()
    if tuple(local.shape) != tuple(local_shape):
        raise InvalidArgumentError(f"parameter {name!r}: DTensor local shard is {tuple(local.shape)}, its placements "
                                   f"say {tuple(local_shape)}", hint="publish a DTensor whose local shard matches "
                                   "its placements (torch's chunk rule)")
    return local, shape, tuple(int(s) for s in start)
