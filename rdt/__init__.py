"""rdt: a direct, out-of-band path for tensors between Ray actors.

``@rdt.tensor_method(tensor_transport=...)`` on an actor method keeps the tensors it returns in that actor; the
ObjectRef's value is only metadata. Passing the ref to another actor moves the tensors out of band (Gloo group,
NIXL, shared memory, ...); passing it back to the producer gives the very same tensors; ``ray.get`` anywhere
else falls back to Ray's object store. Tensors are freed when the last reference to the ref dies.

Transports (``rdt.transports``) follow one contract; ``rdt.register_transport`` adds your own.
"""

__distribution__ = "ray-direct-transport"  # the package index's "rdt" is another project: rdt_transports checks this

# first: fails clearly if the installed Ray lacks a private API rdt needs
from ._ray import hooks as _ray_hooks  # noqa: F401
from ._consumer import async_args as _async_args, parallel_fetch as _batch, unpickle as _unpickle

_unpickle.install()  # an rdt object's metadata, unpickled in this process, fetches its tensors
_batch.install()  # Ray's deserialization of several objects starts all their rdt fetches before waiting on any
_async_args.install()  # an async actor method's ref arguments are fetched off its event loop
from ._api.admin import configure, create_collective_group, destroy_collective_group, stats
from ._api.tensor_method import put, tensor_method
from ._api.get import get, get_async, wait_tensor_freed
from .transports import register_transport
from ._sharded.layout import Layout, Region
from ._sharded.publish import Manifest, Shards, put_shards
from ._sharded.load import LoadReport, WeightLoader
from ._sharded.replica import Replica
from .errors import (
    IntoBusyError,
    IntoMismatchError,
    InvalidArgumentError,
    NoCollectiveGroupError,
    ObjectError,
    ObjectFetchError,
    ObjectFreedError,
    ProducerDiedError,
    RdtError,
    TensorInUseError,
    TransferTimeoutError,
    UnsupportedError,
    VersionGoneError,
    FenceTimeoutError,
    ChecksumMismatchError,
)

__all__ = [
    "tensor_method", "put", "get", "put_shards", "Manifest", "Shards", "Layout", "Region", "WeightLoader",
    "LoadReport", "Replica", "get_async", "wait_tensor_freed", "register_transport", "create_collective_group", "destroy_collective_group", "stats", "configure",
    "TRANSPORTS", "RdtError", "ObjectError", "ObjectFreedError", "ObjectFetchError", "ProducerDiedError",
    "TransferTimeoutError", "IntoBusyError", "IntoMismatchError", "TensorInUseError", "NoCollectiveGroupError", "InvalidArgumentError", "UnsupportedError",
    "VersionGoneError", "FenceTimeoutError", "ChecksumMismatchError",
]


def __getattr__(name: str) -> object:
    """``rdt.TRANSPORTS``: what ``tensor_transport=`` accepts in this process, from the registry (built-in
    transports, then those registered here, then "auto"), so that a registered transport is listed too."""
    if name == "TRANSPORTS":
        from .transports import explicit_names

        return explicit_names()
    raise AttributeError(f"module 'rdt' has no attribute {name!r}")
