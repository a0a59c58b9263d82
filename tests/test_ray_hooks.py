"""rdt's private Ray hooks: each exists in the installed Ray, the declared Ray range is the tested one, and
importing rdt under a Ray that lacks a hook fails at once with a typed error naming the hook and the range."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import ray

ROOT = Path(__file__).resolve().parent.parent


def _version(v: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def test_pyproject_pins_the_ray_range_the_tests_ran_against() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    pins = re.findall(r'"ray(?:\[default\])?>=([0-9.]+),<([0-9.]+)"', text)
    assert pins and "\"ray>=2.57\"" not in text, "ray is declared without an upper bound"
    for low, high in pins:
        assert _version(low) <= _version(ray.__version__) < _version(high)


def test_every_private_hook_exists_in_the_installed_ray() -> None:
    from rdt._ray import hooks as _ray_hooks

    assert _ray_hooks.missing() == []
    assert _ray_hooks.SUPPORTED_RAY in (ROOT / "pyproject.toml").read_text()


_REMOVE = r"""
import importlib, sys
module, attr = sys.argv[1], sys.argv[2]
import ray
m = importlib.import_module(module)
if attr == "CoreWorker":
    m.CoreWorker = type("CoreWorker", (), {})  # an extension type's methods cannot be deleted: replace the class
else:
    delattr(m, attr)
try:
    import rdt
except ImportError as e:
    from rdt_transports.errors import BackendUnavailableError
    print("typed" if isinstance(e, BackendUnavailableError) else "untyped", str(e).replace("\n", " "))
else:
    print("imported")
"""


@pytest.mark.parametrize("module,attr,named", [
    ("ray._raylet", "CoreWorker", "add_object_out_of_scope_callback"),
    ("ray.experimental.internal_kv", "_internal_kv_put", "_internal_kv_put"),
    ("ray._private.state", "actors", "actors"),
])
def test_import_fails_clearly_when_a_hook_is_missing(module: str, attr: str, named: str) -> None:
    out = subprocess.run([sys.executable, "-c", _REMOVE, module, attr], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + sys.path)})
    line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]
    assert line.startswith("typed "), line
    assert named in line and "2.57" in line and ray.__version__ in line, line
