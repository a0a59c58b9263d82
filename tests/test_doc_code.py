"""Every runnable example in doc_code/ runs to completion (each starts and stops its own local Ray).

The examples run three at a time (most of an example's time is Ray starting and stopping, which overlaps well on
two cores: three take about 20 s together against about 40 s one after another); each test waits for its own.
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


def _run(example: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # never attach to a cluster another test module started
    return subprocess.run([sys.executable, str(ROOT / "doc_code" / example)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def runs() -> Iterator[Dict[str, "Future[subprocess.CompletedProcess]"]]:
    """Every example started in the background, AT_ONCE at a time."""
    with ThreadPoolExecutor(max_workers=AT_ONCE, thread_name_prefix="doc-code") as pool:
        yield {example: pool.submit(_run, example) for example in EXAMPLES}


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
