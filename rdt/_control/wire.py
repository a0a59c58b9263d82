"""The control channel's wire format: authenticated binary frames between rdt processes, and raw byte streams.

A frame is ``u32 length | header | payload | HMAC-SHA256``, fixed binary structs, never pickled. The key is the
per-group secret (group requests), the producer's process key (which reaches consumers only inside object metadata
delivered by Ray) or its stats key. Bad MACs, stale timestamps, oversize or malformed frames raise
:class:`ProtocolError`; the server (``server``) drops them, the client (``client``) fails the request.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

MAGIC = b"RDT1"
VERSION = 1
_HEADER = struct.Struct("!4sBBH16sQ")  # magic, version, type, key id, nonce, timestamp (ms)
_MAC_LEN = 32
MAX_FRAME = 1 << 20
MAX_SKEW_MS = 120_000
_CHUNK = 4 << 20  # bytes per socket call when streaming an object's bytes

# Message types. The control channel's own requests are below; every transport numbers its own in its module
# (the built-in ones from 1 to 63, a user's transport from USER_MESSAGES_FROM on) and the registry refuses two
# transports serving one number.
REQ_PING = 4
REQ_STATS = 6  # answer: the process's rdt.stats() as UTF-8 JSON
# Sharded weight sync's reads of a published version (rdt._process.versions): a reader registers before it reads
# and ends after, so that the producer's fence waits for it; checksums of a planned range set (verify=True).
REQ_READ_BEGIN = 60  # payload: obj_id(16) version(u64) reader(16) wait_ms(u32) who(utf-8)
REQ_READ_END = 61  # payload: obj_id(16) reader(16); answer: held(u8): 1 when the version held through the read
REQ_RANGE_SUMS = 62  # payload: obj_id(16) plan_key(16) n(u32) [group u32*n buf u32*n off u64*n len u64*n];
#   answer: 0(u8) when n was 0 and the plan key is unknown (send the ranges), else 1(u8) then the checksums
RESP_OK = 100
RESP_ERR = 101  # payload: code(u16) utf-8 message
CORE_MESSAGES = (REQ_PING, REQ_STATS, REQ_READ_BEGIN, REQ_READ_END, REQ_RANGE_SUMS, RESP_OK, RESP_ERR)
USER_MESSAGES_FROM = 128  # message types are one byte: 128..255 are left to users' transports

KEY_PROCESS = 0
KEY_GROUP = 1
KEY_STATS = 2  # per-process key published in the GCS (namespace "rdt"): authorizes REQ_STATS and REQ_PING only

ERR_NOT_FOUND = 1
ERR_BAD_REQUEST = 2
ERR_INTERNAL = 3
ERR_NO_GROUP = 4
ERR_VERSION_GONE = 20  # the published version is gone (fenced, superseded, no longer kept)


class ProtocolError(Exception):
    """A frame that must be dropped (bad MAC, malformed, replayed)."""


def err(code: int, message: str) -> Tuple[int, bytes]:
    """A control error response."""
    return RESP_ERR, struct.pack("!H", code) + message.encode()


def encode(msg_type: int, key_id: int, key: bytes, payload: bytes, nonce: Optional[bytes] = None) -> bytes:
    """One authenticated frame."""
    nonce = nonce or os.urandom(16)
    header = _HEADER.pack(MAGIC, VERSION, msg_type, key_id, nonce, int(time.time() * 1000))
    mac = hmac.new(key, header + payload, hashlib.sha256).digest()
    body = header + payload + mac
    return struct.pack("!I", len(body)) + body


def decode(body: bytes, key_for: Callable[[int, bytes], Optional[bytes]]) -> Tuple[int, int, bytes, bytes]:
    """Verify and split a frame body -> (type, key id, nonce, payload). ``key_for(key_id, payload)`` picks the key."""
    if len(body) < _HEADER.size + _MAC_LEN:
        raise ProtocolError("short frame")
    magic, version, msg_type, key_id, nonce, ts = _HEADER.unpack_from(body)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError("bad magic/version")
    payload = body[_HEADER.size:-_MAC_LEN]
    key = key_for(key_id, payload)
    if key is None:
        raise ProtocolError("unknown key")
    expected = hmac.new(key, body[:-_MAC_LEN], hashlib.sha256).digest()
    if not hmac.compare_digest(expected, body[-_MAC_LEN:]):
        raise ProtocolError("bad MAC")
    if abs(int(time.time() * 1000) - ts) > MAX_SKEW_MS:
        raise ProtocolError("stale timestamp")
    return msg_type, key_id, nonce, payload


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket) -> bytes:
    """One frame body; ConnectionError if the peer closed between frames, ProtocolError if it closed mid-frame."""
    first = sock.recv(4)
    if not first:
        raise ConnectionError("connection closed")
    try:
        (length,) = struct.unpack("!I", first + _recv_exact(sock, 4 - len(first)))
        if length > MAX_FRAME:
            raise ProtocolError(f"frame of {length} bytes is over the limit")
        return _recv_exact(sock, length)
    except ConnectionError as e:
        raise ProtocolError(f"truncated frame: {e}") from e


Handler = Callable[[int, bytes], Any]  # (key_id, payload) -> (resp type, resp payload[, Stream]) or Held


@dataclass
class Held:
    """A handler's answer that may wait long (a long poll): ``answer()`` runs on the server's hold pool, never on
    a request worker, so held requests cannot queue other requests, the ones that end them included."""

    answer: Callable[[], Tuple[int, bytes]]


@dataclass
class Stream:
    """Raw bytes a handler sends after its answer frame (an object's buffers), and how long that may take."""

    buffers: Sequence[memoryview]
    deadline: float  # time.monotonic() by which the bytes must be sent (the consumer's own deadline)


def send_stream(sock: socket.socket, key: bytes, nonce: bytes, stream: Stream) -> None:
    """Send ``stream``'s bytes then HMAC(key, nonce | bytes), within the stream's timeout."""
    deadline = stream.deadline
    mac = hmac.new(key, nonce, hashlib.sha256)
    for buf in stream.buffers:
        view = memoryview(buf).cast("B")
        for start in range(0, len(view), _CHUNK):
            chunk = view[start:start + _CHUNK]
            mac.update(chunk)
            sock.settimeout(_remaining(deadline, "sending an object's bytes"))
            sock.sendall(chunk)
    sock.settimeout(_remaining(deadline, "sending an object's bytes"))
    sock.sendall(mac.digest())


def recv_stream(sock: socket.socket, key: bytes, nonce: bytes, into: Sequence[memoryview], deadline: float) -> None:
    """Receive raw bytes straight into ``into`` (exactly their sizes) and check the trailing MAC."""
    mac = hmac.new(key, nonce, hashlib.sha256)
    for buf in into:
        view = memoryview(buf).cast("B")
        got = 0
        while got < len(view):
            sock.settimeout(_remaining(deadline, "receiving an object's bytes"))
            n = sock.recv_into(view[got:], min(len(view) - got, _CHUNK))
            if not n:
                raise ProtocolError("connection closed in the middle of an object's bytes")
            mac.update(view[got:got + n])
            got += n
    sock.settimeout(_remaining(deadline, "receiving an object's bytes"))
    if not hmac.compare_digest(mac.digest(), _recv_exact(sock, _MAC_LEN)):
        raise ProtocolError("bad MAC on an object's bytes")


def _remaining(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"timed out {what}")
    return left


Alloc = Callable[[int, bytes], Optional[Sequence[memoryview]]]  # (resp type, resp payload) -> where bytes go
