"""Actors for tests/test_sharded_delta.py: trainer ranks whose weights change a chosen fraction of their elements
per version (deterministically, so that the driver knows every version's bytes), publishing with ``delta=True``.
The engine ranks are tests/_sharded_actors.py's Consumer (fused qkv, row-parallel o, column-parallel gate, a bf16
cast target, a vocabulary slice and a replicated norm)."""

from __future__ import annotations

import functools
import os
from typing import Any, Dict, List, Optional, Tuple

import ray
import torch

import rdt

from ._sharded_actors import REPLICATED, SHAPES, layouts, rows_of, wants


@functools.lru_cache(maxsize=256)
def full_at(name: str, version: int, frac: float = 0.01) -> torch.Tensor:
    """Parameter ``name`` whole at ``version``: version 0 random, each later version changes about ``frac`` of the
    elements (chosen at random) to new values, and also flips the sign of a few zeros (0.0 <-> -0.0) and the payload
    of a few NaNs (bitwise changes a float comparison would miss)."""
    if version == 0:
        g = torch.Generator().manual_seed(sum(map(ord, name)) + 11)
        t = torch.randn(SHAPES[name], generator=g)
        t.view(-1)[::97] = 0.0
        t.view(-1)[5::101] = float("nan")
        return t
    t = full_at(name, version - 1, frac).clone()
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 1000 + version)
    mask = torch.rand(SHAPES[name], generator=g) < frac
    t[mask] = torch.randn(int(mask.sum()), generator=g)
    flat = t.view(-1).view(torch.int32)
    zeros = (t.view(-1) == 0).nonzero().squeeze(1)[:3]
    flat[zeros] = flat[zeros] ^ (1 << 31)  # 0.0 <-> -0.0
    nans = torch.isnan(t.view(-1)).nonzero().squeeze(1)[:3]
    flat[nans] = flat[nans] ^ 1  # another NaN payload
    return t


def expected_at(rank: int, tp: int, version: int, frac: float = 0.01) -> Dict[str, torch.Tensor]:
    """What engine rank ``rank`` of ``tp`` holds at ``version`` (as tests/_sharded_actors.expected)."""
    out = {}
    for target, regions, dim, dtype in wants(rank, tp):
        parts = [full_at(p, version, frac) if d < 0 else full_at(p, version, frac).narrow(d, s, n)
                 for p, d, s, n in regions]
        out[target] = torch.cat(parts, dim).to(getattr(torch, dtype))
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and signed zeros included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


@ray.remote(num_cpus=0)
class DTrainer:
    """Rank ``rank`` of ``world`` holding Shard(0) of every parameter at ``self.version``."""

    def __init__(self, rank: int, world: int, frac: float = 0.01) -> None:
        self.rank, self.world, self.frac = rank, world, frac
        self.version = 0
        self.local = {name: self._rows(name, 0) for name in SHAPES}
        self.published: List[rdt.Shards] = []

    def _rows(self, name: str, version: int) -> torch.Tensor:
        t = full_at(name, version, self.frac)
        if name in REPLICATED:
            return t.clone()
        lo, hi = rows_of(name, self.rank, self.world)
        return t[lo:hi].clone()

    def pid(self) -> int:
        return os.getpid()

    def layouts(self) -> Dict[str, rdt.Layout]:
        return layouts(self.rank, self.world)

    def step(self) -> None:
        """The optimizer's in-place update to the next version (fencing the live publication first)."""
        for s in self.published[-1:]:
            s.fence(timeout=30.0)
        self.version += 1
        for name, t in self.local.items():
            t.copy_(self._rows(name, self.version))

    def publish(self, transport: str = "shm", delta: bool = True, keep_versions: int = 0,
                delta_versions: int = 4) -> rdt.Shards:
        s = rdt.put_shards(self.local, version=self.version, layouts=self.layouts(), rank=self.rank,
                           tensor_transport=transport, keep_versions=keep_versions, delta=delta,
                           delta_versions=delta_versions)
        self.published = self.published[-8:] + [s]
        return s

    def step_publish(self, transport: str = "shm", delta: bool = True, delta_versions: int = 4) -> rdt.Shards:
        self.step()
        return self.publish(transport, delta, 0, delta_versions)

    def step_publish_failing_changes(self, transport: str = "shm") -> str:
        """The next version, with the publication of its changes failing (after the base copy was compared and
        brought along): the error."""
        from rdt._sharded import publish as _publish

        def fail(*_a: Any, **_k: Any) -> Any:
            raise RuntimeError("the changes' publication failed")

        self.step()
        saved, _publish.publish_changes = _publish.publish_changes, fail
        try:
            self.publish(transport)
            return "ok"
        except RuntimeError as e:
            return str(e)
        finally:
            _publish.publish_changes = saved

    def try_publish(self, change: str, transport: str = "shm") -> str:
        """Publish with delta=True after changing a parameter's dtype ("dtype") or this rank's rows ("layout"):
        the error, or "ok"; the weights are put back after."""
        saved = dict(self.local)
        layouts = self.layouts()
        if change == "dtype":
            self.local["o"] = self.local["o"].to(torch.float64)
        else:
            self.local["gate"] = self.local["gate"][:-1].clone()
        try:
            rdt.put_shards(self.local, version=self.version + 1, layouts=layouts, rank=self.rank,
                           tensor_transport=transport, delta=True)
            return "ok"
        except rdt.RdtError as e:
            return f"{type(e).__name__}: {e}"
        finally:
            self.local = saved

    def stats(self) -> Dict[str, Any]:
        return rdt.stats()["sharded"]

    def shard_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.local.values())


def delta_meta_ids(manifest: rdt.Manifest) -> List[Optional[bytes]]:
    """Per rank, the object id of the newest changes' records (None: none)."""
    return [s.deltas[-1].meta.obj_id if s.deltas and s.deltas[-1].meta is not None else None for s in manifest.shards]


def tamper(targets: Dict[str, torch.Tensor], name: str, index: int) -> Tuple[str, int]:
    """Change one element of target ``name`` (a writer the loader does not know of)."""
    flat = targets[name].view(-1)
    flat[index] = flat[index] + 1000.0
    return name, index
