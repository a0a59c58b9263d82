"""The GPU benchmark's rows as a markdown table: no Ray, no torch (scripts/gpu-check formats the report in a process
that has neither)."""

from __future__ import annotations

from typing import Any, Dict, List


def format_markdown(rows: List[Dict[str, Any]]) -> str:
    """One table: case, size, median time, throughput, the path that served, or why it did not run."""
    lines = ["| case | size | median ms | GB/s | path | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        ms = f"{r['median_s'] * 1e3:.3f}" if "median_s" in r else ""
        note = str(r.get("error") or r.get("skipped") or "").replace("|", "/").replace("\n", " ")[:300]
        lines.append(f"| {r['case']} | {int(r['bytes']) >> 20} MiB | {ms} | {r.get('GB/s', '')} | "
                     f"{r.get('path', '')} | {note} |")
    return "\n".join(lines)
