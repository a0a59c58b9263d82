"""Machine info, the stdout table (with what served each case), the JSON file and the PNG plot."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ._mechanism import comparable, mechanisms_of
from ._targets import check_targets, fmt_value, format_targets, index
from ._units import fmt_latency, fmt_size

__all__ = ["check_targets", "compare", "format_markdown", "format_table", "format_targets", "machine_info",
           "write_json", "write_png"]


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


Block = Tuple[str, int, str]  # suite, world size, mode
Cells = Dict[Tuple[str, int, str, str], Dict[Optional[int], Dict[str, Any]]]


def _blocks(rows: List[Dict[str, Any]]) -> Tuple[Cells, Dict[Block, List[str]]]:
    """Rows by (suite, world size, mode, impl) and size, and each block's implementations in run order."""
    cells: Cells = defaultdict(dict)
    for r in rows:
        cells[(r["suite"], r["world_size"], r.get("mode", "barrier"), r["impl"])][r.get("size")] = r
    blocks: Dict[Block, List[str]] = defaultdict(list)
    for suite, ws, mode, impl in cells:
        if impl not in blocks[(suite, ws, mode)]:
            blocks[(suite, ws, mode)].append(impl)
    return cells, blocks


def _mechanism_column(by_size: Dict[Optional[int], Dict[str, Any]], sizes: List[int]) -> Optional[str]:
    """The one mechanism of an implementation's measured cells, or None when it changes with the size."""
    mechs = {by_size[s].get("mechanism", "?") for s in sizes if s in by_size and "error" not in by_size[s]}
    return mechs.pop() if len(mechs) == 1 else ("-" if not mechs else None)


def format_table(rows: List[Dict[str, Any]], sizes: List[int]) -> str:
    """One block per (suite, world size, mode): implementation, mechanism, and per size 'GB/s / latency'."""
    cells, blocks = _blocks(rows)
    out: List[str] = []
    for (suite, ws, mode), impls in blocks.items():
        metric = "algbw GB/s" if suite != "allreduce" else "busbw GB/s"
        out.append(f"\n== {suite}, {mode}  (world size {ws}; cells: {metric} / median latency) ==")
        out.append(f"{'implementation':<22}{'mechanism':<24}" + "".join(f"{fmt_size(s):>22}" for s in sizes))
        for impl in impls:
            by_size = cells[(suite, ws, mode, impl)]
            if None in by_size and len(by_size) == 1:  # setup failed: one error for all sizes
                out.append(f"{impl:<22}{'-':<24}{by_size[None]['error'][:22 * len(sizes) - 2]}")
                continue
            mech = _mechanism_column(by_size, sizes)
            out.append(f"{impl:<22}{(mech or 'per size, below'):<24}" + "".join(
                f"{_cell(by_size.get(s), suite):>22}" for s in sizes))
            if mech is None:
                out.append(f"{'':<22}{'  mechanism':<24}" + "".join(
                    f"{by_size[s].get('mechanism', '?') if s in by_size else '-':>22}" for s in sizes))
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
    return f"{bw:.3f} / {fmt_latency(r['latency_us'])}"


def write_json(path: Path, meta: Dict[str, Any], rows: List[Dict[str, Any]]) -> None:
    """Everything measured, with the run's metadata, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({**meta, "results": rows}, indent=1, default=str))
    tmp.replace(path)


MAX_LINES = 8
GREYS = ("0.2", "0.4", "0.55", "0.7")
BASELINE_MARKERS = ("s", "^", "v", "D")
ALGO_STYLES = {"ring": "-", "bde": "--", "tree": ":"}


def is_baseline(row: Dict[str, Any]) -> bool:
    """Rows that are not rdt: Ray's collectives, torch.distributed, Ray's object store and built-in RDT."""
    return row.get("family") == "baseline" or not str(row["impl"]).startswith("rdt-")


Panel = Tuple[str, List[Dict[str, Any]]]  # title, rows


def _panels(ok: List[Dict[str, Any]]) -> List[Panel]:
    """Per (suite, world size, mode): rdt's default paths with the baselines; rdt's p2p algorithms apart; a
    panel over MAX_LINES lines puts its baselines in their own panel."""
    groups: Dict[Block, List[Dict[str, Any]]] = defaultdict(list)
    for r in ok:
        groups[(r["suite"], r["world_size"], r.get("mode", "barrier"))].append(r)
    order = sorted(groups, key=lambda b: (b[0] != "p2p", b[0], b[1], b[2]))
    out: List[Panel] = []
    for suite, ws, mode in order:
        rs = groups[(suite, ws, mode)]
        title = f"{suite}, {mode}, n={ws}"
        main = [r for r in rs if "/" not in r["impl"]]
        algos = [r for r in rs if "/" in r["impl"]]
        if len({r["impl"] for r in main}) > MAX_LINES:
            out.append((title + ": rdt", [r for r in main if not is_baseline(r)]))
            out.append((title + ": baselines", [r for r in main if is_baseline(r)]))
        else:
            out.append((title, main))
        if algos:
            out.append((title + ": rdt p2p algorithms", algos))
    return out


def _draw_series(ax: Any, rows: List[Dict[str, Any]], colors: Dict[str, Any]) -> None:
    """One line per implementation, labelled with its mechanism(s); baselines grey and dashed."""
    series: Dict[str, List[Dict[str, Any]]] = defaultdict(list)
    for r in rows:
        series[r["impl"]].append(r)
    grey = 0
    for impl, rs in series.items():
        rs.sort(key=lambda r: r["size"])
        xs, ys = [r["size"] for r in rs], [r.get("busbw_gbps", r["gbps"]) for r in rs]
        label = f"{impl} [{mechanisms_of(rs)}]"
        if is_baseline(rs[0]):
            ax.plot(xs, ys, "--", marker=BASELINE_MARKERS[grey % 4], color=GREYS[grey % 4], linewidth=1.2,
                    label=label)
            grey += 1
            continue
        base, _, algo = impl.partition("/")
        ax.plot(xs, ys, ALGO_STYLES.get(algo, "-"), marker="o", color=colors[base], linewidth=1.8, label=label)
    ax.set_xscale("log", base=2)
    ticks = sorted({r["size"] for r in rows})
    ax.set_xticks(ticks, [fmt_size(t) for t in ticks])
    ax.set_yscale("log")
    ax.set_xlabel("message size")
    ax.grid(True, which="both", alpha=0.3)
    if series:
        ax.legend(fontsize=6.5)


def _draw_targets(ax: Any, targets: List[Dict[str, Any]]) -> None:
    """Each target as a bar of (achieved / needed), 1 = just met: green met, red missed; cross-mechanism hatched."""
    names, scores, colors, hatches, texts = [], [], [], [], []
    for t in targets:
        need = t["required"]
        names.append(t["target"])
        hatches.append("//" if t.get("cross_mechanism") else "")
        if t.get("met") is None:  # not available in this build: no bar, the reason as text
            scores.append(float("nan"))
            colors.append("0.6")
            texts.append(str(t.get("status", "n/a")))
            continue
        v = max(t["ratio"], 1e-9)
        scores.append(need / v if t.get("inverse") else v / need)
        colors.append("tab:green" if t["met"] else "tab:red")
        texts.append(f"{fmt_value(t)} (need {need:g}{'x' if t.get('unit', 'x') == 'x' else ' ' + t['unit']})")
    y = list(range(len(names)))
    bars = ax.barh(y, scores, color=colors, alpha=0.8)
    for bar, hatch, text in zip(bars, hatches, texts):
        bar.set_hatch(hatch)
        width = bar.get_width()
        ax.text(width if width == width else 1.0, bar.get_y() + bar.get_height() / 2, " " + text, va="center", fontsize=6)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(y, names, fontsize=6)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("achieved / needed (>= 1: met; hatched: cross-mechanism)")
    na = sum(t.get("met") is None for t in targets)
    ax.set_title(f"targets: {sum(bool(t['met']) for t in targets)} of {len(targets) - na} met (median)"
                 + (f"; {na} not available in this build" if na else ""))


def write_png(path: Path, rows: List[Dict[str, Any]],
              targets: Optional[List[Dict[str, Any]]] = None) -> Optional[Path]:
    """Throughput vs size, at most about MAX_LINES lines per panel, baselines grey and dashed, and a panel of the
    targets. None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [r for r in rows if "error" not in r and r.get("gbps")]
    panels = _panels(ok)
    ncols = max(1, min(3, len(panels)))
    nrows = max(1, -(-len(panels) // ncols))
    target_h = max(2.5, 0.25 * len(targets)) if targets else 0.0  # the targets get a full-width row of their own
    fig = plt.figure(figsize=(6.5 * ncols, 4.8 * nrows + target_h))
    grid = fig.add_gridspec(nrows + (1 if targets else 0), ncols,
                            height_ratios=[4.8] * nrows + ([target_h] if targets else []))
    cmap = plt.get_cmap("tab10")
    bases = sorted({r["impl"].partition("/")[0] for r in ok if not is_baseline(r)})
    colors = {b: cmap(i % 10) for i, b in enumerate(bases)}  # one colour per rdt path in every panel
    for i, (title, prs) in enumerate(panels):
        ax = fig.add_subplot(grid[i // ncols, i % ncols])
        _draw_series(ax, prs, colors)
        suite = prs[0]["suite"] if prs else ""
        ax.set_ylabel("bus bandwidth (GB/s)" if suite == "allreduce" else "throughput (GB/s)")
        ax.set_title(title, fontsize=9)
    if targets:
        _draw_targets(fig.add_subplot(grid[nrows, :]), targets)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

BASELINES = ("ray.collective-gloo", "torch.dist-gloo", "ray-objstore", "ray-objstore-numpy")


def compare(rows: List[Dict[str, Any]]) -> List[str]:
    """rdt-gloo vs each baseline in the same block (median, and best iteration); a pair served by mechanisms of
    different classes is marked cross-mechanism, never shown as a like-for-like ratio."""
    idx = index(rows)
    out = []
    for (suite, ws, impl, mode, size), r in sorted(idx.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][3],
                                                                                 kv[0][4] or 0)):
        if impl != "rdt-gloo":
            continue
        parts = []
        for base in BASELINES:
            b = idx.get((suite, ws, base, mode, size))
            if b is None:
                continue
            text = f"{r['gbps'] / b['gbps']:.2f}x (best {r['gbps_best'] / b['gbps_best']:.2f}x) {base}"
            if not comparable(r.get("mechanism"), b.get("mechanism")):
                text += f" [cross-mechanism: {r.get('mechanism', '?')} vs {b.get('mechanism', '?')}]"
            parts.append(text)
        if parts:
            out.append(f"{suite:<9} {mode:<12} n={ws} {fmt_size(size):>8}: rdt-gloo = " + ", ".join(parts))
    return out


def format_markdown(meta: Dict[str, Any], rows: List[Dict[str, Any]], sizes: List[int]) -> str:
    """The run as Markdown (machine, targets, one table per suite, world size and mode), for docs/benchmarks.md."""
    m = meta.get("machine", {})
    out = [f"Run of {m.get('date', '?')} on {m.get('cpu_model', '?')} ({m.get('cpu_cores', '?')} cores), Python "
           f"{m.get('python', '?')}, torch {m.get('torch', '?')}, Ray {m.get('ray', '?')}; load average at start "
           f"{m.get('loadavg_at_start', ['?'])[0]:.2f}; elapsed {meta.get('elapsed_s', '?')} s.", ""]
    targets = meta.get("targets") or []
    if targets:
        out += ["| target | status | median | best-of | needed | mechanisms |", "|---|---|---|---|---|---|"]
        for t in targets:
            need = f"{t['required']}x" if t.get("unit", "x") == "x" else f"{t['required']:g} {t['unit']}"
            values = [v.replace(" us", " µs") for v in (fmt_value(t), fmt_value(t, "ratio_best"), need)]
            status = t.get("status", "n/a") if t.get("met") is None else ("met" if t["met"] else "**missed**")
            out.append(f"| {t['target']} | {status} | " + " | ".join(values)
                       + f" | {t.get('mechanisms', '?')} |")
        out.append("")
    cells, order = _blocks(rows)
    for (suite, ws, mode), impls in order.items():
        out += [f"### {suite}, {mode} ({ws} actors)", "", "| implementation | mechanism | "
                + " | ".join(fmt_size(x) for x in sizes) + " |", "|---|---|" + "---|" * len(sizes)]
        for impl in impls:
            by_size = cells[(suite, ws, mode, impl)]
            mech = _mechanism_column(by_size, sizes)
            row = []
            for x in sizes:
                cell = _cell(by_size.get(x), suite).replace("us", "µs")
                if mech is None and x in by_size and "error" not in by_size[x]:
                    cell += f" ({by_size[x].get('mechanism', '?')})"
                row.append(cell)
            out.append(f"| {impl} | {mech or 'per cell'} | " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out)
