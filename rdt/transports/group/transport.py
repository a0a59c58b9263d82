"""Objects over a collective group (Gloo, NCCL, UCX): the consumer asks, the producer posts sends, bytes move on
the group's own backend between two members.

Fetch: the consumer picks tags, asks the producer's control server (authenticated with the group's secret) to post
the sends, posts its receives and waits while watching that the producer lives. Serve: the producer posts one send
per buffer on its control thread and lets a waiter finish them, so the actor's task queue is never involved. From
``protocol.GO_MIN_BYTES`` on, a Gloo producer sends only once the consumer says its receives are posted (the
producer's side is in ``serve``).

Fan-out (gloo, objects from ``relay_min_bytes``): consumers that ask while another is still receiving are chained
behind it and the bytes travel in chunks, each member forwarding what it got (``relay``); a member whose source
dies or stalls asks the producer directly for the chunks it misses.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from concurrent.futures import wait as futures_wait
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from rdt_transports.errors import CollectiveTimeoutError, CommunicationError
from rdt_transports.group import TAG_OBJECT, make_tag

from ..._control import wire as _control
from ..._control.peer import control_request, died, producer_alive
from ..._objects.meta import GroupRef, ObjectMeta
from ...errors import NoCollectiveGroupError, ObjectFetchError
from ..base import Capabilities, Fetched, Served, Site, Transport, Unusable
from ..receive import block_views, landing, padded_offsets
from . import relay as _relay
from .protocol import (FLAG_PACKED, FLAG_RELAY, FLAG_RESUME, REQ_FETCH_GROUP, REQ_RELAY_NEXT, message_sizes,
                       messages, waits_for_go)
from .serve import serve_fetch_group, serve_relay_next

logger = logging.getLogger("rdt")

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
        return {REQ_FETCH_GROUP: (serve_fetch_group, (_control.KEY_GROUP,)),
                REQ_RELAY_NEXT: (serve_relay_next, (_control.KEY_GROUP,))}

    def release(self, ctx: Any, entry: Any) -> None:
        state = ctx.peek_transport_state("gloo")
        if state is not None:
            state.forget(entry.obj_id)


class GlooTransport(_GroupTransport):
    capabilities = Capabilities(name="gloo", devices=frozenset({"cpu"}), group_backend="gloo", receive_into=True,
                                serves_from_holder=True, auto_priority=20)

    def stats(self, ctx: Any) -> Dict[str, Any]:
        """Fan-out over groups: bytes served as producer and forwarded as relay, live chains (see ``relay``)."""
        state = ctx.peek_transport_state(self.name)
        return {"relay": state.snapshot() if state is not None else dict(_relay.EMPTY_STATS)}


class NcclTransport(_GroupTransport):
    capabilities = Capabilities(name="nccl", devices=frozenset({"cuda"}), group_backend="nccl", receive_into=True,
                                auto_priority=40)


class UcxTransport(_GroupTransport):
    capabilities = Capabilities(name="ucx", devices=frozenset({"cpu", "cuda"}), group_backend="ucx",
                                receive_into=True, auto_priority=25, explicit=False)


# ------------------------------------------------------------------------------------------------ consumer
def _fetch_group(ctx: Any, meta: ObjectMeta, group: Any, ref: GroupRef, site: Site,
                 deadline: float) -> Sequence[torch.Tensor]:
    n = len(meta.buffers)
    sizes = meta.buffers.sizes
    relay = _relay_wanted(ctx, meta, group)
    nchunks = len(_relay.chunks(message_sizes(sizes))) if relay else 0
    # One tag per buffer (or relayed chunk), and one for the "receives posted" message
    tag_base = ctx.next_tags(group.uid, max(n, nchunks) + 1)
    wait_ms = _wait_ms(deadline)  # the producer waits as long as we do: time left, relative (clocks differ)
    device = site.cuda_device if site.cuda_device is not None and "cuda" in meta.buffers.device_types \
        else torch.device("cpu")
    # Without targets, CPU buffers land in one block and small ones travel packed (one message per run).
    packed = not site.into and len(sizes) > 1 and meta.buffers.device_types == {"cpu"}
    flags = (FLAG_PACKED if packed else 0) | (FLAG_RELAY if relay else 0)
    payload = meta.obj_id + bytes.fromhex(group.uid) + struct.pack("!IIIB", group.rank, tag_base, wait_ms, flags)
    reply = control_request(ctx, meta, REQ_FETCH_GROUP, _control.KEY_GROUP, group.backend.config.secret,
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
        if waits_for_go(group.backend_name, meta.nbytes):  # the producer sends once our receives are posted
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
        if head and waits_for_go("gloo", self.meta.nbytes):
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
            control_request(self.ctx, meta, REQ_FETCH_GROUP, _control.KEY_GROUP,
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
            reply = control_request(self.ctx, meta, REQ_RELAY_NEXT, _control.KEY_GROUP,
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
