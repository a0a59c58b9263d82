"""rdt-bench: rdt_transports p2p and allreduce vs ray.util.collective, torch.distributed and Ray's object store,
rdt's object layer vs Ray's built-in RDT and object store, and a model's weights synced from a trainer to workers.

Usage: ``rdt-bench [--quick] [--suites p2p,allreduce,objects,weight-sync,sharded-sync | --suites xnode] [--sizes 4K,1M] [--world-sizes 2,4]
[--weight-sync-scale 1] [--out DIR|FILE]``, or ``rdt-bench --compare A.json B.json`` (the speed-up of every cell of two runs; no Ray needed).
Progress goes to stderr (one line per case and size, and where the run stands: a bar on a terminal, plain
lines otherwise), the table to stdout, and every measurement plus machine
info to ``benchmarks/results/<timestamp>.json`` next to a PNG plot. Every row names the mechanism that served it
(``mechanism``, read at run time) and how it was timed (``mode``). A suite is a function of a
:class:`BenchContext` returning result dicts; add one to :data:`SUITES` to extend the matrix.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import rdt_transports  # noqa: F401 - first: refuses an 'rdt' of another distribution before anything runs

from ._baselines import RayCollectiveImpl, baseline_impls
from ._compare import CompareError, compare_runs
from ._cluster import ActorPool, env_mismatch, log, start_ray
from ._collectives import BenchConfig, BenchContext, Impl, case_plan, fmt_size, rdt_impls, run_case
from ._objects import object_targets, objects_plan, objects_suite
from ._p2p import interleaved_p2p, interleaved_plan
from ._progress import Progress, SuitePlan
from ._sharded_sync import (CASES as SHARDED_CASES, SOAK_ROW, SUITE as SHARDED_SYNC, sharded_sync_plan,
                            sharded_sync_suite)
from ._sharded_sync_report import format_sharded_sync, sharded_sync_markdown, sharded_sync_targets
from ._sharded_delta import SUITE as SHARDED_DELTA, sharded_delta_plan, sharded_delta_suite
from ._sharded_delta_report import format_sharded_delta, sharded_delta_markdown, sharded_delta_targets
from ._targets import weight_sync_targets
from ._weight_sync import SUITE as WEIGHT_SYNC, model_shape, weight_sync_plan, weight_sync_suite
from ._weight_sync_report import format_weight_sync, weight_sync_markdown, write_weight_sync_png
from ._xnode import SHARDED_CASES as XNODE_SHARDED_CASES
from ._report import (check_targets, compare, format_markdown, format_table, format_targets, machine_info, write_json,
                      write_png)

DEFAULT_SIZES = "4K,1M,16M,128M"
QUICK_SIZES = "4K,64K"
DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "results"
P2P_WORLD_SIZE = 2

Suite = Callable[[BenchContext], List[Dict[str, Any]]]


def _impls(ctx: BenchContext, op: str) -> List[Impl]:
    return rdt_impls(ctx.config.backends, op) + baseline_impls(op)


def _p2p_impls(ctx: BenchContext) -> Tuple[List[Impl], List[Impl]]:
    """The p2p implementations: (those interleaved in the same two actors, those run as their own cases)."""
    impls = [i for i in _impls(ctx, "p2p") if "p2p" in i.ops]
    together = [i for i in impls if i.family == "rdt" or isinstance(i, RayCollectiveImpl)]
    return together, [i for i in impls if i not in together]


def p2p_suite(ctx: BenchContext) -> List[Dict[str, Any]]:
    """Rank 0 -> rank 1 send/recv of one tensor, timed on the receiver.

    rdt's backends and ray.util.collective run in interleaved rounds in the same two actors, both back to back
    and barrier-then-transfer (see _p2p); the other baselines (own processes, or the object store) run as their
    own cases, barrier-then-transfer.
    """
    together, alone = _p2p_impls(ctx)
    rows = interleaved_p2p(ctx, together)
    for impl in alone:
        rows += run_case(ctx, "p2p", "p2p", impl, P2P_WORLD_SIZE)
    return rows


def _allreduce_cases(ctx: BenchContext) -> List[Tuple[Impl, int]]:
    """(implementation, world size) of every allreduce case, fresh implementation objects per world size."""
    return [(impl, ws) for ws in ctx.config.world_sizes for impl in _impls(ctx, "allreduce")
            if "allreduce" in impl.ops]


def allreduce_suite(ctx: BenchContext) -> List[Dict[str, Any]]:
    """In-place SUM allreduce over every world size, timed as the slowest rank per iteration."""
    rows: List[Dict[str, Any]] = []
    for impl, ws in _allreduce_cases(ctx):
        rows += run_case(ctx, "allreduce", "allreduce", impl, ws)
    return rows


SUITES: Mapping[str, Suite] = MappingProxyType({"p2p": p2p_suite, "allreduce": allreduce_suite,
                                               "objects": objects_suite, WEIGHT_SYNC: weight_sync_suite,
                                               SHARDED_SYNC: sharded_sync_suite, SHARDED_DELTA: sharded_delta_suite})


def run_plan(ctx: BenchContext, suites: Sequence[str]) -> List[SuitePlan]:
    """Every case the selected suites will run, with a rough cost each: what the progress report counts."""
    config = ctx.config

    def cases(name: str) -> List[Tuple[Any, float]]:
        if name == "p2p":
            together, alone = _p2p_impls(ctx)
            return interleaved_plan(config, len(together)) + [
                c for impl in alone for c in case_plan(config, "p2p", impl.name, P2P_WORLD_SIZE)]
        if name == "allreduce":
            return [c for impl, ws in _allreduce_cases(ctx) for c in case_plan(config, "allreduce", impl.name, ws)]
        if name == "objects":
            return objects_plan(config)
        if name == SHARDED_SYNC:
            return sharded_sync_plan(config)
        if name == SHARDED_DELTA:
            return sharded_delta_plan(config)
        return weight_sync_plan(config)

    return [SuitePlan(name, tuple(cases(name))) for name in suites]
DEFAULT_SUITES = "p2p,allreduce,objects,weight-sync,sharded-sync"
XNODE = "xnode"  # not in SUITES: it starts its own cluster across network namespaces (run_xnode)
XNODE_SCALE = 0.25  # the cross-node weight sync's default model scale: five nodes' object stores on one machine
XNODE_OBJECT_STORE_MB = 512
WEIGHT_SYNC_OBJECT_STORE_MB = 6144  # Ray's object store path puts one ~1 GB model per step; room for a few


def parse_size(text: str) -> int:
    """'4K' / '4KiB' / '1M' / '4096' -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    n = int(float(t[:-1] if mult > 1 else t) * mult)
    if n < 4 or n % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes (float32)")
    return n


def _csv(text: str) -> List[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(prog="rdt-bench", description=__doc__.split("\n")[0])
    p.add_argument("--suites", default=DEFAULT_SUITES, help=f"comma list of: {', '.join(SUITES)} ({SHARDED_DELTA} is not "
                   f"in the default run; its model scale defaults to 0.25); or {XNODE} alone (cross-node, needs root)")
    p.add_argument("--sizes", default=None, help=f"message sizes (default {DEFAULT_SIZES}; --quick {QUICK_SIZES})")
    p.add_argument("--world-sizes", default="2,4", help="allreduce world sizes (number of actors)")
    p.add_argument("--backends", default="gloo,nixl,ucx", help="rdt_transports backends to measure")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few iterations (CI smoke test)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default: by size)")
    p.add_argument("--warmup", type=int, default=None, help="warmup iterations (default: by size)")
    p.add_argument("--out", default=None, help="JSON file, or directory for <timestamp>.json (default "
                   "benchmarks/results/)")
    p.add_argument("--no-png", action="store_true", help="do not draw the plot")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local one")
    p.add_argument("--num-cpus", type=int, default=None, help="local cluster CPUs (default: max world size)")
    p.add_argument("--object-store-mb", type=int, default=None,
                   help=f"local cluster object store size (default 2048, {WEIGHT_SYNC_OBJECT_STORE_MB} with weight-sync)")
    p.add_argument("--weight-sync-scale", type=float, default=None,
                   help="weight-sync model size: 1 = Qwen2.5-0.5B's shapes (988 MB bf16, the default); smaller "
                   "shrinks layers and vocabulary (below 1/24 also the widths); --quick: 0.01")
    p.add_argument("--weight-sync-workers", default="1,2,4", help="weight-sync worker counts")
    p.add_argument("--sharded-sync-rows", default=None,
                   help=f"sharded-sync rows to run (default all: {', '.join(c.impl for c in SHARDED_CASES)}, "
                   f"and {SOAK_ROW}, which runs on the rdt-sharded-shm row's actors); the others are reported as "
                   "not selected. With --suites xnode: the cross-node sharded rows to run "
                   f"(default all: {', '.join(c.impl for c in XNODE_SHARDED_CASES)})")
    p.add_argument("--group-timeout", type=float, default=None, help="seconds to wait for a group to form")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), default=None,
                   help="print the speed-up (B/A throughput) of every cell in both runs, and the cells in one only")
    return p


def out_path(arg: Optional[str], stamp: str) -> Path:
    """Where the JSON goes: a .json path as given, otherwise <dir>/<timestamp>.json."""
    if arg is None:
        return DEFAULT_OUT_DIR / f"{stamp}.json"
    p = Path(arg)
    return p if p.suffix == ".json" else p / f"{stamp}.json"


def run_compare(path_a: str, path_b: str) -> int:
    """--compare: print the comparison of two result files; 0, or 2 for a file that is not rdt-bench JSON."""
    try:
        print(compare_runs(Path(path_a), Path(path_b)))
    except CompareError as e:
        log(f"rdt-bench --compare: {e}")
        return 2
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the selected suites; returns the exit status."""
    if args.compare:
        return run_compare(*args.compare)
    suites = _csv(args.suites)
    if XNODE in suites:
        if suites != [XNODE]:
            log(f"the {XNODE} suite runs its own cluster across network namespaces: run it alone (--suites {XNODE})")
            return 2
        return run_xnode(args)
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        log(f"unknown suite(s) {unknown}; choose from {list(SUITES)}")
        return 2
    sizes = [parse_size(s) for s in _csv(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))]
    world_sizes = [int(w) for w in _csv(args.world_sizes)]
    config = BenchConfig(sizes=sizes, world_sizes=world_sizes, backends=_csv(args.backends), quick=args.quick,
                         iters=args.iters, warmup=args.warmup,
                         group_timeout=args.group_timeout or (20.0 if args.quick else 30.0),
                         weight_sync_scale=args.weight_sync_scale or (0.01 if args.quick else 1.0),
                         weight_sync_scale_set=bool(args.weight_sync_scale or args.quick),
                         weight_sync_workers=[int(w) for w in _csv(args.weight_sync_workers)],
                         sharded_sync_rows=_csv(args.sharded_sync_rows) if args.sharded_sync_rows else None)
    try:
        shape = model_shape(config.weight_sync_scale)
    except ValueError as e:
        log(str(e))
        return 2
    unknown_rows = sorted(set(config.sharded_sync_rows or ()) - {c.impl for c in SHARDED_CASES} - {SOAK_ROW})
    if unknown_rows:
        log(f"unknown sharded-sync row(s) {unknown_rows}; choose from {[c.impl for c in SHARDED_CASES] + [SOAK_ROW]}")
        return 2
    object_store_mb = args.object_store_mb or (WEIGHT_SYNC_OBJECT_STORE_MB if WEIGHT_SYNC in suites else 2048)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    json_path = out_path(args.out, stamp)
    num_cpus = args.num_cpus or max(world_sizes + [P2P_WORLD_SIZE])
    started = time.monotonic()
    cluster = start_ray(args.address, num_cpus, object_store_mb << 20)
    pool = ActorPool()
    ctx = BenchContext(config=config, pool=pool)
    meta: Dict[str, Any] = {"machine": machine_info(), "cluster": cluster, "argv": sys.argv[1:],
                            "config": {"suites": suites, "sizes": sizes, "world_sizes": world_sizes,
                                       "backends": config.backends, "quick": config.quick}}
    if WEIGHT_SYNC in suites or SHARDED_SYNC in suites or SHARDED_DELTA in suites:
        meta["config"]["weight_sync"] = {"scale": config.weight_sync_scale, "workers": config.weight_sync_workers,
                                         "model": shape.describe(), "model_bytes": shape.nbytes}
    rows: List[Dict[str, Any]] = []
    log(f"rdt-bench: suites={suites} sizes={[fmt_size(s) for s in sizes]} world_sizes={world_sizes} "
        f"backends={config.backends} -> {json_path}")
    try:
        pool.get(P2P_WORLD_SIZE)
        bad = env_mismatch(pool.info)
        meta["actor_env"] = pool.info[0]["env"] if pool.info else {}
        if bad:
            log("warning: workers do not see the benchmark environment: " + "; ".join(bad))
        with Progress(run_plan(ctx, suites)) as ctx.progress:
            for i, name in enumerate(suites):
                ctx.progress.start_suite(name)
                if i:  # every suite starts from fresh actors: what one suite's workers still hold (pools,
                    pool.reset()  # registrations, heap glibc kept) must not push the next one out of memory
                rows += SUITES[name](ctx)
                ctx.progress.finish_suite()
                meta["elapsed_s"] = round(time.monotonic() - started, 1)
                write_json(json_path, meta, rows)  # partial results survive a later crash
    finally:
        pool.shutdown()
        import ray

        ray.shutdown()
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    meta["loadavg_at_end"] = list(os.getloadavg())
    meta["targets"] = check_targets(rows) + object_targets(rows) + (
        weight_sync_targets(rows) if WEIGHT_SYNC in suites else []) + sharded_sync_targets(rows) + \
        sharded_delta_targets(rows)
    write_json(json_path, meta, rows)
    sized = [r for r in rows if r["suite"] not in (WEIGHT_SYNC, SHARDED_SYNC, SHARDED_DELTA)]  # own tables
    synced = [r for r in rows if r["suite"] == WEIGHT_SYNC]
    sharded = [r for r in rows if r["suite"] == SHARDED_SYNC]
    delta = [r for r in rows if r["suite"] == SHARDED_DELTA]
    json_path.with_suffix(".md").write_text(format_markdown(meta, sized, sizes) + "\n"
                                            + (weight_sync_markdown(synced) + "\n" if synced else "")
                                            + (sharded_sync_markdown(sharded, meta["targets"]) + "\n" if sharded
                                               else "")
                                            + (sharded_delta_markdown(delta, meta["targets"]) + "\n" if delta
                                               else ""))
    png = None if args.no_png else write_png(json_path.with_suffix(".png"), sized, meta["targets"])
    ws_png = None if args.no_png or not synced else write_weight_sync_png(
        json_path.with_name(json_path.stem + "-weight-sync.png"), synced)
    if sized:
        print(format_table(sized, sizes))
    if synced:
        print(format_weight_sync(synced))
    if sharded:
        print(format_sharded_sync(sharded))
    if delta:
        print(format_sharded_delta(delta))
    ratios = compare(rows)
    if ratios:
        print("\n== rdt-gloo relative throughput (cross-mechanism pairs marked) ==\n" + "\n".join(ratios))
    if meta["targets"]:
        print("\n== targets ==\n" + format_targets(meta["targets"]))
    load = meta["machine"]["loadavg_at_start"][0]
    if load > (os.cpu_count() or 1):
        print(f"\nwarning: load average was {load:.1f} on {os.cpu_count()} cores at start: timings are noisy")
    print(f"\nJSON: {json_path}\nMarkdown: {json_path.with_suffix('.md')}" + (f"\nPNG:  {png}" if png else "")
          + (f"\nPNG:  {ws_png}" if ws_png else "") + f"\nelapsed: {meta['elapsed_s']} s")
    return 0 if any("error" not in r for r in rows) else 1


def run_xnode(args: argparse.Namespace) -> int:
    """--suites xnode: the cross-node suite on Ray nodes in network namespaces (needs root; see docs/multinode.md)."""
    import ray

    from . import _xnode

    workers = [int(w) for w in _csv(args.weight_sync_workers)]
    chosen = _csv(args.sharded_sync_rows) if args.sharded_sync_rows else None
    unknown = sorted(set(chosen or ()) - {c.impl for c in XNODE_SHARDED_CASES})
    if unknown:
        log(f"unknown cross-node sharded row(s) {unknown}; choose from {[c.impl for c in XNODE_SHARDED_CASES]}")
        return 2
    scale = args.weight_sync_scale or (0.01 if args.quick else XNODE_SCALE)
    iters = args.iters or (3 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else 1
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    json_path = out_path(args.out, f"{stamp}-xnode")
    shape = model_shape(scale)
    meta: Dict[str, Any] = {"machine": machine_info(), "argv": sys.argv[1:],
                            "config": {"suites": [XNODE], "quick": args.quick, "iters": iters, "warmup": warmup,
                                       "link": _xnode._netns.RATE, "weight_sync": {
                                           "scale": scale, "workers": workers, "model": shape.describe(),
                                           "model_bytes": shape.nbytes}}}
    started = time.monotonic()
    rows: List[Dict[str, Any]] = []
    cluster = _xnode.start_cluster(1 + max(workers + [1]), args.object_store_mb or XNODE_OBJECT_STORE_MB)
    try:
        meta["cluster"] = {"address": cluster.address, "nodes": len(cluster.nodes),
                           "cluster_resources": {k: v for k, v in ray.cluster_resources().items() if "node:" not in k}}
        rows += _xnode.object_rows(cluster, iters, timeout=120.0)
        write_json(json_path, meta, rows)
        rows += _xnode.weight_sync_rows(scale, workers, warmup, iters, args.group_timeout or 60.0)
        write_json(json_path, meta, rows)
        rows += _xnode.sharded_rows(cluster, scale, warmup, iters, args.group_timeout or 60.0, chosen)
    finally:
        ray.shutdown()
        cluster.stop()
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    meta["loadavg_at_end"] = list(os.getloadavg())
    meta["targets"] = _xnode.xnode_targets(rows)
    write_json(json_path, meta, rows)
    synced = [r for r in rows if r["suite"] == WEIGHT_SYNC]
    md = _xnode.xnode_markdown(rows, meta["targets"]) + ("\n\n" + weight_sync_markdown(synced) if synced else "")
    json_path.with_suffix(".md").write_text(md + "\n")
    if not args.no_png:
        _xnode.write_object_png(json_path.with_suffix(".png"), rows)
        if synced:
            write_weight_sync_png(json_path.with_name(json_path.stem + "-weight-sync.png"), synced)
    print(md + f"\n\nJSON: {json_path}\nelapsed: {meta['elapsed_s']} s")
    return 0 if any("error" not in r for r in rows) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (rdt-bench)."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
