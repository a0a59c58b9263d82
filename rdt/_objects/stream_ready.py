"""Producer-side stream discipline, written once for every transport: bytes are read only once they are written.

A method may return GPU tensors whose kernels are still queued on the stream current at return, and rdt reads those
bytes later, elsewhere: on the control server's threads (object sends, host copies, NIXL registration) whose current
stream is another one, or one-sidedly from another process. So :func:`record` records one event per device, on
the stream current at return, once per object (``Entry.ready``), and :func:`wait_ready` blocks until those events
completed; every export and serve path calls it before it hands the bytes to anything (a send, a copy, a
registration, an IPC share). A CPU-only object records nothing and waits for nothing.

The devices that need events, and how an event is made, come from one place: the context's :class:`Discipline`
(CUDA events in production). CPU CI swaps in a discipline over CPU buffers whose "event" completes a deferred write
when it is waited on, so a serve path that read before waiting returns stale bytes and its test fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, FrozenSet, List, Optional, Protocol, Sequence

import torch


class Event(Protocol):
    """What :func:`record` needs of an event: it was recorded when made; ``synchronize`` blocks until it completed."""

    def synchronize(self) -> None: ...


def _cuda_event(device: torch.device) -> Event:
    """A CUDA event recorded on ``device``'s current stream (the thin device call)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


@dataclass(frozen=True)
class Discipline:
    """Which buffers need an event (by device type) and how one is made and recorded on a device's current stream."""

    device_types: FrozenSet[str] = frozenset({"cuda"})
    make_event: Callable[[torch.device], Event] = _cuda_event


@dataclass
class Ready:
    """One object's events (one per device), recorded at return; ``waits`` counts :func:`wait_ready` calls."""

    events: List[Event]
    devices: List[torch.device]
    waits: int = 0
    done: bool = field(default=False)

    def wait(self) -> None:
        if not self.done:
            for event in self.events:
                event.synchronize()
            self.done = True  # completed events stay completed: later serves skip the device calls
        self.waits += 1


def record(discipline: Discipline, buffers: Sequence[torch.Tensor]) -> Optional[Ready]:
    """Record the object's events on the streams current now (at return); None when no buffer needs one."""
    devices: List[torch.device] = []
    for b in buffers:
        if b.device.type in discipline.device_types and b.device not in devices:
            devices.append(b.device)
    if not devices:
        return None
    return Ready([discipline.make_event(d) for d in devices], devices)


def wait_ready(entry: Any) -> None:
    """Block until every write to ``entry``'s buffers queued before its return is done; call before reading them."""
    ready: Optional[Ready] = getattr(entry, "ready", None)
    if ready is not None:
        ready.wait()
