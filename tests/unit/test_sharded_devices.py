"""Where sharded sync's tensors may live, checked without a GPU: a publication's shards on the CPU or one CUDA
device its transport moves, a loader's targets contiguous on one device, each refusal naming the tensor; and a
DTensor with a ``_StridedShard`` placement (FSDP2 + TP) published only where this rank's shard is proven to be one
box of the global tensor (torch's own split replayed on index tensors), refused where it is not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import rdt
from rdt._objects.dtensor import local_layout, strided_unproven
from rdt._sharded.devices import check_target, shards_device

CUDA0 = torch.device("cuda", 0)


def _on(device: torch.device) -> SimpleNamespace:
    """Stands for a tensor on ``device`` (the checks read the device only): CUDA tensors cannot be made here."""
    return SimpleNamespace(device=device)


def test_shards_on_one_device_that_the_transport_moves():
    assert shards_device({"a": torch.zeros(2), "b": torch.zeros(3)}, "shm") == torch.device("cpu")
    assert shards_device({"a": _on(CUDA0), "b": _on(CUDA0)}, "auto") == CUDA0
    assert shards_device({"a": _on(CUDA0)}, "cuda_ipc") == CUDA0 and shards_device({}, "shm") is None
    cases = [
        ({"a": torch.zeros(2), "b": _on(CUDA0)}, "auto", r"'b' is on cuda:0, parameter 'a' on cpu: one publication"),
        ({"a": _on(CUDA0), "b": _on(torch.device("cuda", 1))}, "nixl", r"'b' is on cuda:1, parameter 'a' on cuda:0"),
        ({"a": _on(CUDA0)}, "shm", r"'a' is on cuda:0; tensor_transport='shm' moves CPU tensors only"),
        ({"a": _on(CUDA0)}, "gloo", "moves CPU tensors only"),
        ({"a": torch.zeros(2)}, "nccl", r"'a' is on the CPU; tensor_transport='nccl' moves CUDA tensors only"),
        ({"a": torch.zeros(2, device="meta")}, "auto", r"'a' is on meta; sharded sync moves CPU and CUDA tensors"),
    ]
    for tensors, transport, match in cases:
        with pytest.raises(rdt.InvalidArgumentError, match=match):
            shards_device(tensors, transport)


def test_put_shards_refuses_a_transport_that_cannot_move_its_shards_before_anything_is_published():
    with pytest.raises(rdt.InvalidArgumentError, match="moves CUDA tensors only"):
        rdt.put_shards({"w": torch.zeros(4)}, version=0, layouts={"w": rdt.Layout.whole((4,))}, rank=0,
                       tensor_transport="cuda_ipc")


def test_targets_are_contiguous_on_one_device():
    check_target("a", torch.zeros(2, 3), [])
    check_target("a", torch.zeros(2, 3), [torch.zeros(1)])
    with pytest.raises(rdt.InvalidArgumentError, match="'a' must be a contiguous tensor"):
        check_target("a", torch.zeros(3, 2).t(), [])
    with pytest.raises(rdt.InvalidArgumentError, match="'a' is on meta; sharded sync lands bytes in CPU and CUDA"):
        check_target("a", torch.zeros(2, device="meta"), [])
    with pytest.raises(rdt.InvalidArgumentError, match="earlier targets on meta: a loader's targets are on one"):
        check_target("b", torch.zeros(2), [torch.zeros(2, device="meta")])
    loader = rdt.WeightLoader()
    with pytest.raises(rdt.InvalidArgumentError, match="'w' is on meta"):
        loader.want(torch.zeros(2, device="meta"), rdt.Region("w"))


class _Mesh:
    """What torch's layout functions read of a DeviceMesh, for one rank (no process group needed)."""

    def __init__(self, shape, coord) -> None:
        self.shape, self.coord, self.ndim = tuple(shape), list(coord), len(shape)

    def get_coordinate(self):
        return self.coord

    def size(self, mesh_dim=None):
        return self.shape[mesh_dim]

    def _is_current_rank_part_of_mesh(self):
        return True

    def _sym_get_coordinate(self, i):
        return self.coord[i]


def _dtensor(shape, mesh, placements, local_shape):
    return SimpleNamespace(shape=torch.Size(shape), device_mesh=mesh, placements=placements,
                           to_local=lambda: torch.zeros(local_shape))


@pytest.mark.parametrize("coord, start", [((0, 0), 0), ((0, 1), 4), ((1, 0), 2), ((1, 1), 6)])
def test_fsdp2_with_tp_strided_shards_are_proven_one_box(coord, start):
    """FSDP2 over TP (right-to-left sharding of rows: _StridedShard(0, sf=2) on dp, Shard(0) on tp): every rank
    holds two contiguous rows, at the offsets torch's own docstring lists."""
    dt = _dtensor((8, 8), _Mesh((2, 2), coord), [_StridedShard(0, split_factor=2), Shard(0)], (2, 8))
    local, shape, at = local_layout("w", dt)
    assert shape == (8, 8) and at == (start, 0) and tuple(local.shape) == (2, 8)


def test_a_strided_shard_that_is_not_one_box_is_refused_naming_what_it_holds():
    dt = _dtensor((8, 8), _Mesh((2,), (1,)), [_StridedShard(0, split_factor=2)], (4, 8))
    with pytest.raises(rdt.InvalidArgumentError, match=r"'w' is a DTensor with a _StridedShard placement .*holds "
                                                        r"indices \[2, 3, 6, 7\] \(4 in all\), not \[2, 6\)"):
        local_layout("w", dt)
    # a strided shard along dim 1 with TP rows: proven per dimension
    dt = _dtensor((4, 8), _Mesh((2, 2), (1, 1)), [_StridedShard(1, split_factor=2), Shard(1)], (4, 2))
    assert local_layout("w", dt)[2] == (0, 6)
    assert strided_unproven((8,), _Mesh((2,), (0,)), [Replicate()], (8,), (0,)) is None
