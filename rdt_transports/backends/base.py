"""The backend contract: point-to-point transfers (isend/irecv returning Work) plus optional native collectives.

A backend moves bytes between the ranks of one group. It declares :class:`~rdt_transports.types.Capabilities`;
the group validates every request against them before calling the backend, so a backend may assume that
tensors are contiguous, on a supported device and that ``peer != rank``.

Ordering guarantee a backend must give: two sends from rank A to rank B with the same tag are never posted
(the group hands out unique tags), and a recv matches the send with the same (peer, tag) regardless of
the order they were posted in.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional

import torch

from ..types import Capabilities

if TYPE_CHECKING:
    from .._rendezvous import Rendezvous


# Tag layout (31 bits): kind (2 bits) << TAG_KIND_SHIFT | payload; the kinds are named in rdt_transports.group.
TAG_KIND_SHIFT = 29
TAG_KIND_P2P = 1  # user send/recv
TAG_KIND_OBJECT = 2  # rdt object transfers: backends may wait on them apart from collectives


def is_object_tag(tag: int) -> bool:
    """Whether ``tag`` belongs to an rdt object transfer (not to a collective or a user p2p call)."""
    return (tag >> TAG_KIND_SHIFT) == TAG_KIND_OBJECT


@dataclass(frozen=True)
class BackendConfig:
    """Everything a backend needs to join its group."""

    group_name: str
    group_uid: str  # unique per incarnation of the group; namespaces rendezvous keys
    rank: int
    world_size: int
    timeout: float  # seconds; default for every blocking call
    secret: bytes  # per-group secret handed out through Ray; authenticates control messages
    rendezvous: "Rendezvous"  # Ray-backed key/value exchange scoped to this group incarnation


class Work(abc.ABC):
    """Handle of a posted operation."""

    @abc.abstractmethod
    def wait(self, timeout: float) -> None:
        """Block until done; raise CollectiveTimeoutError / PeerUnavailableError / TensorMismatchError.

        A wait that times out ends the operation where the backend can take it back (tcp, nccl, nixl, ucx): it
        then never reads or writes its tensor afterwards, and waiting again is not supported. docs/fault-model.md
        says per backend what a timed-out operation may still do."""

    def is_completed(self) -> bool:  # pragma: no cover - optional
        return False


class Backend(abc.ABC):
    """A transport for one group in one process."""

    capabilities: ClassVar[Capabilities]

    def __init__(self, config: BackendConfig) -> None:
        self.config = config

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @abc.abstractmethod
    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        """Post a send of ``tensor`` (contiguous) to ``peer``; tag is a non-negative int < 2**31."""

    @abc.abstractmethod
    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        """Post a receive into ``tensor`` (contiguous) from ``peer``."""

    def send_wait(self, tensor: torch.Tensor, peer: int, tag: int, timeout: float) -> None:
        """Post a send and wait for it: the common case in one call, so a backend may skip its Work object."""
        self.isend(tensor, peer, tag).wait(timeout)

    def recv_wait(self, tensor: torch.Tensor, peer: int, tag: int, timeout: float) -> None:
        """Post a receive and wait for it (see :meth:`send_wait`)."""
        self.irecv(tensor, peer, tag).wait(timeout)

    def native(self) -> Optional["NativeCollectives"]:
        """The backend's own collectives, or None when every collective must be built from p2p."""
        return None

    def abort(self) -> None:
        """Make pending and future operations fail quickly; must not block."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release every resource (sockets, agents, registrations); idempotent."""


class NativeCollectives(abc.ABC):
    """Collectives a library implements itself (e.g. Gloo). Ops named in capabilities.native_collectives."""

    @abc.abstractmethod
    def run(self, name: str, timeout: float, **kwargs: object) -> None:
        """Run collective ``name`` in place; kwargs are the op's tensors, lists, ranks and ``op`` (ReduceOp)."""
