"""The control client: requests to other processes' control servers over a bounded pool of connections."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import OrderedDict
from typing import List, Optional, Tuple

from .wire import Alloc, ProtocolError, decode, encode, read_frame, recv_stream


class ControlClient:
    """Sends requests to other processes' control servers, reusing connections from a bounded pool.

    At most ``max_idle_per_address`` idle connections per address and ``max_idle_total`` in all are kept (the
    least recently used go first), none longer than ``idle_ttl`` (below the servers' idle timeout). A request on
    a pooled connection the server closed meanwhile is retried once on a fresh one.
    """

    def __init__(self, *, max_idle_per_address: int = 4, max_idle_total: int = 64, idle_ttl: float = 20.0) -> None:
        self.max_idle_per_address = max_idle_per_address
        self.max_idle_total = max_idle_total
        self.idle_ttl = idle_ttl
        self._pool: "OrderedDict[str, List[Tuple[socket.socket, float]]]" = OrderedDict()
        self._lock = threading.Lock()

    def forget_in_child(self) -> None:
        """In a forked child: close this process's copies of the pooled connections (no shutdown: the parent's
        stay as they are). Never raises."""
        pool, self._pool, self._lock = self._pool, OrderedDict(), threading.Lock()
        for conns in pool.values():
            for sock, _ in conns:
                try:
                    sock.close()
                except OSError:
                    pass

    def request(self, address: str, msg_type: int, key_id: int, key: bytes, payload: bytes, timeout: float,
                alloc: Optional[Alloc] = None) -> Tuple[int, bytes]:
        """Send one request and wait for its answer; raises ConnectionError/TimeoutError/ProtocolError.

        With ``alloc``, an answer may be followed by raw bytes: ``alloc`` says where they go (None: no bytes).
        """
        sock, reused = self._take(address, timeout)
        try:
            return self._request_on(sock, address, msg_type, key_id, key, payload, timeout, alloc)
        except (ConnectionResetError, BrokenPipeError, _ClosedBeforeAnswer):
            if not reused:
                raise
        # The server closed the idle pooled connection (its idle timeout) before it read our request.
        sock, _ = self._take(address, timeout, fresh=True)
        return self._request_on(sock, address, msg_type, key_id, key, payload, timeout, alloc)

    def _request_on(self, sock: socket.socket, address: str, msg_type: int, key_id: int, key: bytes,
                    payload: bytes, timeout: float, alloc: Optional[Alloc]) -> Tuple[int, bytes]:
        deadline = time.monotonic() + timeout
        ok = False
        try:
            sock.settimeout(timeout)
            nonce = os.urandom(16)
            sock.sendall(encode(msg_type, key_id, key, payload, nonce))
            try:
                body = read_frame(sock)
            except ConnectionError as e:
                if isinstance(e, (ConnectionResetError, BrokenPipeError)):
                    raise
                raise _ClosedBeforeAnswer(str(e)) from e
            resp_type, _, resp_nonce, resp = decode(body, lambda _k, _p: key)
            if resp_nonce != nonce:
                raise ProtocolError("response to another request")
            into = alloc(resp_type, resp) if alloc is not None else None
            if into is not None:
                recv_stream(sock, key, nonce, into, deadline)
            ok = True
            return resp_type, resp
        except socket.timeout as e:
            raise TimeoutError(f"no answer from {address} within {timeout:.1f}s") from e
        finally:
            if ok:
                self._give(address, sock)
            else:
                sock.close()

    def _take(self, address: str, timeout: float, fresh: bool = False) -> Tuple[socket.socket, bool]:
        if not fresh:
            with self._lock:
                self._prune(time.monotonic())
                free = self._pool.get(address)
                if free:
                    sock = free.pop()[0]
                    if not free:
                        del self._pool[address]
                    return sock, True
        host, port = address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, False

    def _give(self, address: str, sock: socket.socket) -> None:
        """Keep ``sock`` for reuse within the bounds; close what falls outside them."""
        drop: List[socket.socket] = []
        with self._lock:
            free = self._pool.setdefault(address, [])
            self._pool.move_to_end(address)
            free.append((sock, time.monotonic()))
            while len(free) > self.max_idle_per_address:
                drop.append(free.pop(0)[0])
            while self._idle_locked() > self.max_idle_total:
                oldest = next(iter(self._pool))  # least recently used address
                socks = self._pool[oldest]
                drop.append(socks.pop(0)[0])
                if not socks:
                    del self._pool[oldest]
        for s in drop:
            s.close()

    def _prune(self, now: float) -> None:
        """Close idle connections older than the TTL (caller holds the lock)."""
        for address in list(self._pool):
            socks = self._pool[address]
            keep = [(s, t) for s, t in socks if now - t <= self.idle_ttl]
            for s, t in socks:
                if now - t > self.idle_ttl:
                    s.close()
            if keep:
                self._pool[address] = keep
            else:
                del self._pool[address]

    def _idle_locked(self) -> int:
        return sum(len(v) for v in self._pool.values())

    def idle_count(self) -> int:
        """Idle pooled connections (all addresses)."""
        with self._lock:
            return self._idle_locked()

    def close(self) -> None:
        with self._lock:
            pools = list(self._pool.values())
            self._pool.clear()
        for socks in pools:
            for s, _ in socks:
                s.close()


class _ClosedBeforeAnswer(ConnectionError):
    """The server closed the connection before answering (nothing of the answer arrived)."""
