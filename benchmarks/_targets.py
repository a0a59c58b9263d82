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
    if t.get(key) is None:
        return "n/a"
    return f"{t[key]:.2f}x" if unit == "x" else f"{t[key]:.3g} {unit}"


def status_word(t: Mapping[str, Any]) -> str:
    """'MET ', 'MISS' or 'N/A ' (a target this build cannot evaluate)."""
    return "N/A " if t.get("met") is None else ("MET " if t["met"] else "MISS")


def format_targets(targets: List[Mapping[str, Any]]) -> str:
    """Targets as text lines, each with the mechanisms it compared."""
    return "\n".join(f"{status_word(t)} {t['target']:<52} median {fmt_value(t):>10}  best-of "
                     f"{fmt_value(t, 'ratio_best'):>10}  [{t.get('mechanisms', '?')}]" for t in targets)


# ---------------------------------------------------------------------- weight sync (issue 11 §4)
WS = "weight-sync"
NOT_AVAILABLE = "not available in this build"
COUNT_NEED: Mapping[str, float] = {"rdt-shm": 2.0, "rdt-nixl": 2.0, "rdt-gloo": 3.0}
USS_NEED = 0.05


def _ws_rows(rows: List[Mapping[str, Any]]) -> Dict[Tuple[str, int, str], Mapping[str, Any]]:
    """Weight-sync rows by (impl, workers, mode), successful or not."""
    return {(r["impl"], r["world_size"], r.get("mode", "sync")): r for r in rows if r.get("suite") == WS}


def _ok(r: Optional[Mapping[str, Any]]) -> bool:
    return r is not None and "error" not in r


def _ws_target(desc: str, need: float, x: Optional[Mapping[str, Any]], y: Optional[Mapping[str, Any]],
               inverse: bool, why: str = "", unit: str = "x") -> Optional[Dict[str, Any]]:
    """x's time against y's: y/x (>= need) or, ``inverse``, x/y (<= need). Not available (with ``why``) when a
    side could not run in this build; None (left out) when a side was not measured or failed."""
    if why:
        return {"target": desc, "ratio": None, "ratio_best": None, "required": need, "met": None, "met_best": None,
                "inverse": inverse, "unit": unit, "mechanisms": why, "cross_mechanism": False, "status": NOT_AVAILABLE}
    if not (_ok(x) and _ok(y)):
        return None
    assert x is not None and y is not None
    if inverse:
        value, best = x["seconds"] / y["seconds"], x["seconds_best"] / y["seconds_best"]
    else:
        value, best = y["seconds"] / x["seconds"], y["seconds_best"] / x["seconds_best"]
    met = (lambda v: v <= need) if inverse else (lambda v: v >= need)
    mechs = describe_pair(x.get("mechanism"), y.get("mechanism"))
    return {"target": desc, "ratio": round(value, 3), "ratio_best": round(best, 3), "required": need,
            "met": met(value), "met_best": met(best), "inverse": inverse, "unit": "x",
            "mechanisms": f"{x['impl']} ({mechs})", "cross_mechanism": not comparable(x.get("mechanism"),
                                                                                      y.get("mechanism"))}


def _best(idx: Dict[Tuple[str, int, str], Mapping[str, Any]], n: int, suffix: str,
          prefix: str = "rdt-") -> Tuple[Optional[Mapping[str, Any]], str]:
    """The fastest successful rdt row at ``n`` workers whose impl ends with ``suffix``; or why there is none."""
    rows = [r for (impl, ws, mode), r in idx.items()
            if ws == n and mode == "sync" and impl.startswith(prefix) and impl.endswith(suffix)]
    ok = [r for r in rows if _ok(r)]
    if ok:
        return min(ok, key=lambda r: r["seconds"]), ""
    unavailable = [r for r in rows if str(r.get("error", "")).startswith(NOT_AVAILABLE)]
    return None, (str(unavailable[0]["error"]) if unavailable else "")


def weight_sync_targets(rows: List[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Issue 11 §4's targets (medians): the ones needing ``rdt.get(into=)`` are reported as not available in a
    build without it; the ones whose rows were not measured (or failed) are left out."""
    idx = _ws_rows(rows)
    out: List[Optional[Dict[str, Any]]] = []
    into1, why1 = _best(idx, 1, "+into")
    into4, why4 = _best(idx, 4, "+into")
    bcast1, bcast4 = idx.get(("ray.collective-broadcast", 1, "sync")), idx.get(("ray.collective-broadcast", 4, "sync"))
    refs = [r for (impl, _, mode), r in idx.items() if mode == "reference" and impl.startswith("inproc-copy")
            and _ok(r)]
    copy_ref = min(refs, key=lambda r: r["seconds"]) if refs else None  # the stricter: the copy on every core
    if copy_ref is not None:
        out.append(_ws_target("weight-sync 1 worker: best rdt into <= 2x in-process copy_", 2.0, into1, copy_ref,
                              True, why1))
    if bcast1 is not None:
        out.append(_ws_target("weight-sync 1 worker: best rdt into >= 5x hand-written broadcast", 5.0, into1, bcast1,
                              False, why1))
    if bcast4 is not None:
        out.append(_ws_target("weight-sync 4 workers: best rdt into >= 4x hand-written broadcast", 4.0, into4,
                              bcast4, False, why4))
    ray_rdt4 = idx.get(("ray-rdt-gloo", 4, "sync"))
    if ray_rdt4 is not None:
        out.append(_ws_target("weight-sync 4 workers: best rdt into >= 10x Ray's RDT (gloo)", 10.0, into4, ray_rdt4,
                              False, why4))
    gloo4, _ = _best(idx, 4, "", prefix="rdt-gloo")
    if bcast4 is not None:
        out.append(_ws_target("weight-sync 4 workers: rdt-gloo (copy_ or into) >= 1.2x hand-written broadcast", 1.2,
                              gloo4, bcast4, False))
    for impl, need in COUNT_NEED.items():
        out.append(_ws_target(f"weight-sync 1000 vs 1 tensor (4 MiB in all) {impl} <= {need:g}x", need,
                              idx.get((impl, 1, "tensors=1000")), idx.get((impl, 1, "tensors=1")), True))
    for (impl, ws, mode), r in sorted(idx.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if mode == "sync" and impl.endswith("+into"):
            out.append(_uss_target(r, impl, ws))
    return [t for t in out if t is not None]


def _uss_target(r: Mapping[str, Any], impl: str, ws: int) -> Optional[Dict[str, Any]]:
    desc = f"weight-sync {impl} n={ws}: worker USS growth <= {USS_NEED:.0%} of the model"
    if str(r.get("error", "")).startswith(NOT_AVAILABLE):
        return _ws_target(desc, USS_NEED, None, None, True, str(r["error"]), unit="of model")
    if not _ok(r) or "uss_growth_bytes" not in r:
        return None
    worst = max(r["uss_growth_bytes"]) / r["size"]
    return {"target": desc, "ratio": round(worst, 4), "ratio_best": round(worst, 4), "required": USS_NEED,
            "met": worst <= USS_NEED, "met_best": worst <= USS_NEED, "inverse": True, "unit": "of model",
            "mechanisms": str(r.get("mechanism", "?")), "cross_mechanism": False}
