"""Size/dtype-checked send/recv for backends that cannot detect a mismatch themselves (Gloo).

Gloo completes a receive with a *shorter* message silently and aborts the receiving process on a *longer* one,
so the receiver must never post a buffer that a sender may overrun. A header before every message would make
each transfer cost a second latency (measured: 4 KiB 154 µs instead of 91 µs), so the two sides agree once per
direction and then send at full speed:

* Both ends of a direction (``src -> dst``) keep ``agreed``, the (nbytes, dtype) of the last message that both
  checked. A side whose tensor matches ``agreed`` takes the FAST path, otherwise the SLOW one. Each side decides
  from its own tensor alone, and every combination is safe:
* FAST sender: the data (tag D) then a trailer ``[FAST, nbytes, dtype]`` (tag T). FAST receiver: receives D into
  its tensor and T at once (both posted before either is waited on, so Gloo never stages the data).
* SLOW sender: an empty D, the trailer ``[SLOW, ...]``, then it waits for the receiver's verdict (tag V) and sends
  the data (tag E) only when the receiver agreed; both then adopt the new description.
* SLOW receiver: receives D into scratch of the agreed size (an empty message leaves its pages untouched), reads
  the trailer, and answers with a verdict.
* Every receive answers with a verdict V. A FAST sender collects it at its next send to that peer, before any of
  that send moves, or at once for messages of ``ACK_NOW_BYTES`` and more. So a mismatch raises at once on the
  receiver (its tensor untouched), at once on the sender of a large message or a changed shape, and at the next
  send to that peer for a small one: never a truncation, never an aborted process.

Per direction, operations run one at a time and in order (the agreement is a sequence); different peers and the
two directions of a pair are independent. Backends must match by (peer, tag), accept empty messages, and
complete a receive with a message shorter than the posted buffer (Gloo does).
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, Optional, Tuple

import torch

from .backends.base import TAG_KIND_P2P, TAG_KIND_SHIFT, Backend, Work
from .errors import TensorMismatchError

_PAYLOAD_MASK = (1 << TAG_KIND_SHIFT) - 1
_D, _T, _V, _E = 0, 1, 2, 3  # sub-tags: data (fast, or empty), trailer, verdict, data after a slow agreement
_FAST, _SLOW = 1, 2
ACK_NOW_BYTES = 8 << 20  # from this size on a FAST sender waits for the verdict before returning

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8,
          torch.int8, torch.int16, torch.bool, torch.complex64, torch.complex128]
Desc = Tuple[int, int]  # (nbytes, dtype code)


def describe(t: torch.Tensor) -> Desc:
    """(nbytes, dtype code) of ``t``; dtypes outside the table get a code past its end (still compared exactly)."""
    try:
        code = DTYPES.index(t.dtype)
    except ValueError:
        code = len(DTYPES) + hash(str(t.dtype)) % 1000
    return t.numel() * t.element_size(), code


def dtype_name(code: int) -> str:
    return str(DTYPES[code]) if 0 <= code < len(DTYPES) else f"dtype code {code}"


class _Direction:
    """One direction of one pair, as seen by one side: its lock, sequence, agreement and unsettled verdict."""

    __slots__ = ("lock", "seq", "agreed", "pending")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seq = 0
        self.agreed: Optional[Desc] = None
        # sender: (verdict receive, its buffer, message number) of the last FAST send; receiver: the verdict send
        self.pending: Optional[Tuple[Work, torch.Tensor, int]] = None


class CheckedP2P:
    """The checked send/recv of one group over ``backend``; ``left(deadline)`` gives a wait's remaining seconds."""

    def __init__(self, backend: Backend, left: Callable[[float], float]) -> None:
        self._backend = backend
        self._left = left
        self._lock = threading.Lock()
        self._send: Dict[int, _Direction] = {}
        self._recv: Dict[int, _Direction] = {}

    def _direction(self, table: Dict[int, _Direction], peer: int) -> _Direction:
        with self._lock:
            d = table.get(peer)
            if d is None:
                d = table[peer] = _Direction()
            return d

    @staticmethod
    def _tag(seq: int, sub: int) -> int:
        return (TAG_KIND_P2P << TAG_KIND_SHIFT) | (((seq << 2) | sub) & _PAYLOAD_MASK)

    # ------------------------------------------------------------------ sender
    def send(self, t: torch.Tensor, dst: int, deadline: float) -> None:
        d = self._direction(self._send, dst)
        b, left = self._backend, self._left
        with d.lock:
            self._settle_send(d, dst, deadline)
            seq, d.seq = d.seq, d.seq + 1
            mine = describe(t)
            verdict = torch.zeros(3, dtype=torch.int64)
            if mine == d.agreed:
                w_data = b.isend(t, dst, self._tag(seq, _D))
                w_trailer = b.isend(_trailer(_FAST, mine), dst, self._tag(seq, _T))
                w_verdict = b.irecv(verdict, dst, self._tag(seq, _V))
                w_data.wait(left(deadline))
                w_trailer.wait(left(deadline))
                d.pending = (w_verdict, verdict, seq)
                if mine[0] >= ACK_NOW_BYTES:
                    self._settle_send(d, dst, deadline, late=False)
                return
            w_data = b.isend(torch.empty(0, dtype=torch.uint8), dst, self._tag(seq, _D))
            w_trailer = b.isend(_trailer(_SLOW, mine), dst, self._tag(seq, _T))
            b.irecv(verdict, dst, self._tag(seq, _V)).wait(left(deadline))
            w_data.wait(left(deadline))
            w_trailer.wait(left(deadline))
            if int(verdict[0]) != 1:
                raise _sender_mismatch(dst, verdict, mine, "nothing was sent")
            b.isend(t, dst, self._tag(seq, _E)).wait(left(deadline))
            d.agreed = mine

    def _settle_send(self, d: _Direction, dst: int, deadline: float, late: bool = True) -> None:
        """Collect the verdict of the last FAST send; raise its mismatch (before this send moves anything)."""
        if d.pending is None:
            return
        work, verdict, seq = d.pending
        work.wait(self._left(deadline))
        d.pending = None
        if int(verdict[0]) != 1:
            when = (f"the previous send to rank {dst} (message #{seq} on this pair) was refused by the receiver; "
                    "this send was not started") if late else "the receiver discarded the data"
            raise _sender_mismatch(dst, verdict, d.agreed or (0, -1), when)

    # ------------------------------------------------------------------ receiver
    def recv(self, t: torch.Tensor, src: int, deadline: float) -> None:
        d = self._direction(self._recv, src)
        b, left = self._backend, self._left
        with d.lock:
            if d.pending is not None:  # our last verdict: sent long ago in practice; never dropped while in flight
                d.pending[0].wait(left(deadline))
                d.pending = None
            seq, d.seq = d.seq, d.seq + 1
            mine = describe(t)
            fast = mine == d.agreed
            landing = t if fast else torch.empty(d.agreed[0] if d.agreed else 0, dtype=torch.uint8)
            trailer = torch.zeros(3, dtype=torch.int64)
            w_data = b.irecv(landing, src, self._tag(seq, _D))
            w_trailer = b.irecv(trailer, src, self._tag(seq, _T))
            w_data.wait(left(deadline))
            w_trailer.wait(left(deadline))
            mode, theirs = int(trailer[0]), (int(trailer[1]), int(trailer[2]))
            ok = theirs == mine
            answer = torch.tensor([1 if ok else 0, mine[0], mine[1]], dtype=torch.int64)
            w_verdict = b.isend(answer, src, self._tag(seq, _V))
            if ok and mode == _SLOW:
                b.irecv(t, src, self._tag(seq, _E)).wait(left(deadline))
                d.agreed = mine
            d.pending = (w_verdict, answer, seq)
            if not ok:
                w_verdict.wait(left(deadline))
                d.pending = None
                raise TensorMismatchError(
                    f"rank {src} sent {theirs[0]} bytes of {dtype_name(theirs[1])} but this rank receives into "
                    f"{mine[0]} bytes of {t.dtype}; the receive tensor was left untouched", peer=src, op="recv",
                    hint="make the recv tensor the same size and dtype as the sent tensor",
                )


def _trailer(mode: int, desc: Desc) -> torch.Tensor:
    return torch.tensor([mode, desc[0], desc[1]], dtype=torch.int64)


def _sender_mismatch(dst: int, verdict: torch.Tensor, mine: Desc, what: str) -> TensorMismatchError:
    return TensorMismatchError(
        f"rank {dst} receives into {int(verdict[1])} bytes of {dtype_name(int(verdict[2]))} but this rank sends "
        f"{mine[0]} bytes of {dtype_name(mine[1])}; {what}", peer=dst, op="send",
        hint="make the send tensor the same size and dtype as the receiver's tensor",
    )

