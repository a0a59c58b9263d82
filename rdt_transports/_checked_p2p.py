"""Size/dtype-checked send/recv for backends that cannot detect a mismatch themselves (Gloo).

Gloo completes a receive with a *shorter* message silently and aborts the receiving process on a *longer* one,
so a receiver must never post a buffer a sender may overrun. And every Gloo message costs a rendezvous (the
receiver's "ready", then the data): measured here, a header before each message doubles the cost of a 4 KiB
send, and a trailer message adds as much. So the two ends agree once per direction and then send the bare data:

* Both ends of a direction (``src -> dst``) keep ``agreed``: the (nbytes, dtype) of the last message both
  checked. Each end compares its own tensor with ``agreed`` alone: equal is FAST, different is SLOW.
* FAST sender: the data, one message, nothing else. SLOW sender: an empty message, then a trailer with its
  (nbytes, dtype), then it waits for the receiver's verdict and sends the data only on a yes.
* The receiver posts the first message into its tensor (FAST) or into scratch of the agreed size (SLOW), after
  writing a random 16-byte canary at its start. Canary gone: a FAST sender's data arrived. Canary intact: the
  empty message of a SLOW sender arrived, the canary's bytes are put back and the trailer follows. (Data that
  happens to start with the canary, once in 2**128, reads as SLOW and ends in a timeout, never in bad data.)
  Agreements smaller than the canary travel as one staged message instead: [trailer | data].
* Who raises: the receiver at once, with its tensor untouched. The sender at once when it is SLOW or the message
  is ``ACK_NOW_BYTES`` or more (the receiver answers those with a verdict). For a small FAST message the receiver
  leaves a record in the group's rendezvous and aborts its side, so the sender's next operation with that peer
  fails at once and raises the mismatch from that record.

Per direction, operations run one at a time in order (the agreement is a sequence); different peers and the two
directions of a pair are independent. A backend using this must match by (peer, tag), accept empty messages and
complete a receive with a shorter message (Gloo does).
"""

from __future__ import annotations

import ctypes
import os
import random
import threading
import time
from typing import Callable, Dict, Optional, Tuple

import torch

from .backends.base import TAG_KIND_P2P, TAG_KIND_SHIFT, Backend
from .errors import CommunicationError, TensorMismatchError

_PAYLOAD_MASK = (1 << TAG_KIND_SHIFT) - 1
_P2P = TAG_KIND_P2P << TAG_KIND_SHIFT
_D, _T, _V, _E = 0, 1, 2, 3  # sub-tags: first message, trailer, verdict, data after a SLOW agreement
_FAST, _SLOW = 1, 2
_HDR = 24  # a trailer: int64 [mode, nbytes, dtype code]
CANARY = 16  # bytes; agreements smaller than this use one staged message
ACK_NOW_BYTES = 8 << 20  # from this size on the receiver answers every message and a FAST sender waits for it
MISMATCH_KEY = "p2p-mismatch/{src}-{dst}"  # rendezvous record a receiver leaves for a sender it cannot answer

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8,
          torch.int8, torch.int16, torch.bool, torch.complex64, torch.complex128]
Desc = Tuple[int, int]  # (nbytes, dtype code)


_CODES = {d: i for i, d in enumerate(DTYPES)}


def describe(t: torch.Tensor) -> Desc:
    """(nbytes, dtype code) of ``t``; a dtype outside the table gets a code past its end."""
    code = _CODES.get(t.dtype)
    if code is None:
        code = len(DTYPES) + sum(str(t.dtype).encode()) % 1000
    return t.numel() * t.element_size(), code


def dtype_name(code: int) -> str:
    return str(DTYPES[code]) if 0 <= code < len(DTYPES) else f"dtype code {code}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _trailer(mode: int, desc: Desc) -> torch.Tensor:
    return torch.tensor([mode, desc[0], desc[1]], dtype=torch.int64)


_canaries = random.Random(os.urandom(32))  # a canary need not be secret, only unlikely in data: no syscall per receive
# A writable memoryview over raw memory, no copy (a private prototype: pythonapi's shared one is left as it is).
_window_at = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)(
    ("PyMemoryView_FromMemory", ctypes.pythonapi))
_PYBUF_WRITE = 0x200
WINDOWS = 64  # receive tensors whose canary window a group keeps (a pipeline stage reuses a few buffers)


def _new_canary() -> bytes:
    return _canaries.getrandbits(CANARY * 8).to_bytes(CANARY, "little")


def _peek(t: torch.Tensor) -> bytes:
    """The first CANARY bytes of contiguous ``t`` (ctypes on CPU: a few torch calls cost ~50 us per receive)."""
    if t.is_cpu:
        return ctypes.string_at(t.data_ptr(), CANARY)
    return _bytes(t)[:CANARY].cpu().numpy().tobytes()


def _poke(t: torch.Tensor, data: bytes) -> None:
    """Overwrite the first CANARY bytes of contiguous ``t`` with ``data``."""
    if t.is_cpu:
        ctypes.memmove(t.data_ptr(), data, CANARY)
    else:
        _bytes(t)[:CANARY].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


class _Direction:
    """One direction of one pair, as one end sees it: a lock, the next message number and the agreement."""

    __slots__ = ("lock", "seq", "agreed", "canary")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seq = 0
        self.agreed: Optional[Desc] = None
        # The receiver's canary on the usual path: random, and private to this end, so no data can carry it (its
        # bytes never stay in a tensor: they are put back whenever they are not overwritten).
        self.canary = _new_canary()


class CheckedP2P:
    """The checked send/recv of one group over ``backend``; ``left(deadline)`` gives a wait's remaining seconds."""

    def __init__(self, backend: Backend, left: Callable[[float], float]) -> None:
        self._b = backend
        self._left = left
        self._lock = threading.Lock()
        self._send: Dict[int, _Direction] = {}
        self._recv: Dict[int, _Direction] = {}
        # data_ptr -> memoryview of the CANARY bytes there. Used only for a tensor whose data_ptr is that address
        # at that moment, so the bytes are that tensor's own, whatever tensor the address belonged to before. Two
        # ctypes calls per receive cost more than the rest of the canary work, cold after a blocking wait.
        self._windows: Dict[int, memoryview] = {}

    def _direction(self, table: Dict[int, _Direction], peer: int) -> _Direction:
        with self._lock:  # entries are only ever added: callers try a lock-free hit first
            d = table.get(peer)
            if d is None:
                d = table[peer] = _Direction()
            return d

    @staticmethod
    def _tag(seq: int, sub: int) -> int:
        return (TAG_KIND_P2P << TAG_KIND_SHIFT) | (((seq << 2) | sub) & _PAYLOAD_MASK)

    # ------------------------------------------------------------------ sender
    def send(self, t: torch.Tensor, dst: int, deadline: float, nbytes: int, dtype: Optional[torch.dtype] = None,
             cpu: Optional[bool] = None) -> None:
        """Send ``t`` (``nbytes`` long of ``dtype``, as the caller already knows) to ``dst`` by ``deadline``."""
        d = self._send.get(dst) or self._direction(self._send, dst)
        with d.lock:
            seq = d.seq
            d.seq = seq + 1
            code = _CODES.get(t.dtype if dtype is None else dtype)  # describe(t), written out (frames cost here)
            mine = (nbytes, code) if code is not None else describe(t)
            try:
                if mine != d.agreed:
                    self._send_slow(t, dst, seq, mine, d, deadline)
                elif CANARY <= mine[0] < ACK_NOW_BYTES:  # the usual message, inline: the bare data
                    self._b.send_wait(t, dst, _P2P | ((seq << 2) & _PAYLOAD_MASK),
                                      max(deadline - time.monotonic(), 1e-3))
                else:
                    self._send_fast(t, dst, seq, mine, deadline)
            except TensorMismatchError:
                raise
            except CommunicationError as e:
                refused = self._refusal(dst)
                if refused is None:
                    raise
                raise TensorMismatchError(
                    f"rank {dst} refused an earlier send of this rank on this pair: it receives into {refused}; "
                    "it aborted the group, and this send was not completed", peer=dst, op="send",
                    hint="make the send tensor the same size and dtype as the receiver's tensor, then destroy and "
                    "re-create the group",
                ) from e

    def _send_fast(self, t: torch.Tensor, dst: int, seq: int, mine: Desc, deadline: float) -> None:
        b, left = self._b, self._left
        if mine[0] < CANARY:
            staged = torch.empty(_HDR + mine[0], dtype=torch.uint8)
            staged[:_HDR].copy_(_trailer(_FAST, mine).view(torch.uint8))
            staged[_HDR:].copy_(_bytes(t))
            b.isend(staged, dst, self._tag(seq, _D)).wait(left(deadline))
            return
        verdict = torch.zeros(3, dtype=torch.int64)
        w_verdict = b.irecv(verdict, dst, self._tag(seq, _V))
        b.isend(t, dst, self._tag(seq, _D)).wait(left(deadline))
        w_verdict.wait(left(deadline))
        if int(verdict[0]) != 1:
            raise _sender_mismatch(dst, verdict, mine, "the receiver discarded the data")

    def _send_slow(self, t: torch.Tensor, dst: int, seq: int, mine: Desc, d: _Direction, deadline: float) -> None:
        b, left = self._b, self._left
        verdict = torch.zeros(3, dtype=torch.int64)
        w_verdict = b.irecv(verdict, dst, self._tag(seq, _V))
        trailer = _trailer(_SLOW, mine)
        if d.agreed is not None and d.agreed[0] < CANARY:  # the receiver expects one staged message
            works = [b.isend(trailer.view(torch.uint8), dst, self._tag(seq, _D))]
        else:
            works = [b.isend(torch.empty(0, dtype=torch.uint8), dst, self._tag(seq, _D)),
                     b.isend(trailer, dst, self._tag(seq, _T))]
        for w in works:
            w.wait(left(deadline))
        w_verdict.wait(left(deadline))
        if int(verdict[0]) != 1:
            raise _sender_mismatch(dst, verdict, mine, "nothing was sent")
        b.isend(t, dst, self._tag(seq, _E)).wait(left(deadline))
        d.agreed = mine

    def _refusal(self, dst: int) -> Optional[str]:
        """What ``dst`` receives into, if it left a mismatch record for this rank (one read, on failure only)."""
        try:
            raw = self._b.config.rendezvous.try_get(MISMATCH_KEY.format(src=self._b.rank, dst=dst))
        except Exception:  # noqa: BLE001 - no record readable: report the original error
            return None
        return raw.decode(errors="replace") if raw else None

    # ------------------------------------------------------------------ receiver
    def recv(self, t: torch.Tensor, src: int, deadline: float, nbytes: int, dtype: Optional[torch.dtype] = None,
             cpu: Optional[bool] = None) -> None:
        """Receive into ``t`` (``nbytes`` long of ``dtype``) from ``src`` by ``deadline``: all of it, or a typed
        error. ``dtype`` and ``cpu`` (is ``t`` on the CPU) spare torch calls when the caller has read them."""
        d = self._recv.get(src) or self._direction(self._recv, src)
        with d.lock:
            seq = d.seq
            d.seq = seq + 1
            code = _CODES.get(t.dtype if dtype is None else dtype)
            mine = (nbytes, code) if code is not None else describe(t)
            a = d.agreed
            if a == mine and CANARY <= mine[0] < ACK_NOW_BYTES and (t.is_cpu if cpu is None else cpu):
                # The usual message, written out (_recv_canary in fewer steps): the data lands in t behind a canary.
                ptr = t.data_ptr()
                w = self._windows.get(ptr) or self._window(ptr)
                saved = bytes(w)
                canary = d.canary
                w[:] = canary
                try:
                    self._b.recv_wait(t, src, _P2P | ((seq << 2) & _PAYLOAD_MASK),
                                      max(deadline - time.monotonic(), 1e-3))
                except BaseException:
                    if w == canary:
                        w[:] = saved
                    raise
                if w != canary:
                    return
                w[:] = saved  # a SLOW sender's empty message: its trailer follows
                theirs = self._read_trailer(src, seq, deadline)
            elif a is None:  # nothing agreed yet: the sender is SLOW for certain
                self._b.irecv(torch.empty(0, dtype=torch.uint8), src, self._tag(seq, _D)).wait(self._left(deadline))
                theirs = self._read_trailer(src, seq, deadline)
            elif a[0] < CANARY:
                theirs = self._recv_staged(t, src, seq, mine, a, deadline)
            else:
                theirs = self._recv_canary(t, src, seq, mine, a, deadline)
            if theirs is not None:
                self._verdict(t, src, seq, mine, theirs, d, deadline)

    def _window(self, ptr: int) -> memoryview:
        """A writable view of the CANARY bytes at ``ptr`` (kept for the next receives into the same tensor)."""
        if len(self._windows) >= WINDOWS:
            self._windows.clear()
        w = self._windows[ptr] = _window_at(ptr, CANARY, _PYBUF_WRITE)
        return w

    def _read_trailer(self, src: int, seq: int, deadline: float) -> Desc:
        trailer = torch.zeros(3, dtype=torch.int64)
        self._b.irecv(trailer, src, self._tag(seq, _T)).wait(self._left(deadline))
        return int(trailer[1]), int(trailer[2])

    def _recv_staged(self, t: torch.Tensor, src: int, seq: int, mine: Desc, a: Desc,
                     deadline: float) -> Optional[Desc]:
        """One staged message: [trailer | data] from a FAST sender, [trailer] from a SLOW one."""
        staged = torch.empty(_HDR + a[0], dtype=torch.uint8)
        self._b.irecv(staged, src, self._tag(seq, _D)).wait(self._left(deadline))
        head = staged[:_HDR].view(torch.int64)
        theirs = (int(head[1]), int(head[2]))
        if int(head[0]) != _FAST:
            return theirs
        if mine == a:
            _bytes(t).copy_(staged[_HDR:])
            return None
        raise self._refuse(src, seq, mine, theirs)

    def _recv_canary(self, t: torch.Tensor, src: int, seq: int, mine: Desc, a: Desc,
                     deadline: float) -> Optional[Desc]:
        """The first message into ``t`` (FAST) or scratch (SLOW) behind a canary: data, or a SLOW sender's nothing."""
        fast = mine == a
        landing = t if fast else torch.empty(a[0], dtype=torch.uint8)  # Gloo matches bytes, not dtypes
        saved = _peek(landing)
        canary = _new_canary()
        _poke(landing, canary)
        try:
            self._b.recv_wait(landing, src, self._tag(seq, _D), self._left(deadline))
        except BaseException:
            if _peek(landing) == canary:
                _poke(landing, saved)
            raise
        if _peek(landing) == canary:  # a SLOW sender's empty message: its trailer follows
            _poke(landing, saved)
            return self._read_trailer(src, seq, deadline)
        if fast:  # a FAST sender's data, in place
            if a[0] >= ACK_NOW_BYTES:
                self._answer(src, seq, True, mine, deadline)
            return None
        if a[0] >= ACK_NOW_BYTES:
            self._answer(src, seq, False, mine, deadline)
            raise _receiver_mismatch(src, a, mine, t)
        raise self._refuse(src, seq, mine, a)

    def _verdict(self, t: torch.Tensor, src: int, seq: int, mine: Desc, theirs: Desc, d: _Direction,
                 deadline: float) -> None:
        """Answer a SLOW sender: yes, and its data into ``t``; or no, and raise."""
        ok = theirs == mine
        w_data = self._b.irecv(t, src, self._tag(seq, _E)) if ok else None
        self._answer(src, seq, ok, mine, deadline)
        if w_data is None:
            raise _receiver_mismatch(src, theirs, mine, t)
        w_data.wait(self._left(deadline))
        d.agreed = mine

    def _answer(self, src: int, seq: int, ok: bool, mine: Desc, deadline: float) -> None:
        answer = torch.tensor([1 if ok else 0, mine[0], mine[1]], dtype=torch.int64)
        self._b.isend(answer, src, self._tag(seq, _V)).wait(self._left(deadline))

    def _refuse(self, src: int, seq: int, mine: Desc, theirs: Desc) -> TensorMismatchError:
        """A small FAST message this rank cannot take: leave a record for the sender and abort; the error to raise."""
        what = f"{mine[0]} bytes of {dtype_name(mine[1])} (message #{seq} of that pair)"
        try:
            self._b.config.rendezvous.put(MISMATCH_KEY.format(src=src, dst=self._b.rank), what.encode())
        except Exception:  # noqa: BLE001 - the sender then sees a closed connection without the reason
            pass
        self._b.abort()
        return TensorMismatchError(
            f"rank {src} sent {theirs[0]} bytes of {dtype_name(theirs[1])} but this rank receives into {mine[0]} "
            f"bytes of {dtype_name(mine[1])}; the receive tensor was left untouched, and the group was aborted so "
            "that the sender learns of it at its next operation", peer=src, op="recv",
            hint="make the recv tensor the same size and dtype as the sent tensor, then destroy and re-create the "
            "group",
        )


def _receiver_mismatch(src: int, theirs: Desc, mine: Desc, t: torch.Tensor) -> TensorMismatchError:
    return TensorMismatchError(
        f"rank {src} sent {theirs[0]} bytes of {dtype_name(theirs[1])} but this rank receives into {mine[0]} bytes "
        f"of {t.dtype}; the receive tensor was left untouched", peer=src, op="recv",
        hint="make the recv tensor the same size and dtype as the sent tensor",
    )


def _sender_mismatch(dst: int, verdict: torch.Tensor, mine: Desc, what: str) -> TensorMismatchError:
    return TensorMismatchError(
        f"rank {dst} receives into {int(verdict[1])} bytes of {dtype_name(int(verdict[2]))} but this rank sends "
        f"{mine[0]} bytes of {dtype_name(mine[1])}; {what}", peer=dst, op="send",
        hint="make the send tensor the same size and dtype as the receiver's tensor",
    )
