"""The gloo range plan's wire form and message cut: compressed rows decode to exactly the runs given, in order, and
every message's pieces cover the byte stream once (both sides cut it from the plan alone)."""

from __future__ import annotations

import numpy as np

from rdt.transports.group.ranges import (CHUNK, DIRECT_MIN, PLANS_MAX, PLANS_MAX_BYTES, ROW, RUNS_MAX, RangesState,
                                        decode, encode)


def _roundtrip(buf, off, n):
    rows = encode(np.array(buf), np.array(off), np.array(n))
    plan = decode(rows)
    assert plan.buf.tolist() == list(buf) and plan.off.tolist() == list(off) and plan.n.tolist() == list(n)
    return rows, plan


def test_a_row_parallel_slice_is_one_row():
    rows, _ = _roundtrip([0] * 1000, [i * 4096 + 512 for i in range(1000)], [1024] * 1000)
    assert len(rows) == ROW.size


def test_stride_changes_and_buffer_changes_start_new_rows():
    _roundtrip([0, 0, 0, 0, 1, 1, 2], [0, 10, 20, 100, 0, 8, 5], [4, 4, 4, 4, 8, 8, 3])
    _roundtrip([3], [7], [1])


def test_random_plans_roundtrip_and_messages_cover_the_stream_once():
    rng = np.random.default_rng(7)
    for _ in range(200):
        k = int(rng.integers(1, 60))
        n = rng.choice([16, 4096, DIRECT_MIN - 1, DIRECT_MIN, CHUNK // 3, CHUNK + 5], k).astype(np.int64)
        buf = np.sort(rng.integers(0, 4, k))
        off = rng.integers(0, 1 << 30, k)
        _, plan = _roundtrip(buf.tolist(), off.tolist(), n.tolist())
        seen = 0
        for m in range(plan.messages):
            idx, run_at, msg_at, length = plan.pieces(m)
            assert (msg_at[1:] == msg_at[:-1] + length[:-1]).all() and msg_at[0] == 0
            assert int(length.sum()) == plan.message_bytes(m)
            assert ((run_at + length) <= plan.n[idx]).all()
            direct = plan.direct(m)
            if direct is None:  # packed: small runs only
                assert (plan.n[idx] < DIRECT_MIN).all() and plan.message_bytes(m) <= CHUNK
            else:  # direct: one piece of one large run, at the offset it names
                assert idx.tolist() == [direct[0]] and plan.n[direct[0]] >= DIRECT_MIN
                assert run_at.tolist() == [direct[1]] and plan.message_bytes(m) <= CHUNK
            seen += int(length.sum())
        assert seen == plan.total == int(n.sum())


def test_the_producers_plan_cache_is_bounded():
    st = RangesState()
    small = decode(encode(np.zeros(4), np.arange(4) * 64, np.full(4, 16)))
    for i in range(PLANS_MAX + 6):
        st.keep(("g", 1, bytes([i]) * 16), small)
    assert st.snapshot()["plans"] == PLANS_MAX and st.plan(("g", 1, bytes([0]) * 16)) is None  # oldest out first
    big = decode(encode(np.zeros(RUNS_MAX), np.arange(RUNS_MAX) * 64, np.full(RUNS_MAX, 16)))
    assert big.nbytes > PLANS_MAX_BYTES // 2
    st.keep(("g", 2, b"b" * 16), big)
    st.keep(("g", 3, b"c" * 16), big)
    assert st.snapshot()["plans_bytes"] <= PLANS_MAX_BYTES
