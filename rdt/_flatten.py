"""Split a returned value into a picklable skeleton and the tensors it holds, and put them back together.

Tensors are found wherever pickle finds them (dicts, lists, dataclasses, TensorDict, custom classes) through
``persistent_id``; each is replaced by an index. Tensors that share a storage (views) share one *buffer*: the
byte range of the storage their views span, so the bytes move once and the consumer gets views of one storage.
"""

from __future__ import annotations

import io
import pickle
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from ray import cloudpickle

# Leaf kinds: how to give a tensor back to the user.
KIND_TORCH = 0
KIND_NUMPY = 1
KIND_PARAMETER = 2
KIND_CUPY = 3


@dataclass(frozen=True)
class TensorSpec:
    """Where one leaf lives inside a buffer and how to rebuild it."""

    buffer: int  # index into buffers, -1 for an empty tensor
    dtype: str  # torch dtype name, e.g. "float32"
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int  # in elements of dtype, from the buffer start
    kind: int
    requires_grad: bool = False


@dataclass(frozen=True)
class BufferSpec:
    """A contiguous byte range of one storage: the unit that is moved."""

    nbytes: int
    device: str  # "cpu", "cuda:0", ...


class Flattened:
    """Producer-side result of flattening: skeleton bytes, leaf specs, and the byte buffers to move."""

    def __init__(self, skeleton: bytes, specs: List[TensorSpec], buffers: List[torch.Tensor], leaves: List[Any]):
        self.skeleton = skeleton
        self.specs = specs
        self.buffers = buffers  # uint8 1-D views over the producer's storages (no copy)
        self.leaves = leaves  # the original leaf objects, for passing back to the producer

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def buffer_specs(self) -> List[BufferSpec]:
        return [BufferSpec(b.numel(), str(b.device)) for b in self.buffers]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _to_torch(obj: Any) -> Optional[Tuple[torch.Tensor, int]]:
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or obj.is_nested:
            from rdt_transports.errors import InvalidArgumentError

            raise InvalidArgumentError(
                f"rdt moves dense (strided) tensors only, but the value holds a {obj.layout} "
                f"{'nested ' if obj.is_nested else ''}tensor",
                hint="return t.to_dense() (or the sparse tensor's indices() and values()) instead",
            )
        if isinstance(obj, torch.nn.Parameter):
            return obj.detach(), KIND_PARAMETER
        return obj, KIND_TORCH
    np = sys.modules.get("numpy")
    if np is not None and type(obj) is np.ndarray and obj.dtype != object:
        return torch.from_numpy(np.ascontiguousarray(obj) if not obj.flags["C_CONTIGUOUS"] else obj), KIND_NUMPY
    cp = sys.modules.get("cupy")
    if cp is not None and isinstance(obj, cp.ndarray):
        return torch.as_tensor(cp.ascontiguousarray(obj), device=f"cuda:{obj.device.id}"), KIND_CUPY
    return None


class _Pickler(cloudpickle.CloudPickler):
    def __init__(self, file: io.BytesIO, found: "_Collector") -> None:
        super().__init__(file, protocol=5)
        self._found = found

    def persistent_id(self, obj: Any) -> Optional[int]:  # noqa: D401 - pickle hook
        if not isinstance(obj, torch.Tensor) and type(obj).__module__.split(".")[0] not in ("numpy", "cupy"):
            return None
        return self._found.add(obj)


class _Collector:
    def __init__(self) -> None:
        self.leaves: List[Any] = []
        self.tensors: List[Tuple[torch.Tensor, int]] = []
        self._by_id: Dict[int, int] = {}

    def add(self, obj: Any) -> Optional[int]:
        idx = self._by_id.get(id(obj))
        if idx is not None:
            return idx
        conv = _to_torch(obj)
        if conv is None:
            return None
        idx = len(self.leaves)
        self._by_id[id(obj)] = idx
        self.leaves.append(obj)
        self.tensors.append(conv)
        return idx


_BARE_SKELETON = b"\x80\x05K\x00Q."  # protocol 5: persistent id 0, i.e. the value is leaf 0 itself


def flatten(value: Any) -> Flattened:
    """Find every tensor in ``value``; views of one storage share a buffer."""
    found = _Collector()
    if type(value) is torch.Tensor:  # the common case, without running a pickler over it
        found.add(value)
        return _finish(_BARE_SKELETON, found)
    out = io.BytesIO()
    try:
        _Pickler(out, found).dump(value)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        from rdt_transports.errors import InvalidArgumentError

        raise InvalidArgumentError(
            f"the value cannot be pickled around its tensors: {type(e).__name__}: {e}",
            hint="return tensors plus picklable objects only (no locks, sockets, open files, generators)",
        ) from e
    return _finish(out.getvalue(), found)


def _finish(skeleton: bytes, found: _Collector) -> Flattened:
    """Buffers and specs for the tensors ``found`` while pickling ``skeleton``."""
    specs: List[TensorSpec] = []
    buffers: List[torch.Tensor] = []
    spans: Dict[Tuple[str, int], List[int]] = {}  # storage key -> [min_byte, max_byte, buffer index]
    layout: List[Tuple[Tuple[str, int], int]] = []
    for t, _kind in found.tensors:
        if t.numel() == 0:
            layout.append((("", 0), 0))
            continue
        es = t.element_size()
        start = t.storage_offset() * es
        end = start + (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * es
        key = (str(t.device), t.untyped_storage().data_ptr())
        span = spans.setdefault(key, [start, end, -1])
        span[0] = min(span[0], start)
        span[1] = max(span[1], end)
        layout.append((key, start))
    storages: Dict[Tuple[str, int], Any] = {}
    for t, _ in found.tensors:
        if t.numel():
            storages.setdefault((str(t.device), t.untyped_storage().data_ptr()), t)
    for key, span in spans.items():
        owner = storages[key]
        buf = torch.empty(0, dtype=torch.uint8, device=owner.device)
        buf.set_(owner.untyped_storage(), span[0], (span[1] - span[0],), (1,))
        span[2] = len(buffers)
        buffers.append(buf)
    for (t, kind), (key, start), leaf in zip(found.tensors, layout, found.leaves):
        rg = bool(leaf.requires_grad) if kind == KIND_PARAMETER else False
        if t.numel() == 0:
            specs.append(TensorSpec(-1, _dtype_name(t.dtype), tuple(t.shape), tuple(t.stride()), 0, kind, rg))
            continue
        span = spans[key]
        rel = start - span[0]
        if rel % t.element_size():
            from rdt_transports.errors import InvalidArgumentError

            raise InvalidArgumentError(
                f"a {t.dtype} view starts {rel} bytes into the span of its storage, not a multiple of its element "
                "size", hint="return a .clone() of that view (or views of one dtype only)",
            )
        specs.append(TensorSpec(span[2], _dtype_name(t.dtype), tuple(t.shape), tuple(t.stride()),
                                rel // t.element_size(), kind, rg))
    return Flattened(skeleton, specs, buffers, found.leaves)


def leaf_from_buffer(spec: TensorSpec, buffers: List[torch.Tensor], device: Optional[torch.device] = None) -> Any:
    """Rebuild one leaf as a view into its received buffer (no copy)."""
    dtype = getattr(torch, spec.dtype)
    if spec.buffer < 0:
        t = torch.empty(spec.shape, dtype=dtype, device=device or "cpu")
    else:
        buf = buffers[spec.buffer]
        t = torch.empty(0, dtype=dtype, device=buf.device)
        base = buf.storage_offset()
        es = t.element_size()
        if base % es:  # mis-aligned buffer start: copy into an aligned one
            buf = buf.clone()
            base = 0
        t.set_(buf.untyped_storage(), base // es + spec.offset, spec.shape, spec.stride)
    if spec.kind == KIND_NUMPY:
        return t.numpy()
    if spec.kind == KIND_PARAMETER:
        return torch.nn.Parameter(t, requires_grad=spec.requires_grad)
    if spec.kind == KIND_CUPY:
        import cupy

        return cupy.asarray(t)
    return t


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, leaves: List[Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._leaves = leaves

    def persistent_load(self, pid: Any) -> Any:
        return self._leaves[pid]


def unflatten(skeleton: bytes, leaves: List[Any]) -> Any:
    """Put leaves back into the skeleton. Only ever called on bytes that came through Ray."""
    return _Unpickler(skeleton, leaves).load()
