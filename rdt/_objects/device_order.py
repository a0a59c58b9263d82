"""Consumer-side stream discipline for device copies that land in a caller's tensors (sharded loads into GPU
targets), written once for every path that copies on a device.

A load into GPU targets must not write them before the work the caller queued on its current stream (a forward
still reading the weights) is done, and must return only once its bytes are on the device: then whatever the caller
queues next on any stream sees them, and the producer's fence, which waits for the load's read to end, returns only
after every copy that read the producer's memory has finished on the device (not merely been enqueued). So:

1. the loader marks the caller's current stream when the load starts (:meth:`Streams.mark`, in the caller's thread);
2. each reading thread copies on its own stream (:meth:`Streams.stream`, one per thread and device: the *loader's
   stream*), which first waits for that mark (:meth:`Streams.wait`);
3. the copies run on it (:meth:`Streams.run`), an event is recorded after them (:meth:`Streams.done`), and the
   reading thread waits for that event on the host (:meth:`Streams.synchronize`) before the read is reported done
   (and its registration with the producer ended).

Paths that move device memory outside streams (NIXL, an NCCL receive polled to completion) wait for the mark on the
host before they start (:meth:`Streams.wait_host`). CPU work needs none of this: every call is a no-op for a CPU
device. The discipline in use is this module's :func:`current`; CPU CI installs a recording fake (:func:`use`) whose
copies run only when an event recorded after them is synchronised, so a path that reported a read done before its
copies finished leaves stale bytes and its test fails.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, Optional

import torch


class Streams:
    """The production discipline: CUDA streams and events (a no-op for CPU devices)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @staticmethod
    def _cuda(device: Optional[torch.device]) -> bool:
        return device is not None and device.type == "cuda"

    def mark(self, device: Optional[torch.device]) -> Any:
        """An event recorded on the caller's current stream of ``device`` (None for a CPU device)."""
        if not self._cuda(device):
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def stream(self, device: Optional[torch.device]) -> Any:
        """This thread's stream on ``device`` (made once per thread and device; None for a CPU device)."""
        if not self._cuda(device):
            return None
        streams: Dict[Any, Any] = getattr(self._local, "streams", None) or {}
        self._local.streams = streams
        s = streams.get(device)
        if s is None:
            s = streams[device] = torch.cuda.Stream(device=device)
        return s

    def wait(self, stream: Any, mark: Any) -> None:
        """``stream`` waits (on the device) for the work before ``mark``."""
        if stream is not None and mark is not None:
            stream.wait_event(mark)

    def wait_host(self, mark: Any) -> None:
        """The host waits for the work before ``mark`` (paths that move device memory outside streams)."""
        if mark is not None:
            mark.synchronize()

    def run(self, stream: Any, fn: Callable[[], None]) -> None:
        """``fn``'s torch ops, queued on ``stream``."""
        if stream is None:
            fn()
            return
        with torch.cuda.stream(stream):
            fn()

    def done(self, stream: Any) -> Any:
        """An event after everything queued on ``stream`` so far."""
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def synchronize(self, event: Any) -> None:
        """The host waits until ``event`` completed on the device."""
        if event is not None:
            event.synchronize()

    def finish(self, stream: Any) -> None:
        """Record an event on ``stream`` and wait for it: everything queued there so far has run."""
        self.synchronize(self.done(stream))


_current: Streams = Streams()
_lock = threading.Lock()


def current() -> Streams:
    """The discipline device copies use in this process."""
    return _current


@contextlib.contextmanager
def use(streams: Streams) -> Iterator[Streams]:
    """Use ``streams`` in this process while the block runs (tests: a recording fake)."""
    global _current
    with _lock:
        before, _current = _current, streams
    try:
        yield streams
    finally:
        with _lock:
            _current = before


__all__ = ["Streams", "current", "use"]
