"""Receive into existing tensors: match ``into`` to an object's leaves, check it, and plan where each buffer lands.

``into`` has the value's shape (a dict for a dict, a list for a list, nested alike) or is a flat list of every
tensor leaf in leaf order. Every check runs before a byte moves, and a mismatch names the leaf by its path in the
value. A buffer lands straight in its target when one contiguous target covers it exactly (the usual state-dict
case); otherwise (tied weights, views of one storage, another device) it lands in a scratch buffer and is copied.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .._objects.flatten import flat_keys, leaf_from_buffer, unflatten
from .._objects.meta import ObjectMeta
from ..errors import IntoMismatchError
from ..transports.receive import Targets


class _Slot:
    """Stands for leaf ``i`` while the skeleton is walked to find each leaf's path."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


def _walk(node: Any, path: str, out: Dict[int, str], seen: set) -> None:
    if isinstance(node, _Slot):
        out[node.i] = path or "<value>"
        return
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, dict):
        for k, v in node.items():
            _walk(v, f"{path}[{k!r}]", out, seen)
    elif isinstance(node, (list, tuple)):
        for k, v in enumerate(node):
            _walk(v, f"{path}[{k}]", out, seen)
    elif hasattr(node, "__dict__"):
        for k, v in vars(node).items():
            _walk(v, f"{path}.{k}", out, seen)


def leaf_paths(meta: ObjectMeta) -> Tuple[Any, List[str]]:
    """(the value with a placeholder per leaf, each leaf's path in the value)."""
    shape = unflatten(meta.skeleton, [_Slot(i) for i in range(len(meta.specs))])
    found: Dict[int, str] = {}
    _walk(shape, "", found, set())
    return shape, [found.get(i, f"<leaf {i}>") for i in range(len(meta.specs))]


def as_tensor(x: Any) -> Optional[torch.Tensor]:
    """A target as a tensor over the same memory (a numpy array wrapped without a copy); None for anything else."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    return None


def _structural(shape: Any, into: Any, out: Dict[int, Any], path: str) -> Optional[str]:
    """Pair ``into`` with the value's shape; the first difference (a path and why), or None."""
    if isinstance(shape, _Slot):
        out.setdefault(shape.i, []).append(into)  # a leaf returned twice (tied weights): one target per place
        return None
    if isinstance(shape, dict):
        if not isinstance(into, dict):
            return f"{path or '<value>'}: the value has a dict here, into has {type(into).__name__}"
        for k, v in shape.items():
            if k not in into:
                if _has_slot(v):
                    return f"{path}[{k!r}]: missing from into (partial into is refused)"
                continue
            why = _structural(v, into[k], out, f"{path}[{k!r}]")
            if why:
                return why
        return None
    if isinstance(shape, (list, tuple)):
        if not isinstance(into, (list, tuple)) or len(into) != len(shape):
            got = f"{type(into).__name__} of {len(into)}" if isinstance(into, (list, tuple)) else type(into).__name__
            return f"{path or '<value>'}: the value has a {type(shape).__name__} of {len(shape)} here, into has {got}"
        for k, (v, t) in enumerate(zip(shape, into)):
            why = _structural(v, t, out, f"{path}[{k}]")
            if why:
                return why
        return None
    return None if not _has_slot(shape) else f"{path}: tensors inside a {type(shape).__name__}: pass a flat list"


def _has_slot(node: Any, seen: Optional[set] = None) -> bool:
    seen = set() if seen is None else seen
    if isinstance(node, _Slot):
        return True
    if id(node) in seen:
        return False
    seen.add(id(node))
    if isinstance(node, dict):
        return any(_has_slot(v, seen) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_has_slot(v, seen) for v in node)
    return hasattr(node, "__dict__") and any(_has_slot(v, seen) for v in vars(node).values())


def targets_for(meta: ObjectMeta, into: Any) -> Tuple[Any, List[List[torch.Tensor]], List[str]]:
    """(the value to return, with the targets in the leaves' places; each leaf's targets as torch tensors; each
    leaf's path), all checked against ``meta``.

    Raises IntoMismatchError naming the first leaf that does not fit; nothing has moved then.
    """
    fast = _flat_dict_targets(meta, into)
    if fast is not None:
        return fast
    shape, paths = leaf_paths(meta)
    n = len(meta.specs)
    found: Dict[int, List[Any]] = {}
    why = _structural(shape, into, found, "")
    structural = why is None and len(found) == n
    if not structural:
        if isinstance(into, (list, tuple)) and len(into) == n and not isinstance(shape, (list, tuple)):
            found = {i: [t] for i, t in enumerate(into)}  # a flat list of every leaf, in leaf order
        elif why is not None:
            raise IntoMismatchError(f"{meta.describe()}: into does not have the value's shape: {why}",
                                    object_id=meta.id_hex, hint=_HINT)
        else:
            missing = [paths[i] for i in range(n) if i not in found]
            raise IntoMismatchError(f"{meta.describe()}: into has no target for {missing[:5]} (partial into is "
                                    "refused)", object_id=meta.id_hex, hint=_HINT)
    specs = meta.specs
    dtypes = [getattr(torch, name, None) for name in specs.names]
    tensors: List[List[torch.Tensor]] = []
    for i in range(n):
        tensors.append([_check(meta, specs.shape[i], dtypes[specs.dtype[i]], specs.names[specs.dtype[i]], t,
                               paths[i]) for t in found[i]])
    _refuse_shared_bytes(meta, tensors, paths)
    value = _substitute(shape, into) if structural else unflatten(meta.skeleton, [found[i][0] for i in range(n)])
    return value, tensors, paths


def _flat_dict_targets(meta: ObjectMeta, into: Any) -> Optional[Tuple[Any, List[List[torch.Tensor]], List[str]]]:
    """:func:`targets_for` for a state dict (a flat dict of tensors) and an ``into`` dict holding every key: no walk
    of the value's structure. None: not this case (the general walk also names what is missing)."""
    keys = flat_keys(meta.skeleton) if isinstance(into, dict) else None
    if keys is None or len(keys) != len(meta.specs):
        return None
    try:
        picked = [into[k] for k in keys]
    except (KeyError, TypeError):
        return None
    specs = meta.specs
    dtypes = [getattr(torch, name, None) for name in specs.names]
    paths = [f"[{k!r}]" for k in keys]
    tensors = [[_check(meta, shape, dtypes[d], specs.names[d], t, where)]
               for shape, d, t, where in zip(specs.shape, specs.dtype, picked, paths)]
    _refuse_shared_bytes(meta, tensors, paths)
    value = OrderedDict(zip(keys, picked)) if meta.skeleton[4:5] == b"O" else dict(zip(keys, picked))
    return value, tensors, paths


def _refuse_shared_bytes(meta: ObjectMeta, tensors: Sequence[Sequence[torch.Tensor]], paths: Sequence[str]) -> None:
    """IntoMismatchError when the targets of two leaves share bytes the object does not share the same way (one
    leaf's bytes would overwrite the other's, and both would come back as one tensor). Targets of leaves tied in
    the producer (one buffer, the same relative place) may share: the same bytes land twice."""
    flat = [(t, i) for i, ts in enumerate(tensors) for t in ts if t.numel()]
    if len(flat) < 2:
        return
    starts = np.fromiter((t.data_ptr() for t, _ in flat), np.uint64, len(flat))
    ends = starts + np.fromiter((t.nbytes for t, _ in flat), np.uint64, len(flat))
    order = np.argsort(starts, kind="stable")
    if not (starts[order][1:] < np.maximum.accumulate(ends[order])[:-1]).any():
        return  # no two targets share a byte (addresses are unique across devices: CUDA's unified addressing)
    specs = meta.specs
    for reach, span in overlaps([((t.device.type, t.device.index or 0), t.data_ptr(), t.data_ptr() + t.nbytes, i)
                                 for t, i in flat]):
        if not (span[3] == reach[3] and span[1] == reach[1]) \
                and not _same_source(specs, reach[3], span[3], reach[1], span[1], tensors[span[3]][0].element_size()):
            a, b = sorted((reach[3], span[3]))
            what = f"the targets of {paths[a]} and {paths[b]}" if a != b else f"two targets of {paths[a]}"
            raise IntoMismatchError(
                f"{meta.describe()}: {what} share bytes, but the object's bytes there differ: one would overwrite "
                "the other", object_id=meta.id_hex,
                hint="give each leaf its own tensor (leaves tied in the producer, e.g. embed and lm_head, may share "
                     "one)")


def overlaps(spans: Sequence[Tuple[Any, int, int, int]]) -> Iterator[Tuple[Tuple[Any, int, int, int], ...]]:
    """Of byte spans ``(device, start, end, owner)``: each span that starts inside the farthest-reaching earlier
    one on its device, with that one, as ``(earlier, later)`` (every pair that shares bytes meets one of these)."""
    reach: Optional[Tuple[Any, int, int, int]] = None
    for span in sorted(spans, key=lambda sp: (sp[0], sp[1])):
        if reach is not None and span[0] == reach[0] and span[1] < reach[2]:
            yield reach, span
        if reach is None or span[0] != reach[0] or span[2] > reach[2]:
            reach = span


def _same_source(specs: Any, i: int, j: int, at_i: int, at_j: int, itemsize: int) -> bool:
    """Whether leaves ``i`` and ``j`` lie in one producer buffer, densely, as far apart as their targets do (at
    ``at_i`` and ``at_j``): then the bytes both land in agree."""
    b = specs.buffer[i]
    return (b >= 0 and b == specs.buffer[j] and specs.dtype[i] == specs.dtype[j]
            and _dense(specs.shape[i], specs.stride[i]) and _dense(specs.shape[j], specs.stride[j])
            and at_i - at_j == (specs.offset[i] - specs.offset[j]) * itemsize)


def _substitute(shape: Any, into: Any) -> Any:
    """The value with every leaf place holding the target ``into`` has at that place (other parts unchanged)."""
    if isinstance(shape, _Slot):
        return into
    if isinstance(shape, dict) and _has_slot(shape):
        out = type(shape)() if type(shape) is not dict else {}
        for k, v in shape.items():
            out[k] = _substitute(v, into[k]) if _has_slot(v) else v
        return out
    if isinstance(shape, (list, tuple)) and _has_slot(shape):
        items = [_substitute(v, t) if _has_slot(v) else v for v, t in zip(shape, into)]
        if isinstance(shape, tuple) and hasattr(shape, "_fields"):
            return type(shape)(*items)
        return type(shape)(items)
    return shape


def _check(meta: ObjectMeta, shape: Tuple[int, ...], dtype: Optional[torch.dtype], dtype_name: str, t: Any,
           where: str) -> torch.Tensor:
    """``t`` as a torch tensor, if it fits a leaf of ``shape`` and ``dtype``; else IntoMismatchError naming
    ``where``."""
    tt = as_tensor(t)
    if tt is None:
        raise IntoMismatchError(f"{where}: the target is a {type(t).__name__}, not a tensor",
                                object_id=meta.id_hex, hint=_HINT)
    if tt.shape != tuple(shape):
        raise IntoMismatchError(f"{where}: shape {tuple(shape)} != {tuple(tt.shape)} (object != target)",
                                object_id=meta.id_hex, hint=_HINT)
    if tt.dtype != dtype:
        raise IntoMismatchError(f"{where}: dtype {dtype_name} != {str(tt.dtype).replace('torch.', '')} "
                                "(object != target; no silent casts)", object_id=meta.id_hex, hint=_HINT)
    if not tt.is_contiguous():
        raise IntoMismatchError(f"{where}: the target is not contiguous", object_id=meta.id_hex,
                                hint="pass contiguous tensors (e.g. the parameters themselves)")
    if tt.device.type not in ("cpu", "cuda"):
        raise IntoMismatchError(f"{where}: targets on {tt.device} are not supported", object_id=meta.id_hex,
                                hint="use cpu or cuda targets")
    return tt


_HINT = ("pass into= with the value's structure (or a flat list of every tensor leaf in leaf order), each target "
         "with the object's shape and dtype and contiguous")


def landing_plan(meta: ObjectMeta, tensors: Sequence[Sequence[torch.Tensor]]) -> Targets:
    """Per buffer: the one target that covers it exactly (the bytes land there), or None. Reads the spec table's
    columns (a state dict's hundreds of leaves cost microseconds each otherwise)."""
    specs, table = meta.specs, meta.buffers
    users = [0] * len(table)
    leaf_of = [-1] * len(table)
    for i, b in enumerate(specs.buffer):
        if b >= 0:
            users[b] += 1
            leaf_of[b] = i
    device_types: Dict[str, str] = {}
    out: List[Optional[torch.Tensor]] = []
    complete = True
    separate = specs.separate  # every leaf dense, at offset 0 of its own buffer: nothing to check per leaf
    for b, nbytes in enumerate(table.sizes):
        i = leaf_of[b]
        if users[b] != 1 or len(tensors[i]) != 1:
            out.append(None)
            complete = False
            continue
        t = tensors[i][0]  # contiguous, with the leaf's shape and dtype (targets_for checked)
        dev = table.devices[b]
        kind = device_types.get(dev)
        if kind is None:
            kind = device_types[dev] = torch.device(dev).type
        if (separate or specs.offset[i] == 0 and _dense(specs.shape[i], specs.stride[i])) and t.nbytes == nbytes \
                and t.device.type == kind:
            out.append(t)
        else:
            out.append(None)
            complete = False
    return Targets(out, complete)


def _dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether the producer's leaf is laid out contiguously (so its bytes equal the buffer's)."""
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if st != expected and size != 1:
            return False
        expected *= max(size, 1)
    return True


def fill(meta: ObjectMeta, buffers: Sequence[torch.Tensor], tensors: Sequence[Sequence[torch.Tensor]],
         landed: Sequence[Optional[torch.Tensor]]) -> None:
    """Copy into every target whose buffer did not land in it directly (cross-device, tied or shared storage)."""
    if buffers is landed and isinstance(landed, Targets) and landed.complete:
        return  # every buffer landed in its one target
    specs = meta.specs
    for i, (b, targets) in enumerate(zip(specs.buffer, tensors)):  # columns: no TensorSpec for a landed leaf
        if b < 0:
            continue  # an empty tensor
        if landed[b] is not None and buffers[b] is landed[b]:
            continue
        spec = specs[i]
        src = leaf_from_buffer(spec, buffers)
        src = src if isinstance(src, torch.Tensor) else torch.as_tensor(src)
        for t in targets:
            t.copy_(src.detach())


def copy_leaves(leaves: Sequence[Any], tensors: Sequence[Sequence[torch.Tensor]]) -> None:
    """In the producer itself: copy its own leaves into the targets."""
    for leaf, targets in zip(leaves, tensors):
        src = as_tensor(leaf)
        if src is None:  # cupy
            src = torch.as_tensor(leaf)
        for t in targets:
            if src.data_ptr() != t.data_ptr():
                t.copy_(src.detach())
