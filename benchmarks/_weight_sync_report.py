"""The weight-sync suite's table (stdout), Markdown and plot: one column per worker count, then memory per worker,
then the tensor-count objects. Rows that could not run say why (e.g. not available in this build)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ._units import fmt_latency, fmt_size

MB = 1e6


def _split(rows: List[Mapping[str, Any]]) -> Tuple[List[Mapping[str, Any]], List[Mapping[str, Any]]]:
    sync = [r for r in rows if not str(r.get("mode", "")).startswith("tensors=")]
    return sync, [r for r in rows if str(r.get("mode", "")).startswith("tensors=")]


def _order(rows: List[Mapping[str, Any]]) -> List[str]:
    out: List[str] = []
    for r in rows:
        if r["impl"] not in out:
            out.append(r["impl"])
    return out


def _cell(r: Optional[Mapping[str, Any]]) -> str:
    if r is None:
        return "-"
    if "error" in r:
        return "n/a" if str(r["error"]).startswith("not available") else "error"
    return f"{fmt_latency(r['latency_us'])} ({r['gbps']:.2f} GB/s)"


def _mechanism(rs: List[Mapping[str, Any]]) -> str:
    mechs = {str(r.get("mechanism", "?")) for r in rs if "error" not in r}
    return mechs.pop() if len(mechs) == 1 else ("-" if not mechs else "/".join(sorted(mechs)))


def _memory(r: Mapping[str, Any]) -> str:
    if "rss_peak_bytes" not in r:
        return ""
    growth = max(r["uss_growth_bytes"])
    return (f"peak RSS {max(r['rss_peak_bytes']) / MB:.0f} MB, USS +{growth / MB:.0f} MB "
            f"({growth / r['size']:.1%} of the model)")


def _model(rows: List[Mapping[str, Any]]) -> str:
    r = next((r for r in rows if r.get("mode") in ("sync", "reference")), None)
    if r is None:
        return "?"
    return f"{r['tensors']} tensors, {r['params'] / 1e6:.1f} M parameters, {r['size'] / MB:.1f} MB bf16, " \
           f"scale {r['scale']:g}"


def format_weight_sync(rows: List[Mapping[str, Any]]) -> str:
    """The stdout table."""
    sync, counts = _split(rows)
    ns = sorted({r["world_size"] for r in sync if r.get("mode") == "sync"})
    by = {(r["impl"], r["world_size"]): r for r in sync}
    out = [f"\n== weight-sync ({_model(rows)}; cells: median per step (GB/s per worker)) ==",
           f"{'implementation':<26}{'mechanism':<22}" + "".join(f"{f'{n} worker(s)':>24}" for n in ns)]
    for impl in _order(sync):
        rs = [by[(impl, n)] for n in ns if (impl, n) in by]
        if impl.startswith("inproc-copy"):
            out.append(f"{impl:<26}{_mechanism(rs):<22}{_cell(rs[0]):>24}  (one warm dst.copy_(src), reference)")
            continue
        out.append(f"{impl:<26}{_mechanism(rs):<22}" + "".join(f"{_cell(by.get((impl, n))):>24}" for n in ns))
    out.append("\n-- memory per worker during one more sync (rdt pools off; max over workers) --")
    for r in sync:
        if _memory(r):
            out.append(f"{r['impl']:<26}n={r['world_size']:<3}{_memory(r)}")
    if counts:
        cs = sorted({r["tensors"] for r in counts})
        cby = {(r["impl"], r["tensors"]): r for r in counts}
        out.append(f"\n-- one object of N tensors, {fmt_size(counts[0]['size'])} in all, trainer -> 1 worker, "
                   "plain consumption --")
        out.append(f"{'implementation':<26}{'mechanism':<22}" + "".join(f"{f'{c} tensors':>24}" for c in cs))
        for impl in _order(counts):
            rs = [cby[(impl, c)] for c in cs if (impl, c) in cby]
            out.append(f"{impl:<26}{_mechanism(rs):<22}" + "".join(f"{_cell(cby.get((impl, c))):>24}" for c in cs))
    errors = sorted({(r["impl"], r["world_size"], str(r["error"])) for r in rows if "error" in r})
    if errors:
        out.append("\n-- not run / errors --")
        out += [f"{impl} (n={n}): {err}" for impl, n, err in errors]
    return "\n".join(out)


def weight_sync_markdown(rows: List[Mapping[str, Any]]) -> str:
    """The same as Markdown tables, for docs/benchmarks.md."""
    sync, counts = _split(rows)
    ns = sorted({r["world_size"] for r in sync if r.get("mode") == "sync"})
    by = {(r["impl"], r["world_size"]): r for r in sync}
    out = [f"### weight-sync ({_model(rows)})", "",
           "| implementation | mechanism | " + " | ".join(f"{n} worker(s)" for n in ns) + " |",
           "|---|---|" + "---|" * len(ns)]
    for impl in _order(sync):
        rs = [by[(impl, n)] for n in ns if (impl, n) in by]
        cells = [_cell(by.get((impl, n))).replace("us", "µs") for n in ns]
        if impl.startswith("inproc-copy"):
            cells = [_cell(rs[0]).replace("us", "µs") + " (reference)"] + [""] * (len(ns) - 1)
        out.append(f"| {impl} | {_mechanism(rs)} | " + " | ".join(cells) + " |")
    out += ["", "| implementation | workers | peak RSS per worker | USS growth per worker (max) | of the model |",
            "|---|---|---|---|---|"]
    for r in sync:
        if "rss_peak_bytes" in r:
            g = max(r["uss_growth_bytes"])
            out.append(f"| {r['impl']} | {r['world_size']} | "
                       + ", ".join(f"{x / MB:.0f}" for x in r["rss_peak_bytes"]) + " MB"
                       + f" | {g / MB:.0f} MB | {g / r['size']:.1%} |")
    if counts:
        cs = sorted({r["tensors"] for r in counts})
        cby = {(r["impl"], r["tensors"]): r for r in counts}
        out += ["", f"| {fmt_size(counts[0]['size'])} in one object | mechanism | "
                + " | ".join(f"{c} tensors" for c in cs) + " |", "|---|---|" + "---|" * len(cs)]
        for impl in _order(counts):
            rs = [cby[(impl, c)] for c in cs if (impl, c) in cby]
            out.append(f"| {impl} | {_mechanism(rs)} | "
                       + " | ".join(_cell(cby.get((impl, c))).replace("us", "µs") for c in cs) + " |")
    errors = sorted({(r["impl"], r["world_size"], str(r["error"])) for r in rows if "error" in r})
    if errors:
        out += ["", "Not run / errors:", ""] + [f"- {impl} (n={n}): {err}" for impl, n, err in errors]
    return "\n".join(out) + "\n"


def write_weight_sync_png(path: Path, rows: List[Mapping[str, Any]]) -> Optional[Path]:
    """Median seconds per step by implementation and worker count, and the tensor-count objects; None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sync, counts = _split(rows)
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [3, 1.3]})
    _bars(axes[0], [r for r in sync if "error" not in r], "world_size", "{} worker(s)")
    axes[0].set_title(f"weight sync: {_model(rows)}", fontsize=9)
    _bars(axes[1], [r for r in counts if "error" not in r], "tensors", "{} tensors")
    axes[1].set_title("one object, 4 MiB in all, 1 worker", fontsize=9)
    missing = _not_run(rows)
    fig.tight_layout(rect=(0, 0.035 * min(len(missing), 4), 1, 1))
    for i, text in enumerate(missing[:4]):  # never silently dropped: what could not run is written under the bars
        fig.text(0.01, 0.01 + 0.03 * i, text, fontsize=7, color="0.3")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _not_run(rows: List[Mapping[str, Any]]) -> List[str]:
    """One line per error text: 'not run (why): impl, impl at n=1,2,4'."""
    by: Dict[str, Dict[str, List[int]]] = {}
    for r in rows:
        if "error" in r:
            by.setdefault(str(r["error"])[:120], {}).setdefault(r["impl"], []).append(r["world_size"])
    return [f"not run ({err}): " + "; ".join(f"{impl} at n={','.join(map(str, sorted(ns)))}"
                                             for impl, ns in impls.items()) for err, impls in by.items()]


def _bars(ax: Any, rows: List[Mapping[str, Any]], key: str, label: str) -> None:
    """Grouped bars: one group per implementation, one bar per value of ``key``; seconds on a log axis."""
    impls = _order(rows)
    values = sorted({r[key] for r in rows})
    by: Dict[Tuple[str, Any], Mapping[str, Any]] = {(r["impl"], r[key]): r for r in rows}
    width = 0.8 / max(1, len(values))
    for j, v in enumerate(values):
        xs = [i + j * width for i, impl in enumerate(impls) if (impl, v) in by]
        ys = [by[(impl, v)]["seconds"] for impl in impls if (impl, v) in by]
        ax.bar(xs, ys, width, label=label.format(v))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(impls))],
                  [f"{i}\n[{_mechanism([r for r in rows if r['impl'] == i])}]" for i in impls], fontsize=6.5,
                  rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("median seconds per step (lower is better)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    if values:
        ax.legend(fontsize=7)
