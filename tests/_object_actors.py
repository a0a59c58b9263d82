"""Actors shared by the object-layer tests: producers with one method per transport, and consumers."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, NamedTuple

import numpy as np
import ray
import torch

import rdt

TRANSPORTS = ("gloo", "shm", "nixl", "auto", "object_store")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    note: str


class Pair(NamedTuple):
    a: torch.Tensor
    b: int


class FrozenMap(Mapping):
    """A non-dict Mapping holding tensors (stands in for TensorDict-like containers)."""

    def __init__(self, **items: Any) -> None:
        self._d = dict(items)

    def __getitem__(self, k: str) -> Any:
        return self._d[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


def _maker(transport: str):
    @rdt.tensor_method(tensor_transport=transport)
    def make(self, numel: int = 1 << 16, fill: float = 1.0, keep: bool = False) -> Dict[str, Any]:
        t = torch.full((numel,), fill)
        if keep:
            self.kept = t
        return {"w": t, "step": 7}

    return make


def _nested_maker(transport: str):
    @rdt.tensor_method(tensor_transport=transport)
    def nested(self) -> Any:
        base = torch.arange(1 << 15, dtype=torch.float32)
        return {
            "views": [base, base[10:20], base.view(128, -1)],
            "batch": Batch(torch.ones(1 << 14), torch.zeros(3, 4, dtype=torch.int64), "hello"),
            "pair": Pair(torch.full((1 << 14,), 2.0), 5),
            "map": FrozenMap(k=torch.full((1 << 14,), 3.0)),
            "np": np.arange(1 << 14, dtype=np.float64),
            "param": torch.nn.Parameter(torch.ones(1 << 14)),
            "empty": torch.empty(0, 3),
            "plain": ("text", 1, None),
        }

    return nested


def many_tensors(count: int = 300) -> Dict[str, Any]:
    """A state-dict-like value of ``count`` leaves exercising every layout a leaf can have: several dtypes and
    ranks, 0-d and empty tensors, transposed and strided views, views sharing one storage, the same tensor twice,
    numpy arrays, Parameters, conjugate and negative views (deterministic: the same on every call)."""
    g = torch.Generator().manual_seed(11)
    shared = torch.randn(64, 48, generator=g)
    out: Dict[str, Any] = {}
    dtypes = (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float64, torch.bool, torch.float16)
    for i in range(count):
        kind = i % 10
        dt = dtypes[i % len(dtypes)]
        base = torch.randn(30 + i % 7, 50 + i % 3, generator=g) * 50
        t = base.to(dt) if dt != torch.bool else base > 0
        if kind == 1:
            t = t.t()  # transposed view: not contiguous
        elif kind == 2:
            t = t[:, ::2]  # strided view
        elif kind == 3:
            t = shared[i % 60: i % 60 + 3]  # rows of one shared storage
        elif kind == 4:
            t = t[0, 0]  # 0-d view
        elif kind == 5:
            t = torch.empty(0, 4, dtype=dt)
        elif kind == 6:
            t = t.numpy() if dt not in (torch.bfloat16,) else t
        elif kind == 7:
            t = torch.nn.Parameter(t.float(), requires_grad=bool(i % 2))
        elif kind == 8:
            t = torch.complex(base, base.flip(0)).conj()  # a conjugate view: the bit is not in the bytes
        elif kind == 9 and i % 20 == 9:
            t = torch.complex(base, -base).conj().imag  # a negative view (strided), real dtype
        out[f"layer.{i}.w"] = t
    out["tied"] = out["layer.0.w"]
    out["step"] = 7
    return out


def leaf_digests(value: Dict[str, Any]) -> List[Any]:
    """Per leaf: (key, type, dtype, shape, bytes) -- what must survive a transfer bit-exact."""
    rows = []
    for k, v in value.items():
        if isinstance(v, np.ndarray):
            rows.append((k, "numpy", str(v.dtype), v.shape, v.tobytes()))
        elif isinstance(v, torch.Tensor):
            kind = f"param:{v.requires_grad}" if isinstance(v, torch.nn.Parameter) else "torch"
            b = v.detach().resolve_conj().resolve_neg().reshape(-1).contiguous().view(torch.uint8)
            rows.append((k, kind, str(v.dtype), tuple(v.shape), b.numpy().tobytes()))
        else:
            rows.append((k, type(v).__name__, v))
    return rows


def _many_maker(transport: str):
    @rdt.tensor_method(tensor_transport=transport)
    def many(self, count: int = 300) -> Dict[str, Any]:
        return many_tensors(count)

    return many


@ray.remote(num_cpus=0)
class Node:
    """Producer and consumer at once."""

    make_gloo = _maker("gloo")
    make_shm = _maker("shm")
    make_nixl = _maker("nixl")
    make_auto = _maker("auto")
    make_object_store = _maker("object_store")
    nested_gloo = _nested_maker("gloo")
    nested_shm = _nested_maker("shm")
    nested_nixl = _nested_maker("nixl")
    many_gloo = _many_maker("gloo")
    many_shm = _many_maker("shm")
    many_nixl = _many_maker("nixl")

    def __init__(self) -> None:
        self.kept: Any = None
        self.held: List[Any] = []

    @rdt.tensor_method(tensor_transport="gloo", num_returns=2)
    def two(self) -> Any:
        return torch.ones(1 << 16), torch.full((1 << 16,), 2.0)

    @rdt.tensor_method(tensor_transport="gloo")
    def nothing(self) -> Any:
        return {"no": "tensors", "n": 3}

    @rdt.tensor_method(tensor_transport="gloo")
    def fails(self) -> Any:
        raise KeyError("producer bug")

    @rdt.tensor_method(tensor_transport="gloo", snapshot=True)
    def snap(self, numel: int = 1 << 16) -> Any:
        self.kept = torch.ones(numel)
        return self.kept

    @rdt.tensor_method(tensor_transport="nixl")
    def weights_nixl(self, numel: int = 1 << 16) -> Any:
        """The same tensors at every call (weights returned every step)."""
        if getattr(self, "weights", None) is None:
            self.weights = {"w": torch.ones(numel), "b": torch.zeros(16)}
        return self.weights

    def mutate_kept(self, value: float) -> None:
        self.kept.fill_(value)

    def put(self, transport: str, numel: int = 1 << 16) -> Any:
        self.kept = torch.full((numel,), 9.0)
        return rdt.put({"w": self.kept}, tensor_transport=transport)

    def configure(self, **kw: Any) -> None:
        rdt.configure(**kw)

    def pid(self) -> int:
        return os.getpid()

    # ---- consumer side
    def digests(self, value: Any) -> List[Any]:
        return leaf_digests(value) + [("tied is tied", value["tied"] is value["layer.0.w"])]

    def total(self, value: Any) -> float:
        return float(value["w"].sum())

    def total_kw(self, *, value: Any) -> float:
        return float(value["w"].sum())

    def total_nested_arg(self, values: List[Any]) -> float:
        return sum(float(ray.get(v)["w"].sum()) for v in values)

    def same_object(self, value: Any) -> bool:
        return value["w"] is self.kept

    def identity_twice(self, a: Any, b: Any) -> bool:
        return a["w"] is b["w"]

    def mutate_and_sum(self, value: Any) -> float:
        value["w"].add_(100.0)
        return float(value["w"].sum())

    def check_nested(self, v: Any) -> Dict[str, Any]:
        views = v["views"]
        views[0][15] = -1.0  # shared storage: must show in the other views
        return {
            "views_share": bool(views[1][5] == -1.0) and bool(views[2].reshape(-1)[15] == -1.0),
            "same_storage": views[0].untyped_storage().data_ptr() == views[1].untyped_storage().data_ptr(),
            "batch": (type(v["batch"]).__name__, float(v["batch"].x.sum()), v["batch"].y.dtype == torch.int64,
                      v["batch"].note),
            "pair": (type(v["pair"]).__name__, float(v["pair"].a.sum()), v["pair"].b),
            "map": (type(v["map"]).__name__, float(v["map"]["k"].sum())),
            "np": (type(v["np"]).__name__, float(v["np"].sum())),
            "param": (type(v["param"]).__name__, bool(v["param"].requires_grad), float(v["param"].sum())),
            "empty": tuple(v["empty"].shape),
            "plain": v["plain"],
        }

    def hold(self, refs: List[Any]) -> None:
        self.held.extend(refs)

    def release(self) -> None:
        self.held.clear()

    def slow_total(self, value: Any, seconds: float) -> float:
        time.sleep(seconds)
        return float(value["w"].sum())

    def busy(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    def forward(self, consumer: Any, refs: List[Any]) -> float:
        """A coordinator that did not create the group passes a borrowed ref on."""
        return ray.get(consumer.total.remote(refs[0]))

    def try_total(self, value_ref_list: List[Any]) -> Any:
        try:
            return ("ok", float(ray.get(value_ref_list[0])["w"].sum()))
        except Exception as e:  # noqa: BLE001 - the test inspects the error
            return ("err", type(e).__name__, str(e))

    def stats(self) -> Dict[str, Any]:
        return rdt.stats()

    def put_and_ask(self, consumer: Any, transport: str) -> Any:
        """Wait, inside this producer's method, on a consumer that fetches this producer's object."""
        self.kept = torch.full((1 << 16,), 5.0)
        ref = rdt.put({"w": self.kept}, tensor_transport=transport)
        return ray.get(consumer.try_total.remote([ref]), timeout=60)


@ray.remote(num_cpus=0)
class AsyncNode:
    """An async actor as producer and consumer."""

    @rdt.tensor_method(tensor_transport="gloo")
    async def make(self, numel: int = 1 << 16) -> Any:
        await asyncio.sleep(0)
        return {"w": torch.full((numel,), 4.0)}

    @rdt.tensor_method(tensor_transport="shm")
    async def make_shm(self, numel: int = 1 << 16) -> Any:
        return {"w": torch.full((numel,), 5.0)}

    async def total(self, value: Any) -> float:
        await asyncio.sleep(0)
        return float(value["w"].sum())
