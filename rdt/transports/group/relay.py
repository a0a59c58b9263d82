"""Fan-out over a group: consumers of one object that ask while another is still receiving form a chain.

The producer keeps, per object and group, the chain whose last member (the *tail*) is still receiving. A request
that arrives while the tail is open becomes the tail's follower: its reply names its source (the old tail's rank)
and the old tail learns, in the answer to its own authenticated poll to the producer, whom to forward to. Bytes
travel as the packed messages of ``protocol.messages`` cut into chunks of at most :data:`CHUNK` bytes; a member
forwards chunk k as soon as it arrived, so the producer's link carries the object about once whatever the
number of consumers. The first request of an object (a lone consumer) is served at once, never held back.

This module holds the producer's chain table and the layout both sides compute; ``serve`` and ``transport`` drive
the sends and receives (they import this module, never the other way round).
"""

from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..base import TransportState

CHUNK = 4 << 20  # bytes per relayed message at most: a 4-worker sync of 988 MB takes ~790 ms, ~850 with 1 MiB
# chunks (four times the Gloo operations), and no less with 16 MiB ones (a longer pipeline fill)
BOUNCE_SLOTS = 2  # chunk-sized slots a member fed by a relay receives into before copying to into= targets: two
# keep a receive posted while the last chunk is copied (8 MiB a fetch, not a copy of the object)
PARK_MAX = 4  # fetches whose receives from a stalled relay are parked, per process, beyond which none is chained
PARK_MIN_S = 60.0  # a parked receive waits at least this long past its fetch's deadline for the relay to send

MODE_RELAY = 1
REPLY = "!BIIQ"  # mode, source rank, position in the chain (0: fed by the producer), chain id
NEXT_REQUEST = "!IQIB"  # (after obj_id and group uid) rank, chain id, wait_ms, final
NEXT_REPLY = "!iI"  # follower rank (-1: none, the member is the tail and closed), follower's tag base


class UnknownChain(LookupError):
    """A poll names no chain of that object in that group (never told apart from a chain of another group)."""


def chunks(message_sizes: Sequence[int]) -> List[Tuple[int, int, int]]:
    """(message, start, end) of every relayed chunk: each message cut into pieces of at most CHUNK bytes (an empty
    message has none: nothing to land)."""
    out: List[Tuple[int, int, int]] = []
    for m, size in enumerate(message_sizes):
        for start in range(0, size, CHUNK):
            out.append((m, start, min(start + CHUNK, size)))
    return out


def split(messages: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Views of ``messages`` (one uint8 tensor each), one per chunk of :func:`chunks`."""
    sizes = [m.numel() for m in messages]
    return [messages[m][s:e] for m, s, e in chunks(sizes)]


@dataclass
class _Member:
    rank: int
    tag_base: int
    deadline: float  # monotonic: the consumer gives up then, so it will never forward after it
    follower: Optional[Tuple[int, int]] = None  # (rank, tag base) it forwards to, once assigned
    closed: bool = False  # no follower will ever be assigned


@dataclass
class _Chain:
    key: Tuple[bytes, str]  # (object id, group uid)
    members: Dict[int, _Member] = field(default_factory=dict)
    tail: Optional[_Member] = None
    sending: bool = True  # the producer's sends to the head are not finished yet


class RelayTable(TransportState):
    """The producer's chains (one open per object and group) and the process's relay counters.

    Every wait is bounded by a member's deadline; a chain is dropped once its tail is closed (it said it is done,
    or its deadline passed) and the producer's sends to its head ended, so the table drains to empty.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._chains: Dict[int, _Chain] = {}
        self._open: Dict[Tuple[bytes, str], int] = {}
        self.served_bytes = 0  # bytes this process sent as producer to group consumers
        self.relayed_bytes = 0  # bytes this process forwarded to the next consumer of a chain
        self.joined = 0  # consumers appended behind another one (producer side)
        self.fallbacks = 0  # times this consumer asked the producer for what a dead or stalled relay did not send
        self.forward_failures = 0  # forwards to a follower that failed (the follower falls back on its own)
        self.parked = 0  # fetches of this consumer whose receives from a stalled relay may still land (live)
        self._pollers: Optional[ThreadPoolExecutor] = None
        self._waiters: Optional[ThreadPoolExecutor] = None

    def pollers(self) -> ThreadPoolExecutor:
        """Threads that wait, for this process's chained fetches, for the producer to name their followers (each
        wait ends when the fetch is done receiving, or at its deadline)."""
        with self._cond:
            if self._pollers is None:
                self._pollers = ThreadPoolExecutor(max_workers=16, thread_name_prefix="rdt-relay-poll")
            return self._pollers

    def waiters(self) -> ThreadPoolExecutor:
        """Threads that wait, for this process's chained fetches, for their chunks to land, one source's chunks
        in order (a parked one until the stalled relay sends, dies or the group goes; see ``transport._Phase``).
        Bounded: at most two per fetch (``rdt-fetch-wait`` runs at most 8) and :data:`PARK_MAX` parked ones."""
        with self._cond:
            if self._waiters is None:
                self._waiters = ThreadPoolExecutor(max_workers=32, thread_name_prefix="rdt-relay-wait")
            return self._waiters

    # ---------------------------------------------------------------- producer
    def join(self, obj_id: bytes, uid: str, rank: int, tag_base: int,
             deadline: float) -> Tuple[int, Optional[int], int]:
        """Place a consumer: (chain id, source rank or None for the producer itself, position in the chain)."""
        key = (obj_id, uid)
        with self._cond:
            now = time.monotonic()
            self._sweep(now)
            chain = self._chains.get(self._open.get(key, 0))
            tail = chain.tail if chain is not None else None
            if chain is not None and tail is not None and not tail.closed and rank not in chain.members \
                    and tail.deadline > now:
                tail.follower = (rank, tag_base)
                member = _Member(rank, tag_base, deadline)
                chain.members[rank] = member
                chain.tail = member
                self.joined += 1
                self._cond.notify_all()
                return self._open[key], tail.rank, len(chain.members) - 1
            cid = self._new_id()
            member = _Member(rank, tag_base, deadline)
            self._chains[cid] = _Chain(key, {rank: member}, member)
            self._open[key] = cid
            return cid, None, 0

    def _new_id(self) -> int:
        """An unguessable chain id (64 random bits, never 0 nor one in use): a chain's members learn it from the
        producer's replies, nobody else can name it."""
        while True:
            cid = secrets.randbits(64)
            if cid and cid not in self._chains:
                return cid

    def next_of(self, obj_id: bytes, uid: str, cid: int, rank: int, final: bool,
                wait: float) -> Optional[Tuple[int, int]]:
        """Whom member ``rank`` of chain ``cid`` (object ``obj_id`` in group ``uid``: the group whose secret signed
        the request) forwards to: wait up to ``wait`` seconds for a follower (``final``: none, it is done
        receiving: close the tail now). None means never anyone: the member is closed (or not a member).
        UnknownChain when that object has no chain ``cid`` in that group."""
        with self._cond:
            chain = self._chains.get(cid)
            if chain is None or chain.key != (obj_id, uid):
                raise UnknownChain(f"no chain {cid} of object {obj_id.hex()} in group uid {uid}")
            member = chain.members.get(rank)
            if member is None:
                return None
            if not final:
                end = min(time.monotonic() + wait, member.deadline)
                self._cond.wait_for(lambda: member.follower is not None or member.closed,
                                    timeout=max(end - time.monotonic(), 0.0))
            if member.follower is None:
                self._close(chain, member)
            return member.follower

    def sent(self, cid: int, failed: bool = False) -> None:
        """The producer's sends to chain ``cid``'s head ended; ``failed``: the head died or gave up, so nobody may
        join behind it any more (a follower would only have to fall back)."""
        with self._cond:
            chain = self._chains.get(cid)
            if chain is not None:
                chain.sending = False
                head = next(iter(chain.members.values()))
                if failed and chain.tail is head and not head.closed:
                    self._close(chain, head)
                self._drop_if_done(cid, chain)

    def forget(self, obj_id: bytes) -> None:
        """The object was freed: close its chains' tails (held polls are answered; nobody joins any more)."""
        with self._cond:
            for cid, chain in list(self._chains.items()):
                if chain.key[0] == obj_id and chain.tail is not None:
                    self._close(chain, chain.tail)

    def _close(self, chain: _Chain, member: _Member) -> None:
        member.closed = True
        if chain.tail is member and self._open.get(chain.key) is not None:
            cid = self._open[chain.key]
            if self._chains.get(cid) is chain:
                del self._open[chain.key]
        self._cond.notify_all()
        for cid, c in list(self._chains.items()):
            if c is chain:
                self._drop_if_done(cid, chain)

    def _drop_if_done(self, cid: int, chain: _Chain) -> None:
        if not chain.sending and (chain.tail is None or chain.tail.closed):
            self._chains.pop(cid, None)
            if self._open.get(chain.key) == cid:
                del self._open[chain.key]

    def _sweep(self, now: float) -> None:
        """Close tails whose consumer's deadline passed (it died or gave up before saying it was done)."""
        for chain in list(self._chains.values()):
            tail = chain.tail
            if tail is not None and not tail.closed and tail.deadline <= now:
                self._close(chain, tail)

    def stop(self) -> None:
        """At shutdown: close every tail (held polls are answered) and stop the poller and waiter threads (not
        waiting: a waiter blocked in Gloo ends when its group is aborted at exit)."""
        with self._cond:
            for chain in list(self._chains.values()):
                if chain.tail is not None and not chain.tail.closed:
                    self._close(chain, chain.tail)
            pools = [self._pollers, self._waiters]
            self._pollers = self._waiters = None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- both
    def add(self, counter: str, n: int = 1) -> None:
        with self._cond:
            setattr(self, counter, getattr(self, counter) + n)

    def snapshot(self) -> Dict[str, int]:
        """The counters and the live serve state, for ``rdt.stats()``."""
        with self._cond:
            self._sweep(time.monotonic())
            return {"chains": len(self._chains), "open_tails": len(self._open), "joined": self.joined,
                    "served_bytes": self.served_bytes, "relayed_bytes": self.relayed_bytes,
                    "fallbacks": self.fallbacks, "forward_failures": self.forward_failures, "parked": self.parked}


EMPTY_STATS: Dict[str, int] = RelayTable().snapshot()


def table(ctx: Any) -> RelayTable:
    """This process's relay table (made on first use): the gloo transport's per-process state."""
    return ctx.transport_state("gloo", RelayTable)
