"""What a group fetch's two sides agree on: its control messages, their flags, how small buffers are packed into
messages, and when the producer waits for the consumer's "receives posted" message. Both sides compute the layout
from the metadata, so no byte of framing travels.
"""

from __future__ import annotations

from typing import List, Tuple

from ..receive import ALIGN, padded_offsets

REQ_FETCH_GROUP = 1  # payload: obj_id(16) group_uid(16) consumer_rank(u32) tag_base(u32) consumer_wait_ms(u32)
#                      flags(u8) [first_chunk(u32) when resuming]; answer: empty, or how a chained fetch is fed
REQ_RELAY_NEXT = 7  # payload: obj_id(16) group_uid(16) rank(u32) chain(u64) wait_ms(u32) final(u8); whom to forward to
REQ_FETCH_RANGES = 9  # payload: obj_id(16) group_uid(16) rank(u32) tag_base(u32) wait_ms(u32) plan_key(16) [rows];
#                       answer: empty (the ranges stream, cut as ranges._messages), or ranges.NEED_PLAN (send the
#                       rows). 8 was a stream cut without direct messages: a producer that serves it is refused.

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


def message_sizes(sizes: List[int]) -> List[int]:
    """Bytes of each packed message of :func:`messages` (padding between packed buffers included)."""
    offsets, _ = padded_offsets(sizes)
    return [offsets[b] + sizes[b] - offsets[a] for a, b in messages(sizes)]


# Measured here (median of 60 round trips): 128 MiB 52-60 ms with the go message against 62-86 ms without;
# 16 MiB the same either way; 1 MiB 1.2 ms slower with it (the extra message crosses three threads).
GO_MIN_BYTES = 32 << 20


def waits_for_go(backend: str, nbytes: int) -> bool:
    """Whether a group fetch of ``nbytes`` waits for the consumer's "receives posted" message before the data.

    Gloo stages data that arrives before its receive is posted in a temporary buffer (one more allocation and
    copy of the whole message); for large objects one tiny message is far cheaper than that.
    """
    return backend == "gloo" and nbytes >= GO_MIN_BYTES
