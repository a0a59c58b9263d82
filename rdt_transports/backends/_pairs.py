"""One authenticated TCP connection per pair of ranks, carrying fixed-size struct frames (and, for the tcp
backend, raw tensor bytes after a DATA frame).

Set-up (:func:`connect_pairs`, at backend init): every rank listens on an ephemeral port of its node address and
publishes ``host:port`` in the group rendezvous; the lower rank of each pair connects to the higher one. A mutual
HMAC-SHA256 challenge-response with the group secret (``config.secret``, handed out through Ray) runs before
anything else: the server sends a nonce, the client answers with its rank, its own nonce and
HMAC(secret, "c" | proto | server nonce | group uid | client rank | server rank), the server checks it with
``hmac.compare_digest`` and answers HMAC(secret, "s" | proto | client nonce | group uid | server rank | client
rank). Only a rank lower than the server's that is not yet connected is accepted; a listener takes at most
``rank`` authenticated connections and is closed as soon as it has them (or at the init deadline); rank 0 has
none. Handshakes run on their own threads (at most ``rank + 4`` at once, more are refused), so a silent
stranger cannot stall the ranks; every step has a timeout, and a failed handshake closes the socket and counts
``stats["rejected_connections"]``.
Nothing read from a socket is unpickled: frames are :data:`FRAME` records, payload lengths are checked by the
owner against a buffer it already holds.

Each :class:`Link` has a writer thread (frames and payloads leave in queue order, so callers never block on the
network) and a reader thread that hands frames to the owner's callback; neither ever waits on the other side,
so two ranks sending to each other at once cannot deadlock on full socket buffers.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

from .. import _lifecycle
from ..errors import AuthenticationError, CollectiveTimeoutError, PeerUnavailableError
from .base import BackendConfig

logger = logging.getLogger(__name__)

# kind, dtype code, device code, flag, tag, nbytes, aux
FRAME = struct.Struct("<BBBBIQQ")
RTS, CTS, CANCEL, DATA = 1, 2, 3, 4
KINDS = (RTS, CTS, CANCEL, DATA)

_PROTO = b"rdt-pairs-v1"
_NONCE = 32
_MAC = 32
_HELLO = struct.Struct(f"<12s{_NONCE}s")  # proto, server nonce
_RESPONSE = struct.Struct(f"<I{_NONCE}s{_MAC}s")  # client rank, client nonce, client MAC
_MAX_HANDSHAKE_S = 10.0
_SPARE_HANDSHAKES = 4  # handshakes in flight beyond the ranks that may connect

Frame = Tuple[int, int, int, int, int, int, int]
OnFrame = Callable[["Link", Frame], None]
OnClosed = Callable[["Link", BaseException], None]


def local_host() -> str:
    """Address peers connect to: RDT_TCP_HOST, else Ray's node address, else loopback."""
    host = os.environ.get("RDT_TCP_HOST")
    if host:
        return host
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except Exception:  # noqa: BLE001 - Ray missing or unable to resolve: single-host fallback
        pass
    return "127.0.0.1"


def _mac(secret: bytes, role: bytes, nonce: bytes, uid: str, a: int, b: int) -> bytes:
    return hmac.new(secret, role + _PROTO + nonce + uid.encode() + struct.pack("<II", a, b), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return bytes(buf)


class Link:
    """An authenticated connection to one peer: queued writes on a writer thread, frames read on a reader thread."""

    def __init__(self, sock: socket.socket, peer: int, label: str) -> None:
        self.sock = sock
        self.peer = peer
        self.label = label
        self._cv = threading.Condition()
        self._queue: Deque[Tuple[bytes, Any, Optional[Callable[[Optional[BaseException]], None]]]] = \
            collections.deque()
        self.closed: Optional[BaseException] = None
        self._on_frame: Optional[OnFrame] = None
        self._on_closed: Optional[OnClosed] = None
        self._threads: List[threading.Thread] = []

    def start(self, on_frame: OnFrame, on_closed: OnClosed) -> None:
        self._on_frame = on_frame
        self._on_closed = on_closed
        self._threads = [_lifecycle.spawn(self._reader, f"rdt-{self.label}-r{self.peer}"),
                         _lifecycle.spawn(self._writer, f"rdt-{self.label}-w{self.peer}")]

    # -- any thread
    def send_frame(self, kind: int, tag: int, nbytes: int = 0, dtype: int = 0, device: int = 0, flag: int = 0,
                   aux: int = 0) -> None:
        """Queue one control frame (never blocks; dropped silently once the link is closed)."""
        self._put(FRAME.pack(kind, dtype, device, flag, tag, nbytes, aux), None, None)

    def send_data(self, tag: int, payload: memoryview,
                  done: Callable[[Optional[BaseException]], None]) -> None:
        """Queue a DATA frame followed by ``payload``; ``done(error)`` runs once it is written or failed."""
        self._put(FRAME.pack(DATA, 0, 0, 0, tag, payload.nbytes, 0), payload, done)

    def _put(self, head: bytes, payload: Any, done: Optional[Callable[[Optional[BaseException]], None]]) -> None:
        with self._cv:
            closed = self.closed
            if closed is None:
                self._queue.append((head, payload, done))
                self._cv.notify()
        if closed is not None and done is not None:
            done(closed)

    def read_into(self, view: memoryview) -> None:
        """Read exactly ``len(view)`` bytes into ``view`` (reader thread only, after a DATA frame)."""
        got, n = 0, view.nbytes
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise ConnectionError("connection closed in the middle of a payload")
            got += k

    def close(self, reason: BaseException) -> None:
        """Shut the socket (wakes both threads) and fail queued writes with ``reason``; idempotent, never blocks."""
        with self._cv:
            if self.closed is not None:
                return
            self.closed = reason
            pending = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for _, _, done in pending:
            if done is not None:
                done(reason)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(deadline - time.monotonic(), 0.0))
        try:
            self.sock.close()
        except OSError:
            pass

    # -- own threads
    def _writer(self) -> None:
        while True:
            with self._cv:
                while not self._queue and self.closed is None:
                    self._cv.wait()
                if self.closed is not None:
                    return
                head, payload, done = self._queue.popleft()
            try:
                self.sock.sendall(head)
                if payload is not None and payload.nbytes:
                    self.sock.sendall(payload)
            except OSError as e:
                err = self.closed or ConnectionError(f"writing to rank {self.peer} failed: {e}")
                if done is not None:
                    done(err)
                self.close(err)  # the reader wakes from the shut socket and reports the loss
                return
            if done is not None:
                done(None)

    def _reader(self) -> None:
        assert self._on_frame is not None
        head = bytearray(FRAME.size)
        view = memoryview(head)
        err: BaseException
        try:
            while True:
                got = 0
                while got < FRAME.size:
                    k = self.sock.recv_into(view[got:], FRAME.size - got)
                    if k == 0:
                        raise ConnectionError(f"rank {self.peer} closed the connection")
                    got += k
                frame = FRAME.unpack(head)
                if frame[0] not in KINDS:
                    raise ConnectionError(f"rank {self.peer} sent an unknown frame kind {frame[0]}")
                self._on_frame(self, frame)
        except BaseException as e:  # noqa: BLE001 - any failure ends the link
            err = self.closed or e
        self._lost(err)

    def _lost(self, err: BaseException) -> None:
        """Reader thread only: close the link and tell the owner once."""
        self.close(err)
        if self._on_closed is not None:
            self._on_closed(self, self.closed or err)


def connect_pairs(config: BackendConfig, label: str, deadline: float,
                  stats: Dict[str, int]) -> Dict[int, Link]:
    """Authenticated links to every other rank of the group (the lower rank of a pair connects); typed errors."""
    rank, world = config.rank, config.world_size
    links: Dict[int, Link] = {}
    if world == 1:
        return links
    hs_timeout = min(config.timeout, _MAX_HANDSHAKE_S)
    lock = threading.Lock()
    accepted_all = threading.Event()
    listener: Optional[socket.socket] = None
    if rank == 0:  # nobody connects to rank 0 (the lower rank of a pair connects): no listener at all
        accepted_all.set()
    else:
        host = local_host()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((host, 0))
        listener.listen(max(rank, 4))
        config.rendezvous.put(f"{label}/addr/{rank}", f"{host}:{listener.getsockname()[1]}".encode())

    handshakes = threading.BoundedSemaphore(rank + _SPARE_HANDSHAKES)  # a silent stranger cannot stall init

    in_handshake: Set[socket.socket] = set()  # shut when init ends: whoever is still there is a stranger

    def handshake(sock: socket.socket) -> None:
        try:
            peer = _serve_handshake(sock, config, hs_timeout, lambda r: r < rank and r not in links)
            with lock:
                in_handshake.discard(sock)
                if peer in links or accepted_all.is_set():
                    raise AuthenticationError(f"rank {peer} is already connected")
                links[peer] = Link(sock, peer, label)
                stats["connections"] += 1
                if sum(1 for r in links if r < rank) == rank:
                    accepted_all.set()
        except Exception as e:  # noqa: BLE001 - any failure rejects this connection only
            with lock:
                in_handshake.discard(sock)
                stats["rejected_connections"] += 1
            logger.info("group %s rank %d: rejected a %s connection: %s", config.group_name, rank, label, e)
            try:
                sock.close()
            except OSError:
                pass
        finally:
            handshakes.release()

    def accept_loop() -> None:
        assert listener is not None
        listener.settimeout(0.2)
        while not accepted_all.is_set() and time.monotonic() < deadline and not _lifecycle.exiting():
            try:
                sock, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            if not handshakes.acquire(blocking=False):  # too many handshakes at once: refuse this one
                with lock:
                    stats["rejected_connections"] += 1
                sock.close()
                continue
            with lock:
                in_handshake.add(sock)
            _lifecycle.spawn(handshake, f"rdt-{label}-handshake", sock)

    acceptor = _lifecycle.spawn(accept_loop, f"rdt-{label}-accept") if listener is not None else None
    try:
        for peer in range(rank + 1, world):
            left = deadline - time.monotonic()
            addr = config.rendezvous.get(f"{label}/addr/{peer}", max(left, 0.001),
                                         what=f"rank {peer}'s {label} address")
            h, _, p = addr.decode().rpartition(":")
            sock = _connect(h, int(p), deadline, peer, config)
            try:
                _client_handshake(sock, config, peer, hs_timeout)
            except BaseException:
                sock.close()
                raise
            with lock:
                links[peer] = Link(sock, peer, label)
                stats["connections"] += 1
        if not accepted_all.wait(max(deadline - time.monotonic(), 0.0)):
            missing = [r for r in range(rank) if r not in links]
            raise CollectiveTimeoutError(
                f"ranks {missing} did not connect to this rank's {label} listener in time",
                group=config.group_name, rank=rank, op="init",
                hint="every rank must create the group within the timeout; check that the ranks can reach each "
                "other's node address (set RDT_TCP_HOST to the address peers should use)")
    except BaseException:
        with lock:
            accepted_all.set()
            made = list(links.values())
        for link in made:
            link.sock.close()
        raise
    finally:
        with lock:
            accepted_all.set()
            strangers = list(in_handshake)
        for sock in strangers:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # ends their handshake threads now
            except OSError:
                pass
        if acceptor is not None:
            acceptor.join(1.0)
        if listener is not None:
            listener.close()  # no connection is accepted after init: the cap is the group's lower ranks
    return links


def _connect(host: str, port: int, deadline: float, peer: int, config: BackendConfig) -> socket.socket:
    delay = 0.01
    while True:
        left = deadline - time.monotonic()
        try:
            sock = socket.create_connection((host, port), timeout=max(min(left, _MAX_HANDSHAKE_S), 0.001))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as e:
            if time.monotonic() + delay >= deadline:
                raise PeerUnavailableError(
                    f"cannot connect to rank {peer} at {host}:{port}: {e}", group=config.group_name,
                    rank=config.rank, peer=peer, op="init",
                    hint="check that the rank is alive and its node address is reachable (RDT_TCP_HOST)") from e
            time.sleep(delay)
            delay = min(delay * 2, 0.2)


def _serve_handshake(sock: socket.socket, config: BackendConfig, timeout: float,
                     allowed: Callable[[int], bool]) -> int:
    sock.settimeout(timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    nonce = os.urandom(_NONCE)
    sock.sendall(_HELLO.pack(_PROTO, nonce))
    peer, client_nonce, mac = _RESPONSE.unpack(_recv_exact(sock, _RESPONSE.size))
    if not 0 <= peer < config.world_size or not allowed(peer):
        raise AuthenticationError(f"rank {peer} may not connect here")
    if not hmac.compare_digest(mac, _mac(config.secret, b"c", nonce, config.group_uid, peer, config.rank)):
        raise AuthenticationError("wrong HMAC (the client does not hold the group secret)")
    sock.sendall(_mac(config.secret, b"s", client_nonce, config.group_uid, config.rank, peer))
    sock.settimeout(None)
    return peer


def _client_handshake(sock: socket.socket, config: BackendConfig, peer: int, timeout: float) -> None:
    sock.settimeout(timeout)
    try:
        proto, nonce = _HELLO.unpack(_recv_exact(sock, _HELLO.size))
        if proto != _PROTO:
            raise AuthenticationError(f"rank {peer}'s listener speaks {proto!r}, not {_PROTO!r}")
        mine = os.urandom(_NONCE)
        sock.sendall(_RESPONSE.pack(config.rank, mine,
                                    _mac(config.secret, b"c", nonce, config.group_uid, config.rank, peer)))
        reply = _recv_exact(sock, _MAC)
    except (OSError, ConnectionError) as e:
        raise AuthenticationError(
            f"rank {peer} closed the connection during the handshake ({e}): it refused this rank's secret or rank",
            group=config.group_name, rank=config.rank, peer=peer, op="init",
            hint="every member must use the secret handed out with this group incarnation") from e
    if not hmac.compare_digest(reply, _mac(config.secret, b"s", mine, config.group_uid, peer, config.rank)):
        raise AuthenticationError(f"rank {peer} answered with a wrong HMAC", group=config.group_name,
                                  rank=config.rank, peer=peer, op="init",
                                  hint="the listener does not hold this group's secret: re-create the group")
    sock.settimeout(None)
