"""The GPU benchmark's rows as a markdown table: no Ray, no torch (scripts/gpu-check formats the report in a process
that has neither)."""

from __future__ import annotations

import re
from typing import Any, Dict, List


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def error_text(e: BaseException, limit: int = 2000) -> str:
    """An error for a row: its type and its message without terminal colours; when too long, the first lines and
    the last ones (where a RayTaskError's cause and its final message are), ``limit`` characters at most."""
    return clip(f"{type(e).__name__}: {ANSI.sub('', str(e))}", limit)


def clip(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters: a short head and the tail, joined by " ... "."""
    if len(text) <= limit:
        return text
    head = min(200, limit // 4)
    return text[:head] + " ... " + text[-(limit - head - 5):]


def format_markdown(rows: List[Dict[str, Any]]) -> str:
    """One table: case, size, median time, throughput, the path that served, or why it did not run."""
    lines = ["| case | size | median ms | GB/s | path | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        ms = f"{r['median_s'] * 1e3:.3f}" if "median_s" in r else ""
        note = clip(" ".join(str(r.get("error") or r.get("skipped") or r.get("note") or "").replace("|", "/")
                             .split()), 400)
        lines.append(f"| {r['case']} | {int(r['bytes']) >> 20} MiB | {ms} | {r.get('GB/s', '')} | "
                     f"{r.get('path', '')} | {note} |")
    return "\n".join(lines)
