"""The chaos soak of sharded loads at CI scale (``tests/_load_soak.py`` says what it injects and checks; the full
scale is ``python -m tests._load_soak --loads 2000``): at least 100 loads over shm, nixl, gloo and auto, every fault
taking effect at least five times, and no torn bytes, late write, hang or silent success on a changed target."""

from __future__ import annotations

import pytest

from ._load_soak import FAULTS, Soak
from .conftest import HAS_NIXL

pytestmark = [pytest.mark.skipif(not HAS_NIXL, reason="nixl not installed: pip install 'ray-direct-transport[nixl]'"),
              pytest.mark.timeout(300)]


def test_loads_under_faults_never_land_wrong_bytes(ray_cluster) -> None:
    soak = Soak()
    try:
        out = soak.run(100)
    finally:
        soak.close()
    assert out["loads"] >= 100, out
    assert all(out["effects"].get(k, 0) >= 5 for k in FAULTS), out["effects"]
    assert set(out["by_transport"]) == {"shm", "nixl", "gloo", "auto"}, out
    assert (out["torn"], out["late"], out["silent"], out["overtime"]) == (0, 0, 0, 0), out
