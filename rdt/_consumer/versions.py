"""The consumer's side of the version protocol (``rdt._process.versions`` is the producer's): a read of a published
version registers with its producer before any byte moves and ends after, so that the producer's fence waits for
it and a read the version did not hold through is told so; ``sums`` asks the producer's checksums of a range set
(``verify=True``). Errors name the object; the sharded loader adds the rank and version."""

from __future__ import annotations

import os
import secrets
import struct
import time
from typing import Any, Dict, Optional, Tuple

import ray

from .._control import wire as _control
from .._control.peer import control_request
from .._objects.meta import ObjectMeta
from .._process.versions import decode_sums, plan_key
from ..errors import RdtError, TransferTimeoutError

_who: Optional[Tuple[int, str]] = None  # (pid, name): made anew in a forked child


def who() -> str:
    """This consumer as a fence's error names it: its actor, pid and node."""
    global _who
    pid = os.getpid()
    if _who is None or _who[0] != pid:
        actor = node = None
        try:
            if ray.is_initialized():  # never start Ray just to name this process
                rt = ray.get_runtime_context()
                actor, node = rt.get_actor_id(), rt.get_node_id()
        except Exception:  # noqa: BLE001 - not connected
            pass
        _who = (pid, f"{'actor ' + actor[:12] if actor else 'driver'} pid {pid}" + (f" node {node[:12]}"
                                                                                   if node else ""))
    return _who[1]


def ask(ctx: Any, meta: ObjectMeta, msg: int, payload: bytes, deadline: float, what: str) -> bytes:
    """One control request about ``meta`` to its producer, signed with its process key; rdt's typed errors pass
    through, a timeout or a broken channel is a TransferTimeoutError naming ``what``."""
    left = deadline - time.monotonic()
    try:
        if left <= 0:
            raise TimeoutError("no time left")
        return control_request(ctx, meta, msg, _control.KEY_PROCESS, meta.producer.process_key, payload, left)
    except RdtError:
        raise
    except (TimeoutError, OSError, _control.ProtocolError) as e:
        raise TransferTimeoutError(
            f"the producer of {meta.describe()} did not answer {what} in time: {type(e).__name__}: {e}",
            object_id=meta.id_hex,
            hint="the producer may be stuck or its node unreachable; raise timeout= for a slow control path") from e


def begin(ctx: Any, meta: ObjectMeta, version: int, deadline: float) -> bytes:
    """Register a read of ``version`` of ``meta`` with its producer (before any byte moves); the reader's token."""
    reader = secrets.token_bytes(16)
    wait_ms = int(max(deadline - time.monotonic(), 0.0) * 1000)
    payload = struct.pack("!16sQ16sI", meta.obj_id, version, reader, min(wait_ms, 0xFFFFFFFF))
    ask(ctx, meta, _control.REQ_READ_BEGIN, payload + who().encode()[:200], deadline, "the start of a read")
    return reader


def end(ctx: Any, meta: ObjectMeta, reader: bytes, deadline: float) -> bool:
    """End a registered read; True when the version held through it (False: its bytes may be torn)."""
    resp = ask(ctx, meta, _control.REQ_READ_END, struct.pack("!16s16s", meta.obj_id, reader), deadline,
               "the end of a read")
    return resp[:1] == b"\x01"


def sums(ctx: Any, meta: ObjectMeta, ranges: bytes, deadline: float) -> Dict[int, int]:
    """The producer's checksum per group of a range set (``encode_ranges``' rows): asked by the set's key alone
    when the producer knows it, else with the ranges."""
    head = struct.pack("!16s16s", meta.obj_id, plan_key(ranges))
    resp = ask(ctx, meta, _control.REQ_RANGE_SUMS, head + struct.pack("!I", 0), deadline, "checksums")
    if resp[:1] != b"\x01":
        resp = ask(ctx, meta, _control.REQ_RANGE_SUMS, head + struct.pack("!I", len(ranges) // 24) + ranges,
                   deadline, "checksums")
    return decode_sums(resp[1:])
