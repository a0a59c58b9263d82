"""The control server: each process that produces objects runs one, answering authenticated requests.

Each such process runs one :class:`ControlServer` thread on its node's address, port 0. A consumer asks it for
things only the producer can do (post Gloo sends, copy into shared memory, register with NIXL), each answered by
the handler its transport registered (frames: see ``wire``). Bad MACs, stale timestamps, replayed nonces,
oversize or malformed frames are dropped and the connection closed; the server never crashes on input.
"""

from __future__ import annotations

import logging
import queue
import selectors
import socket
import struct
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Optional, Tuple

from rdt_transports import _lifecycle

from .wire import (ERR_INTERNAL, MAX_FRAME, RESP_ERR, Handler, Held, ProtocolError, Stream, decode, encode,
                   send_stream)

logger = logging.getLogger("rdt")


class _ReplayGuard:
    def __init__(self, size: int = 65536) -> None:
        self._seen: "OrderedDict[bytes, None]" = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def check(self, nonce: bytes) -> None:
        with self._lock:
            if nonce in self._seen:
                raise ProtocolError("replayed nonce")
            self._seen[nonce] = None
            if len(self._seen) > self._size:
                self._seen.popitem(last=False)


class _Conn:
    """One accepted connection: bytes of the frame being read and when it started, last activity."""

    __slots__ = ("sock", "buf", "frame_start", "last", "busy")

    def __init__(self, sock: socket.socket, now: float) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.frame_start = 0.0
        self.last = now
        self.busy = False  # a worker owns it (handling a request): never evicted nor timed out meanwhile

    def next_frame(self) -> Optional[bytes]:
        """The next whole frame body in the buffer (removed from it), or None; ProtocolError when oversize."""
        if len(self.buf) < 4:
            return None
        (length,) = struct.unpack_from("!I", self.buf)
        if length > MAX_FRAME:
            raise ProtocolError(f"frame of {length} bytes is over the limit")
        if len(self.buf) < 4 + length:
            return None
        body = bytes(self.buf[4:4 + length])
        del self.buf[:4 + length]
        return body


class ControlServer:
    """Serves authenticated requests: one selector thread reads every connection, a bounded pool answers.

    Idle connections cost a file descriptor, not a thread. At most ``max_conns`` connections are kept: a new one
    beyond that evicts the longest-idle connection not being answered (or is itself closed), counted in
    ``rejected``. A started frame must arrive whole within ``frame_timeout`` (slow peers are dropped and counted);
    connections idle for ``idle_timeout`` are closed. Threads: the selector thread, at most ``workers`` answering
    requests, at most ``streams`` sending objects' bytes (each until the consumer's own deadline) and at most
    ``holds`` computing held answers (:class:`Held`; more wait for one of them, never for a request worker).
    """

    def __init__(self, host: str, key_for: Callable[[int, bytes], Optional[bytes]],
                 handlers: Dict[int, Handler], *, max_conns: int = 256, idle_timeout: float = 60.0,
                 frame_timeout: float = 5.0, workers: int = 8, streams: int = 4, holds: int = 32,
                 send_timeout: float = 30.0) -> None:
        self._key_for = key_for
        self._handlers = handlers
        self._replay = _ReplayGuard()
        self.max_conns = max_conns
        self.idle_timeout = idle_timeout
        self.frame_timeout = frame_timeout
        self.send_timeout = send_timeout
        self.workers = workers
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(128)
        self._sock.setblocking(False)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self.rejected = 0
        self._rejected_lock = threading.Lock()
        self._conns: Dict[socket.socket, _Conn] = {}  # touched by the selector thread only (workers hand back)
        self._returned: "queue.SimpleQueue[_Conn]" = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rdt-control-worker")
        self._streams = ThreadPoolExecutor(max_workers=streams, thread_name_prefix="rdt-control-stream")
        self._holds = ThreadPoolExecutor(max_workers=holds, thread_name_prefix="rdt-control-hold")
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = _lifecycle.spawn(self._loop, "rdt-control")

    # ---------------------------------------------------------------- selector thread
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._step()
                except Exception:  # noqa: BLE001 - one bad event must not stop the server
                    logger.exception("rdt control: the server loop failed; going on")
                    self._stop.wait(0.05)
        finally:
            for c in list(self._conns.values()):
                self._drop(c)

    def _step(self) -> None:
        for key, _ in self._sel.select(timeout=min(0.5, self.frame_timeout / 2)):
            if key.fileobj is self._sock:
                self._accept()
            elif key.fileobj is self._wake_r:
                self._drain_wakeups()
            else:
                self._on_readable(key.data)
        self._take_back()
        self._expire(time.monotonic())

    def _accept(self) -> None:
        for _ in range(64):  # bounded per wakeup so reads are not starved by a connect flood
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            now = time.monotonic()
            if len(self._conns) >= self.max_conns and not self._evict_one():
                self._count_rejected()
                _shut(sock)
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, now)
            self._conns[sock] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _evict_one(self) -> bool:
        """Close the longest-idle connection no worker owns (over the cap); False when all are busy."""
        idle = [c for c in self._conns.values() if not c.busy]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.last)
        self._count_rejected()
        self._drop(victim)
        return True

    def _on_readable(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            if conn.buf:
                self._reject(conn, "truncated frame: connection closed")
            else:
                self._drop(conn)  # a clean close between frames
            return
        now = time.monotonic()
        if not conn.buf:
            conn.frame_start = now
        conn.last = now
        conn.buf += chunk
        self._dispatch(conn)

    def _dispatch(self, conn: _Conn) -> None:
        """Hand a whole frame to a worker (the connection leaves the selector until answered)."""
        try:
            body = conn.next_frame()
        except ProtocolError as e:
            self._reject(conn, str(e))
            return
        if body is None:
            return
        conn.busy = True
        self._sel.unregister(conn.sock)
        self._pool.submit(self._answer, conn, body)

    def _take_back(self) -> None:
        while True:
            try:
                conn = self._returned.get_nowait()
            except queue.Empty:
                return
            conn.busy = False
            if conn.sock not in self._conns:
                continue
            if conn.sock.fileno() < 0:
                self._conns.pop(conn.sock, None)
                continue
            conn.last = conn.frame_start = time.monotonic()
            self._sel.register(conn.sock, selectors.EVENT_READ, conn)
            self._dispatch(conn)  # a frame that arrived with the previous one

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if not c.busy]:
            if conn.buf and now - conn.frame_start > self.frame_timeout:
                self._reject(conn, f"a frame did not arrive whole within {self.frame_timeout:.1f}s")
            elif not conn.buf and now - conn.last > self.idle_timeout:
                self._drop(conn)

    def _count_rejected(self) -> None:
        with self._rejected_lock:
            self.rejected += 1

    def _reject(self, conn: _Conn, why: str) -> None:
        self._count_rejected()
        logger.debug("rdt control: dropped a connection: %s", why)
        self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        """Forget and close a connection; one a worker or stream thread is using wakes there with an error."""
        self._conns.pop(conn.sock, None)
        if not conn.busy:
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
        _shut(conn.sock)

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError, OSError):
            pass

    # ---------------------------------------------------------------- worker threads
    def _answer(self, conn: _Conn, body: bytes) -> None:
        """Verify, run the handler, send the answer; a bad frame closes the connection (counted). Raw bytes that
        follow the answer are sent from the stream pool, and held answers are computed and sent from the hold
        pool, so neither slow readers nor long polls ever hold the request workers."""
        try:
            follow = self._answer_frame(conn.sock, body)
        except ProtocolError as e:
            self._count_rejected()
            logger.debug("rdt control: dropped a connection: %s", e)
            self._hand_back(conn, False)
            return
        except (ConnectionError, OSError, struct.error):
            self._hand_back(conn, False)
            return
        except Exception:  # noqa: BLE001 - never let a worker die on a bug
            logger.exception("rdt control: answering a request failed")
            self._hand_back(conn, False)
            return
        if follow is None:
            self._hand_back(conn, True)
        elif isinstance(follow[3], Held):
            self._holds.submit(self._send_held, conn, *follow)
        else:
            self._streams.submit(self._send_follow, conn, *follow[1:])

    def _send_follow(self, conn: _Conn, key: bytes, nonce: bytes, stream: "Stream") -> None:
        keep = False
        try:
            send_stream(conn.sock, key, nonce, stream)
            conn.sock.setblocking(False)
            keep = True
        except (ConnectionError, OSError) as e:  # the consumer gave up or died; it reports its own error
            logger.debug("rdt control: streaming an object's bytes failed: %s", e)
        except Exception:  # noqa: BLE001
            logger.exception("rdt control: streaming an object's bytes failed")
        self._hand_back(conn, keep)

    def _send_held(self, conn: _Conn, key_id: int, key: bytes, nonce: bytes, held: Held) -> None:
        """(hold pool) Compute a held answer and send it."""
        try:
            resp_type, resp = held.answer()
        except Exception as e:  # noqa: BLE001 - a handler bug must not kill the server
            logger.exception("rdt control: a held answer failed")
            resp_type, resp = RESP_ERR, struct.pack("!H", ERR_INTERNAL) + str(e).encode()[:4000]
        keep = False
        try:
            conn.sock.settimeout(self.send_timeout)
            conn.sock.sendall(encode(resp_type, key_id, key, resp, nonce))
            conn.sock.setblocking(False)
            keep = True
        except OSError as e:  # the requester gave up or died
            logger.debug("rdt control: sending a held answer failed: %s", e)
        self._hand_back(conn, keep)

    def _hand_back(self, conn: _Conn, keep: bool) -> None:
        """Return a connection to the selector thread (closed unless ``keep``)."""
        if not keep:
            _shut(conn.sock)
        self._returned.put(conn)
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    def _answer_frame(self, sock: socket.socket, body: bytes) -> Optional[Tuple[int, bytes, bytes, Any]]:
        """Answer one frame; (key id, key, nonce, stream) when raw bytes must follow the answer, (key id, key,
        nonce, held) when the handler's answer is :class:`Held` (nothing sent yet)."""
        msg_type, key_id, nonce, payload = decode(body, self._key_for)
        self._replay.check(nonce)
        handler = self._handlers.get(msg_type)
        if handler is None:
            raise ProtocolError(f"unknown message type {msg_type}")
        try:
            result = handler(key_id, payload)
        except Exception as e:  # noqa: BLE001 - a handler bug must not kill the server
            logger.exception("rdt control handler failed")
            result = (RESP_ERR, struct.pack("!H", ERR_INTERNAL) + str(e).encode()[:4000])
        key = self._key_for(key_id, payload)
        if key is None:
            raise ProtocolError("the request's key went away")
        if isinstance(result, Held):
            return key_id, key, nonce, result
        resp_type, resp = result[0], result[1]
        stream = result[2] if len(result) > 2 else None
        sock.settimeout(self.send_timeout)
        sock.sendall(encode(resp_type, key_id, key, resp, nonce))
        if stream is not None:
            return key_id, key, nonce, stream
        sock.setblocking(False)
        return None

    def forget_in_child(self) -> None:
        """In a forked child: close this process's copies of the server's sockets (never shut them down, which
        would reach the parent's), so that the port stops accepting once the parent dies. Never raises."""
        for sock in [self._sock, self._wake_r, self._wake_w, *self._conns]:
            try:
                sock.close()
            except OSError:
                pass
        try:
            self._sel.close()
        except (OSError, ValueError):
            pass

    def close(self, timeout: float = 5.0) -> None:
        """Stop the selector thread (bounded join), close every connection and the worker pool.

        Connections are shut down, not only closed: a stream thread blocked in ``sendall`` to a consumer that
        stopped reading wakes at once (a plain close does not wake it, and the interpreter joins pool threads at
        exit, for up to the stream's deadline)."""
        self._stop.set()
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        for conn in list(self._conns.values()):  # the selector thread shut them down as it ended, unless stuck
            _shut(conn.sock)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (close alone does not on Linux)
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        for pool in (self._pool, self._streams, self._holds):
            pool.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():
            self._sel.close()
            for s in (self._wake_r, self._wake_w):
                s.close()


def _shut(sock: socket.socket) -> None:
    """Shut a socket down, then close it: a call blocked on it in another thread returns with an error (a plain
    close leaves a blocked ``sendall`` waiting for its timeout). Never raises."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected, or already closed
        pass
    try:
        sock.close()
    except OSError:
        pass
