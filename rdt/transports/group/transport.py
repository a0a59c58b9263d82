"""Objects over a collective group (Gloo, NCCL, UCX): the consumer asks, the producer posts sends, bytes move on
the group's own backend between two members.

Fetch: the consumer picks tags, asks the producer's control server (authenticated with the group's secret) to post
the sends, posts its receives and waits while watching that the producer lives. Serve: the producer posts one send
per buffer on its control thread and lets a waiter finish them, so the actor's task queue is never involved. From
``_control.GO_MIN_BYTES`` on, a Gloo producer sends only once the consumer says its receives are posted.

Fan-out (gloo, objects from ``relay_min_bytes``): consumers that ask while another is still receiving are chained
behind it and the bytes travel in chunks, each member forwarding what it got (``_relay``); a member whose source
dies or stalls asks the producer directly for the chunks it misses.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import threading
import time
from concurrent.futures import wait as futures_wait
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from rdt_transports._context import get_context as get_transport_context
from rdt_transports.errors import CollectiveTimeoutError, CommunicationError, GroupDestroyedError
from rdt_transports.group import TAG_OBJECT, make_tag

from ..shm import cma as _cma
from ..._control import server as _control
from ..._objects.meta import GroupRef, ObjectMeta
from ..._objects.stream_ready import wait_ready
from ..._control.peer import control_request, died, err, producer_alive
from ...errors import NoCollectiveGroupError, ObjectFetchError
from . import relay as _relay
from ..base import ALIGN, Capabilities, Fetched, Served, Site, Transport, Unusable, block_views, landing, padded_offsets

logger = logging.getLogger("rdt")

PACK_BELOW = 256 << 10  # CPU buffers smaller than this travel packed with their neighbours ...
PACK_MAX = 4 << 20  # ... in messages of at most this many bytes: one message per run, not one per tensor

# The fetch request's last byte: flags
FLAG_PACKED = 1  # small CPU buffers travel packed (messages())
FLAG_RELAY = 2  # the consumer can be chained: serve it in chunks, maybe from another consumer (reply says)
FLAG_RESUME = 4  # a chained consumer whose source failed: send chunks from the u32 that follows, directly


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
        return {_control.REQ_FETCH_GROUP: (_serve_fetch_group, (_control.KEY_GROUP,)),
                _control.REQ_RELAY_NEXT: (_serve_relay_next, (_control.KEY_GROUP,))}

    def release(self, ctx: Any, entry: Any) -> None:
        state = ctx.peek_transport_state("relay")
        if state is not None:
            state.forget(entry.obj_id)


class GlooTransport(_GroupTransport):
    capabilities = Capabilities(name="gloo", devices=frozenset({"cpu"}), group_backend="gloo", receive_into=True,
                                serves_from_holder=True, auto_priority=20)


class NcclTransport(_GroupTransport):
    capabilities = Capabilities(name="nccl", devices=frozenset({"cuda"}), group_backend="nccl", receive_into=True,
                                auto_priority=40)


class UcxTransport(_GroupTransport):
    capabilities = Capabilities(name="ucx", devices=frozenset({"cpu", "cuda"}), group_backend="ucx",
                                receive_into=True, auto_priority=25, explicit=False)


# ------------------------------------------------------------------------------------------------ producer
def _serve_fetch_group(ctx: Any, _key_id: int, payload: bytes) -> Any:
    if len(payload) not in (45, 49):
        return err(_control.ERR_BAD_REQUEST, "malformed fetch request")
    entry = ctx.table.get(payload[:16])
    if entry is None:
        return err(_control.ERR_NOT_FOUND, "object was freed or never existed here")
    uid = payload[16:32].hex()
    rank, tag_base, wait_ms, flags = struct.unpack("!IIIB", payload[32:45])
    if bool(flags & FLAG_RESUME) != (len(payload) == 49):
        return err(_control.ERR_BAD_REQUEST, "malformed fetch request")
    group = next((g for g in get_transport_context().groups() if g is not None and g.uid == uid), None)
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
        parts = _relay.split(_packed_sends(entry.flat))
        if first > len(parts):
            return err(_control.ERR_BAD_REQUEST, f"no chunk {first}: the object has {len(parts)}")
        sends = parts[first:]
        _count_out(ctx, group, sum(p.numel() for p in sends))
        tag = tag_base + first
        if cid is not None and _control.waits_for_go(group.backend_name, entry.nbytes):  # a chain's head
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


def _serve_relay_next(ctx: Any, _key_id: int, payload: bytes) -> Any:
    """A chained consumer asks whom it forwards to: held until a follower joins, it says it is done (``final``),
    or its time runs out. Answered only from the producer's own table."""
    if len(payload) != 32 + struct.calcsize(_relay.NEXT_REQUEST):
        return err(_control.ERR_BAD_REQUEST, "malformed relay request")
    rank, cid, wait_ms, final = struct.unpack(_relay.NEXT_REQUEST, payload[32:])
    follower = _relay.table(ctx).next_of(cid, rank, bool(final), wait_ms / 1000.0)
    rank_, tags = follower if follower is not None else (-1, 0)
    return _control.RESP_OK, struct.pack(_relay.NEXT_REPLY, rank_, tags)


def _send_after_go(go: Any, group: Any, buffers: List[torch.Tensor], rank: int, tag_base: int, deadline: float,
                   obj_id: bytes, on_done: Optional[Callable[[bool], None]] = None) -> None:
    """Post the object's sends once the consumer says its receives are posted (or give up at its deadline)."""
    try:
        go.wait(max(deadline - time.monotonic(), 1e-3))
        works = [group.backend.isend(buf, rank, make_tag(TAG_OBJECT, tag_base + i)) for i, buf in enumerate(buffers)]
    except Exception as e:  # noqa: BLE001 - the consumer timed out or died, or the group was aborted meanwhile
        _send_failed(group, obj_id, rank, e)
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
                _send_failed(group, obj_id, rank, e)
                return
        failed = False
        del keepalive
    finally:
        if on_done is not None:
            on_done(failed)




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
    sizes = meta.buffers.sizes
    relay = _relay_wanted(ctx, meta, group)
    nchunks = len(_relay.chunks(_message_sizes(sizes))) if relay else 0
    # One tag per buffer (or relayed chunk), and one for the "receives posted" message
    tag_base = ctx.next_tags(group.uid, max(n, nchunks) + 1)
    wait_ms = _wait_ms(deadline)  # the producer waits as long as we do: time left, relative (clocks differ)
    device = site.cuda_device if site.cuda_device is not None and "cuda" in meta.buffers.device_types \
        else torch.device("cpu")
    # Without targets, CPU buffers land in one block and small ones travel packed (one message per run).
    packed = not site.into and len(sizes) > 1 and meta.buffers.device_types == {"cpu"}
    flags = (FLAG_PACKED if packed else 0) | (FLAG_RELAY if relay else 0)
    payload = meta.obj_id + bytes.fromhex(group.uid) + struct.pack("!IIIB", group.rank, tag_base, wait_ms, flags)
    reply = control_request(ctx, meta, _control.REQ_FETCH_GROUP, _control.KEY_GROUP, group.backend.config.secret,
                            payload, max(deadline - time.monotonic(), 1e-3))
    if reply:  # the producer chained us: chunks come from it or from the consumer before us
        try:
            return _fetch_chained(ctx, meta, group, ref, site, deadline, reply, tag_base)
        except (CollectiveTimeoutError, CommunicationError) as e:
            _receive_failed(ctx, meta, group, e)
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
    except (CollectiveTimeoutError, CommunicationError) as e:
        _receive_failed(ctx, meta, group, e)
    return bufs


def _receive_failed(ctx: Any, meta: ObjectMeta, group: Any, e: BaseException) -> None:
    """Raise the typed error for a failed receive from the producer (the group is ERRORED from now on)."""
    group._mark_errored(e)
    if isinstance(e, CollectiveTimeoutError):
        raise TimeoutError(str(e)) from e
    if not producer_alive(ctx, meta):
        raise died(meta, e) from e
    raise ObjectFetchError(f"receiving {meta.describe()} over group {group.name!r} failed: {e}",
                           object_id=meta.id_hex) from e


def _wait_ms(deadline: float) -> int:
    return min(max(int((deadline - time.monotonic()) * 1000), 1), 0xFFFFFFFF)


def _relay_wanted(ctx: Any, meta: ObjectMeta, group: Any) -> bool:
    """Whether to offer the producer to chain this fetch (gloo, CPU, large enough, relaying not switched off)."""
    return (ctx.config.relay and group.backend_name == "gloo" and meta.buffers.device_types == {"cpu"}
            and meta.nbytes >= max(ctx.config.relay_min_bytes, 1))


def _message_sizes(sizes: List[int]) -> List[int]:
    """Bytes of each packed message of :func:`messages` (padding between packed buffers included)."""
    offsets, _ = padded_offsets(sizes)
    return [offsets[b] + sizes[b] - offsets[a] for a, b in messages(sizes)]


def _fetch_chained(ctx: Any, meta: ObjectMeta, group: Any, ref: GroupRef, site: Site, deadline: float,
                   reply: bytes, tag_base: int) -> Sequence[torch.Tensor]:
    """Receive the object's chunks from the source the producer named, forwarding each to our follower as soon as
    it arrived; with targets, packed runs land in staging and are copied into them at the end."""
    mode, source, position, cid = struct.unpack(_relay.REPLY, reply)
    if mode != _relay.MODE_RELAY:
        raise ObjectFetchError(f"the producer of {meta.describe()} answered with an unknown relay mode {mode}",
                               object_id=meta.id_hex)
    sizes = meta.buffers.sizes
    msgs = messages(sizes)
    bufs: Any
    scatter: List[Tuple[torch.Tensor, int, int]] = []
    if site.into:
        bufs = [landing(ctx, site, i, nb) for i, nb in enumerate(sizes)]
        offsets, _ = padded_offsets(sizes)
        views = []
        for first, last in msgs:
            if first == last:
                views.append(bufs[first])
            else:
                staging = ctx.buffers.empty(offsets[last] + sizes[last] - offsets[first])
                views.append(staging)
                scatter.append((staging, first, last))
    else:
        bufs = block_views(ctx, sizes)
        views = [bufs.span(a, b) for a, b in msgs]
    receive = _RelayReceive(ctx, meta, group, ref, _relay.split(views), cid, deadline)
    _watching_producer(ctx, meta, lambda: receive.run(source, position, tag_base))
    if scatter:
        offsets, _ = padded_offsets(sizes)
        for staging, first, last in scatter:
            for k in range(first, last + 1):
                at = offsets[k] - offsets[first]
                bufs[k].copy_(staging[at:at + sizes[k]])
    return bufs


class _RelayReceive:
    """One chained fetch: receive every chunk (from the producer or the member before us), forward each to our
    follower once the producer named one, and fall back to the producer when our source fails."""

    def __init__(self, ctx: Any, meta: ObjectMeta, group: Any, ref: GroupRef, parts: List[torch.Tensor], cid: int,
                 deadline: float) -> None:
        self.ctx, self.meta, self.group, self.ref = ctx, meta, group, ref
        self.parts, self.cid, self.deadline = parts, cid, deadline
        self.table = _relay.table(ctx)
        self.follower: Optional[Tuple[int, int]] = None
        self.known = threading.Event()  # set once the producer said whom we forward to (or nobody)
        self.sends: List[Any] = []
        self.forwarded = 0  # chunks posted to the follower
        self.forward_error: Optional[BaseException] = None

    def run(self, source: int, position: int, tag_base: int) -> None:
        producer, n = self.ref.rank, len(self.parts)
        head = source == producer  # only a chain's head is sent to after its "receives posted" message
        try:
            recvs = self._post(source, tag_base, 0)
        except (CollectiveTimeoutError, CommunicationError) as e:  # our source is already known to be gone
            if head:
                raise
            # The producer serves a resumed fetch at once (no GO), so none is sent below.
            recvs, source = self._resume(source, 0, e), producer
        extra: List[Any] = []
        if head and _control.waits_for_go("gloo", self.meta.nbytes):
            extra.append(self.group.backend.isend(torch.ones(1, dtype=torch.uint8), producer,
                                                  make_tag(TAG_OBJECT, tag_base + n)))
        poll = self.table.pollers().submit(self._ask_next, False)  # reused threads: nothing to start per fetch
        k = 0
        try:
            while k < n:
                # With a follower, forward chunk by chunk; until one is named, wake once per LOOKAHEAD chunks
                # (chunks from one peer complete in order); with none ever, once.
                upto = k if self.follower is not None else \
                    n - 1 if self.known.is_set() else min(k + _relay.LOOKAHEAD - 1, n - 1)
                try:
                    for j in (upto, *range(k, upto)):
                        recvs[j].wait(self._chunk_wait(source, position))
                except (CollectiveTimeoutError, CommunicationError) as e:
                    if source == producer:
                        raise
                    recvs = self._resume(source, k, e)
                    source = producer
                    continue
                k = upto + 1
                self._forward(k)
        finally:
            if not self.known.is_set():  # done (or failed): nobody may join behind us any more (authoritative)
                self._ask_next(final=True)
        self._forward(n)
        futures_wait([poll], timeout=max(self.deadline - time.monotonic(), 0.0))
        for w in extra:
            w.wait(max(self.deadline - time.monotonic(), 1e-3))
        self._finish_forwards()

    def _post(self, source: int, tag_base: int, first: int) -> Dict[int, Any]:
        return {k: self.group.backend.irecv(self.parts[k], source, make_tag(TAG_OBJECT, tag_base + k))
                for k in range(first, len(self.parts))}

    def _chunk_wait(self, source: int, position: int) -> float:
        """How long to wait for the next chunk: the whole deadline from the producer; from a relay, a stall timeout
        that grows with our position (the first member behind a stalled one gives up first)."""
        left = max(self.deadline - time.monotonic(), 1e-3)
        if source == self.ref.rank:
            return left
        return min(left, self.ctx.config.relay_stall_timeout * max(position, 1))

    def _resume(self, relay: int, k: int, cause: BaseException) -> Dict[int, Any]:
        """Our source ``relay`` failed at chunk ``k``: ask the producer for chunks k.. directly."""
        group, meta, producer = self.group, self.meta, self.ref.rank
        self.table.add("fallbacks")
        logger.warning("rdt: group=%s rank=%d: relay rank %d failed at chunk %d/%d of object %s (%s); asking the "
                       "producer (rank %d) for the rest", group.name, group.rank, relay, k, len(self.parts),
                       meta.id_hex, cause, producer)
        where = (f"{meta.describe()} in group {group.name!r}: relay rank {relay} failed at chunk {k} ({cause}), and "
                 f"asking the producer (rank {producer}) for the rest")
        tag_base = self.ctx.next_tags(group.uid, len(self.parts) + 1)
        payload = (meta.obj_id + bytes.fromhex(group.uid)
                   + struct.pack("!IIIBI", group.rank, tag_base, _wait_ms(self.deadline), FLAG_RESUME, k))
        try:
            control_request(self.ctx, meta, _control.REQ_FETCH_GROUP, _control.KEY_GROUP,
                            group.backend.config.secret, payload, max(self.deadline - time.monotonic(), 1e-3))
            return self._post(producer, tag_base, k)
        except Exception as e:  # noqa: BLE001 - typed: the dead relay, the producer and the object are named
            # Our side of the group is broken now (a stall timeout makes Gloo close this rank's connections).
            group._mark_errored(CommunicationError(
                f"relay rank {relay} failed while forwarding object {meta.id_hex[:16]}: {cause}", group=group.name,
                rank=group.rank, peer=relay, op="object relay", object_id=meta.id_hex,
                hint="a member died or stalled; destroy the group on every member and create it again"))
            if isinstance(e, TimeoutError):
                raise TimeoutError(f"{where} timed out: {e}") from e
            raise ObjectFetchError(f"{where} failed: {type(e).__name__}: {e}", object_id=meta.id_hex,
                                   hint="destroy the group and re-form it with live members") from e

    def _ask_next(self, final: bool) -> None:
        """Ask the producer whom we forward to: held there until it knows (``final``: we are done receiving)."""
        group, meta = self.group, self.meta
        payload = (meta.obj_id + bytes.fromhex(group.uid)
                   + struct.pack(_relay.NEXT_REQUEST, group.rank, self.cid, _wait_ms(self.deadline), final))
        try:
            reply = control_request(self.ctx, meta, _control.REQ_RELAY_NEXT, _control.KEY_GROUP,
                                    group.backend.config.secret, payload, max(self.deadline - time.monotonic(), 1e-3))
            rank, tags = struct.unpack(_relay.NEXT_REPLY, reply)
        except Exception as e:  # noqa: BLE001 - without an answer we forward to nobody; a follower falls back
            logger.debug("rdt: asking whom to forward %s to failed: %s", meta.id_hex, e)
            rank, tags = -1, 0
        if not self.known.is_set():
            if rank >= 0:
                self.follower = (rank, tags)
            self.known.set()

    def _forward(self, upto: int) -> None:
        """Post the sends of chunks received so far (< ``upto``) to our follower, once one is known."""
        if not self.known.is_set() or self.follower is None or self.forward_error is not None:
            return
        rank, tags = self.follower
        try:
            while self.forwarded < upto:
                k = self.forwarded
                self.sends.append(self.group.backend.isend(self.parts[k], rank, make_tag(TAG_OBJECT, tags + k)))
                self.table.add("relayed_bytes", self.parts[k].numel())
                self.forwarded += 1
        except Exception as e:  # noqa: BLE001 - the follower falls back to the producer on its own
            self._forward_failed(e)

    def _finish_forwards(self) -> None:
        """Our buffers are the caller's once we return: wait for every forward to leave them (bounded)."""
        for w in self.sends:
            if self.forward_error is not None:
                break
            try:
                w.wait(max(self.deadline - time.monotonic(), 1e-3))
            except Exception as e:  # noqa: BLE001
                self._forward_failed(e)
        self.sends = []

    def _forward_failed(self, e: BaseException) -> None:
        self.forward_error = e
        self.table.add("forward_failures")
        rank = self.follower[0] if self.follower is not None else -1
        logger.warning("rdt: group=%s rank=%d: forwarding object %s to rank %d failed: %s", self.group.name,
                       self.group.rank, self.meta.id_hex, rank, e)
        if not isinstance(e, TimeoutError):
            return  # the follower died: our connections to the others are fine (as for a producer's consumer)
        self.group._mark_errored(CommunicationError(
            f"forwarding object {self.meta.id_hex[:16]} to rank {rank} failed: {e}", group=self.group.name,
            rank=self.group.rank, peer=rank, op="object relay", object_id=self.meta.id_hex,
            hint="the next consumer died or stalled; destroy the group on every member and create it again"))


def _wait_watching_producer(ctx: Any, meta: ObjectMeta, works: List[Any], deadline: float) -> None:
    """Wait for posted receives while checking, every half second, that the producer still lives.

    A two-sided receive does not notice a sender that dies mid-message (TCP may stay half-open), so without
    this the consumer would sit out the whole transfer timeout.
    """
    def wait_all() -> None:
        for w in works:
            w.wait(max(deadline - time.monotonic(), 1e-3))

    _watching_producer(ctx, meta, wait_all)


def _watching_producer(ctx: Any, meta: ObjectMeta, receive: Callable[[], None]) -> None:
    """Run ``receive`` (bounded by the fetch's deadline) on a waiter thread, checking every half second that the
    producer lives: ProducerDiedError at once when it is gone, whatever the receive is blocked on."""
    future = ctx.waiters.submit(receive)
    while not futures_wait([future], timeout=0.5).done:
        if not producer_alive(ctx, meta, ping_timeout=0.5):
            raise died(meta, ConnectionError("the producer died during the transfer"))
    future.result()
