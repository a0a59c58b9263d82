"""Turn user arrays (torch, numpy, cupy) into torch tensors that share their memory, and validate them."""

from __future__ import annotations

import sys
from typing import Any, Sequence

import torch

from .errors import InvalidArgumentError

SUPPORTED_DTYPES = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8}
)
FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def as_torch(array: Any, *, what: str = "tensor") -> torch.Tensor:
    """A torch view of ``array`` (no copy), so that results written to it land in the caller's array."""
    if isinstance(array, torch.Tensor):
        return plain_if_empty(array)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(array, np.ndarray):
        if not array.flags["C_CONTIGUOUS"]:
            raise InvalidArgumentError(
                f"{what} is a non-contiguous numpy array", hint="pass numpy.ascontiguousarray(x)"
            )
        if not array.flags["WRITEABLE"]:
            raise InvalidArgumentError(f"{what} is a read-only numpy array", hint="pass a writeable copy")
        return plain_if_empty(torch.from_numpy(array))
    cp = sys.modules.get("cupy")
    if cp is not None and isinstance(array, cp.ndarray):
        return plain_if_empty(torch.as_tensor(array, device=f"cuda:{array.device.id}"))
    raise InvalidArgumentError(
        f"{what} must be a torch.Tensor, numpy.ndarray or cupy.ndarray, got {type(array).__name__}",
        hint="convert it with torch.as_tensor(...)",
    )


def plain_if_empty(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a fresh empty tensor like it when it has no elements: numpy gives size-0 arrays zero strides, which
    no flat byte view accepts, and an empty tensor shares no memory, so nothing is lost by standing in for it."""
    return t if t.numel() else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def check_tensor(t: torch.Tensor, *, what: str, devices: frozenset, backend: str) -> None:
    """Refuse layouts, dtypes and devices the transfer cannot handle."""
    if not t.is_contiguous():
        raise InvalidArgumentError(
            f"{what} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()})",
            hint="pass tensor.contiguous()",
        )
    if t.dtype not in SUPPORTED_DTYPES:
        raise InvalidArgumentError(
            f"{what} has unsupported dtype {t.dtype}",
            hint="use one of " + ", ".join(sorted(str(d) for d in SUPPORTED_DTYPES)),
        )
    if t.device.type not in devices:
        from .errors import UnsupportedError

        raise UnsupportedError(
            f"backend {backend!r} cannot move {t.device.type} tensors ({what} is on {t.device})",
            hint=f"move it with .to('{sorted(devices)[0]}') or use a backend that supports {t.device.type} "
            "(gloo: cpu; nccl: cuda; nixl/ucx: cpu and cuda)",
        )


def check_same(tensors: Sequence[torch.Tensor], ref: torch.Tensor, *, what: str) -> None:
    for i, t in enumerate(tensors):
        if t.dtype != ref.dtype or t.device != ref.device:
            raise InvalidArgumentError(
                f"{what}[{i}] is {t.dtype} on {t.device} but the input is {ref.dtype} on {ref.device}",
                hint="use the same dtype and device for every tensor of one call",
            )
        if t.numel() != ref.numel():
            raise InvalidArgumentError(
                f"{what}[{i}] has {t.numel()} elements but the input has {ref.numel()}",
                hint="every tensor of the list must have the input's number of elements",
            )
