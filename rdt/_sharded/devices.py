"""Where sharded sync's tensors may live: a publication's shards on one device (the CPU, or one CUDA device) that its
transport moves, and a loader's targets on one device, contiguous. Every refusal names the tensor and says what to
do, before anything is published or planned."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from ..errors import InvalidArgumentError

SUPPORTED = ("cpu", "cuda")
HOST_ONLY = ("shm", "gloo")  # transports that move CPU tensors only
DEVICE_ONLY = ("cuda_ipc", "nccl")  # and those that move CUDA tensors only


def _where(t: torch.Tensor) -> str:
    return str(t.device)


def shards_device(tensors: Mapping[str, torch.Tensor], transport: str) -> Optional[torch.device]:
    """The one device a publication's local shards are on (None: no tensor); refuses another device type, shards on
    several devices, and a transport that does not move that device's memory."""
    device: Optional[torch.device] = None
    first = ""
    for name, t in tensors.items():
        if t.device.type not in SUPPORTED:
            raise InvalidArgumentError(
                f"parameter {name!r} is on {_where(t)}; sharded sync moves CPU and CUDA tensors",
                hint="publish t.cpu() or t.cuda()")
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise InvalidArgumentError(
                f"parameter {name!r} is on {_where(t)}, parameter {first!r} on {device}: one publication holds "
                "the shards of one device", hint="publish each device's shards with its own put_shards call (another "
                "rank=), or move them to one device")
    if device is None:
        return None
    if device.type == "cuda" and transport in HOST_ONLY:
        raise InvalidArgumentError(
            f"parameter {first!r} is on {device}; tensor_transport={transport!r} moves CPU tensors only",
            hint="use tensor_transport='cuda_ipc' (same node), 'nixl', 'nccl' (a common nccl group) or 'auto'")
    if device.type == "cpu" and transport in DEVICE_ONLY:
        raise InvalidArgumentError(
            f"parameter {first!r} is on the CPU; tensor_transport={transport!r} moves CUDA tensors only",
            hint="use tensor_transport='shm', 'gloo', 'nixl' or 'auto' for CPU shards (GPU targets may load them)")
    return device


def check_target(label: str, target: object, others: Sequence[torch.Tensor]) -> None:
    """Refuse a target a loader cannot land bytes in: not a tensor, not contiguous, on a device sharded sync does not
    move, or on another device than the loader's earlier targets (``others``)."""
    if not isinstance(target, torch.Tensor) or not target.is_contiguous():
        raise InvalidArgumentError(f"target {label!r} must be a contiguous tensor (CPU or CUDA)",
                                   hint="want into the parameter's contiguous storage")
    if target.device.type not in SUPPORTED:
        raise InvalidArgumentError(f"target {label!r} is on {_where(target)}; sharded sync lands bytes in CPU and "
                                   "CUDA tensors", hint="want into a CPU or CUDA tensor")
    for t in others:
        if t.device != target.device:
            raise InvalidArgumentError(
                f"target {label!r} is on {_where(target)}, this loader's earlier targets on {t.device}: a loader's "
                "targets are on one device", hint="use one rdt.WeightLoader per device")
        break


__all__ = ["check_target", "shards_device"]
