"""The ucx backend's send and receive, as operations advanced by whichever thread progresses the worker.

Wire protocol per user tag ``t`` (each on its own UCX tag of the pair, keyed on worker-address pairs, hashed with
the endpoint's random tag on listener pairs, so posting order does not matter and outsiders cannot match):

* ``HDR(t)``: the sender's header (size, dtype code, flags). Up to :data:`INLINE_MAX` bytes of a host tensor travel
  inside it, after the header (one message, one copy on each side); larger or CUDA payloads follow on ``t`` itself.
* ``REPLY(t)``: the receiver's verdict, ACK or NACK with what it expected. A NACK makes both sides raise
  TensorMismatchError; the sender sends a separate payload only after an ACK, so it never blocks on a receiver that
  will not take it and large payloads stay out of UCX's unexpected-message queue. CANCEL: the receive timed out
  before it answered; it is withdrawn (a header that comes later lands in a spare buffer, never in the tensor) and
  the send fails with CommunicationError saying so.

A wait that times out withdraws its operation when nothing of the caller's tensor is in UCX's hands yet (a
receive that has not answered, a send whose payload is not posted): it never reads or writes that tensor later.
Otherwise (the payload is moving) the wait gives it as long again, then raises with the operation still posted.

The receiver posts its HDR receive with room for the largest inline payload, so a message is never truncated
whatever the two sides' sizes are; it decides from the header alone whether a payload follows.
"""

from __future__ import annotations

import struct
from typing import Any, List, Optional

import torch

from ..errors import RdtError
from ._ucx_progress import Op

# Control record: kind, dtype code, flags, tag, nbytes, reserved (same layout as the connection's control tag).
CTL = struct.Struct("<BBHIQQ")
HDR, ACK, NACK = 1, 2, 3
CANCEL = 5  # a verdict: the receive was withdrawn (4 is BYE on the connection's control tag)
INLINE = 1  # flag: the payload follows the header in the same message
INLINE_MAX = 64 << 10
AGREED_MAX = 16  # (size, dtype) pairs per peer whose small sends skip waiting for their own verdict
HDR_TAG = 1 << 36  # sub-tags of a user tag (user tags are < 2**31)
REPLY_TAG = 2 << 36
_NO_HEADER = bytes(CTL.size)


class P2POp(Op):
    """Common part of a send or receive on one pair: waits for the connection, then runs its steps."""

    kind = ""

    def __init__(self, backend: Any, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self.backend = backend
        self.peer = peer
        self.tag = tag
        self.tensor = tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        self.dcode = backend._dtype_code(tensor.dtype)
        self.state: Any = None
        self.reqs: List[Any] = []
        self.buffers: List[Any] = []  # kept alive while UCX may touch them
        self.prev: Optional[SendOp] = None  # a send's predecessor on the pair, until its verdict was read

    def requests(self) -> List[Any]:
        return self.reqs

    def start(self) -> None:
        self.backend._ensure_connection(self.peer)
        self.advance()

    def finish(self, error: Optional[BaseException] = None) -> None:
        """Done: out of the pending table, and rid of the tensor and payload buffers once UCX is through with them
        (its Work, or the peer's next send, may keep the operation itself for a while)."""
        if self.done:
            return
        super().finish(error)
        self.backend._finished(self)
        self.prev = None
        if error is None or all(r.completed for r in self.requests()):  # else a zombie: UCX may still touch them
            self.tensor = None
            self.buffers = []
            self.reqs = []

    def advance(self) -> None:
        if self.done:  # withdrawn by its timed-out wait: it takes no further step
            return
        if self.state is None:
            state = self.backend._peers.get(self.peer)
            if state is not None and state.error is not None:
                raise state.error
            if state is None or state.ep is None or state.ep._ep is None:
                return  # still connecting (the loop thread attaches the endpoint, then wakes us)
            self.state = state
            self.begin()
        # What arrived counts before a failure of the peer is acted on: its BYE (or close) comes after the last
        # message of a transfer it completed, but the loop thread can mark the peer gone before this operation is
        # looked at (both read in one progress, on a busy machine). So step first; fail only what still needs it.
        try:
            for r in self.reqs:
                if r.completed:
                    r.check_error()
            self.step()
        except RdtError:
            raise
        except Exception:
            if self.state.error is not None:  # UCX's view of the same departure: report it as the peer's
                raise self.state.error from None
            raise
        if not self.done and self.state.error is not None:
            raise self.state.error

    def begin(self) -> None:
        """Post the first requests on the connected pair."""

    def withdraw(self, error: BaseException) -> bool:
        """Its wait timed out: end it with ``error`` when UCX holds nothing of the tensor yet (engine lock held);
        False while a payload is moving."""
        return False

    def step(self) -> None:
        """Take the next step when the requests allow it."""

    def send(self, buf: Any, subtag: int) -> Any:
        request = self.backend._raw_send(self.state, buf, subtag)
        self.buffers.append(buf)
        return request

    def recv(self, buf: Any, subtag: int) -> Any:
        request = self.backend._raw_recv(self.state, buf, subtag)
        self.buffers.append(buf)
        return request

    def reply(self, kind: int) -> Any:
        """Send ACK/NACK for this tag. A NACK is left to complete in the background (the operation fails now);
        an ACK is returned, and the receive ends only when it is out (it needs progress over tcp)."""
        buf = bytearray(CTL.pack(kind, self.dcode, 0, self.tag, self.nbytes, 0))
        request = self.backend._raw_send(self.state, buf, REPLY_TAG | self.tag)
        self.buffers.append(buf)
        if kind != ACK:
            self.backend._engine.background(request, buf)
        return request

    def mismatch(self, their_nbytes: int, their_dcode: int) -> BaseException:
        return self.backend._mismatch(self.kind, self.peer, self.tag, self.nbytes, self.dcode, their_nbytes,
                                      their_dcode)


class SendOp(P2POp):
    """Header (with the payload inline when small and on the host), then the verdict, then a large payload.

    A small host send whose (size, dtype) the receiver already accepted on this pair (one of the last
    :data:`AGREED_MAX` accepted) does not wait for its own verdict ("fast"): it completes once its message is out
    and the verdict of the pair's previous send has come back. So a receiver that changed its mind makes the
    sender raise at its next send to that peer; a new (size, dtype), a large or a CUDA send waits for its own
    verdict and raises on that very message."""

    kind = "send"

    def begin(self) -> None:
        self.spare = self.backend._take_buffer(CTL.size)
        self.verdict = self.spare[0]
        self.verdict[:] = _NO_HEADER  # a reused buffer: only the peer's verdict may read as one
        self.reply_req = self.backend._raw_recv(self.state, self.verdict, REPLY_TAG | self.tag, self.spare[1])
        self.buffers.append(self.spare)
        inline = self.nbytes <= INLINE_MAX and not self.tensor.is_cuda
        head = CTL.pack(HDR, self.dcode, INLINE if inline else 0, self.tag, self.nbytes, 0)
        if inline:
            msg = bytearray(CTL.size + self.nbytes)
            msg[:CTL.size] = head
            if self.nbytes:
                memoryview(msg)[CTL.size:] = self.backend._host_bytes(self.tensor)
        else:
            msg = bytearray(head)
        self.inline = inline
        self.data_req: Optional[Any] = None
        self.head_req = self.send(msg, HDR_TAG | self.tag)
        self.reqs = [self.reply_req, self.head_req]
        state = self.state
        self.fast = inline and (self.nbytes, self.dcode) in state.agreed
        self.prev = state.unverified  # its verdict must be in before this send completes
        state.unverified = self

    def requests(self) -> List[Any]:
        return self.reqs

    def step(self) -> None:
        if not self._prev_verified():
            return
        if self.data_req is not None:
            if _all_done(self.reqs):
                self.finish()
            return
        if self.fast:
            if _all_done([self.head_req]):
                self.finish()  # the verdict is read by the next send to this peer
            return
        if not self.reply_req.completed:
            return
        kind, their_dcode, _, _, their_nbytes, _ = CTL.unpack(bytes(self.verdict))
        if kind == CANCEL:
            raise self.backend._cancelled(self.peer, self.tag, self.nbytes)
        if kind != ACK:
            raise self.mismatch(their_nbytes, their_dcode)
        agreed = self.state.agreed
        agreed[(self.nbytes, self.dcode)] = None
        if len(agreed) > AGREED_MAX:
            del agreed[next(iter(agreed))]
        if self.inline or not self.nbytes:
            if _all_done(self.reqs):
                self.finish()
            else:
                self.data_req = self.head_req  # the header (with the payload) is still going out
            return
        self.data_req = self.send(self.backend._byte_view(self.tensor), self.tag)
        self.reqs.append(self.data_req)
        if _all_done(self.reqs):
            self.finish()

    def withdraw(self, error: BaseException) -> bool:
        """A send whose payload is not posted yet ends (an inline one is out already, and only that copy goes)."""
        if self.state is not None and self.data_req is not None and not self.inline:
            return False
        self.finish(error)
        return True

    def _prev_verified(self) -> bool:
        """True once the previous send's verdict is in; raises when it refused a fast send (which completed)."""
        prev = self.prev
        if prev is None:
            return True
        if prev.error is not None:  # failed or withdrawn: its verdict may never come, and nobody waits for it
            self.prev = None
            return True
        if not prev.reply_req.completed:
            return False
        self.prev = None
        prev.reply_req.check_error()
        kind, their_dcode, _, _, their_nbytes, _ = CTL.unpack(bytes(prev.verdict))
        if prev.done:  # its own step read the verdict already (or never will): this was the last reader
            self.backend._give_buffer(prev.spare)
        if kind == CANCEL and prev.fast:
            raise self.backend._cancelled(self.peer, prev.tag, prev.nbytes, later=self.tag)
        if kind != ACK and prev.fast:
            self.state.agreed.clear()
            raise self.backend._late_mismatch(self.peer, self.tag, prev.tag, prev.nbytes, prev.dcode, their_nbytes,
                                              their_dcode)
        return True


class RecvOp(P2POp):
    """Header (maybe with the payload), check it, answer; the payload lands in the user's tensor."""

    kind = "recv"
    data_req: Optional[Any] = None  # until begin(): an op that fails before it (its peer already gone) finishes
    ack: Optional[Any] = None

    def withdraw(self, error: BaseException) -> bool:
        """A receive that has not answered the header ends and tells the sender (CANCEL); after its ACK the
        payload is on its way into the tensor, so it stays."""
        if self.data_req is not None:
            return False
        self.finish(error)
        if self.state is not None:
            self.reply(CANCEL)
        return True

    def begin(self) -> None:
        self.data_req: Optional[Any] = None
        self.ack: Optional[Any] = None  # the ACK of a payload that came inline (or of an empty one)
        self.spare = self.backend._take_buffer(CTL.size + INLINE_MAX)
        self.head = self.spare[0]
        self.head[:CTL.size] = _NO_HEADER  # a reused buffer: a message too short for a header must not parse as one
        self.head_req = self.backend._raw_recv(self.state, self.head, HDR_TAG | self.tag, self.spare[1])
        self.buffers.append(self.spare)
        self.reqs = [self.head_req]

    def requests(self) -> List[Any]:
        return self.reqs if self.ack is None else self.reqs + [self.ack]

    def step(self) -> None:
        if self.ack is not None:
            self._acked()
            return
        if self.data_req is not None:
            if _all_done(self.reqs):
                self.finish()
            return
        if not self.head_req.completed:
            return
        kind, their_dcode, flags, _, their_nbytes, _ = CTL.unpack_from(self.head)
        if kind != HDR or their_nbytes != self.nbytes or (self.dcode and their_dcode and their_dcode != self.dcode):
            self.reply(NACK)
            raise self.mismatch(their_nbytes, their_dcode)
        if flags & INLINE or not self.nbytes:
            if self.nbytes:
                self.backend._fill(self.tensor, memoryview(self.head)[CTL.size:CTL.size + self.nbytes])
            self.backend._give_buffer(self.spare)  # its receive completed and its bytes are consumed
            self.ack = self.reply(ACK)  # nothing more to receive
            self._acked()
            return
        self.data_req = self.recv(self.backend._byte_view(self.tensor), self.tag)
        self.reqs.append(self.reply(ACK))
        self.backend._give_buffer(self.spare)  # its receive completed and its bytes are consumed
        self.reqs.append(self.data_req)
        if _all_done(self.reqs):
            self.finish()

    def _acked(self) -> None:
        """The data is in the tensor; done once the ACK is out, or at once when the sender is gone (the ACK is
        for the sender's sake: its failure does not undo a receive that is complete)."""
        ack = self.ack
        if ack.completed or self.state.error is not None:
            self.backend._engine.background(ack, self.buffers[-1])  # its error, if any, is consumed there
            self.finish()


def _all_done(requests: List[Any]) -> bool:
    """True when every request completed; raises the first one's error."""
    if not all(r.completed for r in requests):
        return False
    for r in requests:
        r.check_error()
    return True
