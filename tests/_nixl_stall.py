"""Stall this process's NIXL agent: hold its lock so that READs from it make no progress (over UCX TCP a READ moves
only while the producer's agent progresses), deterministically and for a bounded time."""

from __future__ import annotations

import threading
import time


def stall_agent(seconds: float) -> float:
    """Hold this process's NIXL agent lock for ``seconds`` from a daemon thread; returns once it is held, with the
    wall-clock time the stall ends."""
    from rdt._process.context import get_context
    from rdt.transports.nixl.agent import agent

    ag = agent(get_context())
    held = threading.Event()

    def hold() -> None:
        with ag.lock:
            held.set()
            time.sleep(seconds)

    threading.Thread(target=hold, daemon=True).start()
    held.wait()
    return time.time() + seconds
