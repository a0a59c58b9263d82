"""Every runnable example in doc_code/ runs to completion (each starts and stops its own local Ray)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p.name for p in (ROOT / "doc_code").glob("*.py"))


def test_examples_found():
    assert {"quickstart_gloo.py", "pass_to_producer.py", "nested_tensors.py", "driver_get.py", "nixl_no_group.py",
            "collectives.py"} <= set(EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_runs(example):
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # never attach to a cluster another test module started
    proc = subprocess.run([sys.executable, str(ROOT / "doc_code" / example)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        print(proc.stdout[-5000:])
        print(proc.stderr[-10000:], file=sys.stderr)
    assert proc.returncode == 0, f"doc_code/{example} exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert f"{example[:-3]}: OK" in proc.stdout or "skipping" in proc.stdout
