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

import functools
import logging
import struct
import threading
import time
from collections import deque
from concurrent.futures import wait as futures_wait
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from rdt_transports._memcopy import copy_parts
from rdt_transports.errors import CollectiveTimeoutError, CommunicationError
from rdt_transports.group import TAG_OBJECT, make_tag

from ..._control import wire as _control
from ..._control.peer import control_request, died, producer_alive
from ..._objects.meta import GroupRef, ObjectMeta
from ...errors import NoCollectiveGroupError, ObjectFetchError
from ..base import Capabilities, Fetched, Ranges, Served, Site, Transport, Unusable
from ..receive import block_views, fresh_bytes, landing, padded_offsets
from . import ranges as _ranges, relay as _relay
from .protocol import (FLAG_PACKED, FLAG_RELAY, FLAG_RESUME, REQ_FETCH_GROUP, REQ_FETCH_RANGES, REQ_RELAY_NEXT,
                       message_sizes, messages, waits_for_go)
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



# The cost of one more range and one more byte of a sharded load's range read here (exact runs vs covering reads),
# measured by rdt-bench's sharded-sync calibration on the 2-core reference machine (2026-11-27, the median of three
# runs with large runs sent without a copy).
RANGE_RUN_S = 0.6e-6
RANGE_BYTES_PER_S = 2.4e9

class GlooTransport(_GroupTransport):
    capabilities = Capabilities(name="gloo", devices=frozenset({"cpu"}), group_backend="gloo", receive_into=True,
                                serves_from_holder=True, auto_priority=20, range_run_s=RANGE_RUN_S,
                                range_bytes_per_s=RANGE_BYTES_PER_S)

    def read_ranges(self, ctx: Any, meta: ObjectMeta, ranges: Ranges, site: Site,
                    deadline: float) -> Optional[str]:
        """The ranges streamed packed by the producer (see ``ranges``) over the common gloo group; None for an
        object or targets not all on the CPU, or a plan too large for one control frame."""
        if meta.buffers.device_types != {"cpu"} or any(t.device.type != "cpu" for t in ranges.targets):
            return None
        group, ref = site.groups[self.name]
        return _ranges.read_ranges(ctx, meta, group, ref, ranges, deadline, _watching_producer, _receive_failed)

    def handlers(self) -> Dict[int, Served]:
        return {**super().handlers(), REQ_FETCH_RANGES: (_ranges.serve_fetch_ranges, (_control.KEY_GROUP,))}

    def stats(self, ctx: Any) -> Dict[str, Any]:
        """Fan-out over groups: bytes served as producer and forwarded as relay, live chains (see ``relay``); range
        fetches served and received, cached plans and staging (see ``ranges``)."""
        state = ctx.peek_transport_state(self.name)
        ranges = ctx.peek_transport_state("gloo-ranges")
        return {"relay": state.snapshot() if state is not None else dict(_relay.EMPTY_STATS),
                "gloo_ranges": ranges.snapshot() if ranges is not None else dict(_ranges.EMPTY_STATS)}


class NcclTransport(_GroupTransport):
    capabilities = Capabilities(name="nccl", devices=frozenset({"cuda"}), group_backend="nccl", receive_into=True,
                                auto_priority=40)

    def read_ranges(self, ctx: Any, meta: ObjectMeta, ranges: Ranges, site: Site,
                    deadline: float) -> Optional[str]:
        """The gloo ranges protocol over the common NCCL group (``ranges``: small runs packed on the producer's
        device, large ones sent straight from the shard into the target); None unless the object and the targets
        are on GPUs."""
        if meta.buffers.device_types != {"cuda"} or ranges.device.type != "cuda":
            return None
        group, ref = site.groups[self.name]
        return _ranges.read_ranges(ctx, meta, group, ref, ranges, deadline, _watching_producer, _receive_failed)

    def handlers(self) -> Dict[int, Served]:
        return {**super().handlers(), REQ_FETCH_RANGES: (_ranges.serve_fetch_ranges, (_control.KEY_GROUP,))}


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
        _wait_watching_producer(ctx, meta, works, deadline, [t for t in site.into if t is not None], bufs)
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
    """Whether to offer the producer to chain this fetch (gloo, CPU, large enough, relaying not switched off, and
    not too many receives from stalled relays parked here already)."""
    return (ctx.config.relay and group.backend_name == "gloo" and meta.buffers.device_types == {"cpu"}
            and meta.nbytes >= max(ctx.config.relay_min_bytes, 1) and _relay.table(ctx).parked < _relay.PARK_MAX)


def _fetch_chained(ctx: Any, meta: ObjectMeta, group: Any, ref: GroupRef, site: Site, deadline: float,
                   reply: bytes, tag_base: int) -> Sequence[torch.Tensor]:
    """Receive the object's chunks from the source the producer named, forwarding each to our follower as soon as
    it arrived (see :class:`_ChainLanding` for where they land)."""
    mode, source, position, cid = struct.unpack(_relay.REPLY, reply)
    if mode != _relay.MODE_RELAY:
        raise ObjectFetchError(f"the producer of {meta.describe()} answered with an unknown relay mode {mode}",
                               object_id=meta.id_hex)
    landing_ = _ChainLanding(ctx, site, meta.buffers.sizes)
    receive = _RelayReceive(ctx, meta, group, ref, landing_, cid, deadline)
    _watching_producer(ctx, meta, lambda: receive.run(source, position, tag_base),
                       [t for t in site.into if t is not None], landing_)
    return landing_.result()


class _ChainLanding:
    """Where a chained fetch's chunks land.

    A receive posted to a relay that stalls cannot be cancelled and may land whenever that relay goes on, so no
    such receive is ever posted into memory the caller gets.

    With ``rdt.get(into=...)`` every member lands in the caller's targets, as a plain fetch does (packed runs of
    small buffers in staging, copied at the end): chunks from the producer straight in, chunks from a relay through
    a few pooled bounce slots (:meth:`bounce_slots`, :class:`_Phase`), each copied in as it arrives while the fetch
    still waits for it. Receives left posted to a stalled relay stay parked with their slots, never the targets,
    and the rest comes from the producer straight into the targets; the extra memory is the slots, not a copy of
    the object. Without targets the chunks land in one pooled block, which is the result; a member leaving a
    stalled relay parks the receives with that block and moves on to a fresh one (:meth:`move`).
    """

    def __init__(self, ctx: Any, site: Site, sizes: List[int]) -> None:
        self.ctx, self.site, self.sizes = ctx, site, sizes
        self.msgs = messages(sizes)
        self.block: Optional[Any] = None  # BlockViews, unless we land in the caller's targets
        self.bufs: List[torch.Tensor] = []
        self.scatter: List[Tuple[torch.Tensor, int, int]] = []  # (staging, first, last buffer) of packed runs
        self.in_place = bool(site.into)
        if self.in_place:
            offsets, _ = padded_offsets(sizes)
            self.bufs = [landing(ctx, site, i, nb) for i, nb in enumerate(sizes)]
            views = []
            for first, last in self.msgs:
                if first == last:
                    views.append(self.bufs[first])
                else:
                    staging = ctx.buffers.empty(offsets[last] + sizes[last] - offsets[first])
                    views.append(staging)
                    self.scatter.append((staging, first, last))
            self.parts = _relay.split(views)
        else:
            self.parts = self._fresh()

    def _fresh(self) -> List[torch.Tensor]:
        self.block = block_views(self.ctx, self.sizes)
        return _relay.split([self.block.span(a, b) for a, b in self.msgs])

    def keep(self) -> Any:
        """What the receives posted now land in (held while they may still land)."""
        return self.block if self.block is not None else (self.bufs, self.scatter)

    def bounce_slots(self, first: int) -> Optional[List[torch.Tensor]]:
        """Pooled slots (each the size of the largest chunk from ``first`` on) that receives of chunks ``first``..
        from a relay land in before they are copied to :attr:`parts`; None: they land in :attr:`parts` itself (a
        block of ours, not the caller's targets)."""
        if not self.in_place or first >= len(self.parts):
            return None
        size = max(p.numel() for p in self.parts[first:])
        count = min(_relay.BOUNCE_SLOTS, len(self.parts) - first)
        return [fresh_bytes(self.ctx, max(size, 1), torch.device("cpu")) for _ in range(count)]

    def move(self, upto: int) -> None:
        """Land chunks ``upto``.. in a fresh block (the current one stays with receives that may still land
        there); chunks before ``upto`` are copied over. Landing in the caller's targets, nothing moves: receives
        from a relay never land there, only in their phase's bounce slots."""
        if self.in_place:
            return
        old = self.parts
        self.parts = self._fresh()
        copy_parts([(new.data_ptr(), was.data_ptr(), was.numel()) for new, was in zip(self.parts[:upto], old)])

    def result(self) -> Sequence[torch.Tensor]:
        """The fetched buffers, once every chunk is in: the caller's targets where it gave them (packed runs copied
        in from staging), else the block."""
        if self.block is not None:
            return self.block
        sizes, offsets = self.sizes, padded_offsets(self.sizes)[0]
        for staging, first, last in self.scatter:
            base = staging.data_ptr() - offsets[first]
            copy_parts([(self.bufs[k].data_ptr(), base + offsets[k], sizes[k]) for k in range(first, last + 1)
                        if sizes[k]])
        return self.bufs


class _Phase:
    """The receives of chunks ``first``.. from one source, waited on in order on a relay waiter thread (chunks
    from one peer land in order). The fetch only watches :attr:`landed`: it never gives Gloo a timeout of its
    own, since a Gloo receive that times out closes every connection of this rank (Gloo cannot cancel it).

    Receives from the producer wait until the fetch's deadline (a timeout then errors the group, as for a plain
    fetch). Receives from a relay wait until ``until``, well past it: when the relay stalls the fetch moves on
    and leaves them *parked* here, with the memory they land in, until the relay sends (it forwards what it owes
    once it goes on), dies or the group is aborted; only a relay stalled past ``until`` breaks the group.

    Without ``slots`` every receive is posted at once, into ``parts`` (held by ``keep``). With ``slots`` (a relay
    feeding the caller's targets) one receive per slot is posted at a time: a chunk that arrived is copied from
    its slot into ``parts`` under the fetch's lock unless the phase was parked, and the slot takes the receive of
    the chunk ``len(slots)`` further on. A parked phase lets go of ``parts`` and goes on receiving into its slots
    alone, so the relay's forwards all end (Gloo sends a message only once its receive is posted) and its late
    bytes land nowhere the caller sees.
    """

    def __init__(self, source: int, first: int, parts: List[torch.Tensor],
                 post: Callable[[int, torch.Tensor], Any], keep: Any, until: float, cond: threading.Condition,
                 slots: Optional[List[torch.Tensor]] = None) -> None:
        self.source = source
        self.landed = first  # every chunk before this one is in ``parts``
        self.error: Optional[BaseException] = None
        self.done = False  # the waiter ended: nothing more will land
        self.parked = False  # the fetch moved on while receives were still posted
        self._first = first
        self._parts: Optional[List[torch.Tensor]] = parts  # None once parked, when bouncing
        self._sizes = [p.numel() for p in parts]
        self._post = post
        self._slots = slots
        self._keep = keep if slots is None else slots  # what the posted receives land in
        self._until = until
        self._cond = cond
        ahead = len(parts) - first if slots is None else len(slots)
        self._works: Optional["deque[Any]"] = deque(post(k, self._dest(k)) for k in range(first, first + ahead))

    def _dest(self, k: int) -> torch.Tensor:
        """Where chunk ``k``'s receive lands: its part, or (bouncing) the front of its slot."""
        if self._slots is None:
            return self._parts[k]  # type: ignore[index]
        return self._slots[(k - self._first) % len(self._slots)][:self._sizes[k]]

    def wait(self, on_parked_end: Callable[["_Phase"], None]) -> None:
        """(waiter thread) Wait for each receive in turn (bouncing: copy it in, post the slot's next one); then
        drop the receives and their memory."""
        slots = self._slots
        try:
            k = self._first
            while self._works:
                self._works.popleft().wait(max(self._until - time.monotonic(), 1e-3))
                with self._cond:
                    if slots is None:
                        self.landed += 1
                    elif self._parts is not None:  # not parked: the caller still waits for these bytes
                        src = self._dest(k)
                        copy_parts([(self._parts[k].data_ptr(), src.data_ptr(), src.numel())])
                        self.landed += 1
                    self._cond.notify_all()
                if slots is not None and k + len(slots) < len(self._sizes):
                    self._works.append(self._post(k + len(slots), self._dest(k + len(slots))))
                k += 1
        except Exception as e:  # noqa: BLE001 - the fetch reads it (or, parked, on_parked_end)
            with self._cond:
                self.error = _without_frames(e)
        finally:
            with self._cond:
                self.done = True
                parked = self.parked
                self._works = self._keep = self._parts = self._slots = None
                self._cond.notify_all()
            if parked:
                on_parked_end(self)

    def park(self) -> bool:
        """Leave the receives still posted to the waiter (False: none is, nothing to park); bouncing, nothing of
        the caller's is written or held from now on."""
        with self._cond:
            if self.done:
                return False
            self.parked = True
            if self._slots is not None:
                self._parts = None
            return True


def _without_frames(e: BaseException) -> BaseException:
    """``e`` (and its causes) without tracebacks: a stored error's frames would keep this fetch, its object's
    metadata and so the object itself alive until a GC pass (a reference cycle through the waiting frame)."""
    seen: Optional[BaseException] = e
    while seen is not None:
        seen.__traceback__ = None
        seen = seen.__cause__ or seen.__context__
    return e


def _parked_end(table: _relay.RelayTable, group: Any, obj_hex: str, past_s: float, phase: _Phase) -> None:
    """(waiter thread) Parked receives ended: their memory goes back to the pool. A Gloo timeout (the relay
    stalled ``past_s`` past the fetch's deadline) closed this rank's connections: the group is broken here, say
    so. Holds nothing of the fetch but these (not its metadata: the object is freed when its refs die)."""
    table.add("parked", -1)
    if isinstance(phase.error, CollectiveTimeoutError):
        group._mark_errored(CommunicationError(
            f"relay rank {phase.source} stalled for over {past_s:.0f}s past the deadline of object "
            f"{obj_hex[:16]}: receives this rank had posted to it timed out, which closed this rank's connections",
            group=group.name, rank=group.rank, peer=phase.source, op="object relay", object_id=obj_hex,
            hint="a member is stuck; destroy the group on every member and create it again"))


class _RelayReceive:
    """One chained fetch: receive every chunk (from the producer or the member before us), forward each to our
    follower once the producer named one, and fall back to the producer when our source fails or stalls."""

    def __init__(self, ctx: Any, meta: ObjectMeta, group: Any, ref: GroupRef, landing_: _ChainLanding, cid: int,
                 deadline: float) -> None:
        self.ctx, self.meta, self.group, self.ref = ctx, meta, group, ref
        self.landing, self.cid, self.deadline = landing_, cid, deadline
        # Receives from a relay wait this long at most (in Gloo, parked or not): past our deadline by our whole
        # timeout (a relay never sends past its own deadline, unless it is stopped past it), and a minute at least.
        self.park_until = deadline + max(deadline - time.monotonic(), _relay.PARK_MIN_S)
        self.table = _relay.table(ctx)
        self.cond = threading.Condition()  # a chunk landed, a phase ended, or the follower became known
        self.follower: Optional[Tuple[int, int]] = None
        self.known = threading.Event()  # set once the producer said whom we forward to (or nobody)
        self.sends: List[Any] = []
        self.forwarded = 0  # chunks posted to the follower
        self.forward_error: Optional[BaseException] = None

    @property
    def parts(self) -> List[torch.Tensor]:
        return self.landing.parts

    def run(self, source: int, position: int, tag_base: int) -> None:
        producer, n = self.ref.rank, len(self.parts)
        head = source == producer  # only a chain's head is sent to after its "receives posted" message
        try:
            phase = self._phase(source, tag_base, 0)
        except (CollectiveTimeoutError, CommunicationError) as e:  # our source is already known to be gone
            if head:
                raise
            # The producer serves a resumed fetch at once (no GO), so none is sent below.
            phase = self._resume(source, 0, f"{type(e).__name__}: {e}", broken=True)
        extra: List[Any] = []
        if head and waits_for_go("gloo", self.meta.nbytes):
            extra.append(self.group.backend.isend(torch.ones(1, dtype=torch.uint8), producer,
                                                  make_tag(TAG_OBJECT, tag_base + n)))
        poll = self.table.pollers().submit(self._ask_next, False)  # reused threads: nothing to start per fetch
        try:
            self._receive(phase, max(position, 1))
        finally:
            if not self.known.is_set():  # done (or failed): nobody may join behind us any more (authoritative)
                self._ask_next(final=True)
        self._forward(n)
        futures_wait([poll], timeout=max(self.deadline - time.monotonic(), 0.0))
        for w in extra:
            w.wait(max(self.deadline - time.monotonic(), 1e-3))
        self._finish_forwards()

    def _phase(self, source: int, tag_base: int, first: int) -> _Phase:
        """Post the receives of chunks ``first``.. from ``source`` and start waiting for them (from a relay into
        the caller's targets: through bounce slots, see :class:`_ChainLanding`)."""
        backend = self.group.backend

        def post(k: int, buf: torch.Tensor) -> Any:
            return backend.irecv(buf, source, make_tag(TAG_OBJECT, tag_base + k))

        relay = source != self.ref.rank
        slots = self.landing.bounce_slots(first) if relay else None
        phase = _Phase(source, first, self.parts, post, self.landing.keep(), self.park_until if relay else
                       self.deadline, self.cond, slots)
        self.table.waiters().submit(phase.wait, functools.partial(
            _parked_end, self.table, self.group, self.meta.id_hex, self.park_until - self.deadline))
        return phase

    def _receive(self, phase: _Phase, position: int) -> None:
        """Wait for every chunk, forwarding each as soon as it landed. A relay that fails, sends nothing for the
        stall timeout times our ``position`` in the chain (the first member behind a stalled one gives up first),
        or is still sending at our deadline is left: its receives are parked and the producer is asked for the
        rest (at the deadline, a timeout)."""
        n, producer = len(self.parts), self.ref.rank
        stall = self.ctx.config.relay_stall_timeout * position
        k, last = 0, time.monotonic()
        while True:
            with self.cond:
                now = time.monotonic()
                limit = 1.0 if phase.source == producer else max(min(last + stall, self.deadline) - now, 0.0)
                self.cond.wait_for(lambda: phase.landed > k or phase.done or self._unforwarded(k),
                                   timeout=min(limit, 1.0))
                landed, error = phase.landed, phase.error
            if landed > k:
                k, last = landed, time.monotonic()
            self._forward(k)
            if k >= n:
                return
            if phase.source == producer:
                if error is not None:
                    raise error  # the producer's receives wait in Gloo until our deadline, as a plain fetch's do
                continue
            now = time.monotonic()
            if error is not None:
                phase = self._resume(phase.source, k, f"{type(error).__name__}: {error}",
                                     broken=isinstance(error, CommunicationError))
            elif now >= self.deadline:
                self._park(phase, k, "it was still sending at the fetch's deadline")
                raise TimeoutError(f"{self.meta.describe()} in group {self.group.name!r}: relay rank "
                                   f"{phase.source} had sent {k} of {n} chunks at the fetch's deadline")
            elif now - last >= stall:
                self._park(phase, k, f"it sent nothing for {now - last:.1f}s")
                phase = self._resume(phase.source, k, f"it stalled: nothing for {now - last:.1f}s", broken=False)
            else:
                continue
            last = time.monotonic()

    def _unforwarded(self, k: int) -> bool:
        """Whether chunks that landed wait for a follower that became known meanwhile."""
        return self.follower is not None and self.forwarded < k and self.forward_error is None

    def _park(self, phase: _Phase, k: int, why: str) -> None:
        """Leave ``phase``'s receives posted (they cannot be cancelled) with the memory they land in."""
        if not phase.park():
            return
        self.table.add("parked")
        logger.warning("rdt: group=%s rank=%d: left relay rank %d at chunk %d/%d of object %s (%s); its %d "
                       "receives stay posted until it sends, dies or the group goes", self.group.name,
                       self.group.rank, phase.source, k, len(self.parts), self.meta.id_hex, why,
                       len(self.parts) - k)

    def _resume(self, relay: int, k: int, cause: str, broken: bool) -> _Phase:
        """Our source ``relay`` failed or stalled at chunk ``k``: ask the producer for chunks k.. directly, landing
        in the caller's targets or a fresh block (what we posted to the relay may still land in its bounce slots or
        the old block, which the caller never gets).
        ``broken``: its connection failed (it died), so our view of the group is ERRORED if the producer cannot
        be asked either."""
        group, meta, producer = self.group, self.meta, self.ref.rank
        self.table.add("fallbacks")
        self.landing.move(k)
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
        except Exception as e:  # noqa: BLE001 - typed: the failed relay, the producer and the object are named
            if broken:
                group._mark_errored(CommunicationError(
                    f"relay rank {relay} failed while forwarding object {meta.id_hex[:16]}: {cause}",
                    group=group.name, rank=group.rank, peer=relay, op="object relay", object_id=meta.id_hex,
                    hint="a member died; destroy the group on every member and create it again"))
            if isinstance(e, TimeoutError):
                raise TimeoutError(f"{where} timed out: {e}") from e
            raise ObjectFetchError(f"{where} failed: {type(e).__name__}: {e}", object_id=meta.id_hex,
                                   hint="destroy the group and re-form it with live members") from e
        return self._phase(producer, tag_base, k)

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
        with self.cond:
            if not self.known.is_set():
                if rank >= 0:
                    self.follower = (rank, tags)
                self.known.set()
                self.cond.notify_all()

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


def _wait_watching_producer(ctx: Any, meta: ObjectMeta, works: List[Any], deadline: float,
                            targets: Sequence[torch.Tensor] = (), keep: Any = None) -> None:
    """Wait for posted receives while checking, every half second, that the producer still lives.

    A two-sided receive does not notice a sender that dies mid-message (TCP may stay half-open), so without
    this the consumer would sit out the whole transfer timeout.
    """
    def wait_all() -> None:
        for w in works:
            w.wait(max(deadline - time.monotonic(), 1e-3))

    _watching_producer(ctx, meta, wait_all, targets, keep)


def _watching_producer(ctx: Any, meta: ObjectMeta, receive: Callable[[], None],
                       targets: Sequence[torch.Tensor] = (), keep: Any = None) -> None:
    """Run ``receive`` (bounded by the fetch's deadline) on a waiter thread, checking every half second that the
    producer lives: ProducerDiedError at once when it is gone, whatever the receive is blocked on.

    A posted receive cannot be taken back: when this raises before ``receive`` ended (the producer was declared
    dead, or an interrupt), the caller's ``targets`` stay marked busy, and ``keep`` (the pooled buffers it lands
    in) alive, until it ends, at the latest at the fetch's deadline."""
    future = ctx.waiters.submit(receive)
    try:
        while not futures_wait([future], timeout=0.5).done:
            if not producer_alive(ctx, meta, ping_timeout=0.5):
                raise died(meta, ConnectionError("the producer died during the transfer"))
    except BaseException:
        if not future.done():
            hold = ctx.busy_targets.mark(list(targets), f"a receive of {meta.describe()} still posted in its group")
            kept = (keep, [t.untyped_storage() for t in targets])  # the memory stays even if param.data is swapped
            future.add_done_callback(lambda _f, kept=kept: ctx.busy_targets.clear(hold))
        raise
    future.result()
