"""A sharded load whose NIXL range READ timed out must never overwrite a later successful load into the same targets.

Real actors, real NIXL agents over UCX TCP (``UCX_TLS=tcp``: a READ moves only while the producer's agent
progresses, so holding that agent's lock stalls it deterministically, as in ``test_nixl_parked_read.py``). Step k's
load times out; step k+1's load from a healthy trainer into the same targets must end with step k+1's bytes, also
after the stalled READ of step k has landed.
"""

from __future__ import annotations

import time
from typing import Tuple

import pytest
import ray
import torch

import rdt

from ._nixl_stall import stall_agent
from .conftest import HAS_NIXL

pytestmark = [pytest.mark.skipif(not HAS_NIXL, reason="nixl not installed: pip install 'ray-direct-transport[nixl]'"),
              pytest.mark.timeout(120)]

TCP_ONLY = {"env_vars": {"UCX_TLS": "tcp"}}
N = 1 << 20  # 4 MiB of float32: one READ of one run


@ray.remote
class Trainer:
    def __init__(self, fill: float) -> None:
        self.w = torch.full((N,), fill)

    def publish(self, version: int) -> rdt.Shards:
        return rdt.put_shards({"w": self.w}, version=version, layouts={"w": rdt.Layout((N,))}, rank=0,
                              tensor_transport="nixl")

    def stall(self, seconds: float) -> None:
        """Hold this process's NIXL agent lock for ``seconds`` (its READs make no progress meanwhile)."""
        stall_agent(seconds)


@ray.remote
class Engine:
    def __init__(self) -> None:
        self.w = torch.zeros(N)
        self.loader = rdt.WeightLoader()
        self.loader.want(self.w, rdt.Region("w"))

    def load(self, manifest: rdt.Manifest, timeout: float) -> Tuple[str, str]:
        try:
            self.loader.load(manifest, timeout=timeout)
            return "ok", ""
        except rdt.RdtError as e:
            return type(e).__name__, str(e)

    def values(self) -> Tuple[float, float]:
        return float(self.w.min()), float(self.w.max())


def test_a_timed_out_range_read_never_overwrites_a_later_load(ray_cluster):
    stuck, healthy = Trainer.options(runtime_env=TCP_ONLY).remote(1.0), Trainer.options(runtime_env=TCP_ONLY).remote(2.0)
    engine = Engine.options(runtime_env=TCP_ONLY).remote()
    try:
        old = rdt.Manifest([ray.get(stuck.publish.remote(1), timeout=60)])
        new = rdt.Manifest([ray.get(healthy.publish.remote(2), timeout=60)])
        ray.get(stuck.stall.remote(4.0), timeout=30)
        kind, msg = ray.get(engine.load.remote(old, 0.5), timeout=30)
        assert kind == "TransferTimeoutError", (kind, msg)
        kind, msg = ray.get(engine.load.remote(new, 20.0), timeout=60)  # waits for the parked READ, then lands
        assert kind == "ok", (kind, msg)
        time.sleep(5.0)  # well past the stall: step k's READ has landed wherever it was going to
        assert ray.get(engine.values.remote(), timeout=30) == (2.0, 2.0)
    finally:
        for a in (stuck, healthy, engine):
            ray.kill(a)
