"""Byte ranges of an object served over a gloo group: sharded weight sync's path over gloo.

The consumer sends its range list once per (group, consumer rank, plan key); the producer keeps it in a bounded
cache and, on every later request that names the key, streams exactly those bytes in messages of at most
:data:`CHUNK` bytes. A run of :data:`DIRECT_MIN` bytes or more travels in messages of its own, sent straight from
the producer's buffer and received straight into the consumer's target (no copy on either side); the small runs
between them are packed, gathered through at most :data:`SLOTS` staging buffers per consumer, received into one of
:data:`SLOTS` pooled blocks and scattered to the ranges' local addresses. Both sides cut the byte stream into
messages from the plan alone, so no byte of framing travels.

A range list travels compressed: consecutive runs of one buffer and length at a constant stride (a row-parallel
slice: one run per row) are one row of :data:`ROW`. A plan is valid for any object of the group whose buffers
contain its ranges (checked on every request), so a consumer that loads a new version of the same layout names
the key only. A fetch abandoned by its caller (timeout, producer death) never copies into the targets afterwards:
a packed message is scattered only under the fetch's lock, and only while the caller still waits; the targets of
a direct receive still posted when the caller gave up are marked busy (``ctx.busy_targets``) until the receive
ended, so that the next fetch into them waits for it rather than being overwritten.

The same protocol runs over an NCCL group for GPU objects into GPU targets (``nccl-ranges``): the producer packs the
small runs on its device into at most :data:`SLOTS` staging buffers there and sends the large ones straight from the
shard; the consumer receives packed messages into device blocks and scatters them into the targets with device
copies, and the large runs straight into the targets. What differs is only how bytes are reached: by address in CPU
memory (:class:`_HostBytes`), or as tensor views with the copies of ``rdt._objects.device_runs`` on the loader's
stream (:class:`_TensorBytes`). :data:`TENSOR_VIEWS` makes CPU memory go through the latter too: how CPU CI runs the
NCCL path's code over gloo.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from rdt_transports import local_groups
from rdt_transports._memcopy import copy_parts
from rdt_transports.errors import CollectiveTimeoutError, CommunicationError
from rdt_transports.group import TAG_OBJECT, make_tag

from ..._control import wire as _control
from ..._control.peer import control_request
from ..._control.wire import err
from ..._objects import device_order, device_runs
from ..._objects.stream_ready import wait_ready
from ...errors import ObjectFetchError
from ..base import Ranges, TransportState
from .protocol import PACK_MAX, REQ_FETCH_RANGES
from .serve import send_failed

CHUNK = PACK_MAX  # bytes per message (the last may be shorter)
SLOTS = 2  # staging buffers per consumer on the producer, receive blocks per fetch on the consumer
DIRECT_MIN = 64 << 10  # a run this long travels in messages of its own, without a copy on either side
IN_FLIGHT = 8  # messages posted ahead, per fetch and per stream
ROW = struct.Struct("!IQQIQ")  # buffer, offset, length, count, stride: `count` runs at `offset + i * stride`
HEAD = struct.Struct("!III16s")  # consumer rank, tag base, wait ms, plan key (after obj_id(16) group_uid(16))
MAX_ROWS_BYTES = _control.MAX_FRAME - 4096  # a plan must fit one control frame (else: fetched whole)
NEED_PLAN = b"?"  # the producer's answer to a key it does not hold: send the rows
PLANS_MAX = 64  # plans a producer caches ...
PLANS_MAX_BYTES = 64 << 20  # ... and their expanded runs' bytes at most (40 bytes a run)
RUNS_MAX = 1 << 20  # runs one plan may expand to
SENT_MAX = 1024  # (producer, group, key) a consumer remembers having sent
TENSOR_VIEWS = False  # reach CPU bytes as tensor views too (tests: the NCCL path's code over gloo)
SERVED = {"gloo": frozenset({"cpu"}), "nccl": frozenset({"cuda"})}  # group backend -> the memory it serves ranges of


# ------------------------------------------------------------------------------------------------ both sides
@dataclass
class Plan:
    """Runs of one consumer's ranges, expanded: buffer, offset, length, and each run's place in the byte stream;
    and the stream's messages: where each starts and ends, and the run a direct message lies in (-1: packed)."""

    buf: np.ndarray
    off: np.ndarray
    n: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    total: int
    msg_lo: np.ndarray
    msg_hi: np.ndarray
    msg_run: np.ndarray

    @property
    def nbytes(self) -> int:
        """Memory the expanded plan holds."""
        return sum(a.nbytes for a in (self.buf, self.off, self.n, self.starts, self.ends, self.msg_lo, self.msg_hi,
                                      self.msg_run))

    @property
    def messages(self) -> int:
        return len(self.msg_lo)

    def message_bytes(self, m: int) -> int:
        return int(self.msg_hi[m] - self.msg_lo[m])

    def staging(self) -> Tuple[int, int]:
        """(bytes, count) of the buffers packed messages go through on either side: the largest packed message, at
        most SLOTS of them (none without packed messages)."""
        packed = self.msg_run < 0
        if not packed.any():
            return 0, 0
        return int((self.msg_hi - self.msg_lo)[packed].max()), min(SLOTS, int(packed.sum()))

    @property
    def direct_bytes(self) -> int:
        """Bytes of the stream that travel in direct messages (no copy on either side)."""
        return int((self.msg_hi - self.msg_lo)[self.msg_run >= 0].sum())

    def direct(self, m: int) -> Optional[Tuple[int, int]]:
        """A direct message's (run index, offset within the run); None for a packed one."""
        run = int(self.msg_run[m])
        return None if run < 0 else (run, int(self.msg_lo[m] - self.starts[run]))

    def pieces(self, m: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Message ``m``'s pieces: run index, offset within the run, offset within the message, length."""
        lo, hi = int(self.msg_lo[m]), int(self.msg_hi[m])
        i0 = int(np.searchsorted(self.ends, lo, side="right"))
        i1 = int(np.searchsorted(self.starts, hi, side="left"))
        idx = np.arange(i0, i1)
        a = np.maximum(self.starts[idx], lo)
        b = np.minimum(self.ends[idx], hi)
        return idx, a - self.starts[idx], a - lo, b - a


def encode(buf: np.ndarray, off: np.ndarray, n: np.ndarray) -> bytes:
    """The runs as rows of :data:`ROW` (constant-stride stretches of one buffer and length joined)."""
    buf, off, n = (np.asarray(a, np.int64) for a in (buf, off, n))
    k = len(n)
    if k == 0:
        return b""
    step = np.zeros(k, np.int64)
    step[1:] = off[1:] - off[:-1]
    same = np.zeros(k, bool)
    same[1:] = (buf[1:] == buf[:-1]) & (n[1:] == n[:-1])
    brk = ~same
    brk[2:] |= same[1:-1] & (step[2:] != step[1:-1])
    first = np.flatnonzero(brk)
    count = np.diff(np.append(first, k))
    stride = np.where(count > 1, step[np.minimum(first + 1, k - 1)], 0)
    rows = np.zeros(len(first), dtype=[("b", ">u4"), ("o", ">u8"), ("n", ">u8"), ("c", ">u4"), ("s", ">u8")])
    rows["b"], rows["o"], rows["n"], rows["c"], rows["s"] = buf[first], off[first], n[first], count, stride
    return rows.tobytes()


class RangesOutside(ValueError):
    """A plan names bytes outside the buffers it is served from."""


def outside(buf: np.ndarray, off: np.ndarray, n: np.ndarray, sizes: np.ndarray) -> Optional[str]:
    """Why runs reach past buffers of ``sizes`` bytes (None: each lies inside its buffer). Compared as
    ``off <= size - n``, never as a sum: an offset near 2**63 plus its length wraps negative in int64."""
    if not len(n):
        return None
    known = buf < len(sizes)
    size = np.zeros(len(n), np.int64)
    size[known] = sizes[buf[known]]
    bad = ~known | (off < 0) | (n < 0) | (off > size - n)
    if not bad.any():
        return None
    i = int(np.flatnonzero(bad)[0])
    where = f"buffer {int(buf[i])} of {len(sizes)}" if not known[i] else f"buffer {int(buf[i])} ({int(size[i])} bytes)"
    return (f"a range lies outside the object's buffers: run {i} ({int(n[i])} bytes at offset {int(off[i])} of "
            f"{where}), and {int(bad.sum()) - 1} more")


def decode(rows: bytes, sizes: Optional[np.ndarray] = None) -> Plan:
    """The plan of encoded rows; ValueError when they are malformed or expand to over RUNS_MAX runs, and
    :class:`RangesOutside` when ``sizes`` (the bytes of each buffer served from) are given and a run reaches past
    them (checked before the stream is cut into messages, whose count grows with the bytes named)."""
    if len(rows) % ROW.size:
        raise ValueError(f"{len(rows)} bytes of rows is not a multiple of {ROW.size}")
    r = np.frombuffer(rows, dtype=[("b", ">u4"), ("o", ">u8"), ("n", ">u8"), ("c", ">u4"), ("s", ">u8")])
    count = r["c"].astype(np.int64)
    if len(r) and (count.min() < 1 or int(count.sum()) > RUNS_MAX):
        raise ValueError("a row of no runs, or too many runs")
    first = np.concatenate(([0], np.cumsum(count)[:-1])).astype(np.int64)
    within = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(first, count)
    buf = np.repeat(r["b"].astype(np.int64), count)
    off = np.repeat(r["o"].astype(np.int64), count) + within * np.repeat(r["s"].astype(np.int64), count)
    n = np.repeat(r["n"].astype(np.int64), count)
    if len(n) and n.min() < 1:
        raise ValueError("a run of no bytes")
    if sizes is not None:
        why = outside(buf, off, n, sizes)
        if why is not None:
            raise RangesOutside(why)
    ends = np.cumsum(n)
    return Plan(buf, off, n, ends - n, ends, int(ends[-1]) if len(ends) else 0, *_messages(n, ends - n, ends))


def _messages(n: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The stream cut into messages of at most CHUNK bytes: every run of DIRECT_MIN bytes or more on its own (its
    messages direct), the runs between them packed; (first byte, end, direct run or -1) per message."""
    if not len(n):
        z = np.zeros(0, np.int64)
        return z, z, z
    big = n >= DIRECT_MIN
    first = np.flatnonzero(big | np.concatenate(([True], big[:-1])))  # each big run, each stretch of small ones
    lo = starts[first]
    hi = np.append(lo[1:], ends[-1])
    count = -(-(hi - lo) // CHUNK)
    at = np.repeat(lo, count) + (np.arange(int(count.sum()), dtype=np.int64)
                                 - np.repeat(np.cumsum(count) - count, count)) * CHUNK
    end = np.minimum(at + CHUNK, np.repeat(hi, count))
    run = np.repeat(np.where(big[first], first, -1), count)
    return at, end, run


def plan_key(rows: bytes) -> bytes:
    return hashlib.blake2b(rows, digest_size=16).digest()


class RangesState(TransportState):
    """Per process: the producer's cached plans (bounded, least recently used out first), the keys this consumer
    sent to which producer, and the counters ``rdt.stats()["gloo_ranges"]`` shows."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans: "OrderedDict[Tuple[str, int, bytes], Plan]" = OrderedDict()
        self._plans_bytes = 0
        self._sent: "OrderedDict[Tuple[str, str, bytes], None]" = OrderedDict()
        self.counters: Dict[str, int] = {
            "served": 0, "served_bytes": 0, "served_direct_bytes": 0, "plans_received": 0, "plans_asked": 0,
            "staging_bytes": 0, "staging_peak": 0, "staging_stream_peak": 0, "fetches": 0, "received_bytes": 0,
            "received_direct_bytes": 0, "receive_block_bytes": 0,
            # fetches and streams whose bytes were reached as tensor views (NCCL; gloo under TENSOR_VIEWS)
            "view_fetches": 0, "view_streams": 0}

    def plan(self, key: Tuple[str, int, bytes]) -> Optional[Plan]:
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
            return plan

    def keep(self, key: Tuple[str, int, bytes], plan: Plan) -> None:
        """Cache ``plan`` under ``key``, dropping the least recently used beyond the bounds."""
        with self._lock:
            old = self._plans.pop(key, None)
            self._plans_bytes -= old.nbytes if old is not None else 0
            self._plans[key] = plan
            self._plans_bytes += plan.nbytes
            while len(self._plans) > PLANS_MAX or self._plans_bytes > PLANS_MAX_BYTES:
                _, gone = self._plans.popitem(last=False)
                self._plans_bytes -= gone.nbytes

    def was_sent(self, key: Tuple[str, str, bytes]) -> bool:
        with self._lock:
            return key in self._sent

    def sent(self, key: Tuple[str, str, bytes], held: bool) -> None:
        """Remember (``held``) or forget that a producer holds a key."""
        with self._lock:
            if not held:
                self._sent.pop(key, None)
                return
            self._sent[key] = None
            self._sent.move_to_end(key)
            while len(self._sent) > SENT_MAX:
                self._sent.popitem(last=False)

    def add(self, counter: str, n: int = 1) -> None:
        with self._lock:
            self.counters[counter] += n
            if counter == "staging_bytes":
                self.counters["staging_peak"] = max(self.counters["staging_peak"], self.counters[counter])

    def peak(self, counter: str, n: int) -> None:
        with self._lock:
            self.counters[counter] = max(self.counters[counter], n)

    def snapshot(self) -> Dict[str, int]:
        with self._lock:
            return dict(self.counters, plans=len(self._plans), plans_bytes=self._plans_bytes)

    def close(self) -> None:
        with self._lock:
            self._plans.clear()
            self._plans_bytes = 0
            self._sent.clear()


EMPTY_STATS: Dict[str, int] = RangesState().snapshot()


def state(ctx: Any) -> RangesState:
    return ctx.transport_state("gloo-ranges", RangesState)


# ------------------------------------------------------------------------------------------------ consumer
class _Guard:
    """Whether the caller still waits: a packed message is scattered into the targets only under the lock while it
    does; a direct receive still posted when it gave up marks the targets busy until the receiving thread ended."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned = False
        self.direct = False  # a direct receive was posted
        self.ended = False  # the receiving thread ended: nothing it posted lands any more
        self.hold: Optional[int] = None
        self.storages: List[Any] = []  # the targets' memory, kept while a direct receive may still land in it

    def abandon(self, busy: Any, targets: Any, what: str) -> None:
        with self.lock:  # waits for a scatter in progress: none starts after this returns
            self.abandoned = True
            if self.direct and not self.ended and self.hold is None:
                self.hold = busy.mark(targets, what)
                self.storages = [t.untyped_storage() for t in targets]  # param.data swapped meanwhile: not freed

    def end(self, busy: Any) -> None:
        with self.lock:
            self.ended = True
            hold, self.hold = self.hold, None
            self.storages = []
        busy.clear(hold)


def _at(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` at ``address`` (memory a tensor the caller keeps alive owns)."""
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8)


class _HostBytes:
    """The consumer's ranges in CPU memory, by address: blocks from the receive pool, direct receives over the
    targets' bytes, packed messages scattered with ``copy_parts``."""

    def __init__(self, ctx: Any, ranges: Ranges) -> None:
        self.ctx = ctx
        self.dst = np.asarray(ranges.dst, dtype=np.uint64).astype(np.int64)

    def block(self, size: int) -> torch.Tensor:
        return self.ctx.buffers.empty(size)

    def direct(self, run: int, at: int, nbytes: int) -> torch.Tensor:
        return _at(int(self.dst[run]) + at, nbytes)

    def scatter(self, plan: "Plan", m: int, block: torch.Tensor) -> None:
        idx, run_at, msg_at, length = plan.pieces(m)
        base = block.data_ptr()
        copy_parts(list(zip((self.dst[idx] + run_at).tolist(), (msg_at + base).tolist(), length.tolist())))

    def done(self) -> None:
        pass


class _TensorBytes:
    """The consumer's ranges as tensor views of the targets (device memory; CPU memory under TENSOR_VIEWS): blocks
    on the targets' device, direct receives into views, packed messages scattered with device copies on the loader's
    stream, each finished before its block is received into again."""

    def __init__(self, ctx: Any, ranges: Ranges) -> None:
        self.device = ranges.device
        self.targets = [device_runs.flat(t) for t in ranges.targets]
        tgt, tgt_off = ranges.tgt, ranges.tgt_off
        if tgt is None:  # the road gave addresses only (CPU targets): find each range's target
            tgt, tgt_off = _owners(np.asarray(ranges.dst, np.uint64), self.targets)
        self.tgt, self.tgt_off = np.asarray(tgt, np.int64), np.asarray(tgt_off, np.int64)
        self.streams = device_order.current()
        self.stream = self.streams.stream(self.device)
        self.streams.wait_host(ranges.after)  # the caller's work queued on the targets before the load is done

    def block(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, device=self.device)

    def direct(self, run: int, at: int, nbytes: int) -> torch.Tensor:
        o = int(self.tgt_off[run]) + at
        return self.targets[int(self.tgt[run])][o:o + nbytes]

    def scatter(self, plan: "Plan", m: int, block: torch.Tensor) -> None:
        idx, run_at, msg_at, length = plan.pieces(m)
        copies = device_runs.batch(np.zeros(len(idx), np.int64), msg_at, self.tgt[idx], self.tgt_off[idx] + run_at,
                                   length)
        self.streams.run(self.stream, lambda: device_runs.apply(copies, [block], self.targets))
        self.streams.finish(self.stream)

    def done(self) -> None:
        self.streams.finish(self.stream)


def _owners(dst: np.ndarray, targets: List[torch.Tensor]) -> Tuple[np.ndarray, np.ndarray]:
    """Per address, the target it lies in and the byte offset there."""
    bases = np.array([t.data_ptr() for t in targets], np.uint64)
    order = np.argsort(bases)
    at = order[np.searchsorted(bases[order], dst, side="right") - 1]
    return at.astype(np.int64), (dst - bases[at]).astype(np.int64)


def _landing_for(ctx: Any, meta: Any, ranges: Ranges) -> Any:
    views = TENSOR_VIEWS or ranges.device.type != "cpu" or meta.buffers.device_types != {"cpu"}
    return _TensorBytes(ctx, ranges) if views else _HostBytes(ctx, ranges)


def read_ranges(ctx: Any, meta: Any, group: Any, ref: Any, ranges: Ranges, deadline: float,
                watch: Any, failed: Any) -> Optional[str]:
    """"gloo-ranges" once every range landed; None where the plan does not fit a control frame or RUNS_MAX.
    ``watch`` runs the receive while checking that the producer lives (``transport._watching_producer``);
    ``failed`` raises the typed error of a failed receive (``transport._receive_failed``)."""
    rows = encode(ranges.buf, ranges.off, ranges.n)
    if len(rows) > MAX_ROWS_BYTES or len(ranges.n) > RUNS_MAX:
        return None
    plan = decode(rows)
    if plan.total == 0:
        return f"{group.backend_name}-ranges"
    st = state(ctx)
    key = plan_key(rows)
    memo = (meta.producer.control_address, group.uid, key)
    tag_base = ctx.next_tags(group.uid, plan.messages)
    head = meta.obj_id + bytes.fromhex(group.uid)

    def ask(with_rows: bool) -> bytes:
        wait_ms = min(max(int((deadline - time.monotonic()) * 1000), 1), 0xFFFFFFFF)
        payload = head + HEAD.pack(group.rank, tag_base, wait_ms, key) + (rows if with_rows else b"")
        return control_request(ctx, meta, REQ_FETCH_RANGES, _control.KEY_GROUP, group.backend.config.secret,
                               payload, max(deadline - time.monotonic(), 1e-3))

    reply = ask(not st.was_sent(memo))
    if reply == NEED_PLAN:
        st.add("plans_asked")
        reply = ask(True)
    st.sent(memo, reply != NEED_PLAN)
    if reply:
        raise ObjectFetchError(f"the producer of {meta.describe()} answered a range fetch over group "
                               f"{group.name!r} with {reply[:16]!r}", object_id=meta.id_hex,
                               hint="producer and consumer run different rdt versions; install the same on both")
    guard = _Guard()
    where = _landing_for(ctx, meta, ranges)
    what = f"a {group.backend_name} range read of {meta.describe()} over group {group.name!r}"
    try:
        watch(ctx, meta, lambda: _receive(ctx, group, ref.rank, plan, where, tag_base, deadline, guard))
    except (CollectiveTimeoutError, CommunicationError) as e:
        guard.abandon(ctx.busy_targets, ranges.targets, what)
        failed(ctx, meta, group, e)
    except BaseException:
        guard.abandon(ctx.busy_targets, ranges.targets, what)
        raise
    where.done()
    st.add("fetches")
    st.add("view_fetches", int(isinstance(where, _TensorBytes)))
    st.add("received_bytes", plan.total)
    st.add("received_direct_bytes", plan.direct_bytes)
    return f"{group.backend_name}-ranges"


def _receive(ctx: Any, group: Any, peer: int, plan: Plan, where: Any, tag_base: int, deadline: float,
             guard: _Guard) -> None:
    """(waiter thread) Receive the plan's messages, IN_FLIGHT posted ahead: a direct one straight into its target,
    a packed one into one of at most SLOTS pooled blocks, scattered to the targets as it lands (the block then
    posted again). Every posted receive is waited for, also once the caller gave up. ``where``: how the targets'
    bytes are reached (:class:`_HostBytes` or :class:`_TensorBytes`)."""
    n = plan.messages
    size, count = plan.staging()
    blocks = [where.block(size) for _ in range(count)]
    state(ctx).peak("receive_block_bytes", sum(b.numel() for b in blocks))
    free = list(range(len(blocks)))
    posted: "deque[Tuple[int, Optional[int], Any]]" = deque()
    nxt = 0

    def fill() -> None:
        nonlocal nxt
        while nxt < n and len(posted) < IN_FLIGHT:
            tag = make_tag(TAG_OBJECT, tag_base + nxt)
            direct = plan.direct(nxt)
            if direct is None:
                if not free:
                    return
                b: Optional[int] = free.pop()
                work = group.backend.irecv(blocks[b][:plan.message_bytes(nxt)], peer, tag)  # type: ignore[index]
            else:
                b = None
                with guard.lock:
                    if guard.abandoned:
                        return
                    guard.direct = True
                work = group.backend.irecv(where.direct(direct[0], direct[1], plan.message_bytes(nxt)), peer, tag)
            posted.append((nxt, b, work))
            nxt += 1

    try:
        fill()
        while posted:
            m, b, work = posted.popleft()
            work.wait(max(deadline - time.monotonic(), 1e-3))
            if b is not None:
                with guard.lock:
                    if not guard.abandoned:
                        where.scatter(plan, m, blocks[b])
                free.append(b)
            if not guard.abandoned:
                fill()
    finally:
        guard.end(ctx.busy_targets)


# ------------------------------------------------------------------------------------------------ producer
def serve_fetch_ranges(ctx: Any, _key_id: int, payload: bytes) -> Any:
    """REQ_FETCH_RANGES: stream the asking member's planned ranges of the object (NEED_PLAN for an unknown key)."""
    if len(payload) < 32 + HEAD.size:
        return err(_control.ERR_BAD_REQUEST, "malformed range request")
    entry = ctx.table.get(payload[:16])
    if entry is None:
        return err(_control.ERR_NOT_FOUND, "object was freed or never existed here")
    uid = payload[16:32].hex()
    rank, tag_base, wait_ms, key = HEAD.unpack_from(payload, 32)
    group = next((g for g in local_groups() if g is not None and g.uid == uid), None)
    if group is None:
        return err(_control.ERR_NO_GROUP, "the producer is no longer in that group")
    if group.backend_name not in SERVED or not 0 <= rank < group.world_size or rank == group.rank:
        return err(_control.ERR_BAD_REQUEST, f"bad consumer rank {rank} or backend {group.backend_name}")
    if entry.flat.table.device_types != SERVED[group.backend_name]:
        return err(_control.ERR_BAD_REQUEST, f"ranges are served over {group.backend_name} for "
                                             f"{'/'.join(sorted(SERVED[group.backend_name]))} objects only")
    st = state(ctx)
    rows = payload[32 + HEAD.size:]
    bases, sizes = (np.array(c, np.int64) for c in zip(*entry.flat.ranges)) if len(entry.flat.table) \
        else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    if rows:
        if plan_key(rows) != key:
            return err(_control.ERR_BAD_REQUEST, "the range plan does not match its key")
        try:
            plan = decode(rows, sizes)  # refused before it is cached, or cut into messages, if it reaches past
        except RangesOutside as e:
            return err(_control.ERR_BAD_REQUEST, str(e))
        except ValueError as e:
            return err(_control.ERR_BAD_REQUEST, f"malformed range plan: {e}")
        st.keep((uid, rank, key), plan)
        st.add("plans_received")
    else:
        plan = st.plan((uid, rank, key))
        if plan is None:
            return _control.RESP_OK, NEED_PLAN
        why = outside(plan.buf, plan.off, plan.n, sizes)  # a plan made for another object of the group
        if why is not None:
            return err(_control.ERR_BAD_REQUEST, why)
    wait_ready(entry)
    deadline = time.monotonic() + wait_ms / 1000.0
    ctx.stats.add(group.backend_name, "out", plan.total)
    st.add("served")
    st.add("served_bytes", plan.total)
    st.add("served_direct_bytes", plan.direct_bytes)
    ctx.send_waiters.submit(_stream, ctx, group, list(entry.buffers), bases, plan, rank, tag_base, deadline,
                            entry.obj_id)
    return _control.RESP_OK, b""


class _HostSource:
    """The producer's buffers in CPU memory, by address: staging from the receive pool, packing with copy_parts."""

    def __init__(self, ctx: Any, buffers: List[torch.Tensor], bases: np.ndarray) -> None:
        self.ctx, self.bases = ctx, bases

    def slot(self, size: int) -> torch.Tensor:
        return self.ctx.buffers.empty(size)

    def direct(self, plan: Plan, run: int, at: int, nbytes: int) -> torch.Tensor:
        return _at(int(self.bases[plan.buf[run]] + plan.off[run]) + at, nbytes)

    def pack(self, plan: Plan, m: int, slot: torch.Tensor) -> None:
        idx, run_at, msg_at, length = plan.pieces(m)
        src = self.bases[plan.buf[idx]] + plan.off[idx] + run_at
        copy_parts(list(zip((msg_at + slot.data_ptr()).tolist(), src.tolist(), length.tolist())))


class _TensorSource:
    """The producer's buffers as tensor views (device memory; CPU memory under TENSOR_VIEWS): staging on their
    device, packing with device copies, finished before the slot is sent."""

    def __init__(self, ctx: Any, buffers: List[torch.Tensor], bases: np.ndarray) -> None:
        self.buffers = [device_runs.flat(b) for b in buffers]
        self.device = self.buffers[0].device if self.buffers else torch.device("cpu")
        self.streams = device_order.current()
        self.stream = self.streams.stream(self.device)

    def slot(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, device=self.device)

    def direct(self, plan: Plan, run: int, at: int, nbytes: int) -> torch.Tensor:
        o = int(plan.off[run]) + at
        return self.buffers[int(plan.buf[run])][o:o + nbytes]

    def pack(self, plan: Plan, m: int, slot: torch.Tensor) -> None:
        idx, run_at, msg_at, length = plan.pieces(m)
        copies = device_runs.batch(plan.buf[idx], plan.off[idx] + run_at, np.zeros(len(idx), np.int64), msg_at,
                                   length)
        self.streams.run(self.stream, lambda: device_runs.apply(copies, self.buffers, [slot]))
        self.streams.finish(self.stream)


def _stream(ctx: Any, group: Any, keepalive: List[torch.Tensor], bases: np.ndarray, plan: Plan, rank: int,
            tag_base: int, deadline: float, obj_id: bytes) -> None:
    """(send waiter) Send the plan's messages, IN_FLIGHT at most: a direct one straight from the object's buffer, a
    packed one gathered into one of SLOTS staging buffers (refilled only once its previous send ended). A failed
    send errors the group (``serve.send_failed``) and ends the stream."""
    st = state(ctx)
    n = plan.messages
    size, count = plan.staging()
    views = TENSOR_VIEWS or any(b.device.type != "cpu" for b in keepalive)
    source = (_TensorSource if views else _HostSource)(ctx, keepalive, bases)
    st.add("view_streams", int(views))
    slots = [source.slot(size) for _ in range(count)]
    held = sum(s.numel() for s in slots)
    st.add("staging_bytes", held)
    st.peak("staging_stream_peak", held)
    works: "deque[Tuple[Any, Optional[int]]]" = deque()
    busy = [False] * len(slots)  # a slot's send is among ``works``
    k = 0

    def oldest() -> None:
        work, slot = works.popleft()
        work.wait(max(deadline - time.monotonic(), 1e-3))
        if slot is not None:
            busy[slot] = False

    try:
        for m in range(n):
            while len(works) >= IN_FLIGHT:
                oldest()
            direct = plan.direct(m)
            if direct is None:
                slot = k % len(slots)
                k += 1
                while busy[slot]:
                    oldest()
                source.pack(plan, m, slots[slot])
                busy[slot] = True
                works.append((group.backend.isend(slots[slot][:plan.message_bytes(m)], rank,
                                                  make_tag(TAG_OBJECT, tag_base + m)), slot))
            else:
                run, at = direct
                works.append((group.backend.isend(source.direct(plan, run, at, plan.message_bytes(m)), rank,
                                                  make_tag(TAG_OBJECT, tag_base + m)), None))
        while works:
            oldest()
    except Exception as e:  # noqa: BLE001 - the consumer sees its own error; ours errors the group
        send_failed(group, obj_id, rank, e)
    finally:
        del keepalive
        st.add("staging_bytes", -held)
