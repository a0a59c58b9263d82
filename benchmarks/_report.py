"""Machine info, the stdout table, the JSON file and the PNG plot."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ._collectives import fmt_size


def machine_info() -> Dict[str, Any]:
    """CPU model, cores, memory and software versions."""
    import ray
    import torch

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor()
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    return {"date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"), "hostname": platform.node(),
            "loadavg_at_start": list(os.getloadavg()),
            "cpu_model": cpu, "cpu_cores": os.cpu_count(), "memory_bytes": mem, "platform": platform.platform(),
            "python": sys.version.split()[0], "torch": torch.__version__, "ray": ray.__version__}


def _key(row: Dict[str, Any]) -> Tuple[str, int, str]:
    return row["suite"], row["world_size"], row["impl"]


Cells = Dict[Tuple[str, int, str], Dict[Optional[int], Dict[str, Any]]]


def _blocks(rows: List[Dict[str, Any]]) -> Tuple[Cells, Dict[Tuple[str, int], List[str]]]:
    """Rows by (suite, world size, impl) and size, and each (suite, world size)'s implementations in run order."""
    cells: Cells = defaultdict(dict)
    for r in rows:
        cells[_key(r)][r.get("size")] = r
    blocks: Dict[Tuple[str, int], List[str]] = defaultdict(list)
    for suite, ws, impl in cells:
        if impl not in blocks[(suite, ws)]:
            blocks[(suite, ws)].append(impl)
    return cells, blocks


def format_table(rows: List[Dict[str, Any]], sizes: List[int]) -> str:
    """One block per (suite, world size): implementations x sizes, each cell 'GB/s (latency)'."""
    cells, blocks = _blocks(rows)
    out: List[str] = []
    for (suite, ws), impls in blocks.items():
        metric = "algbw GB/s" if suite != "allreduce" else "busbw GB/s"
        out.append(f"\n== {suite}  (world size {ws}; cells: {metric} / median latency) ==")
        out.append(f"{'implementation':<24}" + "".join(f"{fmt_size(s):>22}" for s in sizes))
        for impl in impls:
            by_size = cells[(suite, ws, impl)]
            if None in by_size and len(by_size) == 1:  # setup failed: one error for all sizes
                out.append(f"{impl:<24}  {by_size[None]['error'][:22 * len(sizes) - 2]}")
                continue
            line = f"{impl:<24}"
            for s in sizes:
                r = by_size.get(s)
                line += f"{_cell(r, suite):>22}"
            out.append(line)
    errors = {(r["impl"], r["world_size"], r["error"]) for r in rows if "error" in r}
    if errors:
        out.append("\n== errors / unavailable ==")
        out.extend(f"{impl} (n={ws}): {err}" for impl, ws, err in sorted(errors, key=str))
    return "\n".join(out)


def _cell(r: Optional[Dict[str, Any]], suite: str) -> str:
    if r is None:
        return "-"
    if "error" in r:
        return "error"
    bw = r.get("busbw_gbps", r["gbps"]) if suite == "allreduce" else r["gbps"]
    return f"{bw:.3f} / {_lat(r['latency_us'])}"


def _lat(us: float) -> str:
    if us >= 1e6:
        return f"{us / 1e6:.2f} s"
    if us >= 1e3:
        return f"{us / 1e3:.1f} ms"
    return f"{us:.0f} us"


def write_json(path: Path, meta: Dict[str, Any], rows: List[Dict[str, Any]]) -> None:
    """Everything measured, with the run's metadata, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({**meta, "results": rows}, indent=1, default=str))
    tmp.replace(path)


def write_png(path: Path, rows: List[Dict[str, Any]]) -> Optional[Path]:
    """Throughput vs size per implementation: one panel per (suite, world size). None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [r for r in rows if "error" not in r and r.get("gbps")]
    panels = sorted({(r["suite"], r["world_size"]) for r in ok}, key=lambda p: (p[0] != "p2p", p[0], p[1]))
    if not panels:
        panels = [("no results", 0)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8), squeeze=False)
    names = sorted({r["impl"] for r in ok})
    cmap = plt.get_cmap("tab20")
    colors = {n: cmap(i % 20) for i, n in enumerate(names)}  # one colour per implementation in every panel
    for ax, (suite, ws) in zip(axes[0], panels):
        series: Dict[str, List[Tuple[int, float]]] = defaultdict(list)
        for r in ok:
            if (r["suite"], r["world_size"]) == (suite, ws):
                series[r["impl"]].append((r["size"], r.get("busbw_gbps", r["gbps"])))
        for impl, pts in sorted(series.items()):
            pts.sort()
            baseline = not impl.startswith("rdt-")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "--" if baseline else "-", marker="s" if baseline
                    else "o", color=colors[impl], linewidth=2.2 if baseline else 1.4, label=impl)
        ax.set_xscale("log", base=2)
        ticks = sorted({p[0] for pts in series.values() for p in pts})
        ax.set_xticks(ticks, [fmt_size(t) for t in ticks])
        ax.set_yscale("log")
        ax.set_xlabel("message size")
        ax.set_ylabel("bus bandwidth (GB/s)" if suite == "allreduce" else "throughput (GB/s)")
        ax.set_title(f"{suite}, world size {ws}")
        ax.grid(True, which="both", alpha=0.3)
        if series:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _index(rows: List[Dict[str, Any]]) -> Dict[Tuple[str, int, str, Optional[int]], Dict[str, Any]]:
    return {(r["suite"], r["world_size"], r["impl"], r.get("size")): r for r in rows if "error" not in r}


def compare(rows: List[Dict[str, Any]]) -> List[str]:
    """Ratios the project tracks: rdt-gloo vs each baseline, on the median (and on the best iteration)."""
    idx = _index(rows)
    out = []
    for (suite, ws, impl, size), r in sorted(idx.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][3] or 0)):
        if impl != "rdt-gloo":
            continue
        parts = []
        for base in ("ray.collective-gloo", "torch.dist-gloo", "ray-objstore", "ray-objstore-numpy"):
            b = idx.get((suite, ws, base, size))
            if b is not None:
                parts.append(f"{r['gbps'] / b['gbps']:.2f}x (best {r['gbps_best'] / b['gbps_best']:.2f}x) {base}")
        if parts:
            out.append(f"{suite:<9} n={ws} {fmt_size(size):>8}: rdt-gloo = " + ", ".join(parts))
    return out


# (description, suite, world size, size, impl, baseline, required ratio of impl/baseline throughput)
TARGETS: Tuple[Tuple[str, str, int, int, str, str, float], ...] = (
    ("gloo p2p 128 MiB >= 0.9x ray.util.collective", "p2p", 2, 128 << 20, "rdt-gloo", "ray.collective-gloo", 0.9),
    ("allreduce n=4 16 MiB >= 1x ray.util.collective", "allreduce", 4, 16 << 20, "rdt-gloo", "ray.collective-gloo",
     1.0),
    ("allreduce n=4 128 MiB >= 1x ray.util.collective", "allreduce", 4, 128 << 20, "rdt-gloo",
     "ray.collective-gloo", 1.0),
    ("allreduce n=4 16 MiB >= 10x object store", "allreduce", 4, 16 << 20, "rdt-gloo", "ray-objstore", 10.0),
    ("allreduce n=4 128 MiB >= 10x object store", "allreduce", 4, 128 << 20, "rdt-gloo", "ray-objstore", 10.0),
)


def check_targets(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The project's performance targets, where this run measured both sides (median and best-of ratios)."""
    idx = _index(rows)
    out = []
    for desc, suite, ws, size, impl, base, need in TARGETS:
        a, b = idx.get((suite, ws, impl, size)), idx.get((suite, ws, base, size))
        if a is None or b is None:
            continue
        ratio, best = a["gbps"] / b["gbps"], a["gbps_best"] / b["gbps_best"]
        out.append({"target": desc, "ratio": round(ratio, 3), "ratio_best": round(best, 3), "required": need,
                    "met": ratio >= need, "met_best": best >= need})
    return out


def format_targets(targets: List[Dict[str, Any]]) -> str:
    """Targets as text lines."""
    return "\n".join(f"{'MET ' if t['met'] else 'MISS'} {t['target']:<60} median {t['ratio']:.2f}x  best-of "
                     f"{t['ratio_best']:.2f}x" for t in targets)


def format_markdown(meta: Dict[str, Any], rows: List[Dict[str, Any]], sizes: List[int]) -> str:
    """The run as Markdown (machine, targets, one table per suite and world size), for docs/benchmarks.md."""
    m = meta.get("machine", {})
    out = [f"Run of {m.get('date', '?')} on {m.get('cpu_model', '?')} ({m.get('cpu_cores', '?')} cores), Python "
           f"{m.get('python', '?')}, torch {m.get('torch', '?')}, Ray {m.get('ray', '?')}; load average at start "
           f"{m.get('loadavg_at_start', ['?'])[0]:.2f}; elapsed {meta.get('elapsed_s', '?')} s.", ""]
    targets = meta.get("targets") or []
    if targets:
        out += ["| target | status | median | best-of | needed |", "|---|---|---|---|---|"]
        for t in targets:
            out.append(f"| {t['target']} | {'met' if t['met'] else '**missed**'} | {t['ratio']:.2f}x | "
                       f"{t['ratio_best']:.2f}x | {t['required']}x |")
        out.append("")
    cells, order = _blocks(rows)
    for (suite, ws), impls in order.items():
        out += [f"### {suite} ({ws} actors)", "", "| implementation | " + " | ".join(fmt_size(x) for x in sizes)
                + " |", "|---|" + "---|" * len(sizes)]
        for impl in impls:
            by_size = cells[(suite, ws, impl)]
            out.append(f"| {impl} | " + " | ".join(_cell(by_size.get(x), suite).replace("us", "µs") for x in sizes)
                       + " |")
        out.append("")
    return "\n".join(out)
