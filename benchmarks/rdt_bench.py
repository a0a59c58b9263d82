"""rdt-bench: rdt_transports p2p and allreduce vs ray.util.collective, torch.distributed and Ray's object store,
rdt's object layer vs Ray's built-in RDT and object store, and a model's weights synced from a trainer to workers.

Usage: ``rdt-bench [--full | --quick] [--suites p2p,allreduce,objects,weight-sync,sharded-sync | --suites xnode]
[--sizes 4K,1M] [--world-sizes 2,4] [--weight-sync-scale 1] [--out DIR|FILE]``, or ``rdt-bench --compare A.json
B.json`` (the speed-up of every cell of two runs; no Ray needed). With no --suites and no --full it runs the default
run (:data:`DEFAULT`): the questions a newcomer comes with, in about 3 minutes on 2 cores; ``--full`` (or --suites,
for the suites named) runs the whole matrix (:data:`FULL`).
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
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import rdt_transports  # noqa: F401 - first: refuses an 'rdt' of another distribution before anything runs

from ._baselines import RayCollectiveImpl, baseline_impls
from ._compare import CompareError, compare_runs
from ._cluster import ActorPool, env_mismatch, log, start_ray
from ._collectives import BenchConfig, BenchContext, Impl, case_plan, fmt_size, rdt_impls, run_case
from ._objects import IMPLS as OBJECT_IMPLS, object_targets, objects_plan, objects_suite
from ._p2p import interleaved_p2p, interleaved_plan
from ._progress import Progress, SuitePlan, estimate_check, fmt_duration, load_pace
from ._sharded_sync import (CASES as SHARDED_CASES, SOAK_ROW, SUITE as SHARDED_SYNC, sharded_sync_plan,
                            sharded_sync_suite)
from ._sharded_sync_report import format_sharded_sync, sharded_sync_markdown, sharded_sync_targets
from ._sharded_delta import SUITE as SHARDED_DELTA, sharded_delta_plan, sharded_delta_suite
from ._sharded_delta_report import format_sharded_delta, sharded_delta_markdown, sharded_delta_targets
from ._targets import weight_sync_targets
from ._weight_sync import (CASES as WEIGHT_SYNC_CASES, SUITE as WEIGHT_SYNC, model_shape, weight_sync_plan,
                           weight_sync_suite)
from ._weight_sync_report import format_weight_sync, weight_sync_markdown, write_weight_sync_png
from ._xnode import SHARDED_CASES as XNODE_SHARDED_CASES
from ._report import (check_targets, compare, format_markdown, format_table, format_targets, machine_info, write_json,
                      write_png)

DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "results"
# For the time-left estimate: the actors' and Ray's shutdown and the report (tables, Markdown, two plots) after the
# last case, in the plan's reference seconds (6.9 s in the quiet default run of 2026-11-29 14:20, at pace ~1.2)
EST_TAIL_S = 6.0
P2P_WORLD_SIZE = 2

Suite = Callable[[BenchContext], List[Dict[str, Any]]]


def _impls(ctx: BenchContext, op: str) -> List[Impl]:
    return rdt_impls(ctx.config.backends, op) + baseline_impls(op)


def _p2p_impls(ctx: BenchContext) -> Tuple[List[Impl], List[Impl]]:
    """The p2p implementations: (those interleaved in the same two actors, those run as their own cases)."""
    impls = [i for i in _impls(ctx, "p2p") if "p2p" in i.ops]
    together = [i for i in impls if i.family == "rdt" or isinstance(i, RayCollectiveImpl)]
    return together, [i for i in impls if i not in together] if ctx.config.p2p_alone else []


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


# ---------------------------------------------------------------------- kinds of run
@dataclass(frozen=True)
class Preset:
    """What a kind of run sets where the command line is silent (an option given always wins), down to the
    suites' own trims (see :class:`BenchConfig`)."""

    name: str
    suites: str
    sizes: str
    weight_sync_scale: float
    weight_sync_workers: str
    world_sizes: str = "2,4"
    group_timeout: float = 30.0
    sharded_sync_rows: Optional[Tuple[str, ...]] = None
    p2p_alone: bool = True
    object_impls: Optional[Tuple[str, ...]] = None
    object_rounds: float = 1.0
    weight_sync_cases: Optional[Tuple[str, ...]] = None
    weight_sync_steps: Optional[int] = None
    sharded_sync_calibrate: bool = True
    sharded_sync_shared: bool = False
    about: str = ""  # what it covers, for the log and the report


FULL_SUITES = "p2p,allreduce,objects,weight-sync,sharded-sync"
DEFAULT_SUITES = "p2p,objects,weight-sync,sharded-sync"
FULL = Preset("full", FULL_SUITES, "4K,1M,16M,128M", 1.0, "1,2,4",
              about="the whole matrix: every suite, size, world size, row and worker count, the model at full scale")
QUICK = Preset("quick", FULL_SUITES, "4K,64K", 0.01, "1,2,4", group_timeout=20.0,
               about="the CI smoke test: tiny sizes, few iterations, the model at scale 0.01")
DEFAULT = Preset(
    "default", DEFAULT_SUITES, "4K,128M", 0.25, "1,4",
    sharded_sync_rows=("hand-written", "ray-rdt", "rdt-sharded-shm"),
    p2p_alone=False,
    object_impls=tuple(impl for impl, _ in OBJECT_IMPLS if impl != "rdt-gloo-noinline"),
    object_rounds=0.3,
    weight_sync_cases=tuple(c.impl for c in WEIGHT_SYNC_CASES if c.consume != "copy_" or c.impl == "ray-rdt-gloo"),
    weight_sync_steps=3,
    sharded_sync_calibrate=False,
    sharded_sync_shared=True,
    about="p2p against ray.util.collective at 4 KiB and 128 MiB (rdt's gloo, nixl, ucx interleaved with it); one "
          "object round trip per transport at 4 KiB and 128 MiB, with peak memory; weight sync of Qwen2.5-0.5B's "
          "shapes at scale 0.25 (247 MB), whole to 1 and 4 workers (Ray's RDT, the hand-written broadcast, rdt "
          "into= per transport, with worker memory) and sharded over shm (4 trainer ranks -> 2 engines x TP 2, "
          "against the hand-written broadcast and Ray's RDT, the three rows on one shared set of 8 actors, with "
          "trainer memory)")
FULL_ONLY = ("allreduce; p2p at 1 MiB and 16 MiB and the baselines run as their own cases (torch.distributed, the "
             "object store); objects rdt-gloo-noinline and more round trips; weight sync at full scale with 2 "
             "workers, the object store and the copy_ rows; sharded-sync's whole-model rows, nixl, gloo and auto, "
             "the replicas row, the 200-step verify soak and the range-cost calibration, each sharded-sync row in "
             "fresh actors")


def pick_preset(args: argparse.Namespace) -> Tuple[Optional[Preset], str]:
    """The kind of run the command line asks for, or (None, why) when its options contradict each other."""
    if args.full and args.quick:
        return None, ("--full and --quick contradict each other: --full runs the whole matrix at full size, --quick "
                      "a tiny smoke test; give one of them")
    if args.quick:
        return QUICK, ""
    if args.full or args.suites:  # --suites X: suite X in full
        return FULL, ""
    return DEFAULT, ""


def make_config(args: argparse.Namespace, preset: Preset) -> BenchConfig:
    """The run's configuration: the command line's options, the preset's settings where it gives none."""
    return BenchConfig(
        sizes=[parse_size(s) for s in _csv(args.sizes or preset.sizes)],
        world_sizes=[int(w) for w in _csv(args.world_sizes or preset.world_sizes)],
        backends=_csv(args.backends), quick=preset is QUICK, iters=args.iters, warmup=args.warmup,
        group_timeout=args.group_timeout or preset.group_timeout,
        weight_sync_scale=args.weight_sync_scale or preset.weight_sync_scale,
        weight_sync_scale_set=bool(args.weight_sync_scale or preset is QUICK),
        weight_sync_workers=[int(w) for w in _csv(args.weight_sync_workers or preset.weight_sync_workers)],
        sharded_sync_rows=(_csv(args.sharded_sync_rows) if args.sharded_sync_rows else
                           list(preset.sharded_sync_rows) if preset.sharded_sync_rows is not None else None),
        p2p_alone=preset.p2p_alone,
        object_impls=list(preset.object_impls) if preset.object_impls is not None else None,
        object_rounds=preset.object_rounds,
        weight_sync_cases=list(preset.weight_sync_cases) if preset.weight_sync_cases is not None else None,
        weight_sync_steps=None if args.iters else preset.weight_sync_steps,
        sharded_sync_calibrate=preset.sharded_sync_calibrate,
        sharded_sync_shared=preset.sharded_sync_shared)


def full_plan_s(args: argparse.Namespace) -> float:
    """The estimated seconds of ``rdt-bench --full`` with this command line's other options (its progress plan's
    costs, before any pace)."""
    config = make_config(argparse.Namespace(**{**vars(args), "suites": None}), FULL)
    plan = run_plan(BenchContext(config=config, pool=None), _csv(FULL.suites))  # type: ignore[arg-type]
    return sum(c for s in plan for _, c in s.cases)


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
    p.add_argument("--suites", default=None,
                   help=f"comma list of: {', '.join(SUITES)}, each run in full; or {XNODE} alone (cross-node, needs "
                   f"root). Default: the default run's {DEFAULT.suites}, trimmed (planned for 3 minutes on a quiet "
                   "2-core machine)")
    p.add_argument("--full", action="store_true",
                   help=f"the whole matrix ({FULL.suites}; about 25 minutes on a 2-core machine) instead of the "
                   "default run")
    p.add_argument("--sizes", default=None, help=f"message sizes (default run {DEFAULT.sizes}; --full and --suites "
                   f"{FULL.sizes}; --quick {QUICK.sizes})")
    p.add_argument("--world-sizes", default=None, help=f"allreduce world sizes (number of actors; default "
                   f"{FULL.world_sizes})")
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
                   help="weight-sync model size: 1 = Qwen2.5-0.5B's shapes (988 MB bf16; --full and --suites); "
                   f"smaller shrinks layers and vocabulary (below 1/24 also the widths); default run "
                   f"{DEFAULT.weight_sync_scale:g}; --quick {QUICK.weight_sync_scale:g}")
    p.add_argument("--weight-sync-workers", default=None, help=f"weight-sync worker counts (default run "
                   f"{DEFAULT.weight_sync_workers}; --full and --suites {FULL.weight_sync_workers})")
    p.add_argument("--sharded-sync-rows", default=None,
                   help="sharded-sync rows to run (--full and --suites: all, "
                   f"{', '.join(c.impl for c in SHARDED_CASES)}, and {SOAK_ROW}, which runs on the rdt-sharded-shm "
                   "row's actors; default run: "
                   f"{', '.join(DEFAULT.sharded_sync_rows or ())}); the others are reported as "
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
    preset, why = pick_preset(args)
    if preset is None:
        log(f"rdt-bench: {why}")
        return 2
    suites = _csv(args.suites or preset.suites)
    if XNODE in suites:
        if suites != [XNODE]:
            log(f"the {XNODE} suite runs its own cluster across network namespaces: run it alone (--suites {XNODE})")
            return 2
        return run_xnode(args)
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        log(f"unknown suite(s) {unknown}; choose from {list(SUITES)}")
        return 2
    config = make_config(args, preset)
    sizes, world_sizes = config.sizes, config.world_sizes
    load0 = os.getloadavg()[0]  # before this run adds its own processes
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
    run_kind = preset.name if args.suites is None or preset is QUICK else "suites"
    meta: Dict[str, Any] = {"machine": machine_info(), "cluster": cluster, "argv": sys.argv[1:],
                            "config": {"run": run_kind, "suites": suites, "sizes": sizes, "world_sizes": world_sizes,
                                       "backends": config.backends, "quick": config.quick,
                                       "trims": _trims(config)}}
    if WEIGHT_SYNC in suites or SHARDED_SYNC in suites or SHARDED_DELTA in suites:
        meta["config"]["weight_sync"] = {"scale": config.weight_sync_scale, "workers": config.weight_sync_workers,
                                         "model": shape.describe(), "model_bytes": shape.nbytes}
    rows: List[Dict[str, Any]] = []
    if run_kind == DEFAULT.name:
        log(f"rdt-bench: the default run, {DEFAULT.about}. rdt-bench --full runs the whole matrix.")
    log(f"rdt-bench: suites={suites} sizes={[fmt_size(s) for s in sizes]} world_sizes={world_sizes} "
        f"backends={config.backends} -> {json_path}")
    progress: Optional[Progress] = None
    try:
        pool.get(P2P_WORLD_SIZE)
        bad = env_mismatch(pool.info)
        meta["actor_env"] = pool.info[0]["env"] if pool.info else {}
        if bad:
            log("warning: workers do not see the benchmark environment: " + "; ".join(bad))
        meta["progress_started_s"] = round(time.monotonic() - started, 1)
        prior = load_pace(load0, os.cpu_count() or 1)
        if prior > 1:
            log(f"rdt-bench: load average {load0:.1f} on {os.cpu_count()} cores before the run: the time-left "
                f"estimate starts at {prior:.1f}x the plan's reference times")
        with Progress(run_plan(ctx, suites), prior_pace=prior, tail_s=EST_TAIL_S) as ctx.progress:
            progress = ctx.progress
            for i, name in enumerate(suites):
                ctx.progress.start_suite(name)
                if i:  # every suite starts from fresh actors: what one suite's workers still hold (pools,
                    pool.reset()  # registrations, heap glibc kept) must not push the next one out of memory
                rows += SUITES[name](ctx)
                ctx.progress.finish_suite()
                meta["elapsed_s"] = round(time.monotonic() - started, 1)
                write_json(json_path, meta, rows)  # partial results survive a later crash
    finally:
        suites_done = time.monotonic()
        pool.shutdown()
        import ray

        ray.shutdown()
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    meta["shutdown_s"] = round(time.monotonic() - suites_done, 1)
    meta["loadavg_at_end"] = list(os.getloadavg())
    meta["targets"] = check_targets(rows) + object_targets(rows) + (
        weight_sync_targets(rows) if WEIGHT_SYNC in suites else []) + sharded_sync_targets(rows) + \
        sharded_delta_targets(rows)
    checked = [t for t in meta["targets"] if not _left_out(t)]
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
    png = None if args.no_png else write_png(json_path.with_suffix(".png"), sized, checked)
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
        print("\n" + targets_panel(meta["targets"], run_kind))
    if run_kind == DEFAULT.name:
        pace = progress.pace() if progress is not None else 1.0
        print(f"\nThis was the default run: {DEFAULT.about}.\nrdt-bench --full adds {FULL_ONLY}: about "
              f"{fmt_duration(full_plan_s(args) * pace)} on this machine at this run's pace.")
    load = meta["machine"]["loadavg_at_start"][0]
    if load > (os.cpu_count() or 1):
        print(f"\nwarning: load average was {load:.1f} on {os.cpu_count()} cores at start: timings are noisy")
    print(f"\nJSON: {json_path}\nMarkdown: {json_path.with_suffix('.md')}" + (f"\nPNG:  {png}" if png else "")
          + (f"\nPNG:  {ws_png}" if ws_png else "") + f"\nelapsed: {meta['elapsed_s']} s")
    if progress is not None:  # how good the time-left estimate was, over the whole run (report included)
        progress.finish()
        meta["progress"] = progress.record()
        meta["progress"]["check"] = estimate_check(meta["progress"], progress.elapsed())
        meta["report_s"] = round(time.monotonic() - started - meta["elapsed_s"], 1)
        meta["elapsed_s"] = round(time.monotonic() - started, 1)
        write_json(json_path, meta, rows)
        log(f"rdt-bench: outside the suites: Ray's start and the first actors {meta['progress_started_s']:.1f} s, "
            f"the actors' and Ray's shutdown {meta['shutdown_s']:.1f} s, the report {meta['report_s']:.1f} s")
        log("rdt-bench: the time-left estimate / what remained, at " + ", ".join(
            f"{c['at']:.0%}: {c['ratio']:.2f} ({fmt_duration(c['estimate_s'])} / {fmt_duration(c['remaining_s'])})"
            for c in meta["progress"]["check"]))
    return 0 if any("error" not in r for r in rows) else 1


def _trims(config: BenchConfig) -> Dict[str, Any]:
    """What this run leaves out of its suites (the default run's trims; empty for a full run)."""
    out: Dict[str, Any] = {}
    if not config.p2p_alone:
        out["p2p_alone"] = False
    if config.object_impls is not None:
        out["object_impls"] = config.object_impls
    if config.object_rounds != 1.0:
        out["object_rounds"] = config.object_rounds
    if config.weight_sync_cases is not None:
        out["weight_sync_cases"] = config.weight_sync_cases
    if config.weight_sync_steps is not None:
        out["weight_sync_steps"] = config.weight_sync_steps
    if config.sharded_sync_rows is not None:
        out["sharded_sync_rows"] = config.sharded_sync_rows
    if not config.sharded_sync_calibrate:
        out["sharded_sync_calibrate"] = False
    if config.sharded_sync_shared:
        out["sharded_sync_shared"] = True
    return out


def _left_out(t: Mapping[str, Any]) -> bool:
    """A target whose rows this run did not select (it says so; the full run checks it)."""
    return t.get("met") is None and "not selected" in str(t.get("status", ""))


def targets_panel(targets: List[Dict[str, Any]], run_kind: str) -> str:
    """The targets this run checked, one a line; the ones whose rows it did not select are counted apart."""
    checked = [t for t in targets if not _left_out(t)]
    left = len(targets) - len(checked)
    met = sum(bool(t.get("met")) for t in checked)
    head = f"== targets: {met} of {len(checked)} met"
    if run_kind == DEFAULT.name:
        head += " (the default run checks these; rdt-bench --full checks every target)"
    out = [head + " ==", format_targets(checked)]
    if left:
        out.append(f"({left} more not checked: their rows were not selected; they are in the JSON)")
    return "\n".join(out)


def run_xnode(args: argparse.Namespace) -> int:
    """--suites xnode: the cross-node suite on Ray nodes in network namespaces (needs root; see docs/multinode.md)."""
    import ray

    from . import _xnode

    workers = [int(w) for w in _csv(args.weight_sync_workers or FULL.weight_sync_workers)]
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
