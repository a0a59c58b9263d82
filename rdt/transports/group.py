"""Objects over a collective group (Gloo, NCCL, UCX): the consumer asks, the producer posts sends, bytes move on
the group's own backend between two members.

Fetch: the consumer picks tags, asks the producer's control server (authenticated with the group's secret) to post
the sends, posts its receives and waits while watching that the producer lives. Serve: the producer posts one send
per buffer on its control thread and lets a waiter finish them, so the actor's task queue is never involved. From
``_control.GO_MIN_BYTES`` on, a Gloo producer sends only once the consumer says its receives are posted.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import time
from concurrent.futures import wait as futures_wait
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from rdt_transports._context import get_context as get_transport_context
from rdt_transports.errors import CollectiveTimeoutError, CommunicationError, GroupDestroyedError
from rdt_transports.group import TAG_OBJECT, make_tag

from .. import _cma, _control
from .._meta import GroupRef, ObjectMeta
from .._ready import wait_ready
from .._peer import control_request, died, err, producer_alive
from ..errors import NoCollectiveGroupError, ObjectFetchError
from .base import ALIGN, Capabilities, Fetched, Served, Site, Transport, Unusable, block_views, landing

logger = logging.getLogger("rdt")

PACK_BELOW = 256 << 10  # CPU buffers smaller than this travel packed with their neighbours ...
PACK_MAX = 4 << 20  # ... in messages of at most this many bytes: one message per run, not one per tensor


def messages(sizes: List[int]) -> List[Tuple[int, int]]:
    """How a packed fetch splits an object's buffers into messages: (first, last) buffer of each, runs of small
    buffers together (laid out as in one landing block, see ``padded_offsets``), each large buffer alone. Both
    sides compute it from the metadata, so no byte of framing travels."""
    out: List[Tuple[int, int]] = []
    i, n = 0, len(sizes)
    while i < n:
        j, total = i, 0
        while j < n and sizes[j] < PACK_BELOW and total + sizes[j] <= PACK_MAX:
            total += -(-sizes[j] // ALIGN) * ALIGN
            j += 1
        if j == i:  # a large buffer
            j = i + 1
        out.append((i, j - 1))
        i = j
    return out


def _packed_sends(flat: Any) -> List[torch.Tensor]:
    """One tensor per message of :func:`messages`: a large buffer itself, or a run of small CPU buffers copied
    into one staging tensor, each at the offset it has in the consumer's landing block (one memmove per buffer
    from its address: no tensor object per buffer)."""
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
        _cma.gather([(base + o, addr, n) for (addr, n), o in zip(ranges[first:last + 1], offsets)])
        for k in range(first, last):
            end = offsets[k - first] + sizes[k]
            gap = offsets[k - first + 1] - end
            if gap:
                ctypes.memset(base + end, 0, gap)
        out.append(staging)
    return out


def common_group(meta: ObjectMeta, backend: str) -> Optional[Tuple[Any, GroupRef]]:
    """A healthy group of ``backend`` that both this process and the producer are in (and the producer's rank)."""
    mine = {g.uid: g for g in get_transport_context().groups() if g is not None}
    for ref in meta.groups:
        g = mine.get(ref.uid)
        if g is not None and ref.backend == backend and g.state.value == "healthy":
            return g, ref
    return None


class _GroupTransport(Transport):
    """Shared by the group backends; subclasses only declare their capabilities."""

    def unusable(self, ctx: Any, meta: ObjectMeta, site: Site) -> Optional[Unusable]:
        if self.name in site.groups:
            return None
        reason = f"this process shares no healthy {self.name} group with the producer"
        if not site.task_argument:
            return Unusable(reason)  # the driver, a task, or a ray.get: falls back to the producer's stream
        return Unusable(reason, NoCollectiveGroupError(
            f"{meta.describe()} uses transport {self.name!r} but this actor shares no healthy {self.name} group "
            f"with its producer (actor {meta.producer.actor_id[:12]})",
            object_id=meta.id_hex,
            hint=f"call rdt.create_collective_group([producer, consumer, ...], backend={self.name!r}) from the "
            "driver before passing the ref, or use tensor_transport='auto'",
        ))

    def fetch(self, ctx: Any, meta: ObjectMeta, site: Site, deadline: float) -> Fetched:
        group, ref = site.groups[self.name]
        return Fetched(_fetch_group(ctx, meta, group, ref, site, deadline), self.name)

    def handlers(self) -> Dict[int, Served]:
        return {_control.REQ_FETCH_GROUP: (_serve_fetch_group, (_control.KEY_GROUP,))}


class GlooTransport(_GroupTransport):
    capabilities = Capabilities(name="gloo", devices=frozenset({"cpu"}), group_backend="gloo", receive_into=True,
                                auto_priority=20)


class NcclTransport(_GroupTransport):
    capabilities = Capabilities(name="nccl", devices=frozenset({"cuda"}), group_backend="nccl", receive_into=True,
                                auto_priority=40)


class UcxTransport(_GroupTransport):
    capabilities = Capabilities(name="ucx", devices=frozenset({"cpu", "cuda"}), group_backend="ucx",
                                receive_into=True, auto_priority=25, explicit=False)


# ------------------------------------------------------------------------------------------------ producer
def _serve_fetch_group(ctx: Any, _key_id: int, payload: bytes) -> Any:
    if len(payload) != 45:
        return err(_control.ERR_BAD_REQUEST, "malformed fetch request")
    entry = ctx.table.get(payload[:16])
    if entry is None:
        return err(_control.ERR_NOT_FOUND, "object was freed or never existed here")
    uid = payload[16:32].hex()
    rank, tag_base, wait_ms, packed = struct.unpack("!IIIB", payload[32:45])
    group = next((g for g in get_transport_context().groups() if g is not None and g.uid == uid), None)
    if group is None:
        return err(_control.ERR_NO_GROUP, "the producer is no longer in that group")
    if not 0 <= rank < group.world_size or rank == group.rank:
        return err(_control.ERR_BAD_REQUEST, f"bad consumer rank {rank}")
    wait_ready(entry)  # the sends below run on other streams than the one the producer returned on
    ctx.stats.add(group.backend_name, "out", entry.nbytes)
    # Wait exactly as long as the consumer does (its time left, relative): a shorter wait would kill a transfer the
    # consumer still waits for, a longer one would hold the buffers after it gave up.
    deadline = time.monotonic() + wait_ms / 1000.0
    n = len(entry.flat.table)
    if packed and entry.flat.table.device_types == {"cpu"}:
        sends = _packed_sends(entry.flat)
    else:
        sends = list(entry.buffers)
    if _control.waits_for_go(group.backend_name, entry.nbytes):
        go = group.backend.irecv(torch.zeros(1, dtype=torch.uint8), rank, make_tag(TAG_OBJECT, tag_base + n))
        ctx.send_waiters.submit(_send_after_go, go, group, sends, rank, tag_base, deadline, entry.obj_id)
        return _control.RESP_OK, b""
    works = [group.backend.isend(buf, rank, make_tag(TAG_OBJECT, tag_base + i)) for i, buf in enumerate(sends)]
    # Posted sends move without a waiter (the backend progresses them); a queued wait only learns the outcome.
    ctx.send_waiters.submit(_finish_sends, works, group, sends, deadline, entry.obj_id, rank)
    return _control.RESP_OK, b""


def _send_after_go(go: Any, group: Any, buffers: List[torch.Tensor], rank: int, tag_base: int, deadline: float,
                   obj_id: bytes) -> None:
    """Post the object's sends once the consumer says its receives are posted (or give up at its deadline)."""
    try:
        go.wait(max(deadline - time.monotonic(), 1e-3))
        works = [group.backend.isend(buf, rank, make_tag(TAG_OBJECT, tag_base + i)) for i, buf in enumerate(buffers)]
    except Exception as e:  # noqa: BLE001 - the consumer timed out or died, or the group was aborted meanwhile
        _send_failed(group, obj_id, rank, e)
        return
    _finish_sends(works, group, buffers, deadline, obj_id, rank)


def _finish_sends(works: List[Any], group: Any, keepalive: List[torch.Tensor], deadline: float, obj_id: bytes,
                  rank: int) -> None:
    """Wait for posted sends off the control thread; buffers stay referenced until then.

    A failed send leaves the group ERRORED here as well (after a timeout the backend is aborted too, so the
    group's other members fail fast): the backend's state is unknown, the next collective must not use it.
    """
    for w in works:
        try:
            w.wait(max(deadline - time.monotonic(), 1e-3))
        except Exception as e:  # noqa: BLE001 - the consumer sees its own error; ours errors the group
            _send_failed(group, obj_id, rank, e)
            return
    del keepalive


def _send_failed(group: Any, obj_id: bytes, rank: int, cause: BaseException) -> None:
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


# ------------------------------------------------------------------------------------------------ consumer
def _fetch_group(ctx: Any, meta: ObjectMeta, group: Any, ref: GroupRef, site: Site,
                 deadline: float) -> Sequence[torch.Tensor]:
    n = len(meta.buffers)
    tag_base = ctx.next_tags(group.uid, n + 1)  # one per buffer, and one for the "receives posted" message
    # The producer waits as long as we do: our time left, as relative milliseconds (clocks differ across hosts).
    wait_ms = min(max(int((deadline - time.monotonic()) * 1000), 1), 0xFFFFFFFF)
    device = site.cuda_device if site.cuda_device is not None and "cuda" in meta.buffers.device_types \
        else torch.device("cpu")
    sizes = meta.buffers.sizes
    # Without targets, CPU buffers land in one block and small ones travel packed (one message per run).
    packed = not site.into and len(sizes) > 1 and meta.buffers.device_types == {"cpu"}
    payload = meta.obj_id + bytes.fromhex(group.uid) + struct.pack("!IIIB", group.rank, tag_base, wait_ms, packed)
    control_request(ctx, meta, _control.REQ_FETCH_GROUP, _control.KEY_GROUP, group.backend.config.secret,
                    payload, max(deadline - time.monotonic(), 1e-3))
    bufs: Any
    if packed:
        bufs = block_views(ctx, sizes, device)
        recvs = [bufs.span(a, b) for a, b in messages(sizes)]
    else:
        bufs = recvs = [landing(ctx, site, i, nb, device) for i, nb in enumerate(sizes)]
    try:
        works = [group.backend.irecv(buf, ref.rank, make_tag(TAG_OBJECT, tag_base + i)) for i, buf in enumerate(recvs)]
        if _control.waits_for_go(group.backend_name, meta.nbytes):  # the producer sends once our receives are posted
            works.append(group.backend.isend(torch.ones(1, dtype=torch.uint8), ref.rank,
                                             make_tag(TAG_OBJECT, tag_base + n)))
        _wait_watching_producer(ctx, meta, works, deadline)
    except CollectiveTimeoutError as e:
        group._mark_errored(e)
        raise TimeoutError(str(e)) from e
    except CommunicationError as e:
        group._mark_errored(e)
        if not producer_alive(ctx, meta):
            raise died(meta, e) from e
        raise ObjectFetchError(f"receiving {meta.describe()} over group {group.name!r} failed: {e}",
                               object_id=meta.id_hex) from e
    return bufs


def _wait_watching_producer(ctx: Any, meta: ObjectMeta, works: List[Any], deadline: float) -> None:
    """Wait for posted receives while checking, every half second, that the producer still lives.

    A two-sided receive does not notice a sender that dies mid-message (TCP may stay half-open), so without
    this the consumer would sit out the whole transfer timeout.
    """
    def wait_all() -> None:
        for w in works:
            w.wait(max(deadline - time.monotonic(), 1e-3))

    future = ctx.waiters.submit(wait_all)
    while not futures_wait([future], timeout=0.5).done:
        if not producer_alive(ctx, meta, ping_timeout=0.5):
            raise died(meta, ConnectionError("the producer died during the transfer"))
    future.result()
