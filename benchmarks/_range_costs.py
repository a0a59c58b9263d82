"""The sharded-sync suite's calibration: what one more range and one more byte cost each transport's range reads
(``Capabilities.range_run_s`` / ``range_bytes_per_s``), measured between two fresh actors with exact runs only:
a one-row load (the fixed cost of a load), the whole weight (bytes), and a column slice (one short run per row).
The suite hands the constants to its engine ranks (``rdt.configure(range_costs=)``), which then read a strided
slice as one covering range wherever that is cheaper; the report lists them beside the transports' declared ones."""

from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Optional, Tuple

import ray
import torch

import rdt

from ._cluster import log

ROWS, COLS, SLICE = 8192, 2048, 128  # bf16: 32 MiB whole; the slice is 8192 runs of 256 bytes
SMALL_ROWS = 1024  # below a tenth of the model (smoke runs): 4 MiB whole, 1024 runs
REPS = 5
EXACT = (1e-9, 1e12)  # ranges cost nothing: exact runs while calibrating


class _Side:
    """Producer (holds the weight) or consumer (three loaders) of the calibration."""

    def __init__(self) -> None:
        self.w: Optional[torch.Tensor] = None
        self.kept: Any = None

    def publish(self, transport: str, rows: int) -> Any:
        if self.w is None:
            self.w = torch.arange(rows * COLS, dtype=torch.float32).reshape(rows, COLS).to(torch.bfloat16)
        self.kept = rdt.put_shards({"w": self.w}, version=0, rank=0,
                                   layouts={"w": rdt.Layout.whole(tuple(self.w.shape))}, tensor_transport=transport)
        return self.kept

    def times(self, manifest: Any, rows: int) -> Dict[str, float]:
        """Median seconds of replayed loads: one row, the whole weight, a column slice."""
        rdt.configure(range_costs={name: EXACT for name in ("shm", "nixl", "gloo")})
        cases = {"row": (torch.empty(1, COLS, dtype=torch.bfloat16), rdt.Region("w", 0, 0, 1)),
                 "whole": (torch.empty(rows, COLS, dtype=torch.bfloat16), rdt.Region("w")),
                 "slice": (torch.empty(rows, SLICE, dtype=torch.bfloat16), rdt.Region("w", 1, 0, SLICE))}
        out = {}
        for name, (target, region) in cases.items():
            loader = rdt.WeightLoader()
            loader.want(target, region)
            loader.load(manifest, timeout=60.0)
            runs = []
            for _ in range(REPS):
                t0 = time.perf_counter()
                loader.load(manifest, timeout=60.0)
                runs.append(time.perf_counter() - t0)
            out[name] = statistics.median(runs)
        return out


def fit(t: Dict[str, float], rows: int = ROWS) -> Tuple[float, float]:
    """(seconds per range, bytes per second) from the three loads' times."""
    row, whole, sliced = COLS * 2, rows * COLS * 2, rows * SLICE * 2
    bps = (whole - row) / max(t["whole"] - t["row"], 1e-9)
    run_s = (t["slice"] - t["row"] - (sliced - row) / bps) / (rows - 1)
    return max(run_s, 1e-9), bps


def calibrate(transports: List[str], group_timeout: float, rows: int = ROWS) -> Dict[str, Any]:
    """Per transport: the measured (run_s, bytes_per_s), the raw times, and the transport's declared constants;
    an ``error`` entry for a transport that could not be measured. ``rows``: the weight's rows (and the slice's
    runs)."""
    cls = ray.remote(num_cpus=0, max_restarts=0)(_Side)
    out: Dict[str, Any] = {}
    for name in transports:
        producer, consumer = cls.remote(), cls.remote()
        group = None
        try:
            if name == "gloo":
                group = rdt.create_collective_group([producer, consumer], backend="gloo", timeout=group_timeout)
            manifest = rdt.Manifest([ray.get(producer.publish.remote(name, rows), timeout=120)])
            t = ray.get(consumer.times.remote(manifest, rows), timeout=300)
            run_s, bps = fit(t, rows)
            caps = rdt.transports.get(name).capabilities
            out[name] = {"run_s": run_s, "bytes_per_s": bps, "times_s": t, "rows": rows,
                         "declared": [caps.range_run_s, caps.range_bytes_per_s]}
            log(f"sharded-sync calibration {name:<5} {run_s * 1e6:8.2f} us per range  {bps / 1e9:6.2f} GB/s  "
                f"(declared {caps.range_run_s and caps.range_run_s * 1e6} us, "
                f"{caps.range_bytes_per_s and caps.range_bytes_per_s / 1e9} GB/s)")
        except Exception as e:  # noqa: BLE001 - recorded; the rows then use the declared constants
            out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            log(f"sharded-sync calibration {name} ERROR {out[name]['error']}")
        finally:
            if group is not None:
                try:
                    rdt.destroy_collective_group(group)
                except Exception:  # noqa: BLE001
                    pass
            for a in (producer, consumer):
                ray.kill(a)
    return out


def costs(measured: Dict[str, Any]) -> Dict[str, Tuple[float, float]]:
    """The measured constants as rdt.configure(range_costs=) takes them."""
    return {k: (v["run_s"], v["bytes_per_s"]) for k, v in measured.items() if "error" not in v}
