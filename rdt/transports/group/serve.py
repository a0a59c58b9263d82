"""The producer's side of a group fetch, answered on its control thread: post the object's sends (packed, after the
consumer's "receives posted" message for large Gloo objects, or chunk by chunk into a relay chain) and let a waiter
finish them, so the actor's task queue is never involved.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import time
from typing import Any, Callable, List, Optional

import torch

from rdt_transports import local_groups
from rdt_transports._memcopy import copy_parts
from rdt_transports.errors import CollectiveTimeoutError, CommunicationError, GroupDestroyedError
from rdt_transports.group import TAG_OBJECT, make_tag

from ..._control import wire as _control
from ..._control.wire import err
from ..._objects.stream_ready import wait_ready
from . import relay as _relay
from ..receive import ALIGN
from .protocol import FLAG_PACKED, FLAG_RELAY, FLAG_RESUME, messages, waits_for_go

logger = logging.getLogger("rdt")


def packed_sends(flat: Any) -> List[torch.Tensor]:
    """One tensor per message of ``protocol.messages``: a large buffer itself, or a run of small CPU buffers copied
    into one staging tensor, each at the offset it has in the consumer's landing block (one copy call for the whole
    run, from the buffers' addresses: no tensor object per buffer)."""
    sizes = flat.table.sizes
    ranges = flat.ranges
    out: List[torch.Tensor] = []
    for first, last in messages(sizes):
        if first == last:
            out.append(flat.view(first))
            continue
        at, offsets = 0, []
        for k in range(first, last + 1):
            offsets.append(at)
            at += -(-sizes[k] // ALIGN) * ALIGN
        # Not torch.zeros: zeroing (and faulting in) the whole staging first cost more than the copy itself. Only
        # the alignment gaps are cleared, so no stale heap bytes of this process travel.
        staging = torch.empty(offsets[-1] + sizes[last], dtype=torch.uint8)
        base = staging.data_ptr()
        copy_parts([(base + o, addr, n) for (addr, n), o in zip(ranges[first:last + 1], offsets)])
        for k in range(first, last):
            end = offsets[k - first] + sizes[k]
            gap = offsets[k - first + 1] - end
            if gap:
                ctypes.memset(base + end, 0, gap)
        out.append(staging)
    return out


def serve_fetch_group(ctx: Any, _key_id: int, payload: bytes) -> Any:
    """REQ_FETCH_GROUP: post the object's sends to the asking member (or chain it behind the one receiving)."""
    if len(payload) not in (45, 49):
        return err(_control.ERR_BAD_REQUEST, "malformed fetch request")
    entry = ctx.table.get(payload[:16])
    if entry is None:
        return err(_control.ERR_NOT_FOUND, "object was freed or never existed here")
    uid = payload[16:32].hex()
    rank, tag_base, wait_ms, flags = struct.unpack("!IIIB", payload[32:45])
    if bool(flags & FLAG_RESUME) != (len(payload) == 49):
        return err(_control.ERR_BAD_REQUEST, "malformed fetch request")
    group = next((g for g in local_groups() if g is not None and g.uid == uid), None)
    if group is None:
        return err(_control.ERR_NO_GROUP, "the producer is no longer in that group")
    if not 0 <= rank < group.world_size or rank == group.rank:
        return err(_control.ERR_BAD_REQUEST, f"bad consumer rank {rank}")
    wait_ready(entry)  # the sends below run on other streams than the one the producer returned on
    # Wait exactly as long as the consumer does (its time left, relative): a shorter wait would kill a transfer the
    # consumer still waits for, a longer one would hold the buffers after it gave up.
    deadline = time.monotonic() + wait_ms / 1000.0
    cpu = entry.flat.table.device_types == {"cpu"}
    if flags & FLAG_RESUME and cpu:
        first = struct.unpack("!I", payload[45:49])[0]
        return _serve_chunks(ctx, entry, group, rank, tag_base, deadline, first, None)
    if flags & FLAG_RELAY and cpu and group.backend_name == "gloo" and ctx.config.relay:
        return _serve_relay(ctx, entry, group, rank, tag_base, deadline)
    _count_out(ctx, group, entry.nbytes)
    n = len(entry.flat.table)
    if flags & FLAG_PACKED and cpu:
        sends = packed_sends(entry.flat)
    else:
        sends = list(entry.buffers)
    if waits_for_go(group.backend_name, entry.nbytes):
        go = group.backend.irecv(torch.zeros(1, dtype=torch.uint8), rank, make_tag(TAG_OBJECT, tag_base + n))
        ctx.send_waiters.submit(_send_after_go, go, group, sends, rank, tag_base, deadline, entry.obj_id)
        return _control.RESP_OK, b""
    works = [group.backend.isend(buf, rank, make_tag(TAG_OBJECT, tag_base + i)) for i, buf in enumerate(sends)]
    # Posted sends move without a waiter (the backend progresses them); a queued wait only learns the outcome.
    ctx.send_waiters.submit(_finish_sends, works, group, sends, deadline, entry.obj_id, rank)
    return _control.RESP_OK, b""


def _count_out(ctx: Any, group: Any, nbytes: int) -> None:
    """Bytes this producer puts on its link for a group fetch (``rdt.stats()``: transfers and relay)."""
    ctx.stats.add(group.backend_name, "out", nbytes)
    _relay.table(ctx).add("served_bytes", nbytes)


def _serve_relay(ctx: Any, entry: Any, group: Any, rank: int, tag_base: int, deadline: float) -> Any:
    """Chain the consumer behind the one still receiving this object (it will forward), or start a chain and
    send it the chunks. The reply names its source; only the producer's authenticated replies say who sends."""
    cid, source, position = _relay.table(ctx).join(entry.obj_id, group.uid, rank, tag_base, deadline)
    reply = struct.pack(_relay.REPLY, _relay.MODE_RELAY, group.rank if source is None else source, position, cid)
    if source is not None:
        return _control.RESP_OK, reply
    return _serve_chunks(ctx, entry, group, rank, tag_base, deadline, 0, cid, reply)


def _serve_chunks(ctx: Any, entry: Any, group: Any, rank: int, tag_base: int, deadline: float, first: int,
                  cid: Optional[int], reply: bytes = b"") -> Any:
    """Send chunks ``first``.. of the object's relay layout to ``rank`` (a chain's head, or a member whose source
    failed); the head of a large object is sent to once its receives are posted."""
    table = _relay.table(ctx)
    on_done = (lambda failed: table.sent(cid, failed)) if cid is not None else None
    try:
        parts = _relay.split(packed_sends(entry.flat))
        if first > len(parts):
            return err(_control.ERR_BAD_REQUEST, f"no chunk {first}: the object has {len(parts)}")
        sends = parts[first:]
        _count_out(ctx, group, sum(p.numel() for p in sends))
        tag = tag_base + first
        if cid is not None and waits_for_go(group.backend_name, entry.nbytes):  # a chain's head
            go = group.backend.irecv(torch.zeros(1, dtype=torch.uint8), rank,
                                     make_tag(TAG_OBJECT, tag_base + len(parts)))
            ctx.send_waiters.submit(_send_after_go, go, group, sends, rank, tag, deadline, entry.obj_id, on_done)
        else:
            works = [group.backend.isend(buf, rank, make_tag(TAG_OBJECT, tag + i)) for i, buf in enumerate(sends)]
            ctx.send_waiters.submit(_finish_sends, works, group, sends, deadline, entry.obj_id, rank, on_done)
    except BaseException:
        if cid is not None:
            table.sent(cid, True)
        raise
    return _control.RESP_OK, reply


def serve_relay_next(ctx: Any, _key_id: int, payload: bytes) -> Any:
    """A chained consumer asks whom it forwards to: held until a follower joins, it says it is done (``final``),
    or its time runs out. Answered only from the producer's own table, and only for a chain of the request's
    object in the group whose secret signed it (``RelayTable.next_of``); a poll that may wait is answered from the
    control server's hold pool, so polls never take the workers that answer everything else (the ``final``
    requests that end them included)."""
    if len(payload) != 32 + struct.calcsize(_relay.NEXT_REQUEST):
        return err(_control.ERR_BAD_REQUEST, "malformed relay request")
    rank, cid, wait_ms, final = struct.unpack(_relay.NEXT_REQUEST, payload[32:])
    table = _relay.table(ctx)
    obj_id, uid = payload[:16], payload[16:32].hex()  # the request's MAC was checked with this group's secret

    def answer() -> Any:
        try:
            follower = table.next_of(obj_id, uid, cid, rank, bool(final), wait_ms / 1000.0)
        except _relay.UnknownChain as e:  # another group's chain, another object's, or one already gone
            return err(_control.ERR_BAD_REQUEST, str(e))
        rank_, tags = follower if follower is not None else (-1, 0)
        return _control.RESP_OK, struct.pack(_relay.NEXT_REPLY, rank_, tags)

    return answer() if final else _control.Held(answer)


def _send_after_go(go: Any, group: Any, buffers: List[torch.Tensor], rank: int, tag_base: int, deadline: float,
                   obj_id: bytes, on_done: Optional[Callable[[bool], None]] = None) -> None:
    """Post the object's sends once the consumer says its receives are posted (or give up at its deadline)."""
    try:
        go.wait(max(deadline - time.monotonic(), 1e-3))
        works = [group.backend.isend(buf, rank, make_tag(TAG_OBJECT, tag_base + i)) for i, buf in enumerate(buffers)]
    except Exception as e:  # noqa: BLE001 - the consumer timed out or died, or the group was aborted meanwhile
        send_failed(group, obj_id, rank, e)
        if on_done is not None:
            on_done(True)
        return
    _finish_sends(works, group, buffers, deadline, obj_id, rank, on_done)


def _finish_sends(works: List[Any], group: Any, keepalive: List[torch.Tensor], deadline: float, obj_id: bytes,
                  rank: int, on_done: Optional[Callable[[bool], None]] = None) -> None:
    """Wait for posted sends off the control thread; buffers stay referenced until then (then ``on_done(failed)``).

    A failed send leaves the group ERRORED here as well (after a timeout the backend is aborted too, so the
    group's other members fail fast): the backend's state is unknown, the next collective must not use it.
    """
    failed = True
    try:
        for w in works:
            try:
                w.wait(max(deadline - time.monotonic(), 1e-3))
            except Exception as e:  # noqa: BLE001 - the consumer sees its own error; ours errors the group
                send_failed(group, obj_id, rank, e)
                return
        failed = False
        del keepalive
    finally:
        if on_done is not None:
            on_done(failed)




def send_failed(group: Any, obj_id: bytes, rank: int, cause: BaseException) -> None:
    """Log a failed object send with its context and mark the group ERRORED (not after an abort or destroy)."""
    logger.warning("rdt: group=%s rank=%d: sending object %s to rank %d failed: %s", group.name, group.rank,
                   obj_id.hex(), rank, cause)
    if isinstance(cause, GroupDestroyedError):
        return
    cls = CollectiveTimeoutError if isinstance(cause, TimeoutError) else CommunicationError
    group.fail(cls(f"sending object {obj_id.hex()[:16]} to rank {rank} failed: {cause}", group=group.name,
                   rank=group.rank, peer=rank, op="object send", object_id=obj_id.hex(),
                   hint="the consumer did not receive in time or died; destroy the group on every member and "
                   "create it again"))
