"""The GPU benchmark's sharded-sync row: Qwen2.5-0.5B's shapes in bf16, two trainer ranks holding ``Shard(0)`` of
every parameter on the GPU, two tensor-parallel engine ranks wanting vLLM's layout (fused qkv and gate_up,
row-parallel o_proj and down_proj, a vocabulary slice, whole norms) in GPU targets, all four sharing the one GPU
(num_gpus=0.2 each). The first load plans; every later step the trainers fence, update in place and publish
(``cuda_ipc``), and the engines replay the load. The row: the median of the replays' in-actor seconds of one engine
rank (``LoadReport.seconds``), its GB/s over its targets' bytes, and that against the CUDA IPC copy rate of the
benchmark's ``cuda_ipc copy`` row at its largest size; the engines' targets are checked against the pattern every
element must hold (first and last step)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Optional

import ray
import torch

import rdt

from ._sharded_sync_model import engine_wants, pattern, region_views, target_bytes, trainer_rows
from ._weight_sync import ModelShape

CASE = "sharded sync (cuda_ipc, Qwen2.5-0.5B bf16, 2 trainers -> 2 engines)"
TP = 2
TRAINERS = 2


@ray.remote(num_gpus=0.2)
class ShardedRank:
    def trainer(self, rank: int, shape: ModelShape, device: str, transport: str) -> int:
        self.rank, self.step, self.device, self.transport = rank, 0, torch.device(device), transport
        self.rows = trainer_rows(shape, TRAINERS, rank)
        self.local = {n: pattern(((s, s + k),) + tuple((0, d) for d in g[1:]), g, 0).to(self.device)
                      for n, (g, s, k) in self.rows.items()}
        self.published: Optional[rdt.Shards] = None
        self._sync()
        return sum(t.numel() * 2 for t in self.local.values())

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def publish(self) -> rdt.Shards:
        layouts = {n: rdt.Layout(g, (s,) + (0,) * (len(g) - 1)) for n, (g, s, _) in self.rows.items()}
        self.published = rdt.put_shards(self.local, version=self.step, layouts=layouts, rank=self.rank,
                                        tensor_transport=self.transport)
        return self.published

    def step_publish(self) -> rdt.Shards:
        if self.published is not None:
            self.published.fence(timeout=60.0)
        self.step += 1
        for t in self.local.values():
            t.add_(1)  # integers below 256: exact in bf16
        self._sync()
        return self.publish()

    def engine(self, r: int, shape: ModelShape, device: str) -> int:
        self.wants = engine_wants(shape, TP, r)
        self.shapes = dict(shape.shapes())
        self.loader = rdt.WeightLoader()
        self.targets = {}
        for name, shape, regions in self.wants:
            t = self.targets[name] = torch.empty(shape, dtype=torch.bfloat16, device=device)
            self.loader.want(t, regions, name=name)
        return target_bytes(self.wants)

    def load(self, manifest: rdt.Manifest, check: bool) -> Dict[str, Any]:
        report = self.loader.load(manifest, timeout=120.0)
        bad = 0
        if check:
            for name, _, regions in self.wants:
                for view, reg, box in region_views(self.targets[name], regions, self.shapes, name):
                    bad += int(not torch.equal(view.cpu(), pattern(box, self.shapes[reg.param], manifest.version)))
        return {"seconds": report.seconds, "paths": sorted(set(report.paths.values())), "bad": bad,
                "planned": report.planned, "ipc": rdt.stats().get("cuda_ipc_ranges", {})}


def run(iters: int, warmup: int, ipc_rate: Optional[float], call_timeout: float = 120.0,
        shape: Optional[ModelShape] = None, device: str = "cuda", transport: str = "cuda_ipc") -> Dict[str, Any]:
    """The row (see the module docstring); ``ipc_rate``: the CUDA IPC copy row's GB/s, if it ran. ``shape``,
    ``device`` and ``transport`` other than Qwen2.5-0.5B's on CUDA over ``cuda_ipc``: a check of this code on CPU."""
    shape = shape or ModelShape()
    gpus = 0.2 if device == "cuda" else 0
    actors = [ShardedRank.options(num_gpus=gpus).remote() for _ in range(TRAINERS + TP)]
    trainers, engines = actors[:TRAINERS], actors[TRAINERS:]
    try:
        get = lambda refs: ray.get(refs, timeout=call_timeout)  # noqa: E731
        get([t.trainer.remote(r, shape, device, transport) for r, t in enumerate(trainers)])
        nbytes = get([e.engine.remote(r, shape, device) for r, e in enumerate(engines)])[0]
        manifest = rdt.Manifest(get([t.publish.remote() for t in trainers]))
        first = get([e.load.remote(manifest, True) for e in engines])
        seconds: List[float] = []
        walls: List[float] = []
        last: List[Dict[str, Any]] = first
        for i in range(warmup + iters):
            manifest = rdt.Manifest(get([t.step_publish.remote() for t in trainers]))
            start = time.perf_counter()
            last = get([e.load.remote(manifest, i == warmup + iters - 1) for e in engines])
            if i >= warmup:
                walls.append(time.perf_counter() - start)
                seconds.append(last[0]["seconds"])
        bad = sum(o["bad"] for o in first + last)
        median = statistics.median(seconds)
        row: Dict[str, Any] = {"case": CASE, "bytes": nbytes, "median_s": median, "path": ",".join(last[0]["paths"]),
                               "first_load_s": round(first[0]["seconds"], 4),
                               "driver_median_s": round(statistics.median(walls), 4),
                               "ipc_mappings": last[0]["ipc"]}
        rate = nbytes / median / 1e9
        note = f"replayed load {rate:.1f} GB/s per engine rank (first load, planned: {first[0]['seconds'] * 1e3:.1f} ms)"
        if ipc_rate:
            note += f"; {rate / ipc_rate:.2f} x the cuda_ipc copy rate ({ipc_rate:.1f} GB/s)"
        if bad:
            row["error"] = f"{bad} region(s) landed wrong bytes"
        elif any(o["planned"] for o in last):
            row["error"] = "a replayed load planned again"
        else:
            row["note"] = note
        return row
    finally:
        for a in actors:
            ray.kill(a)
