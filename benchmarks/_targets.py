"""The project's performance targets, checked on one run's rows; each says which mechanisms it compared.

A target compares rdt with a baseline on purpose even when they are different mechanisms (e.g. the same-node
shared-memory allreduce against ray.util.collective's Gloo over TCP: what a user gets from each); such a target
is marked ``cross_mechanism`` so that it is never read as a like-for-like comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ._mechanism import comparable, describe_pair
from ._units import fmt_size

KiB, MiB = 1 << 10, 1 << 20
P2P_MODES = ("back-to-back", "barrier")

Key = Tuple[str, int, str, str, Optional[int]]  # suite, world size, impl, mode, size


@dataclass(frozen=True)
class Target:
    """impl's throughput >= need x base's (``base`` set), or an absolute bound on impl alone: ``metric`` 'gbps'
    (>= need GB/s) or 'latency_us' (<= need microseconds)."""

    desc: str
    suite: str
    world_size: int
    mode: str
    size: int
    impl: str
    need: float
    base: str = ""
    metric: str = "ratio"


def _p2p_targets() -> List[Target]:
    out: List[Target] = []
    for mode in P2P_MODES:
        for size in (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 128 * MiB):
            out.append(Target(f"gloo p2p {mode} {fmt_size(size)} >= 0.95x ray.util.collective", "p2p", 2, mode,
                              size, "rdt-gloo", 0.95, "ray.collective-gloo"))
        for size in (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 128 * MiB):
            need = 1.0 if size <= 64 * KiB else 1.5
            out.append(Target(f"nixl p2p {mode} {fmt_size(size)} >= {need}x ray.util.collective", "p2p", 2, mode,
                              size, "rdt-nixl", need, "ray.collective-gloo"))
        out.append(Target(f"ucx p2p {mode} 128 MiB >= 5 GB/s", "p2p", 2, mode, 128 * MiB, "rdt-ucx", 5.0,
                          metric="gbps"))
        out.append(Target(f"ucx p2p {mode} 4 KiB <= 150 us", "p2p", 2, mode, 4 * KiB, "rdt-ucx", 150.0,
                          metric="latency_us"))
    return out


TARGETS: Tuple[Target, ...] = tuple(_p2p_targets()) + (
    Target("allreduce n=4 16 MiB >= 1x ray.util.collective", "allreduce", 4, "barrier", 16 * MiB, "rdt-gloo", 1.0,
           "ray.collective-gloo"),
    Target("allreduce n=4 128 MiB >= 1x ray.util.collective", "allreduce", 4, "barrier", 128 * MiB, "rdt-gloo", 1.0,
           "ray.collective-gloo"),
    Target("allreduce n=4 16 MiB >= 10x object store", "allreduce", 4, "barrier", 16 * MiB, "rdt-gloo", 10.0,
           "ray-objstore"),
    Target("allreduce n=4 128 MiB >= 10x object store", "allreduce", 4, "barrier", 128 * MiB, "rdt-gloo", 10.0,
           "ray-objstore"),
)


def index(rows: List[Mapping[str, Any]]) -> Dict[Key, Mapping[str, Any]]:
    """Successful rows by (suite, world size, impl, mode, size)."""
    return {(r["suite"], r["world_size"], r["impl"], r.get("mode", "barrier"), r.get("size")): r
            for r in rows if "error" not in r}


def check_targets(rows: List[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Every target this run measured (median and best-of), with the mechanisms on each side."""
    idx = index(rows)
    out = []
    for t in TARGETS:
        a = idx.get((t.suite, t.world_size, t.impl, t.mode, t.size))
        b = idx.get((t.suite, t.world_size, t.base, t.mode, t.size)) if t.base else None
        if a is None or (t.base and b is None):
            continue
        out.append(_result(t, a, b))
    return out


def _result(t: Target, a: Mapping[str, Any], b: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    inverse = t.metric == "latency_us"
    if b is not None:
        value, best, unit = a["gbps"] / b["gbps"], a["gbps_best"] / b["gbps_best"], "x"
        mechs, cross = describe_pair(a.get("mechanism"), b.get("mechanism")), not comparable(
            a.get("mechanism"), b.get("mechanism"))
    elif inverse:
        value, best, unit = a["latency_us"], a["seconds_min"] * 1e6, "us"
        mechs, cross = str(a.get("mechanism") or "?"), False
    else:
        value, best, unit = a["gbps"], a["gbps_best"], "GB/s"
        mechs, cross = str(a.get("mechanism") or "?"), False
    met = (lambda v: v <= t.need) if inverse else (lambda v: v >= t.need)
    return {"target": t.desc, "ratio": round(value, 3), "ratio_best": round(best, 3), "required": t.need,
            "met": met(value), "met_best": met(best), "inverse": inverse, "unit": unit, "mechanisms": mechs,
            "cross_mechanism": cross}


def fmt_value(t: Mapping[str, Any], key: str = "ratio") -> str:
    """A target's value with its unit: '0.97x', '5.2 GB/s', '120 us'."""
    unit = t.get("unit", "x")
    return f"{t[key]:.2f}x" if unit == "x" else f"{t[key]:.3g} {unit}"


def format_targets(targets: List[Mapping[str, Any]]) -> str:
    """Targets as text lines, each with the mechanisms it compared."""
    return "\n".join(f"{'MET ' if t['met'] else 'MISS'} {t['target']:<52} median {fmt_value(t):>10}  best-of "
                     f"{fmt_value(t, 'ratio_best'):>10}  [{t.get('mechanisms', '?')}]" for t in targets)
