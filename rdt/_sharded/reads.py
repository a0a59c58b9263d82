"""A sharded load's reads as its producers see them: each rank's read is registered before any byte moves and ended
after (so that the producer's fence waits for it, and a read the version did not hold through fails), and, with
``verify=True``, the producer's checksums of the range set are compared with the landed bytes."""

from __future__ import annotations

import os
import secrets
import struct
import time
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from .._control import wire as _control
from .._control.peer import control_request
from .._process.versions import decode_sums, encode_ranges, plan_key
from ..errors import (ChecksumMismatchError, ObjectFetchError, ObjectFreedError, ProducerDiedError, RdtError, TransferTimeoutError,
                      VersionGoneError)
from .publish import Shards

SUM_CHUNK = 32768  # ranges per checksum request (24 bytes each: well inside a control frame)
_who: Optional[str] = None


def who() -> str:
    """This consumer as a fence's error names it: its actor, pid and node."""
    global _who
    if _who is None:
        try:
            import ray

            rt = ray.get_runtime_context()
            actor = rt.get_actor_id()
            node = rt.get_node_id()
        except Exception:  # noqa: BLE001 - not connected
            actor, node = None, None
        _who = f"{'actor ' + actor[:12] if actor else 'driver'} pid {os.getpid()}" + (f" node {node[:12]}"
                                                                                      if node else "")
    return _who


def _ask(ctx: Any, shards: Shards, msg: int, payload: bytes, deadline: float, what: str) -> bytes:
    """One control request to ``shards``' producer; every error names the producer rank and the version."""
    meta = shards.meta
    left = deadline - time.monotonic()
    try:
        if left <= 0:
            raise TimeoutError("no time left")
        return control_request(ctx, meta, msg, _control.KEY_PROCESS, meta.producer.process_key, payload, left)
    except VersionGoneError as e:
        raise gone(shards, getattr(e, "reason", e.message)) from e
    except (ProducerDiedError, ObjectFreedError, ObjectFetchError) as e:
        raise type(e)(f"{shards.source} (version {shards.version}): {e}", rank=shards.rank,
                      object_id=meta.id_hex, hint=e.hint) from e
    except RdtError:
        raise
    except (TimeoutError, OSError, _control.ProtocolError) as e:
        raise TransferTimeoutError(
            f"{shards.source} (version {shards.version}) did not answer {what} in time: "
            f"{type(e).__name__}: {e}", rank=shards.rank, object_id=meta.id_hex,
            hint="the trainer rank may be stuck or its node unreachable; raise timeout= for a slow control path") from e


def gone(shards: Shards, why: str) -> VersionGoneError:
    """The error for a version its producer no longer serves."""
    err = VersionGoneError(
        f"version {shards.version} of {shards.source} is gone: {why}", rank=shards.rank,
        object_id=shards.meta.id_hex if shards.meta is not None else None,
        hint="load the manifest of the newest version (the trainer fences a version before it updates the "
             "weights in place); publish with keep_versions=N to keep older versions readable")
    err.version = shards.version
    return err


def begin(ctx: Any, shards: Shards, deadline: float) -> bytes:
    """Register a read of ``shards``' version with its producer (before any byte moves); the reader's token."""
    reader = secrets.token_bytes(16)
    wait_ms = int(max(deadline - time.monotonic(), 0.0) * 1000)
    payload = struct.pack("!16sQ16sI", shards.meta.obj_id, shards.version, reader, min(wait_ms, 0xFFFFFFFF))
    _ask(ctx, shards, _control.REQ_READ_BEGIN, payload + who().encode()[:200], deadline, "the start of a read")
    return reader


def end(ctx: Any, shards: Shards, reader: bytes, deadline: float) -> bool:
    """End a registered read; True when the version held through it (False: its bytes may be torn)."""
    resp = _ask(ctx, shards, _control.REQ_READ_END, struct.pack("!16s16s", shards.meta.obj_id, reader),
                deadline, "the end of a read")
    return resp[:1] == b"\x01"


def verify(ctx: Any, shards: Shards, group: np.ndarray, buf: np.ndarray, off: np.ndarray, n: np.ndarray,
           landed: Callable[[int], np.ndarray], target: np.ndarray, dst: np.ndarray, names: Sequence[str],
           deadline: float) -> int:
    """Compare the producer's CRC-32 per parameter of this rank's ranges with the bytes landed here (``landed(t)``:
    target ``t``'s bytes); ChecksumMismatchError names the parameter and the rank. The bytes checked."""
    views: Dict[int, np.ndarray] = {}
    for lo in range(0, len(n), SUM_CHUNK):
        hi = lo + SUM_CHUNK
        theirs = _sums(ctx, shards, encode_ranges(group[lo:hi], buf[lo:hi], off[lo:hi], n[lo:hi]), deadline)
        ours: Dict[int, int] = {}
        for g, t, d, k in zip(group[lo:hi].tolist(), target[lo:hi].tolist(), dst[lo:hi].tolist(),
                              n[lo:hi].tolist()):
            view = views.get(t)
            if view is None:
                view = views[t] = landed(t)
            ours[g] = zlib.crc32(view[d:d + k], ours.get(g, 0))
        for g, crc in ours.items():
            if theirs.get(g) != crc:
                param = shards.params[g].name
                into = sorted({names[t] for gg, t in zip(group[lo:hi].tolist(), target[lo:hi].tolist()) if gg == g})
                err = ChecksumMismatchError(
                    f"parameter {param!r} from {shards.source} (version {shards.version}), landed in "
                    f"target(s) {into}: the bytes' CRC-32 is {crc:08x}, the producer's {theirs.get(g, 0):08x}",
                    rank=shards.rank,
                    object_id=shards.meta.id_hex,
                    hint="the bytes changed between the producer's checksum and the read (an in-place update "
                         "without shards.fence()), or were corrupted on the way; the targets hold wrong bytes: "
                         "load again")
                err.param, err.version = param, shards.version
                raise err
    return int(n.sum())


def _sums(ctx: Any, shards: Shards, ranges: bytes, deadline: float) -> Dict[int, int]:
    """The producer's checksums of a range set: by plan key alone when it knows the set, else with the ranges."""
    key = plan_key(ranges)
    head = struct.pack("!16s16s", shards.meta.obj_id, key)
    resp = _ask(ctx, shards, _control.REQ_RANGE_SUMS, head + struct.pack("!I", 0), deadline, "checksums")
    if resp[:1] != b"\x01":
        resp = _ask(ctx, shards, _control.REQ_RANGE_SUMS, head + struct.pack("!I", len(ranges) // 24) + ranges,
                    deadline, "checksums")
    return decode_sums(resp[1:])


def landed_bytes(tensors: List[torch.Tensor]) -> Callable[[int], np.ndarray]:
    """Target ``t``'s bytes as a uint8 array (no copy)."""
    return lambda t: tensors[t].reshape(-1).view(torch.uint8).numpy()
