"""A sharded load's reads as its producer ranks see them: registered with each rank before any byte moves and ended
after (``rdt._consumer.versions`` speaks the protocol), so that a trainer's fence waits for them and a read the
version did not hold through fails. Errors name the rank and the version."""

from __future__ import annotations

import time
from typing import Any

from .._consumer import versions
from ..errors import ObjectFetchError, ObjectFreedError, RdtError, VersionGoneError
from .publish import Shards


def gone(shards: Shards, why: str) -> VersionGoneError:
    """The error for a version its producer no longer serves."""
    err = VersionGoneError(
        f"version {shards.version} of {shards.source} is gone: {why}", rank=shards.rank,
        object_id=shards.meta.id_hex if shards.meta is not None else None,
        hint="load the manifest of the newest version (the trainer fences a version before it updates the "
             "weights in place); publish with keep_versions=N to keep older versions readable")
    err.version = shards.version
    return err


def named(shards: Shards, e: BaseException) -> BaseException:
    """``e`` as raised by a read of ``shards``: rdt's object errors name the rank and version; others as they are."""
    if not isinstance(e, RdtError) or e.rank is not None:  # not rdt's, or named already
        return e
    if isinstance(e, VersionGoneError):
        return gone(shards, getattr(e, "reason", None) or e.message)
    if isinstance(e, (ObjectFetchError, ObjectFreedError)):
        err = type(e)(f"{shards.source} (version {shards.version}): {e.message}", rank=shards.rank,
                      object_id=shards.meta.id_hex, hint=e.hint)
        err.__cause__ = e
        for key in ("param", "version"):  # what a ChecksumMismatchError carries
            if hasattr(e, key):
                setattr(err, key, getattr(e, key))
        return err
    return e


def begin(ctx: Any, shards: Shards, deadline: float) -> bytes:
    """Register a read of ``shards``' version with its producer rank; the reader's token."""
    try:
        return versions.begin(ctx, shards.meta, shards.version, deadline)
    except RdtError as e:
        raise named(shards, e) from e


def end(ctx: Any, shards: Shards, reader: bytes, deadline: float) -> bool:
    """End a registered read; True when the version held through it (False: its bytes may be torn)."""
    try:
        return versions.end(ctx, shards.meta, reader, deadline)
    except RdtError as e:
        raise named(shards, e) from e


def end_quietly(ctx: Any, shards: Shards, reader: bytes, seconds: float = 0.5) -> None:
    """End a registration after a failure (bounded, best effort: the failure is what is raised)."""
    try:
        versions.end(ctx, shards.meta, reader, time.monotonic() + seconds)
    except Exception:  # noqa: BLE001 - see above
        pass
