"""Formatting of sizes and latencies (no Ray or torch import: ``rdt-bench --compare`` uses it)."""

from __future__ import annotations


def fmt_size(nbytes: int) -> str:
    """4096 -> '4 KiB'."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= (1 << shift) and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def fmt_latency(us: float) -> str:
    """Microseconds as '95 us', '1.6 ms' or '2.75 s'."""
    if us >= 1e6:
        return f"{us / 1e6:.2f} s"
    if us >= 1e3:
        return f"{us / 1e3:.1f} ms"
    return f"{us:.0f} us"
