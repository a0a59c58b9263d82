"""A process context with only what the NIXL object path uses, for tests without Ray: identity, a receive pool and
per-transport state (``nixl``: the agent, once made)."""

from __future__ import annotations

import secrets
import threading
from typing import Any, Callable, Dict

from rdt.transports.recv_buffers import BufferPool


class BareContext:
    def __init__(self) -> None:
        self.instance = secrets.token_bytes(8)
        self.buffers = BufferPool(0, 1.0)
        self._states: Dict[str, Any] = {}
        self._lock = threading.Lock()

    def transport_state(self, name: str, factory: Callable[[], Any]) -> Any:
        with self._lock:
            if name not in self._states:
                self._states[name] = factory()
            return self._states[name]

    def peek_transport_state(self, name: str) -> Any:
        with self._lock:
            return self._states.get(name)

    @property
    def nixl(self) -> Any:
        """The NIXL agent, or None before the first registration or read made it."""
        return self.peek_transport_state("nixl")
