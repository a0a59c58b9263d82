"""Metrics.op queues calls; flush_ops hands them to Ray's metric objects (here fakes): counters summed per label
set, one histogram point per successful call, nothing for an empty queue, the backlog bounded."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from rdt_transports import _metrics
from rdt_transports._metrics import Metrics


class _Fake:
    """Stands in for a ray.util.metrics Counter/Histogram: records (value, tags)."""

    def __init__(self) -> None:
        self.calls: List[Tuple[float, Dict[str, str]]] = []

    def inc(self, value: float, tags: Dict[str, str]) -> None:
        assert value > 0  # Ray's Counter.inc refuses 0
        self.calls.append((value, dict(tags)))

    def observe(self, value: float, tags: Dict[str, str]) -> None:
        self.calls.append((value, dict(tags)))


def _metrics_with_fakes() -> Tuple[Metrics, Dict[str, Any]]:
    m = Metrics()
    fakes = {k: _Fake() for k in ("ops", "op_bytes", "op_latency")}
    m._m = fakes  # as if Ray's metric objects had been made
    m._flusher = object()  # type: ignore[assignment]  # no background thread in this test
    return m, fakes


def test_flush_sums_counters_and_observes_each_call() -> None:
    m, fakes = _metrics_with_fakes()
    m.op("gloo", "send", 100, 0.001, True)
    m.op("gloo", "send", 50, 0.002, True)
    m.op("gloo", "barrier", 0, 0.003, True)
    m.op("gloo", "recv", 10, 0.004, False)
    assert fakes["ops"].calls == []  # nothing reaches Ray on the call path
    m.flush_ops()
    assert sorted((v, t["op"], t["status"]) for v, t in fakes["ops"].calls) == [
        (1, "barrier", "ok"), (1, "recv", "error"), (2, "send", "ok")]
    assert fakes["op_bytes"].calls == [(150, {"backend": "gloo", "op": "send"})]  # no zero increment for barrier
    assert sorted(v for v, _ in fakes["op_latency"].calls) == [0.001, 0.002, 0.003]  # failed calls: no point
    m.flush_ops()  # an empty queue records nothing more
    assert len(fakes["ops"].calls) == 3


def test_backlog_is_bounded(monkeypatch: Any) -> None:
    monkeypatch.setattr(_metrics, "OP_BACKLOG", 4)
    m, fakes = _metrics_with_fakes()
    for i in range(10):
        m.op("nixl", "send", 1, 0.001, True)
    m.flush_ops()
    assert fakes["ops"].calls == [(4, {"backend": "nixl", "op": "send", "status": "ok"})]
