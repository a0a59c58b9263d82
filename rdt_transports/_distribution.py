"""Refuses an environment where ``import rdt`` finds another distribution's package.

This project is the distribution ``ray-direct-transport`` with the import packages ``rdt`` and
``rdt_transports``. The package index's ``rdt`` distribution (Reversible Data Transforms, a dependency of SDV) also
installs an import package named ``rdt``; with both in one environment, whichever Python finds first (or whichever
pip wrote last) answers ``import rdt``. ``rdt_transports`` is only ever ours, so it checks, without importing
``rdt``, that the ``rdt`` found carries this project's marker; and fails at import, naming both, when it does not.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

DISTRIBUTION = "ray-direct-transport"
MARKER = f'__distribution__ = "{DISTRIBUTION}"'  # a line of this project's rdt/__init__.py
FOREIGN = "rdt (Reversible Data Transforms, a dependency of SDV)"


def rdt_origin() -> Optional[str]:
    """The file ``import rdt`` runs (or ran) in this interpreter, or None where there is none."""
    try:
        spec = importlib.util.find_spec("rdt")  # sys.modules' entry when rdt is imported or being imported
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


def is_ours(origin: str) -> bool:
    """Whether ``origin`` is this project's rdt/__init__.py (its marker line is there)."""
    try:
        with open(origin, encoding="utf-8") as f:
            return any(line.split("#", 1)[0].strip() == MARKER for line in f)
    except (OSError, UnicodeDecodeError):
        return False


def check_rdt() -> None:
    """Raise ImportError when the ``rdt`` Python finds is not this project's; no ``rdt`` at all is fine here."""
    origin = rdt_origin()
    if origin is None or is_ours(origin):
        return
    raise ImportError(
        f"the 'rdt' package Python finds ({origin.removesuffix('__init__.py').rstrip('/')}) is not the one of "
        f"{DISTRIBUTION} (import packages rdt and rdt_transports): the distribution {FOREIGN} installs an import "
        f"package of the same name, and the two cannot share one environment. Fix: pip uninstall rdt, then "
        f"reinstall {DISTRIBUTION} (pip install -e . in its checkout, or pip install {DISTRIBUTION}); or keep the "
        f"two in separate virtual environments.", name="rdt", path=origin)
