"""Lifetime tokens: tiny producer-owned ObjectRefs, one per object, made ahead of time off the critical path.

An object lives while its token does: the producer frees it when Ray says the token's last reference died.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import ray

from rdt_transports import _lifecycle


class TokenPool:
    """Lifetime tokens made by a background thread, so that a return never waits for ``ray.put``."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._tokens: "collections.deque[Any]" = collections.deque()
        self._need = threading.Event()
        self._need.set()
        self._stop = threading.Event()
        self._thread = _lifecycle.spawn(self._fill, "rdt-tokens")

    def _fill(self) -> None:
        while True:
            self._need.wait()
            if self._stop.is_set():
                return
            try:
                while len(self._tokens) < self._size and not self._stop.is_set():
                    self._tokens.append(ray.put(b""))
            except Exception:  # Ray shutting down
                return
            self._need.clear()

    def close(self) -> None:
        """Stop the filler thread (bounded) and drop the spare tokens."""
        self._stop.set()
        self._need.set()
        self._thread.join(_lifecycle.JOIN_TIMEOUT_S)
        self._tokens.clear()

    def take(self) -> Any:
        """A fresh token (made here when the pool ran dry); asks the filler for more below half full."""
        try:
            token = self._tokens.popleft()
        except IndexError:
            token = ray.put(b"")
        if len(self._tokens) < self._size // 2:
            self._need.set()
        return token
