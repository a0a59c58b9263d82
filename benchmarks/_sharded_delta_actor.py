"""The sharded-delta suite's actor: the sharded-sync suite's trainer or engine rank (:class:`ShardedActor`), plus
what delta pulls need. A trainer rank changes a chosen fraction of its bf16 elements per step (uniformly at
random, each changed bitwise), or runs AdamW on fp32 master weights and publishes them in bf16; it publishes with
``put_shards(delta=True)`` and times it. An engine rank holds two copies of its targets: one loaded in full every
step (loader F, the reference: the trainers' bf16 bytes as the full sharded load lands them) and one loaded as
deltas (loader D), compared byte for byte after every step."""

from __future__ import annotations

import copy
import os
import random
import time
from typing import Any, Dict, List, Optional, Tuple

import ray
import torch

import rdt

from ._sharded_sync_actor import ShardedActor, _IoClock
from ._sharded_sync_model import Want


def _strip(manifest: Any) -> Any:
    """The same publications without their changes: a loader given it loads in full."""
    out = []
    for s in manifest.shards:
        c = copy.copy(s)
        c.deltas = ()
        out.append(c)
    return rdt.Manifest(out)


def _report(rep: Any) -> Dict[str, Any]:
    return {"mode": rep.mode, "nbytes": rep.nbytes, "read_bytes": rep.read_bytes, "delta": dict(rep.delta),
            "changed_fraction": rep.changed_fraction, "repaired": dict(rep.repaired), "seconds": rep.seconds,
            "verify_seconds": rep.verify_seconds, "verified_bytes": rep.verified_bytes, "paths": dict(rep.paths)}


class DeltaActor(ShardedActor):
    """Trainer rank or engine rank of the sharded-delta suite (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.master: Dict[str, torch.Tensor] = {}
        self.opt: Any = None
        self.gen = torch.Generator()
        self.dtargets: Dict[str, torch.Tensor] = {}
        self.dloader: Any = None
        self.last_pub: Any = None

    # ------------------------------------------------------------------ trainer
    def delta_update(self, how: str, density: float, seed: int, timeout: float) -> Dict[str, float]:
        """Fence the live publication, then change the weights: ``how`` "density" flips the lowest bit of about
        ``density`` of the bf16 elements (uniformly at random, with repeats), "adamw" runs one AdamW step (lr 1e-6)
        on fp32 master weights (std 0.02) with synthetic gradients and casts them to the bf16 shards."""
        if self.last_pub is not None:
            self.last_pub.fence(timeout=timeout)
            self.last_pub = None
        t0 = time.perf_counter()
        self.gen.manual_seed(seed * 131 + self.rank)
        if how == "density":
            self.master, self.opt = {}, None
            for t in self.shards.values():
                v = t.view(-1).view(torch.int16)
                k = max(int(round(v.numel() * density)), 1)
                pos = torch.randint(0, v.numel(), (k,), generator=self.gen)
                v[pos] = v[pos] ^ 1
        else:
            if self.opt is None:
                self.master = {n: torch.empty(t.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=self.gen)
                               for n, t in self.shards.items()}
                params = [torch.nn.Parameter(m) for m in self.master.values()]
                self.master = dict(zip(self.master, params))
                self.opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.01, foreach=False)
            for p in self.master.values():
                p.grad = torch.empty_like(p).normal_(0.0, 1e-2, generator=self.gen)
            self.opt.step()
            with torch.no_grad():
                for n, t in self.shards.items():
                    t.copy_(self.master[n])
        self.step += 1
        return {"update_s": time.perf_counter() - t0}

    def delta_publish(self, version: int, transport: str, delta_versions: int = 4) -> Tuple[Any, Dict[str, Any]]:
        """``put_shards(delta=True)`` of the live shards, timed (the trainer's delta computation: compare, encode,
        publish the changes, update the base copy); the fraction of elements the newest changes hold."""
        t0 = time.perf_counter()
        s = rdt.put_shards(self.shards, version=version, layouts=self.layouts, rank=self.rank,
                           tensor_transport=transport, delta=True, delta_versions=delta_versions)
        seconds = time.perf_counter() - t0
        self.last_pub = s
        d = s.deltas[-1] if s.deltas and s.deltas[-1].version == version else None
        changed = elements = 0
        if d is not None:
            changed, elements = int(d.changed.sum()), int(d.elements.sum())
        return s, {"publish_s": seconds, "changed": changed, "elements": elements,
                   "records_bytes": d.nbytes if d is not None else 0,
                   "kinds": {k: int((d.kinds == k).sum()) for k in (0, 1, 2)} if d is not None else {},
                   "shard_bytes": sum(t.numel() * 2 for t in self.shards.values()),
                   "stats": rdt.stats()["sharded"]}

    # ------------------------------------------------------------------ engine
    def setup_delta_engine(self, wants: List[Want]) -> Dict[str, int]:
        """A second copy of the targets, loaded by loader D (deltas); loader F (``self.loader``) loads in full."""
        self.dtargets = {name: torch.zeros(tshape, dtype=torch.bfloat16) for name, tshape, _ in wants}
        self._new_dloader()
        return {"pid": os.getpid()}

    def _new_dloader(self) -> None:
        self.dloader = rdt.WeightLoader()
        for name, _, regions in self.wants:
            self.dloader.want(self.dtargets[name], list(regions), name=name)

    def restart_dloader(self) -> None:
        """A restarted engine: a new loader (holding no version) over the same targets."""
        self._new_dloader()

    def load_full(self, manifest: Any, timeout: float, verify: bool = False) -> Dict[str, Any]:
        t0 = time.perf_counter()
        rep = self.loader.load(_strip(manifest), timeout=timeout, verify=verify)
        out = _report(rep)
        out["wall_s"] = time.perf_counter() - t0
        return out

    def load_delta(self, manifest: Any, timeout: float, verify: bool = False) -> Dict[str, Any]:
        t0 = time.perf_counter()
        rep = self.dloader.load(manifest, timeout=timeout, verify=verify)
        out = _report(rep)
        out["wall_s"] = time.perf_counter() - t0
        return out

    def compare(self) -> Dict[str, int]:
        """Bytes of the delta-loaded targets that differ from the fully loaded ones, and bytes compared."""
        wrong = total = 0
        for name, t in self.targets.items():
            a, b = t.view(torch.uint8), self.dtargets[name].view(torch.uint8)
            wrong += int((a != b).sum())
            total += a.numel()
        return {"wrong": wrong, "compared": total}

    def tamper(self, seed: int) -> str:
        """Change one element of one delta-loaded target behind its loader's back."""
        rng = random.Random(seed)
        name = rng.choice(sorted(self.dtargets))
        flat = self.dtargets[name].view(-1).view(torch.int16)
        i = rng.randrange(flat.numel())
        flat[i] = flat[i] ^ 0x40
        return f"{name}[{i}]"

    def checksum_speed(self, nbytes: int) -> Dict[str, float]:
        """verify's checksum (CRC-32C) on ``nbytes`` here, per CPU-second of this thread, and zlib's CRC-32."""
        import zlib

        import numpy as np

        from rdt._objects.checksum import crc32c

        a = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        out = {}
        for name, f in (("crc32c", crc32c), ("zlib_crc32", zlib.crc32)):
            f(a)
            best = float("inf")
            for _ in range(3):
                t0 = time.thread_time()
                f(a)
                best = min(best, time.thread_time() - t0)
            out[name] = nbytes / best / 1e9
        return out


def delta_actor_class() -> Any:
    """No CPU reserved, Ray's RDT enabled (the base class's methods), no restarts."""
    return ray.remote(num_cpus=0, max_restarts=0, enable_tensor_transport=True)(DeltaActor)


__all__ = ["DeltaActor", "delta_actor_class", "_IoClock"]
