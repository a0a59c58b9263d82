"""Actors for tests/test_sharded_versions.py: trainer ranks that publish, fence and update their shards in place
(row by row, so that an unfenced read would see a mix of versions), and engine ranks that load and compare every
landed byte against the version their manifest names (parameters as in tests/_sharded_actors.py)."""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

import ray
import torch

import rdt

from ._nixl_stall import stall_agent
from ._sharded_actors import REPLICATED, SHAPES, expected, full, rows_of, wants

TP = 2


def _outcome(e: BaseException) -> Dict[str, Any]:
    return {"kind": type(e).__name__, "msg": str(e), "rank": getattr(e, "rank", None),
            "version": getattr(e, "version", None), "param": getattr(e, "param", None),
            "readers": getattr(e, "readers", None)}


@ray.remote(num_cpus=0, max_concurrency=4)
class VTrainer:
    """Rank ``rank`` of ``world``, holding Shard(0) of every parameter at ``self.version``."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.version = rank, world, 0
        self.local = {name: self._rows(name, 0) for name in SHAPES}
        self.shards: Optional[rdt.Shards] = None

    def _rows(self, name: str, version: int) -> torch.Tensor:
        t = full(name, version)
        if name in REPLICATED:
            return t.clone()
        lo, hi = rows_of(name, self.rank, self.world)
        return t[lo:hi].clone()

    def file(self) -> str:
        return rdt.__file__

    def publish(self, transport: str = "shm", keep: int = 0) -> rdt.Shards:
        layouts = {}
        for name in SHAPES:
            if name in REPLICATED:
                layouts[name] = rdt.Layout.whole(SHAPES[name])
            else:
                lo = rows_of(name, self.rank, self.world)[0]
                layouts[name] = rdt.Layout(SHAPES[name], (lo,) + (0,) * (len(SHAPES[name]) - 1))
        self.shards = rdt.put_shards(self.local, version=self.version, layouts=layouts, rank=self.rank,
                                     tensor_transport=transport, keep_versions=keep)
        return self.shards

    def fence(self, timeout: float) -> Dict[str, Any]:
        """Fence the last publication; its outcome ("ok" or the error's fields) and the seconds it took."""
        start = time.monotonic()
        try:
            self.shards.fence(timeout=timeout)
            out = {"kind": "ok"}
        except rdt.RdtError as e:
            out = _outcome(e)
        out["seconds"] = time.monotonic() - start
        return out

    def update(self, fence: bool = True, compute: float = 0.0, timeout: float = 20.0) -> Dict[str, Any]:
        """The optimizer step: ``compute`` seconds of backward pass, a fence (when asked), then every parameter
        moved to the next version in place, one row at a time."""
        time.sleep(compute)
        out = self.fence(timeout) if fence else {"kind": "ok"}
        self.version += 1
        for name, t in self.local.items():
            new = self._rows(name, self.version)
            for i in range(t.shape[0]):
                t[i].copy_(new[i])
                if i % 4 == 0:
                    time.sleep(0)
        return out

    def corrupt(self, name: str) -> None:
        """Flip one byte of the first element of ``name`` in place, without a fence (a test of verify)."""
        b = self.local[name].view(-1)[:1].view(torch.uint8)
        b[0] ^= 0x40

    def stall(self, seconds: float) -> float:
        """Hold this process's NIXL agent lock for ``seconds`` (its READs make no progress meanwhile)."""
        return stall_agent(seconds)

    def stats(self) -> Dict[str, Any]:
        return rdt.stats()["sharded"]


@ray.remote(num_cpus=0)
class VEngine:
    """An engine rank: its targets (fused qkv, row-parallel o, uneven gate, a cast, replicated norm) and a loader."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.loader = rdt.WeightLoader()
        self.targets: Dict[str, torch.Tensor] = {}
        for target, regions, dim, dtype in wants(rank, TP):
            ref = expected(rank, TP, 0)[target]
            t = self.targets[target] = torch.full(ref.shape, -1.0, dtype=getattr(torch, dtype))
            regs = [rdt.Region(p) if d < 0 else rdt.Region(p, d, s, n) for p, d, s, n in regions]
            self.loader.want(t, regs, dim=dim, cast=dtype != "float32", name=target)

    def load(self, manifest: rdt.Manifest, timeout: float = 30.0, verify: bool = False) -> Dict[str, Any]:
        """One load: "ok" with whether every target holds exactly the manifest's version, or the error's fields;
        ``untouched``: whether the targets were left as they were (on an error)."""
        before = {k: v.clone() for k, v in self.targets.items()}
        start = time.monotonic()
        try:
            report = self.loader.load(manifest, timeout=timeout, verify=verify)
            out: Dict[str, Any] = {"kind": "ok", "exact": self.exact(manifest.version), "report": report}
        except rdt.RdtError as e:
            out = _outcome(e)
            out["untouched"] = all(torch.equal(before[k], v) for k, v in self.targets.items())
        out["seconds"] = time.monotonic() - start
        return out

    def load_many(self, manifest: rdt.Manifest, n: int) -> List[Tuple[str, bool]]:
        """``n`` loads back to back: (outcome kind, exact) each."""
        out = []
        for _ in range(n):
            r = self.load(manifest, 20.0)
            out.append((r["kind"], r.get("exact", False)))
        return out

    def load_until_error(self, manifest: rdt.Manifest, timeout: float, seconds: float) -> Dict[str, Any]:
        """Load again and again (each exact) until one fails or ``seconds`` pass; the failing load's outcome."""
        end = time.monotonic() + seconds
        loads = 0
        while time.monotonic() < end:
            r = self.load(manifest, timeout)
            if r["kind"] != "ok":
                r["loads"] = loads
                return r
            assert r["exact"]
            loads += 1
        return {"kind": "none", "loads": loads}

    def exact(self, version: int) -> bool:
        want = expected(self.rank, TP, version)
        return all(torch.equal(self.targets[k], want[k]) for k in want)
