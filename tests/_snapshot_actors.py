"""Actors for the snapshot tests: a producer that returns state dicts with ``snapshot=True`` (one method per
transport) and then changes or frees the originals, and consumers that report what they received."""

from __future__ import annotations

import gc
import hashlib
from typing import Any, Dict, List, Optional, Tuple

import ray
import torch

import rdt

Digests = List[Tuple[str, str]]


def state(count: int, nbytes: int, seed: int) -> Dict[str, torch.Tensor]:
    """``count`` random int32 CPU tensors of ``nbytes`` each, alone on their storages (a state dict)."""
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}.w": torch.randint(-(1 << 31), (1 << 31) - 1, (nbytes // 4,), dtype=torch.int32, generator=g)
            for i in range(count)}


def digests(value: Dict[str, torch.Tensor]) -> Digests:
    """Per key: the SHA-256 of the tensor's bytes."""
    return [(k, hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest())
            for k, v in value.items()]


def _snap_maker(transport: str):
    @rdt.tensor_method(tensor_transport=transport, snapshot=True)
    def make(self, count: int, nbytes: int, seed: int) -> Dict[str, torch.Tensor]:
        self.kept = state(count, nbytes, seed)
        self.want = digests(self.kept)  # the values at return: what every consumer must get
        return self.kept

    return make


@ray.remote(num_cpus=0)
class SnapNode:
    """Producer (snapshot=True, per transport) and consumer at once."""

    snap_shm = _snap_maker("shm")
    snap_gloo = _snap_maker("gloo")
    snap_nixl = _snap_maker("nixl")
    snap_auto = _snap_maker("auto")

    def __init__(self) -> None:
        self.kept: Optional[Dict[str, torch.Tensor]] = None
        self.want: Digests = []
        self.scratch: List[torch.Tensor] = []

    def put(self, transport: str, count: int, nbytes: int, seed: int) -> Any:
        """rdt.put(..., snapshot=True) of a state dict; the ref, inside a list so Ray does not resolve it."""
        self.kept = state(count, nbytes, seed)
        self.want = digests(self.kept)
        return [rdt.put(self.kept, tensor_transport=transport, snapshot=True)]

    def change(self, action: str) -> Digests:
        """After the return: change the originals in place, or drop them and fill their memory with other bytes
        (tensors of the same sizes, allocated where they were); the digests taken at return."""
        assert self.kept is not None
        if action == "mutate":
            for t in self.kept.values():
                t.bitwise_not_()
        else:
            sizes = [t.numel() for t in self.kept.values()]
            self.kept = None
            gc.collect()
            self.scratch = [torch.full((n,), 0x5A5A5A5A, dtype=torch.int32) for n in sizes]
        return self.want

    def configure(self, **kw: Any) -> None:
        rdt.configure(**kw)

    def where(self) -> str:
        return rdt.__file__

    def digests(self, value: Dict[str, torch.Tensor]) -> Digests:
        """What this consumer received."""
        return digests(value)
