"""The GPU benchmark that ``scripts/gpu-check`` runs on a machine with a GPU: every GPU path of rdt's object layer.

Cases: cuda_ipc copy and map, NIXL VRAM->VRAM and VRAM->DRAM (a consumer without CUDA), ``auto``, ``rdt.get(...,
into=)`` on a GPU target (where this build has it), ``ray.get`` on the driver, and NCCL where two GPUs exist. Each
is timed as ``ray.get(consumer.consume.remote(producer.make.remote()))`` on the driver (the objects suite's
method), the producer returning the same kept tensor every time (weights returned every step), the median of
``--iters`` after warm-ups; the path that served is read from the consumer's ``rdt.stats()`` and every checksum is
verified. Usage: ``python -m benchmarks.gpu_bench [--sizes 1M,64M,256M] [--iters 10] [--out FILE.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import ray
import torch

import rdt

PAGE_FLOATS = 1024


@ray.remote
class GpuBench:
    """Producer and consumer of the benchmark (two of them share one GPU, num_gpus=0.5 each)."""

    def __init__(self) -> None:
        self.t = torch.zeros(1)
        self._paths: Dict[str, int] = {}

    def prepare(self, nbytes: int) -> Dict[str, Any]:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.t = torch.ones(max(nbytes // 4, 1), device=dev)
        return {"cuda": torch.cuda.is_available(), "devices": torch.cuda.device_count()}

    @rdt.tensor_method(tensor_transport="cuda_ipc")
    def cuda_ipc(self) -> torch.Tensor:
        return self.t

    @rdt.tensor_method(tensor_transport="cuda_ipc", ipc_map=True)
    def cuda_ipc_map(self) -> torch.Tensor:
        return self.t

    @rdt.tensor_method(tensor_transport="nixl")
    def nixl(self) -> torch.Tensor:
        return self.t

    @rdt.tensor_method(tensor_transport="auto")
    def auto(self) -> torch.Tensor:
        return self.t

    @rdt.tensor_method(tensor_transport="nccl")
    def nccl(self) -> torch.Tensor:
        return self.t

    def consume(self, t: torch.Tensor) -> List[Any]:
        return [float(t.view(-1)[::PAGE_FLOATS].sum()), str(t.device), self._last_path()]

    def consume_into(self, refs: List[Any]) -> List[Any]:
        """rdt.get(ref, into=...) into a GPU buffer allocated once (the consumer-side receive-into path)."""
        target = getattr(self, "_into", None)
        if target is None or target.numel() != self.t.numel():
            target = self._into = torch.empty(self.t.numel(), device="cuda")
        start = time.perf_counter()
        rdt.get(refs[0], into=target)  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        return [float(target[::PAGE_FLOATS].sum()), time.perf_counter() - start, self._last_path()]

    def _last_path(self) -> str:
        paths = rdt.stats()["paths"]
        grown = sorted(p for p, n in paths.items() if n > self._paths.get(p, 0))
        self._paths = paths
        return ",".join(grown)


def _time(fn: Callable[[], List[Any]], want: float, iters: int, warmup: int) -> Dict[str, Any]:
    """Median wall time of ``fn`` on the driver, the path it took, and whether every checksum was right."""
    times: List[float] = []
    out: List[Any] = []
    for i in range(warmup + iters):
        start = time.perf_counter()
        out = fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if abs(out[0] - want) > 1e-3 * max(want, 1.0):
            return {"error": f"checksum {out[0]} != {want}", "path": out[-1]}
    return {"median_s": statistics.median(times), "path": out[-1], "device": out[1] if len(out) > 2 else "cuda"}


def run(sizes: List[int], iters: int, warmup: int) -> List[Dict[str, Any]]:
    """Every case at every size; a case that cannot run here is a row with its reason."""
    n_gpus = torch.cuda.device_count()
    half = {"num_gpus": 0.5}
    a, b = GpuBench.options(**half).remote(), GpuBench.options(**half).remote()
    cpu = GpuBench.options(num_gpus=0, runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}).remote()
    group = None
    pair = None
    if n_gpus >= 2:
        pair = [GpuBench.options(num_gpus=1).remote() for _ in range(2)]
        group = rdt.create_collective_group(pair, backend="nccl")
    rows: List[Dict[str, Any]] = []
    try:
        for nbytes in sizes:
            info = ray.get([x.prepare.remote(nbytes) for x in (a, b, cpu) + tuple(pair or ())], timeout=120)
            want = float(len(range(0, nbytes // 4, PAGE_FLOATS)))
            cases: Dict[str, Optional[Callable[[], List[Any]]]] = {
                "cuda_ipc copy": lambda: ray.get(b.consume.remote(a.cuda_ipc.remote()), timeout=120),
                "cuda_ipc map": lambda: ray.get(b.consume.remote(a.cuda_ipc_map.remote()), timeout=120),
                "nixl VRAM->VRAM": lambda: ray.get(b.consume.remote(a.nixl.remote()), timeout=120),
                "nixl VRAM->DRAM": (lambda: ray.get(cpu.consume.remote(a.nixl.remote()), timeout=120))
                if not info[2]["cuda"] else None,
                "auto": lambda: ray.get(b.consume.remote(a.auto.remote()), timeout=120),
                "rdt.get(into=) GPU": (lambda: ray.get(b.consume_into.remote([a.auto.remote()]), timeout=120))
                if hasattr(rdt, "get") else None,
                "ray.get on the driver": lambda: _driver_get(a.auto.remote()),
                "nccl": (lambda: ray.get(pair[1].consume.remote(pair[0].nccl.remote()), timeout=120))
                if pair is not None else None,
            }
            for name, fn in cases.items():
                row: Dict[str, Any] = {"case": name, "bytes": nbytes}
                if fn is None:
                    row["skipped"] = {"nixl VRAM->DRAM": "the CPU-only consumer still sees CUDA",
                                      "rdt.get(into=) GPU": "this build has no rdt.get",
                                      "nccl": f"needs two GPUs, found {n_gpus}"}[name]
                else:
                    try:
                        row.update(_time(fn, want, iters, warmup))
                    except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
                        row["error"] = f"{type(e).__name__}: {e}"
                if "median_s" in row:
                    row["GB/s"] = round(nbytes / row["median_s"] / 1e9, 2)
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    finally:
        if group is not None:
            rdt.destroy_collective_group(group)
        for actor in (a, b, cpu) + tuple(pair or ()):
            ray.kill(actor)
    return rows


def _driver_get(ref: Any) -> List[Any]:
    t = ray.get(ref, timeout=120)
    return [float(t.view(-1)[::PAGE_FLOATS].sum()), str(t.device), "driver"]


def format_markdown(rows: List[Dict[str, Any]]) -> str:
    """One table: case, size, median time, throughput, the path that served, or why it did not run."""
    lines = ["| case | size | median ms | GB/s | path | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        ms = f"{r['median_s'] * 1e3:.3f}" if "median_s" in r else ""
        note = r.get("error") or r.get("skipped") or ""
        lines.append(f"| {r['case']} | {r['bytes'] >> 20} MiB | {ms} | {r.get('GB/s', '')} | {r.get('path', '')} "
                     f"| {note} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_bench", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1M,64M,256M", help="object sizes (K/M/G binary units)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    from .rdt_bench import parse_size

    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA here; nothing to measure", file=sys.stderr)
        return 2
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        rows = run(sizes, args.iters, args.warmup)
    finally:
        ray.shutdown()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "gpus": torch.cuda.device_count(),
                       "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}, f, indent=1)
    print(format_markdown(rows))
    return 0 if rows and not any("error" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
