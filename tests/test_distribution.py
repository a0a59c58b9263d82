"""The distribution is ray-direct-transport; its import packages are rdt and rdt_transports. Another distribution
on the package index (Reversible Data Transforms, a dependency of SDV) also installs an import package named rdt:
when that one is the rdt Python finds, importing rdt_transports or starting rdt-bench fails with an ImportError
naming both distributions and the fix. Each case runs in a fresh interpreter (no Ray needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIST = "ray-direct-transport"

# What the other distribution's rdt/__init__.py starts with (its package, not ours).
FOREIGN_INIT = '"""Top-level package for RDT."""\n\n__author__ = "DataCebo, Inc."\n__version__ = "1.17.0"\n'


def _python(code: str, foreign: Optional[Path] = None, *args: str) -> subprocess.CompletedProcess:
    """Run ``code`` (or ``-m`` with ``args``) with this checkout on the path, behind ``foreign`` when given (the
    working directory, first on sys.path, is then ``foreign`` too)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*([str(foreign)] if foreign else []), str(ROOT)]))
    cmd = [sys.executable, *(args or ("-c", code))]
    return subprocess.run(cmd, cwd=foreign or ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def foreign(tmp_path: Path) -> Path:
    """A directory holding a foreign ``rdt`` package, to put on sys.path before this checkout."""
    (tmp_path / "rdt").mkdir()
    (tmp_path / "rdt" / "__init__.py").write_text(FOREIGN_INIT)
    return tmp_path


def _assert_refused(proc: subprocess.CompletedProcess, foreign: Path) -> None:
    assert proc.returncode != 0, proc.stdout + proc.stderr
    err = proc.stderr
    assert "ImportError" in err, err
    assert str(foreign / "rdt") in err, err  # where the wrong rdt is
    assert DIST in err and "Reversible Data Transforms" in err, err  # both distributions
    assert "pip uninstall rdt" in err and "separate virtual environments" in err, err  # the fix


def test_pyproject_names_the_distribution_and_rdt_carries_the_marker() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["name"] == DIST
    proc = _python("import rdt, rdt_transports; print(rdt.__distribution__, rdt.__file__, rdt_transports.__file__)")
    assert proc.returncode == 0, proc.stderr
    dist, rdt_file, rt_file = proc.stdout.split()
    assert dist == DIST
    assert Path(rdt_file).parent.parent == Path(rt_file).parent.parent == ROOT


def test_import_refused_when_a_foreign_rdt_comes_first(foreign: Path) -> None:
    _assert_refused(_python("import rdt_transports", foreign), foreign)


def test_import_refused_when_a_foreign_rdt_was_imported_before(foreign: Path) -> None:
    proc = _python("import rdt\nassert rdt.__version__ == '1.17.0'\nimport rdt_transports", foreign)
    _assert_refused(proc, foreign)


def test_rdt_bench_refused_before_it_starts(foreign: Path, tmp_path: Path) -> None:
    """The entry point checks before anything else (--compare needs no Ray: it would otherwise run)."""
    missing = str(tmp_path / "none.json")
    _assert_refused(_python("", foreign, "-m", "benchmarks.rdt_bench", "--compare", missing, missing), foreign)
