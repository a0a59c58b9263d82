"""Published versions of sharded weights and the reads in flight on them, kept in the producer process.

Every ``rdt.put_shards`` publication is recorded here with its rank and version. A consumer's load registers each
read before it moves a byte (``REQ_READ_BEGIN``) and ends it after (``REQ_READ_END``, whose answer says whether the
version held through the read). ``Shards.fence`` closes a version to new readers, waits (bounded) until the readers
in flight ended, then forgets it: a reader that comes after gets "gone", a reader the fence had to give up on is
told at its end that its bytes may be torn. Publications that keep a copy (``keep_versions``) are never fenced: the
newest N of a stream stay readable, an older one is closed and its copy freed once its readers ended. Checksums of a
planned range set (``verify=True``) are computed here once per publication and plan, and cached.

Everything is bounded: readers expire at their own deadline (plus a grace), records of gone versions are dropped
(the consumer names the version from its manifest), and the caches have fixed caps.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from .._control import wire as _control
from .._objects.checksum import tensor_ranges_crc
from ..errors import FenceTimeoutError

MAX_READERS = 4096  # reads in flight, all publications of this process together
MAX_RECORDS = 4096  # publications not yet gone (the oldest is forgotten beyond it)
MAX_GONE = 1024  # why a recent publication went, for the consumer's error
MAX_SUMS = 256  # cached checksum answers (publication, plan key)
MAX_PLAN_BYTES = 64 << 20  # cached range sets, all plans together
GRACE_S = 2.0  # a reader is given up on this long after its own deadline
_BEGIN = struct.Struct("!16sQ16sI")
_END = struct.Struct("!16s16s")
_SUMS = struct.Struct("!16s16sI")
RANGE_BYTES = 24  # a range on the wire: group u32, buffer u32, offset u64, length u64


@dataclass
class _Reader:
    who: str
    since: float
    expires: float


@dataclass
class _Record:
    """One publication: its stream (rank and parameter names), version, the bytes of its copy (0: it reads the live
    weights), whether new readers are let in, why not, and its readers in flight."""

    obj_id: bytes
    stream: Hashable
    rank: int
    version: int
    kept_bytes: int
    changes: bool = False  # a delta stream's changes (rdt._sharded.delta), not weights
    open: bool = True
    why: str = ""
    retired: bool = False  # a kept copy no longer kept: freed once its readers ended
    readers: Dict[bytes, _Reader] = field(default_factory=dict)


class Versions:
    """The producer's table of publications and reads in flight (one per process, on the context)."""

    def __init__(self, buffers: Callable[[bytes], Optional[Sequence[Any]]], free: Callable[[bytes], None]) -> None:
        self._buffers = buffers  # obj_id -> the object's uint8 CPU buffers (None: not held here)
        self._free = free  # obj_id -> free the object now (a kept copy dropped from the ring)
        self._cond = threading.Condition()
        self._records: "OrderedDict[bytes, _Record]" = OrderedDict()
        self._gone: "OrderedDict[bytes, str]" = OrderedDict()
        self._sums: "OrderedDict[Tuple[bytes, bytes], bytes]" = OrderedDict()
        self._plans: "OrderedDict[bytes, bytes]" = OrderedDict()
        self._plan_bytes = 0
        self._readers = 0
        self._bases: Dict[Hashable, int] = {}  # delta streams' base copies (rdt._sharded.delta): bytes per stream

    # ---------------------------------------------------------------- the producer's side
    def publish(self, obj_id: bytes, stream: Hashable, rank: int, version: int, kept_bytes: int, keep: int,
                changes: bool = False) -> None:
        """Record a publication (``changes``: a delta stream's changes, counted apart in :meth:`stats`). Earlier live-weight publications of the stream with another version are gone (the
        weights they read may have changed since: their readers in flight fail); kept copies beyond the newest
        ``keep`` of the stream are closed and freed once their readers ended."""
        to_free: List[bytes] = []
        with self._cond:
            self._sweep(time.monotonic(), to_free)
            same = [r for r in self._records.values() if r.stream == stream and r.open]
            for r in same:
                if not r.kept_bytes and r.version != version:
                    self._drop(r, f"superseded by version {version}, published without a fence first", to_free)
            self._records[obj_id] = _Record(obj_id, stream, rank, version, kept_bytes, changes)
            kept = [r for r in self._records.values() if r.stream == stream and r.open and r.kept_bytes]
            for r in kept[:max(len(kept) - keep, 0)] if keep else []:
                r.open, r.retired = False, True
                r.why = f"no longer kept: version {version} was published with keep_versions={keep}"
                if not r.readers:
                    self._drop(r, r.why, to_free)
            while len(self._records) > MAX_RECORDS:
                self._drop(next(iter(self._records.values())), "forgotten: too many publications held", to_free)
            self._cond.notify_all()
        self._free_all(to_free)

    def fence(self, obj_id: bytes, rank: int, version: int, timeout: float) -> None:
        """Close the publication to new readers, wait until its readers in flight ended, then forget it. A kept
        copy is not fenced (its readers read the copy). FenceTimeoutError names the readers left after ``timeout``:
        the version is gone all the same, and they fail at their end."""
        deadline = time.monotonic() + timeout
        to_free: List[bytes] = []
        with self._cond:
            rec = self._records.get(obj_id)
            if rec is None or rec.kept_bytes:
                return
            rec.open = False
            rec.why = "fenced: the producer updates its weights in place"
            while rec.readers:
                now = time.monotonic()
                self._sweep(now, to_free)
                if not rec.readers or now >= deadline:
                    break
                self._cond.wait(min(deadline - now, 0.5))
            left = sorted(rec.readers.values(), key=lambda r: r.since)
            self._drop(rec, rec.why, to_free)
        self._free_all(to_free)
        if left:
            now = time.monotonic()
            names = "; ".join(f"{r.who} (reading for {now - r.since:.1f}s)" for r in left[:5])
            err = FenceTimeoutError(
                f"version {version} of producer rank {rank}: {len(left)} read(s) still in flight after "
                f"{timeout:.1f}s: {names}. The version is gone: they fail with VersionGoneError rather than return "
                "bytes of the update", rank=rank, object_id=obj_id.hex(),
                hint="raise the fence's timeout, or find why those consumers are stuck; publish with "
                     "keep_versions=N to let readers go on while the weights change")
            err.version, err.readers = version, [r.who for r in left]
            raise err

    def forget(self, obj_id: bytes) -> None:
        """The object was freed (its last reference died): its readers fail, new ones are told it is gone."""
        with self._cond:
            rec = self._records.get(obj_id)
            if rec is not None:
                self._drop(rec, "freed: every reference to it died", [])
            for key in [k for k in self._sums if k[0] == obj_id]:
                del self._sums[key]

    def set_base(self, stream: Hashable, nbytes: int) -> None:
        """The bytes of a delta stream's base copy (0: it has none), for stats."""
        with self._cond:
            if nbytes:
                self._bases[stream] = nbytes
                while len(self._bases) > MAX_RECORDS:
                    self._bases.pop(next(iter(self._bases)))
            else:
                self._bases.pop(stream, None)

    def stats(self) -> Dict[str, int]:
        """Counters for rdt.stats(): publications not yet gone, reads in flight, bytes of kept copies; of delta
        streams (``put_shards(delta=True)``): the versions whose changes are kept, their bytes, and the base
        copies' bytes."""
        with self._cond:
            delta = [r for r in self._records.values() if r.changes]
            full = [r for r in self._records.values() if not r.changes]
            return {"publications": len(full), "readers": self._readers,
                    "kept_versions": sum(1 for r in full if r.kept_bytes),
                    "kept_bytes": sum(r.kept_bytes for r in full),
                    "delta_versions": len(delta), "delta_bytes": sum(r.kept_bytes for r in delta),
                    "delta_base_bytes": sum(self._bases.values())}

    # ---------------------------------------------------------------- control requests
    def handle_begin(self, payload: bytes) -> Tuple[int, bytes]:
        """REQ_READ_BEGIN: register a reader of a version, or say why the version is gone."""
        obj_id, version, reader, wait_ms = _BEGIN.unpack_from(payload)
        who = payload[_BEGIN.size:_BEGIN.size + 200].decode(errors="replace") or "a consumer"
        to_free: List[bytes] = []
        with self._cond:
            now = time.monotonic()
            self._sweep(now, to_free)
            rec = self._records.get(obj_id)
            answer: Tuple[int, bytes]
            if rec is None:
                answer = _control.err(_control.ERR_VERSION_GONE, self._gone.get(obj_id, "it is no longer held"))
            elif rec.version != version:
                answer = _control.err(_control.ERR_BAD_REQUEST, f"it is version {rec.version}, not {version}")
            elif not rec.open:
                answer = _control.err(_control.ERR_VERSION_GONE, rec.why)
            elif self._readers >= MAX_READERS:
                answer = _control.err(_control.ERR_BAD_REQUEST, f"{MAX_READERS} reads are in flight already")
            else:
                if reader not in rec.readers:
                    self._readers += 1
                rec.readers[reader] = _Reader(who, now, now + wait_ms / 1000.0 + GRACE_S)
                answer = (_control.RESP_OK, b"")
        self._free_all(to_free)
        return answer

    def handle_end(self, payload: bytes) -> Tuple[int, bytes]:
        """REQ_READ_END: forget a reader; answer 1 when the version held through its read (0: it may be torn)."""
        obj_id, reader = _END.unpack_from(payload)
        to_free: List[bytes] = []
        with self._cond:
            rec = self._records.get(obj_id)
            held = rec is not None and rec.readers.pop(reader, None) is not None
            if held:
                self._readers -= 1
                if rec.retired and not rec.readers:
                    self._drop(rec, rec.why, to_free)
                self._cond.notify_all()
        self._free_all(to_free)
        return _control.RESP_OK, b"\x01" if held else b"\x00"

    def handle_sums(self, payload: bytes) -> Tuple[int, bytes]:
        """REQ_RANGE_SUMS: CRC-32C per group of a range set of a version being read (cached per plan key).

        A request that carries ranges is served and cached only when its key is their digest (:func:`plan_key`)
        and every range lies inside the object's buffers: else a holder of the process key could file other ranges
        under the key of an honest consumer's set, whose ``verify=True`` would then compare its bytes with the
        wrong checksums."""
        obj_id, key, n = _SUMS.unpack_from(payload)
        sent = payload[_SUMS.size:] if n else b""
        if n and len(sent) != n * RANGE_BYTES:
            return _control.err(_control.ERR_BAD_REQUEST, f"the range count {n} is not the {len(sent)} bytes of "
                                                          f"ranges sent ({RANGE_BYTES} bytes each)")
        if n and plan_key(sent) != key:
            return _control.err(_control.ERR_BAD_REQUEST, "the ranges sent do not match their key (it must be "
                                                          "their digest)")
        with self._cond:
            rec = self._records.get(obj_id)
            if rec is None:
                return _control.err(_control.ERR_VERSION_GONE, self._gone.get(obj_id, "it is no longer held"))
            cached = self._sums.get((obj_id, key))
            if cached is not None:
                self._sums.move_to_end((obj_id, key))
                return _control.RESP_OK, b"\x01" + cached
            ranges = sent or self._plans.get(key)
            if ranges is None:
                return _control.RESP_OK, b"\x00"  # send the ranges
        buffers = self._buffers(obj_id)
        if buffers is None:
            return _control.err(_control.ERR_NOT_FOUND, "its buffers are not held here")
        decoded = decode_ranges(ranges)
        outside = ranges_outside(decoded, [b.numel() for b in buffers])
        if outside is not None:
            return _control.err(_control.ERR_BAD_REQUEST, outside)
        answer = range_sums(buffers, *decoded)
        with self._cond:
            if sent:
                self._keep_plan(key, sent)
            if obj_id in self._records:
                self._sums[(obj_id, key)] = answer
                while len(self._sums) > MAX_SUMS:
                    self._sums.popitem(last=False)
        return _control.RESP_OK, b"\x01" + answer

    # ---------------------------------------------------------------- internals (under the lock)
    def _sweep(self, now: float, to_free: List[bytes]) -> None:
        """Give up on readers past their deadline (they fail at their end); free drained retired copies."""
        for rec in list(self._records.values()):
            for key in [k for k, r in rec.readers.items() if r.expires < now]:
                del rec.readers[key]
                self._readers -= 1
            if rec.retired and not rec.readers:
                self._drop(rec, rec.why, to_free)

    def _drop(self, rec: _Record, why: str, to_free: List[bytes]) -> None:
        """Forget a publication (its readers fail at their end); a retired copy is freed (outside the lock)."""
        self._records.pop(rec.obj_id, None)
        self._readers -= len(rec.readers)
        rec.readers.clear()
        rec.open = False
        self._gone[rec.obj_id] = why
        while len(self._gone) > MAX_GONE:
            self._gone.popitem(last=False)
        for key in [k for k in self._sums if k[0] == rec.obj_id]:
            del self._sums[key]
        if rec.retired:
            to_free.append(rec.obj_id)
        self._cond.notify_all()

    def _keep_plan(self, key: bytes, ranges: bytes) -> None:
        if key in self._plans:
            return
        self._plans[key] = ranges
        self._plan_bytes += len(ranges)
        while self._plan_bytes > MAX_PLAN_BYTES and self._plans:
            self._plan_bytes -= len(self._plans.popitem(last=False)[1])

    def _free_all(self, obj_ids: List[bytes]) -> None:
        for obj_id in obj_ids:
            self._free(obj_id)


# -------------------------------------------------------------------- range sets and their checksums
def encode_ranges(group: np.ndarray, buf: np.ndarray, off: np.ndarray, n: np.ndarray) -> bytes:
    """A range set on the wire: per range its group (checksummed together), buffer, offset and length."""
    return b"".join((group.astype(">u4").tobytes(), buf.astype(">u4").tobytes(), off.astype(">u8").tobytes(),
                     n.astype(">u8").tobytes()))


def decode_ranges(data: bytes) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`encode_ranges`' columns: group and buffer as int64, offset and length as uint64 (a length or offset
    of 2**63 or more stays what it is rather than wrapping negative; see :func:`ranges_outside`)."""
    k = len(data) // RANGE_BYTES
    a = np.frombuffer(data, dtype=np.uint8)
    return (a[:4 * k].view(">u4").astype(np.int64), a[4 * k:8 * k].view(">u4").astype(np.int64),
            a[8 * k:16 * k].view(">u8").astype(np.uint64), a[16 * k:24 * k].view(">u8").astype(np.uint64))


def ranges_outside(ranges: Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
                   sizes: Sequence[int]) -> Optional[str]:
    """Why a decoded range set reaches past the buffers of ``sizes`` bytes (None: every range lies inside one).
    Compared without sums, so that no offset or length can wrap past the check."""
    _, buf, off, n = ranges
    if not len(n):
        return None
    nbuf = len(sizes)
    bad = buf >= nbuf
    size = np.zeros(len(n), dtype=np.uint64)
    size[~bad] = np.asarray(sizes, dtype=np.uint64)[buf[~bad]]
    bad |= (off > size) | (n > size - np.minimum(off, size))
    if not bad.any():
        return None
    i = int(np.flatnonzero(bad)[0])
    where = f"buffer {int(buf[i])} of {nbuf}" if buf[i] >= nbuf else f"buffer {int(buf[i])} ({int(size[i])} bytes)"
    return (f"range {i} ({int(n[i])} bytes at offset {int(off[i])} of {where}) lies outside the object's buffers; "
            f"{int(bad.sum())} of {len(n)} ranges do")


def plan_key(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def range_sums(buffers: Sequence[Any], group: np.ndarray, buf: np.ndarray, off: np.ndarray,
               n: np.ndarray) -> bytes:
    """CRC-32C of each group's ranges, chained in order (``rdt._objects.checksum``): count(u32), then (group u32,
    crc u32) pairs."""
    sums = tensor_ranges_crc(list(buffers), group, buf, off, n)  # a GPU's bytes checksummed where they are
    return struct.pack("!I", len(sums)) + b"".join(struct.pack("!II", g, c) for g, c in sums.items())


def decode_sums(data: bytes) -> Dict[int, int]:
    (count,) = struct.unpack_from("!I", data)
    return {g: c for g, c in (struct.unpack_from("!II", data, 4 + 8 * i) for i in range(count))}
