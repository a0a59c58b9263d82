"""Small value types: reduce ops, group lifecycle states and backend capabilities."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import timedelta
from typing import FrozenSet, Optional, Union

Timeout = Union[float, int, timedelta, None]


class ReduceOp(enum.Enum):
    """Reduction applied by allreduce, reduce and reducescatter."""

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"  # floating-point dtypes only


class GroupState(enum.Enum):
    """Lifecycle of a collective group (TorchFT style): failures move it out of HEALTHY for good."""

    HEALTHY = "healthy"
    ERRORED = "errored"  # an op failed (timeout, dead peer); destroy and re-form the group
    ABORTED = "aborted"  # abort() was called; pending and future calls fail at once
    DESTROYED = "destroyed"


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; consulted before any peer is touched."""

    name: str
    devices: FrozenSet[str]  # torch device types, e.g. {"cpu"} or {"cpu", "cuda"}
    two_sided: bool = True  # send/recv need both sides to post
    one_sided: bool = False  # remote READ/WRITE without the peer's Python
    native_collectives: FrozenSet[str] = field(default_factory=frozenset)  # ops the library does itself
    native_reduce_ops: FrozenSet[ReduceOp] = field(default_factory=frozenset)
    can_abort: bool = True  # a stuck op can be ended without killing the process
    checks_p2p_sizes: bool = True  # send/recv detect size/dtype mismatch themselves (else the group adds a header)
    requires: Optional[str] = None  # pip package that provides it, for error messages

    def supports_device(self, device_type: str) -> bool:
        return device_type in self.devices


ALL_OPS = (
    "send",
    "recv",
    "broadcast",
    "allreduce",
    "reduce",
    "allgather",
    "gather",
    "scatter",
    "reducescatter",
    "alltoall",
    "barrier",
)


COLLECTIVE_OPS = frozenset(ALL_OPS) - {"send", "recv"}


def to_seconds(timeout: Timeout, default: float) -> float:
    """Normalise a timeout given as seconds or timedelta; None means the default."""
    if timeout is None:
        return default
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        from .errors import InvalidArgumentError

        raise InvalidArgumentError(
            f"timeout must be seconds (float) or a datetime.timedelta, got {type(timeout).__name__}",
            hint="pass e.g. timeout=30.0",
        )
    if not seconds > 0:
        from .errors import InvalidArgumentError

        raise InvalidArgumentError(f"timeout must be > 0 seconds, got {seconds}", hint="pass e.g. timeout=30.0")
    return seconds
