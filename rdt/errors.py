"""rdt's errors: the same typed hierarchy as rdt_transports (one base, RdtError), re-exported here."""

from rdt_transports.errors import (  # noqa: F401
    BackendUnavailableError,
    CollectiveTimeoutError,
    CommunicationError,
    GroupError,
    GroupNotFoundError,
    InvalidArgumentError,
    NoCollectiveGroupError,
    ObjectError,
    ObjectFetchError,
    ObjectFreedError,
    PeerUnavailableError,
    ProducerDiedError,
    RdtError,
    TransferTimeoutError,
    UnsupportedError,
)

__all__ = [
    "RdtError", "ObjectError", "ObjectFreedError", "ObjectFetchError", "ProducerDiedError", "TransferTimeoutError",
    "NoCollectiveGroupError", "InvalidArgumentError", "UnsupportedError", "BackendUnavailableError", "GroupError",
    "GroupNotFoundError", "CommunicationError", "CollectiveTimeoutError", "PeerUnavailableError",
]
