"""scripts/gpu-check without a GPU: its dry run lists the GPU tests pytest collects and the wheels it would install,
and the splitting of wheels into parts that fit a device call joins back byte for byte (a lost part is caught)."""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check"


def _script():
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _test_names(path: Path) -> list:
    return [n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)
            and n.name.startswith("test_")]


def test_dry_run_lists_the_collected_gpu_tests_and_the_wheels():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    listed = [ln.strip() for ln in out.splitlines() if ln.startswith("  tests/")]
    # every test of tests/test_gpu.py is marked gpu (module pytestmark), so each must be listed
    for name in _test_names(ROOT / "tests" / "test_gpu.py"):
        assert any(t.split("::")[1].split("[")[0] == name for t in listed if t.startswith("tests/test_gpu.py")), name
    assert "tests/unit/test_nixl_mem_types.py::test_read_of_an_object_keeps_each_buffer_on_its_device[True]" in listed
    assert not any("[False]" in t or "test_gpu_cpu_side" in t for t in listed)  # CPU tests are not GPU tests
    assert f"would run {len(listed)} GPU test(s)" in out
    assert "ray==2.60.0" in out and "nixl-cu13" in out
    assert "nixl VRAM->DRAM" in out and "cuda_ipc map" in out


def test_wheels_split_into_parts_join_back_and_a_lost_part_is_caught(tmp_path):
    gc = _script()
    whl = tmp_path / "big-1.0-py3-none-any.whl"
    whl.write_bytes(os.urandom(2500))
    parts = gc.split(whl, tmp_path / "parts", 1000)
    assert [p.stat().st_size for p in parts] == [1000, 1000, 500]
    digest = gc.sha256(whl)
    assert gc.join(parts, tmp_path / "joined.whl", digest).read_bytes() == whl.read_bytes()
    with pytest.raises(SystemExit, match="missing or damaged"):
        gc.join(parts[:2], tmp_path / "short.whl", digest)
    exact = tmp_path / "exact.whl"
    exact.write_bytes(b"x" * 1000)
    assert len(gc.split(exact, tmp_path / "p2", 1000)) == 1


def test_parts_are_packed_into_the_fewest_calls_that_fit():
    gc = _script()
    mib = 1 << 20
    calls = gc.pack([("ray.part000", 50 * mib), ("ray.part001", 20 * mib), ("nixl.part000", 45 * mib),
                     ("nixl.part001", 5 * mib), ("rpds", 1 * mib)], 52 * mib)
    assert sorted(map(sorted, calls)) == sorted([["ray.part000", "rpds"], ["nixl.part000", "nixl.part001"],
                                                 ["ray.part001"]])
    with pytest.raises(SystemExit, match="exceeds"):
        gc.pack([("huge", 60 * mib)], 52 * mib)


def _probe_wheel(path: Path) -> Path:
    """A minimal pure-Python wheel (no network): what the run step joins, checks and installs."""
    import base64
    import hashlib
    import zipfile

    files = {"rdtprobe/__init__.py": b"VALUE = 42\n",
             "rdtprobe-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: rdtprobe\nVersion: 0.1\n",
             "rdtprobe-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                              b"Tag: py3-none-any\n"}
    record = [f"{k},sha256={base64.urlsafe_b64encode(hashlib.sha256(v).digest()).rstrip(b'=').decode()},{len(v)}"
              for k, v in files.items()] + ["rdtprobe-0.1.dist-info/RECORD,,"]
    files["rdtprobe-0.1.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    whl = path / "rdtprobe-0.1-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return whl


def test_stage_then_run_installs_the_joined_wheel_and_writes_the_report(tmp_path):
    """The device-side steps on CPU: a first call stages its parts, the last joins, installs and reports (the GPU
    tests show as skipped here and the benchmark finds no CUDA; on a GPU machine they run)."""
    gc = _script()
    whl = _probe_wheel(tmp_path)
    parts = gc.split(whl, tmp_path / "parts", 400)
    assert len(parts) >= 2
    manifest = {"wheels": {whl.name: {"sha256": gc.sha256(whl), "bytes": whl.stat().st_size,
                                      "parts": [p.name for p in parts]}}, "calls": [[parts[0].name],
                                                                                   [p.name for p in parts[1:]]]}
    wheels, tmp, out = tmp_path / "wheels", tmp_path / "device-tmp", tmp_path / "out"
    env = dict(os.environ, RDT_GPU_CHECK_WHEELS=str(wheels), RDT_GPU_CHECK_TMP=str(tmp), OUT=str(out),
               PYTHONPATH="")

    def call(n: int, verb: str) -> subprocess.CompletedProcess:
        import json
        import shutil

        shutil.rmtree(wheels, ignore_errors=True)  # each call carries only its own folder
        d = wheels / f"call-{n}"
        d.mkdir(parents=True)
        for name in manifest["calls"][n - 1]:
            shutil.copy(tmp_path / "parts" / name, d / name)
        (d / "manifest.json").write_text(json.dumps(manifest))
        return subprocess.run([sys.executable, str(SCRIPT), verb, "--sizes", "1M"], cwd=ROOT, capture_output=True,
                              text=True, env=env, timeout=240)

    first = call(1, "stage")
    assert first.returncode == 0, first.stdout + first.stderr
    last = call(2, "run")
    assert (tmp / "rdt-gpu-site" / "rdtprobe" / "__init__.py").read_text() == "VALUE = 42\n"
    report = (out / "gpu-check-report.md").read_text()
    assert "installed: rdtprobe-0.1-py3-none-any.whl" in report
    assert "tests/test_gpu.py::test_cuda_ipc_copy_between_actors_on_one_gpu" in report
    if not torch_cuda():
        assert "| skipped | needs CUDA" in report and last.returncode == 1  # the benchmark had nothing to measure
    # a lost part is named, not installed half
    (tmp / "rdt-gpu-wheels" / parts[0].name).unlink()
    again = call(2, "run")
    assert again.returncode != 0 and "missing" in again.stderr + again.stdout


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
