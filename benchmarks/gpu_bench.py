"""The GPU benchmark that ``scripts/gpu-check`` runs on a machine with a GPU: every GPU path of rdt's object layer.

Cases: cuda_ipc copy and map, NIXL VRAM->VRAM (also with UCX's own defaults for the actors' UCX_NET_DEVICES and
UCX_TLS, and with UCX told to use its CUDA IPC and copy transports, each with the protocols UCX chose), a NIXL object
read by a consumer without CUDA, ``auto``, ``rdt.get(..., into=)`` on a GPU target (where this build has it),
``ray.get`` on the driver, a sharded weight sync of Qwen2.5-0.5B's shapes over CUDA IPC (``_gpu_sharded``: one
row), and NCCL where two GPUs exist. Each
is timed as ``ray.get(consumer.consume.remote(producer.make.remote()))`` on the driver (the objects suite's
method), the producer returning the same kept tensor every time (weights returned every step), the median of
``--iters`` after warm-ups; the path that served is read from the consumer's ``rdt.stats()`` and every checksum is
verified. Usage: ``python -m benchmarks.gpu_bench [--sizes 1M,64M,256M] [--iters 10] [--out FILE.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import ray
import torch

import rdt

from ._gpu_sharded import CASE as SHARDED_CASE
from ._gpu_table import error_text, format_markdown  # noqa: F401 - re-exported

PAGE_FLOATS = 1024
UCX_DEFAULTS_CASE = "nixl VRAM->VRAM (UCX defaults)"
# The 0.5 GB/s of NIXL VRAM->VRAM on one GPU (docs/gpu.md): UCX told to use its CUDA IPC and copy transports, and
# its protocol table printed, to see whether they are there and chosen (a fallback through host memory over TCP
# would explain the rate).
UCX_CUDA_CASE = "nixl VRAM->VRAM (UCX_TLS=cuda_ipc,cuda_copy)"


@ray.remote
class GpuBench:
    """Producer and consumer of the benchmark (up to four of them share one GPU, num_gpus=0.25 each)."""

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

    def capture_stdio(self, path: str) -> None:
        """Send this process's stdout and stderr to ``path`` (UCX prints its protocol choices there)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    def ucx_protocols(self, path: str, limit: int = 3000) -> str:
        """The protocol lines UCX printed with UCX_PROTO_INFO=y (the transports it chose per message size)."""
        sys.stdout.flush()
        try:
            with open(path, errors="replace") as f:
                lines = [ln.rstrip() for ln in f if ln.startswith(("|", "+")) or "ucp_context" in ln]
        except OSError as e:
            return f"no capture: {e}"
        return "\n".join(lines)[-limit:] or "UCX printed no protocol table"

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


# The cases in the order they run: the riskiest last (a hang there costs only what comes after it).
CASES = ["cuda_ipc copy", "cuda_ipc map", "auto", "ray.get on the driver", SHARDED_CASE, "nixl VRAM->VRAM",
         "rdt.get(into=) GPU", "nixl object, consumer without CUDA", UCX_DEFAULTS_CASE, UCX_CUDA_CASE, "nccl"]
CALL_TIMEOUT_S = 60
# UCX's own defaults for the actors of UCX_DEFAULTS_CASE (every transport and device: the machine has no network
# peer to reach anyway), and its protocol table printed to their captured stdio.
UCX_DEFAULT_ENV = {"UCX_NET_DEVICES": "all", "UCX_TLS": "all", "UCX_PROTO_INFO": "y", "UCX_WARN_UNUSED_ENV_VARS": "n"}
UCX_CAPTURE = "/tmp/rdt-gpu-bench-ucx-{}.log"
UCX_CUDA_ENV = {"UCX_TLS": "cuda_ipc,cuda_copy,sm,self,tcp", "UCX_NET_DEVICES": "all", "UCX_PROTO_INFO": "y",
                "UCX_WARN_UNUSED_ENV_VARS": "n"}
UCX_PAIRS = {UCX_DEFAULTS_CASE: ("ua", "ub"), UCX_CUDA_CASE: ("ia", "ib")}


class _Actors:
    """The benchmark's actors, each made the first time a case needs it (inside that case's ``try``)."""

    def __init__(self) -> None:
        self._made: Dict[str, Any] = {}
        self.group: Any = None

    def names(self) -> List[str]:
        """The actors made so far."""
        return list(self._made)

    def get(self, name: str) -> Any:
        if name not in self._made:
            ucx = {"num_gpus": 0.25, "runtime_env": {"env_vars": dict(UCX_DEFAULT_ENV)}}
            cuda = {"num_gpus": 0.25, "runtime_env": {"env_vars": dict(UCX_CUDA_ENV)}}
            opts = {"a": {"num_gpus": 0.25}, "b": {"num_gpus": 0.25},
                    "cpu": {"num_gpus": 0, "runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}},
                    "ua": ucx, "ub": ucx, "ia": cuda, "ib": cuda, "p0": {"num_gpus": 1}, "p1": {"num_gpus": 1}}[name]
            self._made[name] = GpuBench.options(**opts).remote()
            if name in ("ua", "ub", "ia", "ib"):
                ray.get(self._made[name].capture_stdio.remote(UCX_CAPTURE.format(name)), timeout=CALL_TIMEOUT_S)
            if name == "p1":
                self.group = rdt.create_collective_group([self.get("p0"), self._made["p1"]], backend="nccl")
        return self._made[name]

    def drop(self, *names: str) -> None:
        """Kill these actors (their GPU share is freed for the next case)."""
        for name in names:
            actor = self._made.pop(name, None)
            if actor is not None:
                ray.kill(actor)

    def close(self) -> None:
        if self.group is not None:
            try:
                rdt.destroy_collective_group(self.group)
            except Exception:  # noqa: BLE001 - killing the actors below ends the group anyway
                pass
        for actor in self._made.values():
            ray.kill(actor)


def _case(name: str, actors: _Actors, nbytes: int, n_gpus: int) -> Optional[Callable[[], List[Any]]]:
    """The timed call of one case, after its set-up (actors made, tensors prepared); None when it cannot run here."""
    def prepared(*names: str) -> List[Any]:
        return ray.get([actors.get(n).prepare.remote(nbytes) for n in names], timeout=CALL_TIMEOUT_S)

    get = lambda ref: ray.get(ref, timeout=CALL_TIMEOUT_S)  # noqa: E731
    if name == "nccl":
        if n_gpus < 2:
            return None
        actors.drop("a", "b", "cpu", "ua", "ub")  # each rank needs a whole GPU
        prepared("p0", "p1")
        p0, p1 = actors.get("p0"), actors.get("p1")
        return lambda: get(p1.consume.remote(p0.nccl.remote()))
    if name == "nixl object, consumer without CUDA":
        info = prepared("a", "cpu")
        if info[1]["cuda"]:
            raise RuntimeError("the CPU-only consumer still sees CUDA (CUDA_VISIBLE_DEVICES='' did not hide it)")
        a, cpu = actors.get("a"), actors.get("cpu")
        return lambda: get(cpu.consume.remote(a.nixl.remote()))
    if name in UCX_PAIRS:
        pa, pb = UCX_PAIRS[name]
        if name == UCX_CUDA_CASE:
            actors.drop("ua", "ub")  # their GPU share
        prepared(pa, pb)
        ua, ub = actors.get(pa), actors.get(pb)
        return lambda: get(ub.consume.remote(ua.nixl.remote()))
    if name == "rdt.get(into=) GPU" and not hasattr(rdt, "get"):
        return None
    prepared("a", "b")
    a, b = actors.get("a"), actors.get("b")
    return {"cuda_ipc copy": lambda: get(b.consume.remote(a.cuda_ipc.remote())),
            "cuda_ipc map": lambda: get(b.consume.remote(a.cuda_ipc_map.remote())),
            "auto": lambda: get(b.consume.remote(a.auto.remote())),
            "ray.get on the driver": lambda: _driver_get(a.auto.remote()),
            "nixl VRAM->VRAM": lambda: get(b.consume.remote(a.nixl.remote())),
            "rdt.get(into=) GPU": lambda: get(b.consume_into.remote([a.auto.remote()]))}[name]


def run(sizes: List[int], iters: int, warmup: int, out: Optional[str] = None,
        budget: float = float("inf")) -> List[Dict[str, Any]]:
    """Every case at every size, case by case in CASES order; each row written to ``out`` as it ends, so a kill
    keeps what was reached. A case that cannot run here, fails or is past ``budget`` is a row with its reason."""
    n_gpus = torch.cuda.device_count()
    deadline = time.monotonic() + budget
    actors = _Actors()
    rows: List[Dict[str, Any]] = []
    skip_reason = {"rdt.get(into=) GPU": "this build has no rdt.get", "nccl": f"needs two GPUs, found {n_gpus}"}
    try:
        for name in CASES:
            if name == SHARDED_CASE:  # one row: the model's shapes, not the sizes
                rows.append(_sharded_row(rows, min(iters, 5), min(warmup, 1), deadline, budget, actors))
                _write(out, rows)
                continue
            for nbytes in sizes:
                row: Dict[str, Any] = {"case": name, "bytes": nbytes}
                if time.monotonic() > deadline:
                    row["skipped"] = f"not run: the benchmark's budget ({budget:.0f} s) was spent"
                else:
                    started = time.monotonic()
                    try:
                        fn = _case(name, actors, nbytes, n_gpus)
                        if fn is None:
                            row["skipped"] = skip_reason[name]
                        else:
                            want = float(len(range(0, nbytes // 4, PAGE_FLOATS)))
                            row.update(_time(fn, want, iters, warmup))
                    except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
                        row["error"] = error_text(e)
                    if name in UCX_PAIRS and UCX_PAIRS[name][1] in actors.names():
                        row["ucx"] = _protocols(actors, UCX_PAIRS[name])
                    row["case_s"] = round(time.monotonic() - started, 2)
                if "median_s" in row:
                    row["GB/s"] = round(nbytes / row["median_s"] / 1e9, 2)
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
                _write(out, rows)
    finally:
        actors.close()
    return rows


def _sharded_row(rows: List[Dict[str, Any]], iters: int, warmup: int, deadline: float, budget: float,
                 actors: _Actors) -> Dict[str, Any]:
    """The sharded-sync row (``_gpu_sharded``), against the largest cuda_ipc copy row that ran."""
    from . import _gpu_sharded

    row: Dict[str, Any] = {"case": SHARDED_CASE, "bytes": 0}
    if time.monotonic() > deadline:
        row["skipped"] = f"not run: the benchmark's budget ({budget:.0f} s) was spent"
        return row
    started = time.monotonic()
    actors.drop("a", "b")  # their GPU share, for the four ranks
    ipc = [r for r in rows if r["case"] == "cuda_ipc copy" and "GB/s" in r]
    try:
        row = _gpu_sharded.run(iters, warmup, max(ipc, key=lambda r: r["bytes"])["GB/s"] if ipc else None)
    except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
        row["error"] = error_text(e)
    row["case_s"] = round(time.monotonic() - started, 2)
    if "median_s" in row and row["bytes"]:
        row["GB/s"] = round(row["bytes"] / row["median_s"] / 1e9, 2)
    print(json.dumps(row, default=str), file=sys.stderr, flush=True)
    return row


def _protocols(actors: _Actors, pair: Any = ("ua", "ub")) -> str:
    """What UCX chose for the READs of a UCX case, as its consumer and producer printed it; never raises."""
    try:
        return "\n".join(f"[{n}]\n" + ray.get(actors.get(n).ucx_protocols.remote(UCX_CAPTURE.format(n)),
                                                 timeout=CALL_TIMEOUT_S) for n in pair[::-1])
    except Exception as e:  # noqa: BLE001 - a missing table must not fail the row
        return f"could not read UCX's protocol table: {error_text(e)}"


def _write(out: Optional[str], rows: List[Dict[str, Any]]) -> None:
    """The rows so far, replacing the file whole (a reader never sees half a JSON)."""
    if not out:
        return
    import os

    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"rows": rows, "gpus": torch.cuda.device_count(), "gpu": torch.cuda.get_device_name(0),
                   "torch": torch.__version__}, f, indent=1)
    os.replace(tmp, out)


def _driver_get(ref: Any) -> List[Any]:
    t = ray.get(ref, timeout=120)
    return [float(t.view(-1)[::PAGE_FLOATS].sum()), str(t.device), "driver"]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_bench", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1M,64M,256M", help="object sizes (K/M/G binary units)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="write the rows as JSON here (after each case)")
    p.add_argument("--budget", type=float, default=float("inf"), help="seconds: later cases are not started")
    args = p.parse_args(argv)
    from .rdt_bench import parse_size

    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA here; nothing to measure", file=sys.stderr)
        return 2
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        rows = run(sizes, args.iters, args.warmup, args.out, args.budget)
    finally:
        ray.shutdown()
    print(format_markdown(rows))
    return 0 if rows and not any("error" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
