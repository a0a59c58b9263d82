"""Smoke test for rdt-bench: a --quick run finishes, writes JSON with gloo and baseline rows, and a PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXPECTED_IMPLS = ("rdt-gloo", "ray.collective-gloo", "torch.dist-gloo", "ray-objstore")


@pytest.mark.timeout(200)
def test_rdt_bench_quick(tmp_path: Path) -> None:
    """rdt-bench --quick over all three suites exits 0 with positive rdt and baseline throughput."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.rdt_bench", "--quick", "--suites", "p2p,allreduce,objects",
         "--backends", "gloo,nixl", "--world-sizes", "2", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, f"rdt-bench failed:\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 1, f"expected one JSON file in {tmp_path}, got {files}"
    data = json.loads(files[0].read_text())
    assert data["machine"]["cpu_cores"] >= 1 and data["machine"]["ray"] and data["machine"]["torch"]
    ok = [r for r in data["results"] if "error" not in r]
    for suite in ("p2p", "allreduce"):
        for impl in EXPECTED_IMPLS:
            rows = [r for r in ok if r["suite"] == suite and r["impl"] == impl]
            assert rows, f"no successful {suite} rows for {impl}"
            assert all(r["gbps"] > 0 and r["seconds"] > 0 for r in rows), rows
    assert any(r["suite"] == "allreduce" and r.get("busbw_gbps", 0) > 0 for r in ok)
    for impl in ("rdt-gloo", "rdt-shm", "rdt-auto", "ray-objstore", "ray-rdt-gloo"):
        rows = [r for r in ok if r["suite"] == "objects" and r["impl"] == impl]
        assert rows and all(r["gbps"] > 0 for r in rows), (impl, rows)
    png = files[0].with_suffix(".png")
    assert png.exists() and png.stat().st_size > 1000
    assert "rdt-gloo" in proc.stdout  # the table went to stdout
