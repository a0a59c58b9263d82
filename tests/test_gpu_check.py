"""scripts/gpu-check without a GPU: its dry run lists the GPU tests pytest collects and the wheels it would install,
and the splitting of wheels into parts that fit a device call joins back byte for byte (a lost part is caught)."""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import os
import re
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
    assert ("ray==2.60.0" in out or "ray-2.60.0-" in out) and ("nixl-cu13" in out or "nixl_cu13-" in out)  # fetched or not
    assert "nixl object, consumer without CUDA" in out and "cuda_ipc map" in out


def test_the_plan_fits_three_calls_and_eight_minutes_and_lists_the_sharded_gpu_checks():
    """The dry run's plan (from the pinned wheels' sizes when none were fetched) stays within 3 device calls and
    480 s, with the GPU sharded-sync tests and the benchmark's sharded-sync row in it, the row in the benchmark's
    own case list."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                         env=env, timeout=240).stdout
    plan = re.search(r"^plan: (\d+) device calls, (\d+) s", out, re.M)
    assert plan and int(plan.group(1)) <= 3 and int(plan.group(2)) <= 480, out[-2000:]
    assert "OVER the limit" not in out
    listed = [ln.strip() for ln in out.splitlines() if ln.startswith("  tests/test_gpu_sharded.py::")]
    for name in _test_names(ROOT / "tests" / "test_gpu_sharded.py"):
        assert any(t.split("::")[1] == name for t in listed), name
    gc = _script()
    assert any(c.startswith("sharded sync (cuda_ipc") for c in gc.BENCH_CASES)
    from benchmarks import gpu_bench

    assert gpu_bench.CASES == gc.BENCH_CASES


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


def _wheel(path: Path, name: str, files: dict) -> Path:
    """A minimal pure-Python wheel (no network): what the run step joins, checks and installs."""
    import base64
    import hashlib
    import zipfile

    files = dict(files)
    info = f"{name}-0.1.dist-info"
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [f"{k},sha256={base64.urlsafe_b64encode(hashlib.sha256(v).digest()).rstrip(b'=').decode()},{len(v)}"
              for k, v in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    whl = path / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return whl


# Ray as the device machine has it: only in the staged site. The shim loads this venv's Ray under the name `ray`.
_RAY_SHIM = """import importlib.util, os, sys
_spec = importlib.util.spec_from_file_location("ray", {origin!r}, submodule_search_locations=[{folder!r}])
_mod = importlib.util.module_from_spec(_spec)
sys.modules["ray"] = _mod
_spec.loader.exec_module(_mod)
_mod.STAGED = True
"""
# The benchmark's stand-in: needs Ray (from the staged site), writes two rows and leaves the other cases unrun.
_FAKE_BENCH = """import argparse, json, sys
import ray
assert getattr(ray, "STAGED", False), "the benchmark step must see the staged site's Ray"
p = argparse.ArgumentParser()
p.add_argument("--out")
args, _ = p.parse_known_args()
rows = [{"case": "cuda_ipc copy", "bytes": 1 << 20, "median_s": 0.001, "GB/s": 1.05, "path": "cuda_ipc"},
        {"case": "nixl object, consumer without CUDA", "bytes": 1 << 20, "error": "TimeoutError: no read in 60 s"}]
json.dump({"rows": rows, "gpu": "fake"}, open(args.out, "w"))
print("fake bench wrote", len(rows), "rows")
sys.exit(1)
"""


def test_run_step_end_to_end_without_ray_in_its_own_process(tmp_path):
    """The device-side steps as the GPU image runs them, on CPU: Ray exists only in the staged site (the image has
    none), a first call stages its parts, the last joins, installs, runs the GPU tests (they skip here) and a
    benchmark stand-in whose JSON the report formats in gpu-check's own process, which has no Ray."""
    import importlib.util
    import json
    import shutil

    gc = _script()
    spec = importlib.util.find_spec("ray")
    origin, folder = spec.origin, list(spec.submodule_search_locations)[0]
    whl = _wheel(tmp_path, "rdtstaged", {"ray/__init__.py": _RAY_SHIM.format(origin=origin, folder=folder).encode(),
                                         "rdt_fake_gpu_bench.py": _FAKE_BENCH.encode()})
    parts = gc.split(whl, tmp_path / "parts", 700)
    assert len(parts) >= 2
    manifest = {"wheels": {whl.name: {"sha256": gc.sha256(whl), "bytes": whl.stat().st_size,
                                      "parts": [p.name for p in parts]}},
                "calls": [[parts[0].name], [p.name for p in parts[1:]]]}
    noray = tmp_path / "noray" / "ray"  # gpu-check's own process: `import ray` fails as on the GPU image
    noray.mkdir(parents=True)
    (noray / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'ray'\", name='ray')\n")
    wheels, tmp, out = tmp_path / "wheels", tmp_path / "device-tmp", tmp_path / "out"
    env = dict(os.environ, RDT_GPU_CHECK_WHEELS=str(wheels), RDT_GPU_CHECK_TMP=str(tmp), OUT=str(out),
               PYTHONPATH=str(noray.parent), RDT_GPU_CHECK_BENCH_MODULE="rdt_fake_gpu_bench")

    def call(n: int, verb: str) -> subprocess.CompletedProcess:
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
    assert (tmp / "rdt-gpu-site" / "ray" / "__init__.py").is_file()
    assert (out / "gpu-check-report.md").is_file(), last.stdout[-3000:] + last.stderr[-3000:]
    report = (out / "gpu-check-report.md").read_text()
    assert last.returncode == 1  # the stand-in's error row fails the run
    # the report opens with the machine's facts
    head = report.split("## Tests")[0]
    for fact in ("GPU", "driver", "CUDA", "torch", "NCCL", "UCX"):
        assert fact in head, fact
    # every GPU test, each with its outcome (skipped here: no CUDA), from the JSONL written as they ended
    results = [json.loads(ln) for ln in (out / "gpu-results.jsonl").read_text().splitlines()]
    ended = {r["test"]: r for r in results if r["event"] == "result"}
    assert "tests/test_gpu.py::test_cuda_ipc_copy_between_actors_on_one_gpu" in ended
    if not torch_cuda():
        assert all(r["outcome"] == "skipped" for r in ended.values()), ended
        assert re.search(r"\| tests/test_gpu.py::test_cuda_ipc_copy_between_actors_on_one_gpu \| skipped \| [\d.]+ \| "
                         r"needs CUDA", report)
    # the benchmark's rows, formatted without Ray; the cases it never reached are listed as not run
    assert "| cuda_ipc copy | 1 MiB | 1.000 | 1.05 | cuda_ipc |" in report
    assert "TimeoutError: no read in 60 s" in report
    assert "not run" in report.split("## Benchmark")[1] and "nccl" in report.split("## Benchmark")[1]
    # what comes back fits the device tool's 8 files, none in a subfolder
    assert len(list(out.iterdir())) <= 8 and all(p.is_file() for p in out.iterdir())
    # a machine given back between calls: the last call finds a part (and the install) lost, names it, and the
    # report still says so
    (tmp / "rdt-gpu-wheels" / parts[0].name).unlink()
    shutil.rmtree(tmp / "rdt-gpu-site")
    again = call(2, "run")
    assert again.returncode != 0 and "missing" in again.stderr + again.stdout
    assert "missing" in (out / "gpu-check-report.md").read_text()


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_a_timeout_error_in_a_failure_is_not_a_pytest_timeout():
    """The first H100 run marked a failed assertion about CollectiveTimeoutError as "timeout": only pytest-timeout's
    own line makes a timeout, and the failure's own line leads the message."""
    from types import SimpleNamespace

    from tests import _gpu_check_plugin as plugin

    def report(text: str, crash: str) -> SimpleNamespace:
        longrepr = SimpleNamespace(reprcrash=SimpleNamespace(message=crash))
        return SimpleNamespace(when="call", failed=True, skipped=False, longrepr=longrepr, longreprtext=text)

    failed = report("err = {'type': 'CollectiveTimeoutError'}\nE   AssertionError: the 1 s timeout took 4.0 s",
                    "AssertionError: the 1 s timeout took 4.0 s")
    assert plugin.outcome_of(failed) == "failed"
    hung = report(">   ???\nE   Failed: Timeout (>60.0s) from pytest-timeout.\n...\nE   SystemError: wait", "SystemError")
    assert plugin.outcome_of(hung) == "timeout"
    assert plugin.outcome_of(SimpleNamespace(**{**vars(failed), "when": "setup"})) == "error"
    assert plugin._crash(failed) == "AssertionError: the 1 s timeout took 4.0 s"


def test_benchmark_errors_keep_their_type_and_final_message():
    """The first run's NIXL row kept 500 characters of a RayTaskError's traceback and lost the message at its end."""
    sys.path.insert(0, str(ROOT))
    from benchmarks._gpu_table import error_text, format_markdown

    class RayTaskError(Exception):
        pass

    body = "\x1b[36mray::GpuBench.consume()\x1b[39m\n" + "  File \"x.py\", line 1, in f\n" * 200
    text = error_text(RayTaskError(body + "rdt.errors.ObjectFetchError: NIXL READ failed: remote VRAM unreachable"))
    assert text.startswith("RayTaskError: ray::GpuBench.consume()") and "\x1b" not in text
    assert text.endswith("NIXL READ failed: remote VRAM unreachable") and len(text) <= 2000
    table = format_markdown([{"case": "x", "bytes": 1 << 20, "error": text}])
    assert "remote VRAM unreachable" in table and "RayTaskError" in table
