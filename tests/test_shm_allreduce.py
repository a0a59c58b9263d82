"""Gloo groups whose ranks share a node allreduce large tensors through shared memory: results, identity across
ranks, every dtype and op, and segment clean-up."""

from __future__ import annotations

import os

import pytest
import ray
import torch

import rdt_transports as rt
from rdt_transports import ReduceOp

from .conftest import wait_for

NUMEL = 100_003  # odd: uneven chunks; ~400 KB of float32, above the 64 KiB shared-memory threshold
DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8"]


def _input(rank: int, dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype in ("int32", "int64", "uint8"):
        return torch.randint(1, 4, (NUMEL,), generator=g).to(getattr(torch, dtype))
    return (torch.rand(NUMEL, generator=g) + 0.5).to(getattr(torch, dtype))


@ray.remote(num_cpus=0)
class Rank:
    def run(self, name: str, dtype: str, op: str) -> torch.Tensor:
        t = _input(rt.get_rank(name), dtype)
        rt.allreduce(t, name, op=ReduceOp[op])
        return t

    def segments(self) -> list:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"rdt-{os.getpid()}-"))


def _expected(world: int, dtype: str, op: str) -> torch.Tensor:
    xs = [_input(r, dtype) for r in range(world)]
    acc = xs[0].clone()
    for x in xs[1:]:
        if op in ("SUM", "AVG"):
            acc.add_(x)
        elif op == "PRODUCT":
            acc.mul_(x)
        elif op == "MIN":
            torch.minimum(acc, x, out=acc)
        else:
            torch.maximum(acc, x, out=acc)
    return acc / world if op == "AVG" else acc


@pytest.fixture(scope="module")
def ranks(ray_cluster):
    actors = [Rank.remote() for _ in range(3)]
    yield actors
    for a in actors:
        ray.kill(a)


@pytest.mark.parametrize("world", [2, 3])
def test_shm_allreduce_matches_torch_for_every_dtype_and_op(ranks, world):
    actors = ranks[:world]
    name = f"shm-ar-{world}"
    handle = rt.create_collective_group(actors, backend="gloo", group_name=name)
    try:
        for dtype in DTYPES:
            ops = ["SUM", "PRODUCT", "MIN", "MAX"] + (["AVG"] if dtype.startswith(("float", "bfloat")) else [])
            for op in ops:
                if op == "PRODUCT" and dtype == "uint8" and world == 3:
                    continue  # 3*3*3 fits, but keep uint8 products well inside range for every input
                outs = ray.get([a.run.remote(name, dtype, op) for a in actors], timeout=120)
                assert all(torch.equal(outs[0], o) for o in outs[1:]), (dtype, op, "ranks disagree")
                exp = _expected(world, dtype, op)
                if dtype in ("float16", "bfloat16"):
                    assert torch.allclose(outs[0].float(), exp.float(), rtol=2e-2, atol=1e-2), (dtype, op)
                elif dtype.startswith("float"):
                    assert torch.allclose(outs[0], exp, rtol=1e-5), (dtype, op)
                else:
                    assert torch.equal(outs[0], exp), (dtype, op)
        held = ray.get([a.segments.remote() for a in actors])
        assert all(held), f"the shared-memory path was not used: {held}"
    finally:
        handle.destroy()
    assert wait_for(lambda: not any(ray.get([a.segments.remote() for a in actors])), timeout=20)
