"""rdt's errors: the same typed hierarchy as rdt_transports (one base, RdtError), re-exported here."""

from rdt_transports.errors import (  # noqa: F401
    AuthenticationError,
    BackendUnavailableError,
    CollectiveTimeoutError,
    CommunicationError,
    GroupDestroyedError,
    GroupError,
    GroupErroredError,
    GroupExistsError,
    GroupNotFoundError,
    IntoBusyError,
    IntoMismatchError,
    TensorInUseError,
    InvalidArgumentError,
    NoCollectiveGroupError,
    ObjectError,
    ObjectFetchError,
    ObjectFreedError,
    PeerUnavailableError,
    ProducerDiedError,
    RdtError,
    TensorMismatchError,
    TransferTimeoutError,
    UnsupportedError,
    VersionGoneError,
    FenceTimeoutError,
    ChecksumMismatchError,
)

__all__ = [
    "RdtError", "ObjectError", "ObjectFreedError", "ObjectFetchError", "ProducerDiedError", "TransferTimeoutError", "IntoBusyError", "IntoMismatchError", "TensorInUseError",
    "NoCollectiveGroupError", "InvalidArgumentError", "UnsupportedError", "BackendUnavailableError", "GroupError",
    "GroupNotFoundError", "GroupExistsError", "GroupErroredError", "GroupDestroyedError", "CommunicationError",
    "CollectiveTimeoutError", "PeerUnavailableError", "TensorMismatchError", "AuthenticationError",
    "VersionGoneError", "FenceTimeoutError", "ChecksumMismatchError",
]
