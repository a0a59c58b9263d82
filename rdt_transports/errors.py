"""Typed errors shared by rdt_transports and rdt.

Every error subclasses :class:`RdtError` (a ``RuntimeError``), carries the context it happened in
(group, rank, peer, op, object) as attributes, and its message says how to fix the problem.
"""

from __future__ import annotations

from typing import Any, Optional


class RdtError(RuntimeError):
    """Base of every error raised by rdt and rdt_transports."""

    def __init__(
        self,
        message: str,
        *,
        group: Optional[str] = None,
        rank: Optional[int] = None,
        peer: Optional[int] = None,
        op: Optional[str] = None,
        object_id: Optional[str] = None,
        hint: Optional[str] = None,
    ) -> None:
        self.group = group
        self.rank = rank
        self.peer = peer
        self.op = op
        self.object_id = object_id
        self.hint = hint
        parts = []
        ctx = [
            f"{k}={v!r}"
            for k, v in (("group", group), ("rank", rank), ("peer", peer), ("op", op), ("object", object_id))
            if v is not None
        ]
        if ctx:
            parts.append("[" + ", ".join(ctx) + "] ")
        parts.append(message)
        if hint:
            parts.append(f" Fix: {hint}")
        super().__init__("".join(parts))
        self.message = message

    def __reduce__(self) -> Any:
        # Keep attributes when the error crosses a Ray task boundary.
        return (_rebuild_error, (type(self), self.message, self.__dict__.copy()))


_FIELDS = ("group", "rank", "peer", "op", "object_id", "hint")


def _rebuild_error(cls: type, message: str, state: dict) -> "RdtError":
    # Through __init__, never cls.__new__: classes that also derive from TimeoutError/KeyError have a C layout
    # that RuntimeError.__new__ cannot build.
    err = cls(message, **{k: state.get(k) for k in _FIELDS})
    err.__dict__.update({k: v for k, v in state.items() if k not in _FIELDS and k != "message"})
    return err


class InvalidArgumentError(RdtError, ValueError):
    """A call was made with arguments that can never work (bad rank, dtype, device, layout ...)."""


class UnsupportedError(RdtError, ValueError):
    """The backend or transport cannot do what was asked (device, op, dtype); checked before any peer is touched."""


class SharedDeviceError(InvalidArgumentError):
    """Two ranks of a group that needs one device per rank (NCCL) would run on the same GPU."""


class BackendUnavailableError(RdtError, ImportError):
    """The package a backend needs is not installed or cannot run on this machine."""


class GroupError(RdtError):
    """Base for errors about a collective group's identity or lifecycle."""


class GroupNotFoundError(GroupError, KeyError):
    """No group of that name is initialised in this process."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return RuntimeError.__str__(self)


class GroupExistsError(GroupError):
    """A group of that name is already initialised in this process."""


class GroupErroredError(GroupError):
    """The group failed earlier (timeout, dead peer) and must be destroyed and re-formed."""


class GroupDestroyedError(GroupError):
    """The group was destroyed or aborted; calls on it are refused."""


class CommunicationError(RdtError):
    """A transfer or collective failed while talking to a peer."""


class CollectiveTimeoutError(CommunicationError, TimeoutError):
    """A blocking call did not complete within its timeout."""


class PeerUnavailableError(CommunicationError):
    """The peer died, closed its connection or never joined."""


class TensorMismatchError(CommunicationError, ValueError):
    """The two sides of a transfer disagree on size, dtype or shape."""


class AuthenticationError(CommunicationError):
    """A control message failed authentication (wrong or missing group secret)."""


class ObjectError(RdtError):
    """Base for errors of the rdt object layer."""


class ObjectFreedError(ObjectError):
    """The object was freed (its last reference died) before it was fetched."""


class ObjectFetchError(ObjectError):
    """Fetching an object's tensors from its producer failed."""


class ProducerDiedError(ObjectFetchError):
    """The producer of an object died; its tensors are gone."""


class TransferTimeoutError(ObjectFetchError, TimeoutError):
    """Fetching an object did not finish within the transfer timeout."""


class IntoBusyError(TransferTimeoutError):
    """``rdt.get(..., into=...)``: an earlier fetch into the same bytes failed but may still write them (a NIXL READ
    in flight), and did not end within the timeout; nothing was moved."""


class IntoMismatchError(ObjectError, ValueError):
    """``rdt.get(..., into=...)`` does not fit the object (count, shape, dtype, contiguity); nothing was moved."""


class TensorInUseError(ObjectError, TimeoutError):
    """``rdt.wait_tensor_freed`` timed out: live objects still hold bytes of the tensor's storage."""


class NoCollectiveGroupError(ObjectError, ValueError):
    """A collective transport was asked for but no group contains both producer and consumer."""


class VersionGoneError(ObjectError):
    """A sharded load asked for a version its producer no longer serves (fenced before an in-place update,
    superseded by a newer publication, or dropped from the kept versions); ``version`` and ``rank`` name it."""


class FenceTimeoutError(TensorInUseError):
    """``Shards.fence`` timed out: readers of the version were still in flight (``readers`` names them). The version
    is gone all the same: those readers fail with :class:`VersionGoneError` rather than return bytes of the update."""


class ChecksumMismatchError(ObjectFetchError):
    """A sharded load with ``verify=True`` landed bytes whose checksum differs from the producer's (``param`` and
    ``rank`` name where)."""
