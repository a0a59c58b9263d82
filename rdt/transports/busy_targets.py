"""Bytes of ``rdt.get(into=...)`` targets that a transfer which already failed may still write.

A posted NIXL READ cannot be cancelled: releasing its handle does not stop UCX from landing the bytes, it only
loses the one way to learn when they have landed. So a READ that times out stays in flight ("parked") until NIXL
reports it over, and the targets it lands in are marked here meanwhile. A later ``rdt.get`` into any of those bytes
first waits for the mark to clear (bounded by its timeout), so that a late READ never overwrites what a later
fetch returned. Marks are cleared when the transfer ends; the table holds one entry per such transfer, and the
transfers that may hold one are bounded by their own layer (``NixlAgent.max_parked``).

The process context holds the table (``ctx.busy_targets``); the NIXL transport marks and clears, the consumer role
(``rdt._consumer.resolve``) waits on it before an ``into=`` fetch moves a byte.
"""

from __future__ import annotations

import itertools
import threading
import time
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

Span = Tuple[str, int, int]  # (device, first byte's address, end address)


@dataclass
class Hold:
    """One transfer that may still write: what it is, since when, and the bytes it writes (merged, per device)."""

    what: str
    since: float
    spans: Dict[str, Tuple[List[int], List[int]]] = field(default_factory=dict)  # device -> (starts, ends), sorted

    def overlaps(self, span: Span) -> bool:
        """Whether any byte of ``span`` is one this transfer writes."""
        runs = self.spans.get(span[0])
        if runs is None:
            return False
        starts, ends = runs
        i = bisect_right(starts, span[1]) - 1  # the last run starting at or before the span
        return (i >= 0 and ends[i] > span[1]) or (i + 1 < len(starts) and starts[i + 1] < span[2])


def span_of(t: torch.Tensor) -> Span:
    """The bytes ``t`` covers (a non-contiguous tensor: its whole storage, to be safe)."""
    if t.is_contiguous():
        lo = t.data_ptr()
        return str(t.device), lo, lo + t.numel() * t.element_size()
    storage = t.untyped_storage()
    return str(t.device), storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _merged(spans: Sequence[Span]) -> Dict[str, Tuple[List[int], List[int]]]:
    """Per device, the spans as sorted disjoint runs."""
    out: Dict[str, Tuple[List[int], List[int]]] = {}
    for dev, lo, hi in sorted(spans):
        starts, ends = out.setdefault(dev, ([], []))
        if ends and lo <= ends[-1]:
            ends[-1] = max(ends[-1], hi)
        else:
            starts.append(lo)
            ends.append(hi)
    return out


class BusyTargets:
    """Holds on target bytes (see the module docstring); thread-safe, waited on with a condition."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._holds: Dict[int, Hold] = {}
        self._ids = itertools.count()

    def mark(self, tensors: Sequence[torch.Tensor], what: str) -> Optional[int]:
        """Mark the bytes of ``tensors`` as still being written by ``what``; the key to :meth:`clear` (None: no
        bytes)."""
        spans = [s for s in map(span_of, tensors) if s[2] > s[1]]
        if not spans:
            return None
        hold = Hold(what, time.monotonic(), _merged(spans))
        with self._cv:
            key = next(self._ids)
            self._holds[key] = hold
        return key

    def clear(self, key: Optional[int]) -> None:
        """The transfer behind ``key`` has ended: its bytes are free; wakes waiters."""
        if key is None:
            return
        with self._cv:
            self._holds.pop(key, None)
            self._cv.notify_all()

    def wait_free(self, tensors: Iterable[torch.Tensor], timeout: float) -> List[Hold]:
        """Wait until no hold covers any byte of ``tensors``, at most ``timeout`` seconds; the holds still on them
        then (empty: free)."""
        if not self._holds:  # the usual case: nothing failed in flight; no lock, no spans computed
            return []
        spans = [s for s in map(span_of, tensors) if s[2] > s[1]]
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                busy = [h for h in self._holds.values() if any(map(h.overlaps, spans))]
                left = deadline - time.monotonic()
                if not busy or left <= 0:
                    return busy
                self._cv.wait(left)

    def __len__(self) -> int:
        with self._cv:
            return len(self._holds)
