"""``rdt-bench --compare A.json B.json``: the speed-up of every cell measured in both runs (no Ray needed).

A cell is (suite, impl, mechanism, size, world size, mode). The speed-up is B's median throughput over A's
(equivalently A's median latency over B's): above 1 means B is faster. A case measured in both runs but served by
a different mechanism is listed apart (its ratio is not a like-for-like comparison), as are cells in one run
only and cells that failed in either.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ._units import fmt_latency, fmt_size

Cell = Tuple[str, str, str, Optional[int], int, str]  # suite, impl, mechanism, size, world size, mode


class CompareError(ValueError):
    """A file that is not an rdt-bench JSON result."""


def load_rows(path: Path) -> List[Dict[str, Any]]:
    """The result rows of an rdt-bench JSON file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CompareError(f"{path}: cannot read an rdt-bench JSON file: {e}") from e
    rows = data.get("results") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise CompareError(f"{path}: no 'results' list: not an rdt-bench JSON file")
    return [r for r in rows if isinstance(r, dict) and "suite" in r and "impl" in r]


def cell_of(r: Mapping[str, Any]) -> Cell:
    """A row's cell; files from before mechanism/mode were recorded read '?'."""
    return (str(r["suite"]), str(r["impl"]), str(r.get("mechanism") or "?"), r.get("size"),
            int(r.get("world_size") or 0), str(r.get("mode") or "?"))


def _cells(rows: List[Dict[str, Any]]) -> Dict[Cell, Dict[str, Any]]:
    return {cell_of(r): r for r in rows}


def _name(c: Cell) -> str:
    suite, impl, mech, size, ws, mode = c
    return f"{suite:<9} {mode:<12} n={ws} {impl:<22} {mech:<24} {fmt_size(size) if size else '-':>8}"


def _ok(r: Mapping[str, Any]) -> bool:
    return "error" not in r and bool(r.get("gbps"))


def _line(c: Cell, a: Mapping[str, Any], b: Mapping[str, Any]) -> Tuple[str, float]:
    speedup = b["gbps"] / a["gbps"]
    return (f"{_name(c)}  {fmt_latency(a['latency_us']):>9} -> {fmt_latency(b['latency_us']):>9}  "
            f"{speedup:6.2f}x"), speedup


def compare_runs(path_a: Path, path_b: Path) -> str:
    """The comparison report of two rdt-bench JSON files, as text."""
    a, b = _cells(load_rows(path_a)), _cells(load_rows(path_b))
    out = [f"A: {path_a}", f"B: {path_b}",
           "speed-up = B median throughput / A median throughput (= A latency / B latency); > 1: B is faster", "",
           f"{'suite':<9} {'mode':<12} {'n':<3} {'impl':<22} {'mechanism':<24} {'size':>8}  {'A':>9}    "
           f"{'B':>9}  speed-up"]
    both = [c for c in a if c in b]
    speedups: List[float] = []
    failed: List[str] = []
    for c in sorted(both, key=_sort_key):
        if _ok(a[c]) and _ok(b[c]):
            text, x = _line(c, a[c], b[c])
            out.append(text)
            speedups.append(x)
        else:
            failed.append(f"{_name(c)}  A: {_status(a[c])}; B: {_status(b[c])}")
    if speedups:
        gmean = math.exp(sum(math.log(x) for x in speedups) / len(speedups))
        out.append(f"\n{len(speedups)} cells in both runs; geometric mean speed-up {gmean:.2f}x")
    out += _mechanism_changes(a, b)
    out += _unlabelled(a, b)
    if failed:
        out += ["", "== failed in A or B =="] + failed
    only_a = sorted((c for c in a if c not in b), key=_sort_key)
    only_b = sorted((c for c in b if c not in a), key=_sort_key)
    out += ["", f"== only in A ({len(only_a)}) =="] + [_name(c) for c in only_a]
    out += ["", f"== only in B ({len(only_b)}) =="] + [_name(c) for c in only_b]
    return "\n".join(out)


def _mechanism_changes(a: Dict[Cell, Dict[str, Any]], b: Dict[Cell, Dict[str, Any]]) -> List[str]:
    """Cases measured in both runs but served by different mechanisms (their cells are 'only in' one run)."""
    def case(c: Cell) -> Tuple[Any, ...]:
        return c[:2] + c[3:]

    by_case_b = {case(c): c for c in b if c not in a}
    lines = []
    for ca in sorted((c for c in a if c not in b), key=_sort_key):
        cb = by_case_b.get(case(ca))
        if cb is not None and _ok(a[ca]) and _ok(b[cb]):
            lines.append(f"{_name(ca)} -> {cb[2]}: {b[cb]['gbps'] / a[ca]['gbps']:.2f}x (cross-mechanism)")
    return (["", "== same case, different mechanism (A -> B) =="] + lines) if lines else []


def _unlabelled(a: Dict[Cell, Dict[str, Any]], b: Dict[Cell, Dict[str, Any]]) -> List[str]:
    """Cells of a run recorded before labels ('?' mechanism and mode), matched by (suite, impl, size, world size)
    with the other run's cells of every mode: which mode and mechanism the old run measured is unknown."""
    def case(c: Cell) -> Tuple[Any, ...]:
        return c[0], c[1], c[3], c[4]

    def old(c: Cell) -> bool:
        return c[2] == "?" and c[5] == "?"

    lines = []
    for ca in sorted(a, key=_sort_key):
        for cb in sorted(b, key=_sort_key):
            if ca != cb and case(ca) == case(cb) and (old(ca) != old(cb)) and _ok(a[ca]) and _ok(b[cb]):
                lines.append(f"{_name(cb if old(ca) else ca)}  {b[cb]['gbps'] / a[ca]['gbps']:6.2f}x  ("
                             f"{'A' if old(ca) else 'B'} recorded without labels)")
    return (["", "== matched across a run recorded without labels (mode and mechanism unknown there) =="]
            + lines) if lines else []


def _status(r: Mapping[str, Any]) -> str:
    return ("error: " + str(r["error"])[:80]) if "error" in r else "no throughput"


def _sort_key(c: Cell) -> Tuple[Any, ...]:
    suite, impl, mech, size, ws, mode = c
    return suite != "p2p", suite, mode, ws, impl, size or 0, mech
