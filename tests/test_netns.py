"""Runs tests/netns_cases.py (Ray nodes in network namespaces over tc-shaped links) in a pytest process of its own.

The session's local cluster is shut down first, and a fresh driver process runs the cases, so they do not depend
on what ran before them (an earlier ``ray.init`` leaves ``RAY_AUTH_MODE=token`` in the environment, and a driver
with it made the namespace cluster's first actors die at start: its nodes run with authentication disabled).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import _netns

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.netns, pytest.mark.timeout(420)]


def test_netns_cases_in_their_own_driver() -> None:
    reason = _netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    import ray

    ray.shutdown()  # the session's local cluster: the next module's ray_cluster fixture starts it again
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-q", "-rs", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "netns_cases.py")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=400)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"tests/netns_cases.py failed (exit {proc.returncode}):\n{tail}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], tail
