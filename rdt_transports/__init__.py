"""rdt_transports: named collective groups for Ray actors over Gloo, NCCL, NIXL, UCX and plain TCP.

Same shape as ``ray.util.collective`` (switch by changing the import): declare a group from the driver with
:func:`create_collective_group` or join one inside an actor with :func:`init_collective_group`, then call
send/recv/broadcast/allreduce/reduce/allgather/gather/scatter/reducescatter/alltoall/barrier on torch, numpy
or cupy arrays in place. Every blocking call takes ``timeout=`` and fails with a typed error from
:mod:`rdt_transports.errors`; p2p-only backends (nixl, ucx, tcp) build collectives with ring / bde / tree algorithms
(``algorithm=``), which also run on Gloo for comparison.

The object layer (``rdt``) uses this package through this public API (``local_groups`` and ``metrics`` are for
it) and four shared helpers, kept private here: ``_lifecycle`` (threads, exit and fork hooks), ``_proc`` (process
liveness, owner locks), ``_memcopy`` (GIL-free copies) and ``_cma`` (``process_vm_readv``).
"""

from ._distribution import check_rdt

check_rdt()  # first: an 'rdt' from another distribution (the package index's rdt) fails here, naming both

from .collective import (
    DEFAULT_TIMEOUT_S,
    GroupHandle,
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    create_collective_group,
    destroy_collective_group,
    gather,
    get_collective_group_size,
    get_group,
    get_rank,
    init_collective_group,
    is_group_initialized,
    local_groups,
    metrics,
    recv,
    reduce,
    reducescatter,
    scatter,
    send,
)
from .backends import backend_class, backend_names
from .errors import (
    AuthenticationError,
    BackendUnavailableError,
    CollectiveTimeoutError,
    CommunicationError,
    GroupDestroyedError,
    GroupError,
    GroupErroredError,
    GroupExistsError,
    GroupNotFoundError,
    InvalidArgumentError,
    PeerUnavailableError,
    SharedDeviceError,
    RdtError,
    TensorMismatchError,
    UnsupportedError,
)
from .group import CollectiveGroup
from .types import Capabilities, GroupState, ReduceOp


def capabilities(backend: str) -> Capabilities:
    """What ``backend`` supports (devices, one/two-sided, native collectives), without creating a group."""
    return backend_class(backend).capabilities


__all__ = [
    "DEFAULT_TIMEOUT_S", "GroupHandle", "CollectiveGroup", "Capabilities", "GroupState", "ReduceOp",
    "init_collective_group", "create_collective_group", "destroy_collective_group", "is_group_initialized",
    "get_rank", "get_collective_group_size", "get_group", "local_groups", "metrics", "capabilities", "backend_names",
    "send", "recv", "broadcast", "allreduce", "reduce", "allgather", "gather", "scatter", "reducescatter",
    "alltoall", "barrier",
    "RdtError", "InvalidArgumentError", "UnsupportedError", "BackendUnavailableError", "GroupError",
    "GroupNotFoundError", "GroupExistsError", "GroupErroredError", "GroupDestroyedError", "CommunicationError",
    "CollectiveTimeoutError", "PeerUnavailableError", "SharedDeviceError", "TensorMismatchError", "AuthenticationError",
]
