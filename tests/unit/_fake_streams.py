"""A recording fake of ``rdt._objects.device_order.Streams`` for CPU CI: streams are queues of deferred work that
runs only when an event recorded after it is synchronised (as a GPU runs queued kernels later), every call is logged
in order, and the caller's stream can hold work queued before a load. A path that reports its copies done before
synchronising them leaves stale bytes; one that skips the wait for the caller's mark lands before the caller's
queued writes, which then overwrite it."""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Tuple

from rdt._objects.device_order import Streams


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.items: List[Tuple[str, Any]] = []  # ("run", fn) or ("wait", event)
        self.ran = 0  # items executed so far


class FakeEvent:
    def __init__(self, stream: FakeStream, position: int, name: str) -> None:
        self.stream, self.position, self.name = stream, position, name


class Recorder(Streams):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.RLock()
        self.log: List[Tuple[str, str]] = []
        self.caller = FakeStream("caller")
        self._streams: dict = {}
        self._events = 0

    def note(self, what: str, detail: str = "") -> None:
        with self.lock:
            self.log.append((what, detail))

    def _event(self, stream: FakeStream) -> FakeEvent:
        self._events += 1
        return FakeEvent(stream, len(stream.items), f"e{self._events}@{stream.name}")

    # the caller's side (tests)
    def caller_queues(self, fn: Callable[[], None]) -> None:
        """Work the caller queued on its current stream before the load (runs when something waits for it)."""
        with self.lock:
            self.caller.items.append(("run", fn))

    def drain(self) -> None:
        """The device runs everything still queued (as it would eventually)."""
        with self.lock:
            for s in [self.caller] + list(self._streams.values()):
                self._flush(s, len(s.items))

    def pending(self) -> int:
        with self.lock:
            return sum(len(s.items) - s.ran for s in [self.caller] + list(self._streams.values()))

    # the discipline
    def mark(self, device: Any) -> Any:
        with self.lock:
            ev = self._event(self.caller)
            self.note("mark", ev.name)
            return ev

    def stream(self, device: Any) -> Any:
        with self.lock:
            key = (threading.get_ident(), str(device))
            s = self._streams.get(key)
            if s is None:
                s = self._streams[key] = FakeStream(f"loader{len(self._streams)}")
            return s

    def wait(self, stream: Any, mark: Any) -> None:
        with self.lock:
            self.note("wait", getattr(mark, "name", "none"))
            if mark is not None:
                stream.items.append(("wait", mark))

    def wait_host(self, mark: Any) -> None:
        with self.lock:
            self.note("wait_host", getattr(mark, "name", "none"))
            if mark is not None:
                self._flush(mark.stream, mark.position)

    def run(self, stream: Any, fn: Callable[[], None]) -> None:
        with self.lock:
            self.note("run", stream.name)
            stream.items.append(("run", fn))

    def done(self, stream: Any) -> Any:
        with self.lock:
            ev = self._event(stream)
            self.note("record", ev.name)
            return ev

    def synchronize(self, event: Any) -> None:
        if event is None:
            return
        with self.lock:
            self._flush(event.stream, event.position)
            self.note("synchronize", event.name)

    def _flush(self, stream: FakeStream, upto: int) -> None:
        while stream.ran < upto:
            kind, item = stream.items[stream.ran]
            stream.ran += 1
            if kind == "wait":
                self._flush(item.stream, item.position)
            else:
                item()
                self.note("executed", stream.name)


def order_of(log: List[Tuple[str, str]], what: str, detail: Optional[str] = None) -> int:
    """The index of the first entry ``what`` (with ``detail``) in ``log``."""
    for i, (w, d) in enumerate(log):
        if w == what and (detail is None or d == detail):
            return i
    raise AssertionError(f"{what} {detail or ''} not in {log}")
