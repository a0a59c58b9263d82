"""The producer's relay chain table and the chunk layout, without Ray: who is chained behind whom, what a member is
told, and that the table drains (rdt/transports/group/relay.py)."""

from __future__ import annotations

import threading
import time
from typing import Any, List, Tuple

import pytest
import torch

from rdt.transports.group import relay as _relay
from rdt.transports.group.protocol import message_sizes as _message_sizes, messages

OBJ, UID = b"o" * 16, "ab" * 16


def _far() -> float:
    return time.monotonic() + 30.0


def test_requests_while_the_tail_receives_form_one_chain_in_arrival_order():
    t = _relay.RelayTable()
    cid, source, position = t.join(OBJ, UID, 1, 100, _far())
    assert (source, position) == (None, 0)  # the head: fed by the producer, at once
    assert t.join(OBJ, UID, 3, 300, _far()) == (cid, 1, 1)  # behind rank 1
    assert t.join(OBJ, UID, 2, 200, _far()) == (cid, 3, 2)  # behind rank 3
    assert t.next_of(OBJ, UID, cid, 1, False, 0.0) == (3, 300)  # rank 1 forwards to rank 3, on rank 3's tags
    assert t.next_of(OBJ, UID, cid, 3, False, 0.0) == (2, 200)
    assert t.snapshot()["joined"] == 2 and t.snapshot()["open_tails"] == 1
    assert t.next_of(OBJ, UID, cid, 2, True, 0.0) is None  # the tail is done: closed, nobody joins any more
    late, source, _ = t.join(OBJ, UID, 4, 400, _far())
    assert source is None and late != cid  # a late consumer starts a new chain
    t.next_of(OBJ, UID, late, 4, True, 0.0)
    t.sent(late)
    assert t.snapshot()["chains"] == 1  # the first chain: the producer's sends to its head are still going
    t.sent(cid)
    assert t.snapshot()["chains"] == 0 and t.snapshot()["open_tails"] == 0


def _held_poll(t: _relay.RelayTable) -> Tuple[threading.Thread, List[Any]]:
    """Rank 1 heads a new chain and polls for its follower on a thread; (the thread, what the poll returned)."""
    cid, _, _ = t.join(OBJ, UID, 1, 0, _far())
    got: List[Any] = []
    poll = threading.Thread(target=lambda: got.append(t.next_of(OBJ, UID, cid, 1, False, 10.0)))
    poll.start()
    time.sleep(0.05)
    return poll, got


def test_a_held_poll_is_answered_when_a_follower_joins():
    t = _relay.RelayTable()
    poll, got = _held_poll(t)
    assert got == []  # held: nobody joined yet
    t.join(OBJ, UID, 2, 77, _far())
    poll.join(5)
    assert got == [(2, 77)]


def test_a_poll_ends_at_its_deadline_and_closes_the_tail():
    t = _relay.RelayTable()
    cid, _, _ = t.join(OBJ, UID, 1, 0, time.monotonic() + 0.2)
    start = time.monotonic()
    assert t.next_of(OBJ, UID, cid, 1, False, 10.0) is None  # bounded by the member's deadline, not the wait asked
    assert time.monotonic() - start < 2
    assert t.join(OBJ, UID, 2, 0, _far())[1] is None  # not chained behind a member that gave up


def test_a_tail_that_died_silently_closes_at_its_deadline_and_the_table_drains():
    t = _relay.RelayTable()
    cid, _, _ = t.join(OBJ, UID, 1, 0, time.monotonic() + 0.1)
    t.sent(cid)
    assert t.snapshot()["chains"] == 1
    time.sleep(0.15)
    assert t.snapshot()["chains"] == 0  # swept


def test_nobody_joins_behind_a_head_the_producer_failed_to_send_to():
    t = _relay.RelayTable()
    cid, _, _ = t.join(OBJ, UID, 1, 0, _far())
    t.sent(cid, failed=True)
    assert t.join(OBJ, UID, 2, 0, _far())[1:] == (None, 0)
    assert t.snapshot()["chains"] == 1


def test_freeing_the_object_answers_held_polls():
    t = _relay.RelayTable()
    poll, got = _held_poll(t)
    t.forget(OBJ)
    poll.join(5)
    assert got == [None]


def test_unknown_chains_are_refused_and_non_members_get_nobody():
    t = _relay.RelayTable()
    with pytest.raises(_relay.UnknownChain):
        t.next_of(OBJ, UID, 99, 1, False, 0.0)
    cid, _, _ = t.join(OBJ, UID, 1, 0, _far())
    assert t.next_of(OBJ, UID, cid, 5, True, 0.0) is None  # not a member: told nothing, changes nothing
    assert t.snapshot()["open_tails"] == 1


def test_a_poll_is_bound_to_its_chains_object_and_group():
    """A request signed by another group (its uid), or naming another object, cannot poll or close the chain,
    even with the chain's id and a member's rank; chain ids are random 64-bit numbers, not a count."""
    t = _relay.RelayTable()
    cid, _, _ = t.join(OBJ, UID, 1, 0, _far())
    other, _, _ = t.join(b"p" * 16, UID, 1, 0, _far())
    assert cid != other and min(cid, other) > 1 << 16 and max(cid, other) < 1 << 64
    for obj, uid in ((OBJ, "cd" * 16), (b"p" * 16, UID)):
        for final in (False, True):
            with pytest.raises(_relay.UnknownChain):
                t.next_of(obj, uid, cid, 1, final, 0.0)
    assert t.snapshot()["open_tails"] == 2  # neither chain was closed
    assert t.next_of(OBJ, UID, cid, 1, True, 0.0) is None  # its own member closes it


def test_chunks_cover_every_message_in_pieces_of_at_most_one_mib():
    sizes = [100, 3000, 5 << 20, 0, 7, (1 << 20) + 1, 300 << 10]
    msg_sizes = _message_sizes(sizes)
    assert len(msg_sizes) == len(messages(sizes))
    parts = _relay.chunks(msg_sizes)
    assert all(0 < e - s <= _relay.CHUNK for _, s, e in parts)
    for m, size in enumerate(msg_sizes):
        mine = [(s, e) for i, s, e in parts if i == m]
        assert sum(e - s for s, e in mine) == size and (not mine or (mine[0][0] == 0 and mine[-1][1] == size))
    views = _relay.split([torch.zeros(n, dtype=torch.uint8) for n in msg_sizes])
    assert [v.numel() for v in views] == [e - s for _, s, e in parts]
