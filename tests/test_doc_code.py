"""Every runnable example in doc_code/ runs to completion, each in a driver process of its own.

Run by a user, an example starts and stops a local Ray cluster of its own. Here each joins the module's cluster as a
new driver (``tests/_doc_code_driver.py``: its ``ray.init`` arguments that size a new cluster are dropped), two at a
time; each test waits for its own. Starting a cluster per example cost about 10 CPU-seconds each on two cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p.name for p in (ROOT / "doc_code").glob("*.py"))
AT_ONCE = 2  # examples at once (each starts a Ray cluster of its own; another pytest worker runs beside them)
TIMEOUT_S = 240


def _run(example: str, address: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, RDT_DOC_CODE_ADDRESS=address)
    env.pop("RAY_ADDRESS", None)
    driver = ROOT / "tests" / "_doc_code_driver.py"
    return subprocess.run([sys.executable, str(driver), str(ROOT / "doc_code" / example)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def runs(ray_cluster) -> Iterator[Dict[str, "Future[subprocess.CompletedProcess]"]]:
    """Every example started in the background, AT_ONCE at a time, as drivers of the module's cluster."""
    address = ray_cluster.get_runtime_context().gcs_address
    with ThreadPoolExecutor(max_workers=AT_ONCE, thread_name_prefix="doc-code") as pool:
        yield {example: pool.submit(_run, example, address) for example in EXAMPLES}


def test_examples_found():
    assert {"quickstart_gloo.py", "pass_to_producer.py", "nested_tensors.py", "driver_get.py", "nixl_no_group.py",
            "collectives.py", "custom_transport.py", "weight_sync_into.py", "weight_sync_sharded.py",
            "weight_sync_fsdp2.py", "weight_sync_qwen2.py", "weight_sync_delta.py"} <= set(EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_runs(runs, example):
    proc = runs[example].result(timeout=TIMEOUT_S * len(EXAMPLES))
    if proc.returncode != 0:
        print(proc.stdout[-5000:])
        print(proc.stderr[-10000:], file=sys.stderr)
    assert proc.returncode == 0, f"doc_code/{example} exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
    if f"{example[:-3]}: OK" not in proc.stdout and "skipping" in proc.stdout:
        pytest.skip(proc.stdout.strip().splitlines()[-1])  # an optional dependency is missing: a skip, not a pass
    assert f"{example[:-3]}: OK" in proc.stdout, proc.stdout[-2000:]
