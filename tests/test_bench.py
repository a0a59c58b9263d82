"""rdt-bench: a --quick run finishes and says what ran (mechanism, mode); the mechanism labels are read from the
real paths; ``--compare`` reads two result files without Ray."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
EXPECTED_IMPLS = ("rdt-gloo", "ray.collective-gloo", "torch.dist-gloo", "ray-objstore")
INTERLEAVED = ("rdt-gloo", "rdt-nixl", "ray.collective-gloo")
KiB = 1 << 10


def _cma_expected() -> str:
    """What a same-node shm fetch is on this machine: a direct read where the kernel allows one, else a segment."""
    from rdt.transports.shm import cma as _cma

    return "cma" if _cma.supported() and _cma.yama_allows_siblings() else "shm-segment"


def _bench(*args: str, timeout: float = 180, env: Dict[str, str] = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.rdt_bench", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env)


def _check_progress(stderr: str, suites: List[str], rows: List[Dict[str, Any]]) -> None:
    """Not a terminal: plain progress lines, from suite 1's first case to every case done; none skipped unless a
    case failed (so the plan of cases matches what the suites marked done)."""
    lines = [ln for ln in stderr.splitlines() if ln.startswith("rdt-bench progress: ")]
    n = len(suites)
    assert lines and lines[0].startswith(f"rdt-bench progress: suite 1/{n} {suites[0]}, cases 0/"), lines
    for k, name in enumerate(suites, 1):
        assert any(f"suite {k}/{n} {name}, " in ln for ln in lines), (name, lines)
    last = re.match(r"rdt-bench progress: suite (\d+)/\d+ \S+, cases (\d+)/(\d+) \(100%\)( \(\d+ skipped\))?, "
                    r"elapsed \S+, about 0s left$", lines[-1])
    assert last and last.group(1) == str(n) and last.group(2) == last.group(3), lines[-1]
    assert last.group(4) is None or any("error" in r for r in rows), lines[-1]
    assert "\x1b" not in stderr


QUICK_SUITES = ["p2p", "allreduce", "objects", "weight-sync"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Tuple[subprocess.CompletedProcess, Path]:
    """One rdt-bench --quick process for the smoke test and the tiny weight-sync test (a second process would
    start a second cluster and actor pool): its output and its one JSON file."""
    out = tmp_path_factory.mktemp("quick")
    proc = _bench("--quick", "--suites", ",".join(QUICK_SUITES), "--backends", "gloo,nixl", "--world-sizes", "2",
                  "--sizes", "4K,256K", "--weight-sync-scale", "0.01", "--weight-sync-workers", "1,4",
                  "--object-store-mb", "512", "--out", str(out), timeout=330)
    assert proc.returncode == 0, f"rdt-bench failed:\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
    files = sorted(out.glob("*.json"))
    assert len(files) == 1, f"expected one JSON file in {out}, got {files}"
    return proc, files[0]


# The smoke test runs first: its rdt-bench starts its own cluster, before this module's shared one exists.
@pytest.mark.timeout(360)
def test_rdt_bench_quick(quick_run: Tuple[subprocess.CompletedProcess, Path]) -> None:
    """rdt-bench --quick over the p2p, allreduce and objects suites (and weight-sync, checked below) exits 0 with
    positive throughput, and every row says what ran."""
    proc, path = quick_run
    files = [path]
    data = json.loads(path.read_text())
    _check_progress(proc.stderr, QUICK_SUITES, [r for r in data["results"] if r["impl"] != "ray-rdt-nixl"])
    assert data["machine"]["cpu_cores"] >= 1 and data["machine"]["ray"] and data["machine"]["torch"]
    ok = [r for r in data["results"] if "error" not in r]
    for suite in ("p2p", "allreduce"):
        for impl in EXPECTED_IMPLS:
            rows = [r for r in ok if r["suite"] == suite and r["impl"] == impl]
            assert rows, f"no successful {suite} rows for {impl}"
            assert all(r["gbps"] > 0 and r["seconds"] > 0 for r in rows), rows
    assert any(r["suite"] == "allreduce" and r.get("busbw_gbps", 0) > 0 for r in ok)
    for impl in ("rdt-gloo", "rdt-shm", "rdt-auto", "ray-objstore", "ray-rdt-gloo"):
        rows = [r for r in ok if r["suite"] == "objects" and r["impl"] == impl]
        assert rows and all(r["gbps"] > 0 for r in rows), (impl, rows)
    _check_labels(data["results"])
    _check_modes(ok)
    for t in data["targets"]:
        assert t["mechanisms"] and isinstance(t["cross_mechanism"], bool), t
    assert data["config"]["run"] == "quick" and data["config"]["trims"] == {}
    record = data["progress"]  # what the progress report estimated, against what each case took
    assert record["cases"] and sum(c["seconds"] for c in record["cases"]) <= record["elapsed_s"] + 0.1, record
    assert all(c["estimate_s"] >= 0 and c["seconds"] >= 0 for c in record["cases"]), record["cases"]
    assert record["events"] and all(0 < c["at"] < 1 and c["ratio"] >= 0 for c in record["check"]), record
    assert "time-left estimate / what remained" in proc.stderr
    png = files[0].with_suffix(".png")
    assert png.exists() and png.stat().st_size > 1000
    assert "| mechanism |" in files[0].with_suffix(".md").read_text()
    assert "rdt-gloo" in proc.stdout and "mechanism" in proc.stdout  # the table went to stdout
    assert "shm-allreduce" in proc.stdout and "[cross-mechanism: shm-allreduce vs gloo]" in proc.stdout

    same = _bench("--compare", str(files[0]), str(files[0]), timeout=60)  # a real run against itself
    assert same.returncode == 0, same.stderr
    ratios = [ln for ln in same.stdout.splitlines() if ln.rstrip().endswith("x") and " -> " in ln]
    assert len(ratios) == len(ok) and all(ln.rstrip().endswith("1.00x") for ln in ratios), same.stdout
    assert "== only in A (0) ==" in same.stdout and "== only in B (0) ==" in same.stdout


@pytest.mark.timeout(60)
def test_weight_sync_suite_tiny(quick_run: Tuple[subprocess.CompletedProcess, Path]) -> None:
    """rdt-bench --suites weight-sync at a tiny scale, 1 and 4 workers: every mechanism has its labelled row with
    per-worker memory, the rdt.get(into=) rows are measured or say they are not available in this build, the
    tensor-count objects are measured per transport, and the suite's targets are in the summary."""
    import rdt

    from benchmarks._weight_sync import CASES, COUNTS, UNAVAILABLE, model_shape

    proc, path = quick_run
    data = json.loads(path.read_text())
    rows = [r for r in data["results"] if r["suite"] == "weight-sync"]
    shape = model_shape(0.01)
    assert data["config"]["weight_sync"]["model_bytes"] == shape.nbytes
    by = {(r["impl"], r["world_size"], r["mode"]): r for r in rows}
    expected = {"ray-objstore": "object_store", "ray-rdt-gloo": "ray-rdt (gloo)", "ray.collective-broadcast": "gloo",
                "rdt-gloo": "gloo", "rdt-shm": _cma_expected(), "rdt-nixl": "nixl",
                "rdt-shm-shared": "shm-map" if _cma_expected() == "cma" else _cma_expected()}
    into = hasattr(rdt, "get")
    for n in (1, 4):
        for case in CASES:
            r = by[(case.impl, n, "sync")]
            assert r["size"] == shape.nbytes and r["tensors"] == len(shape.shapes()) and r["consume"] == case.consume
            if case.consume == "into" and not into:
                assert r["error"] == UNAVAILABLE and "seconds" not in r, r  # never a made-up number
                continue
            assert "error" not in r, r
            assert r["mechanism"] == expected[case.impl.split("+")[0]], r
            assert r["seconds"] > 0 and len(r["times_s"]) == 3, r
            assert len(r["rss_peak_bytes"]) == n and all(x > shape.nbytes for x in r["rss_peak_bytes"]), r
            assert len(r["uss_growth_bytes"]) == n, r
    for impl in ("inproc-copy", f"inproc-copy-{os.cpu_count()}t"):
        ref = by[(impl, 1, "reference")]
        assert ref["mechanism"] == "memcpy" and ref["seconds"] > 0
    for count in COUNTS:
        for impl in ("rdt-gloo", "rdt-shm", "rdt-nixl"):
            r = by[(impl, 1, f"tensors={count}")]
            assert "error" not in r and r["tensors"] == count and r["size"] == 4 << 20, r
            assert r["mechanism"] == expected[impl] and r["seconds"] > 0, r
            assert r["round_trip_seconds"] > r["seconds"] and r["check_seconds"] > 0, r  # the check is not counted
    targets = {t["target"]: t for t in data["targets"] if t["target"].startswith("weight-sync")}
    assert targets and all(t["suite"] == "weight-sync" for t in targets.values() if "suite" in t)
    for impl in ("rdt-gloo", "rdt-shm", "rdt-nixl"):
        t = next(t for name, t in targets.items() if f"1000 vs 1 tensor (4 MiB in all) {impl}" in name)
        assert isinstance(t["met"], bool) and t["ratio"] > 0, t
    t = targets["weight-sync 4 workers: rdt-gloo (copy_ or into) >= 1.2x hand-written broadcast"]
    assert isinstance(t["met"], bool) and t["mechanisms"].startswith("rdt-gloo+"), t
    t = targets["weight-sync 4 workers: best rdt into >= 10x Ray's RDT (gloo)"]
    assert (t["met"] is None and t["status"] == "not available in this build") if not into else \
        isinstance(t["met"], bool), t
    assert "== weight-sync" in proc.stdout and "rdt-shm+into" in proc.stdout
    assert into or ("N/A  weight-sync" in proc.stdout and UNAVAILABLE in proc.stdout)
    assert "### weight-sync" in path.with_suffix(".md").read_text()
    assert path.with_name(path.stem + "-weight-sync.png").stat().st_size > 1000


def test_sharded_sync_layout_and_byte_check() -> None:
    """The engines' wants cover the model (norms once per TP rank), and the check that ends every row fails on one
    wrong byte in any engine target (run in this process: no Ray)."""
    from benchmarks._sharded_sync_actor import ShardedActor, WrongMarkerError
    from benchmarks._sharded_sync_model import engine_wants, narrow_into, pattern, target_bytes, trainer_rows
    from benchmarks._weight_sync import model_shape

    shape = model_shape(0.004)
    shapes = dict(shape.shapes())
    norms = sum(2 * s[0] for n, s in shapes.items() if "norm" in n)
    assert sum(target_bytes(engine_wants(shape, 2, r)) for r in range(2)) == shape.nbytes + norms
    rows = [trainer_rows(shape, 4, r) for r in range(4)]
    assert all(sum(r[name][2] for r in rows if name in r) == s[0] for name, s in shapes.items())
    full = {name: pattern(tuple((0, d) for d in s), s, 3) for name, s in shapes.items()}
    engine = ShardedActor()
    engine.setup_engine(engine_wants(shape, 2, 1), shapes, staging=False, loader=False)
    for name, _, regions in engine.wants:
        narrow_into(engine.targets[name], regions, full, name)
    assert engine.check(3) == 3.0 and engine.check_all(3) == target_bytes(engine.wants)
    o_proj = engine.targets["model.layers.0.self_attn.o_proj.weight"]
    o_proj[1, 1] += 1
    engine.check(3)  # three elements per region: this one is not among them
    with pytest.raises(WrongMarkerError, match="o_proj"):
        engine.check_all(3)
    with pytest.raises(WrongMarkerError):
        engine.check(4)  # a stale step
    from benchmarks._mechanism import comparable

    assert comparable("shm-direct", "cma") and comparable("whole:gloo", "gloo")  # the loader's labels, by class
    assert not comparable("whole:gloo", "nixl")


def test_weight_sync_model_shape() -> None:
    """The default model has Qwen2.5-0.5B's shapes: 290 tensors, 494 M parameters, 988 MB in bf16."""
    from benchmarks._weight_sync import model_shape

    full = model_shape()
    shapes = dict(full.shapes())
    assert len(shapes) == 290 and full.params == 494_032_768 and full.nbytes == 988_065_536
    assert shapes["model.embed_tokens.weight"] == (151936, 896)
    assert shapes["model.layers.23.self_attn.k_proj.weight"] == (128, 896)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (896, 4864)
    small = model_shape(0.01)
    assert small.layers == 1 and small.nbytes < full.nbytes // 100


def _preset_plan(*argv: str) -> Tuple[Any, Any, Dict[str, float]]:
    """(preset, config, estimated seconds per suite) of an rdt-bench command line, without running it."""
    from benchmarks._collectives import BenchContext
    from benchmarks.rdt_bench import build_parser, make_config, pick_preset, run_plan

    args = build_parser().parse_args(list(argv))
    preset, why = pick_preset(args)
    assert preset is not None, why
    config = make_config(args, preset)
    suites = (args.suites or preset.suites).split(",")
    plan = run_plan(BenchContext(config=config, pool=None), suites)  # type: ignore[arg-type]
    return preset, config, {s.name: sum(c for _, c in s.cases) for s in plan}


def test_default_run_is_short_and_full_is_the_matrix() -> None:
    """No flags: the default run (p2p and objects at a small and a large size, weight sync whole and sharded at
    scale 0.25), planned within 3 minutes of the 2-core reference machine; --full and --suites X: the whole
    matrix, or suite X whole; an option given wins over the default run's setting."""
    from benchmarks.rdt_bench import DEFAULT, DEFAULT_SUITES, FULL, FULL_SUITES

    assert DEFAULT_SUITES == "p2p,objects,weight-sync,sharded-sync"
    assert FULL_SUITES == "p2p,allreduce,objects,weight-sync,sharded-sync"
    preset, config, plan = _preset_plan()
    assert preset is DEFAULT and list(plan) == DEFAULT_SUITES.split(",")
    assert config.sizes == [4 * KiB, 128 << 20] and config.weight_sync_scale == 0.25
    assert config.weight_sync_workers == [1, 4] and not config.p2p_alone
    assert config.sharded_sync_rows == ["hand-written", "ray-rdt", "rdt-sharded-shm"]
    assert not config.sharded_sync_calibrate  # the transports' declared range costs, as a user gets them
    assert config.sharded_sync_shared  # the three sharded rows on one set of 8 actors, started once
    assert "ray-rdt-gloo" in config.object_impls and "rdt-gloo-noinline" not in config.object_impls
    assert {"ray-rdt-gloo", "ray.collective-broadcast", "rdt-shm+into"} <= set(config.weight_sync_cases)
    assert not {"ray-objstore", "rdt-shm+copy"} & set(config.weight_sync_cases)
    assert 60 < sum(plan.values()) <= 180, plan  # the costs are fitted to the reference machine

    preset, config, full = _preset_plan("--full")
    assert preset is FULL and list(full) == FULL_SUITES.split(",")
    assert config.sizes == [4 * KiB, 1 << 20, 16 << 20, 128 << 20] and config.weight_sync_scale == 1.0
    assert config.weight_sync_workers == [1, 2, 4] and config.world_sizes == [2, 4] and config.p2p_alone
    assert config.sharded_sync_rows is config.object_impls is config.weight_sync_cases is None
    assert config.sharded_sync_calibrate and config.object_rounds == 1.0 and config.weight_sync_steps is None
    assert not config.sharded_sync_shared  # every sharded-sync row in fresh actors
    assert sum(full.values()) > 5 * sum(plan.values())

    preset, config, only = _preset_plan("--suites", "weight-sync")  # one suite: in full
    assert preset is FULL and list(only) == ["weight-sync"] and only["weight-sync"] == full["weight-sync"]
    _, config, _ = _preset_plan("--weight-sync-scale", "0.5", "--sizes", "4K")  # what is given wins
    assert config.weight_sync_scale == 0.5 and config.sizes == [4 * KiB] and config.weight_sync_workers == [1, 4]


def test_full_with_quick_is_refused() -> None:
    """--full (the whole matrix at full size) and --quick (a tiny smoke test) together: exit 2, saying why, before
    any cluster starts."""
    proc = _bench("--full", "--quick", timeout=60, env=dict(os.environ, RAY_ADDRESS="127.0.0.1:1"))
    assert proc.returncode == 2 and "--full and --quick contradict each other" in proc.stderr, proc.stderr


def test_targets_panel_names_what_the_run_checked() -> None:
    """The default run's panel lists the targets it checked and counts the ones whose rows it did not select."""
    from benchmarks.rdt_bench import targets_panel

    checked = {"target": "a", "ratio": 2.0, "ratio_best": 2.0, "required": 1.0, "met": True, "unit": "x"}
    missed = dict(checked, target="b", ratio=0.5, ratio_best=0.5, met=False)
    left = dict(checked, target="c", ratio=None, ratio_best=None, met=None,
                status="not run: not selected (--sharded-sync-rows)")
    text = targets_panel([checked, missed, left], "default")
    assert text.splitlines()[0] == ("== targets: 1 of 2 met (the default run checks these; rdt-bench --full checks "
                                    "every target) ==")
    assert "MET  a" in text and "MISS b" in text and " c " not in text and "1 more not checked" in text


def test_weight_sync_wrong_marker_is_an_error(ray_cluster) -> None:
    """A worker whose parameters do not end up with the trainer's marker fails the step (it is not timed)."""
    import ray
    import torch

    from benchmarks._weight_sync import model_shape
    from benchmarks._weight_sync_actor import WrongMarkerError, actor_class

    shapes = model_shape(0.002).shapes()
    worker = actor_class().remote()
    try:
        ray.get(worker.setup_model.remote(shapes, 0.0), timeout=60)
        good = {name: torch.full(shape, 7.0, dtype=torch.bfloat16) for name, shape in shapes}
        assert ray.get(worker.load.remote(good, 7.0), timeout=60) == 7.0
        stale = dict(good, **{shapes[-1][0]: torch.full(shapes[-1][1], 6.0, dtype=torch.bfloat16)})
        with pytest.raises(WrongMarkerError, match="model.norm.weight"):
            ray.get(worker.load.remote(stale, 7.0), timeout=60)
    finally:
        ray.kill(worker)


@pytest.mark.timeout(200)
def test_sharded_sync_suite_tiny(ray_cluster) -> None:
    """The sharded-sync suite at the smallest scale with one of its rows (rdt sharded over shm, in 8 fresh actors;
    each more row costs 10-20 s here), run in this module's cluster as rdt-bench runs it: every row and every target
    of the suite is in the report (the others as not selected), the row received
    exactly its targets' bytes over exact runs, and every byte of every engine's targets was compared with the
    trainers' values; the verify soak ran its 20 steps on that row's actors with no torn or wrong read. rdt-bench
    runs the suite by default and counts its cases in the progress report."""

    from benchmarks._collectives import BenchConfig, BenchContext
    from benchmarks._progress import Progress
    from benchmarks._sharded_sync import CASES, NOT_SELECTED, sharded_sync_suite
    from benchmarks._sharded_sync_model import engine_wants, target_bytes
    from benchmarks._sharded_sync_report import format_sharded_sync, sharded_sync_markdown, sharded_sync_targets
    from benchmarks._weight_sync import model_shape
    from benchmarks.rdt_bench import DEFAULT, FULL, build_parser, run_plan

    run = ["rdt-sharded-shm", "rdt-sharded-soak"]
    args = build_parser().parse_args(["--sharded-sync-rows", ",".join(run)])
    assert "sharded-sync" in DEFAULT.suites.split(",") and "sharded-sync" in FULL.suites.split(",")
    assert "rdt-sharded-shm" in (DEFAULT.sharded_sync_rows or ()) and args.sharded_sync_rows == ",".join(run)
    config = BenchConfig(sizes=[], world_sizes=[], backends=[], iters=1, weight_sync_scale=0.004,
                         sharded_sync_rows=run)
    ctx = BenchContext(config=config, pool=None)  # type: ignore[arg-type] - the suite starts its own actors
    stream = io.StringIO()
    with Progress(run_plan(ctx, ["sharded-sync"]), stream=stream, tty=False) as ctx.progress:
        ctx.progress.start_suite("sharded-sync")
        rows = sharded_sync_suite(ctx)
        assert ctx.progress.cases_done == ctx.progress.cases_total == 2 and not ctx.progress.skipped, stream.getvalue()
    shape = model_shape(0.004)
    targets = [target_bytes(engine_wants(shape, 2, i % 2)) for i in range(4)]
    by = {r["impl"]: r for r in rows}
    assert list(by) == ["rdt-range-costs"] + [c.impl for c in CASES] + ["rdt-sharded-soak"]
    cal = by["rdt-range-costs"]["calibration"]  # the selected rows' transports, measured with exact runs
    assert list(cal) == ["shm"] and cal["shm"]["run_s"] > 0 and cal["shm"]["bytes_per_s"] > 1e8, cal
    for impl, r in by.items():
        if impl in run and impl != "rdt-sharded-soak":
            assert "error" not in r, r
            assert r["target_bytes"] == targets and r["bytes_checked"] == sum(targets), r  # every byte compared
            assert len(r["trainer_rss_peak_bytes"]) == 4 and len(r["engine_uss_growth_bytes"]) == 4, r
            assert r["seconds"] > 0 and len(r["times_s"]) == 1, r
        elif impl not in ("rdt-sharded-soak", "rdt-range-costs"):
            assert r["error"] == NOT_SELECTED and "seconds" not in r, r
    soak = by["rdt-sharded-soak"]  # on the shm row's actors: loads with verify=True racing in-place updates
    assert "error" not in soak and soak["steps"] == 20 and soak["transport"] == "shm", soak.get("error")
    assert soak["torn_reads"] == soak["checksum_mismatches"] == 0 and not soak["other_errors"], soak
    assert soak["loads_landed"] > 0 and soak["loads_landed"] + soak["loads_version_gone"] == soak["loads"] == 80, soak
    shm = by["rdt-sharded-shm"]
    direct = _cma_expected() == "cma"
    assert shm["mechanism"] == "shm-direct" if direct else shm["mechanism"].startswith("whole:"), shm
    if direct:  # range reads: the bytes received are the targets' bytes (covering reads' excess counted apart)
        assert "whole fetch" not in shm["read_mode"], shm
        assert [g - x for g, x in zip(shm["bytes_received"], shm["bytes_covering_excess"])] == targets, shm
    assert shm["planned_steps"] == 4 and all(o > 0 for o in shm["replay_overhead_s"]), shm  # one plan per engine
    assert len(shm["replay_solo_overhead_s"]) == 4 and all(o > 0 for o in shm["replay_solo_overhead_s"]), shm
    got = {t["target"]: t for t in sharded_sync_targets(rows)}
    assert len(got) == 4 * 2 + 1 + 2 + 4 + 4 + 1, sorted(got)  # the replicas row: its trainers' link
    for name, t in got.items():
        measured = ("rdt-sharded-shm:" in name and "rdt-whole" not in name) or "torn or wrong reads" in name
        assert isinstance(t["met"], bool) if measured else t["met"] is None and "not run" in t["status"], t
    assert got["sharded-sync rdt-sharded-shm: bytes received per consumer <= 1.01x its targets"]["met"] is direct
    assert "hand-written: one ray.util.collective" in format_sharded_sync(rows)  # the schemes are described
    md = sharded_sync_markdown(rows, list(got.values()))
    assert "### sharded-sync" in md and all(name in md for name in got)


@pytest.mark.timeout(300)
def test_sharded_sync_rows_share_actors(ray_cluster) -> None:
    """The default run's sharded-sync rows (hand-written, Ray's RDT, rdt sharded over shm) on one shared set of 8
    actors: the same processes serve all three, the two Ray Gloo groups coexist in them, each row starts from its
    own step 0 (every byte of every engine's targets compared), and the table says the actors were shared."""
    from benchmarks._collectives import BenchConfig, BenchContext
    from benchmarks._progress import Progress
    from benchmarks._sharded_sync import sharded_sync_suite
    from benchmarks._sharded_sync_model import engine_wants, target_bytes
    from benchmarks._sharded_sync_report import format_sharded_sync
    from benchmarks._weight_sync import model_shape
    from benchmarks.rdt_bench import DEFAULT, run_plan

    run = list(DEFAULT.sharded_sync_rows or ())
    assert DEFAULT.sharded_sync_shared and run == ["hand-written", "ray-rdt", "rdt-sharded-shm"]
    config = BenchConfig(sizes=[], world_sizes=[], backends=[], iters=1, weight_sync_scale=0.004,
                         sharded_sync_rows=run, sharded_sync_calibrate=False, sharded_sync_shared=True)
    ctx = BenchContext(config=config, pool=None)  # type: ignore[arg-type]
    with Progress(run_plan(ctx, ["sharded-sync"]), stream=io.StringIO(), tty=False) as ctx.progress:
        ctx.progress.start_suite("sharded-sync")
        rows = sharded_sync_suite(ctx)
    shape = model_shape(0.004)
    targets = [target_bytes(engine_wants(shape, 2, i % 2)) for i in range(4)]
    by = {r["impl"]: r for r in rows}
    for i, impl in enumerate(run):
        r = by[impl]
        assert "error" not in r, r
        assert r["actors"] == "shared" and r["actors_rows_before"] == i, r
        assert r["bytes_checked"] == sum(targets) and r["seconds"] > 0, r
        assert r["actor_pids"] == by[run[0]]["actor_pids"] and len(set(r["actor_pids"])) == 8, r
    assert by["hand-written"]["mechanism"] == "gloo (ray.util.collective)"
    assert by["ray-rdt"]["mechanism"] == "ray-rdt (gloo)"
    assert by["rdt-sharded-shm"]["planned_steps"] == 4, by["rdt-sharded-shm"]  # its own loaders, planned once
    assert "ran on one shared set of 8 actors" in format_sharded_sync(rows)


def _check_labels(rows: List[Dict[str, Any]]) -> None:
    """Every row has a mechanism; the ones this machine determines are what ran."""
    assert all(r.get("mechanism") for r in rows), [r for r in rows if not r.get("mechanism")]
    by = {(r["suite"], r["impl"], r.get("mode"), r.get("size")): r["mechanism"] for r in rows if "error" not in r}
    for size in (4 * KiB, 256 * KiB):
        assert by[("allreduce", "rdt-gloo", "barrier", size)] == "shm-allreduce"  # one node: shared memory
        assert by[("allreduce", "rdt-gloo/ring", "barrier", size)] == "gloo-p2p/ring"
        assert by[("allreduce", "ray.collective-gloo", "barrier", size)] == "gloo"
        assert by[("p2p", "rdt-gloo", "barrier", size)] == "gloo"
        assert by[("p2p", "ray-objstore", "barrier", size)] == "object_store"
        for impl in ("rdt-gloo", "rdt-shm", "rdt-nixl", "rdt-auto"):  # 4 KiB is under the 64 KiB inline threshold
            if size == 4 * KiB:
                assert by[("objects", impl, "round-trip", size)] == "inline", impl
    assert by[("objects", "rdt-gloo", "round-trip", 256 * KiB)] == "gloo"
    assert by[("objects", "rdt-gloo-noinline", "round-trip", 4 * KiB)] == "gloo"
    assert by[("objects", "rdt-shm", "round-trip", 256 * KiB)] == _cma_expected()
    assert by[("objects", "rdt-nixl", "round-trip", 256 * KiB)] == "nixl"
    assert by[("objects", "ray-rdt-gloo", "round-trip", 256 * KiB)] == "ray-rdt (gloo)"


def _check_modes(ok: List[Dict[str, Any]]) -> None:
    """p2p: rdt and ray.util.collective measured both ways, interleaved in the same actors."""
    for impl in INTERLEAVED:
        for mode in ("back-to-back", "barrier"):
            rows = [r for r in ok if r["suite"] == "p2p" and r["impl"] == impl and r["mode"] == mode]
            assert len(rows) == 2 and all(r["interleaved"] and r["gbps"] > 0 for r in rows), (impl, mode, rows)
    assert all(r["mode"] == "barrier" for r in ok if r["suite"] == "allreduce")
    assert all(r["mode"] == "round-trip" for r in ok if r["suite"] == "objects")


# ---------------------------------------------------------------------- labels read from real transfers
def _label(consume: Any, producer: Any, stats_of_consumer: Any, transport: str) -> str:
    import rdt

    from benchmarks._mechanism import object_mechanism

    before = (rdt.stats(producer), stats_of_consumer())
    consume()
    return object_mechanism(transport, before[1], stats_of_consumer(), before[0], rdt.stats(producer))


def test_object_mechanism_labels(ray_cluster) -> None:
    """The labels of object fetches, read from rdt.stats() around real transfers: inline, gloo, a direct read or
    a segment for shm, and the object-store fallback for a consumer outside the group."""
    import ray
    import rdt

    from ._object_actors import Node

    p, c = Node.remote(), Node.remote()
    group = rdt.create_collective_group([p, c], backend="gloo")
    n = 1 << 16  # 256 KiB: over the inline threshold
    try:
        def in_c() -> Dict[str, Any]:
            return rdt.stats(c)

        def via_c(method: str, numel: int) -> Any:
            return lambda: ray.get(c.total.remote(getattr(p, method).remote(numel)), timeout=60)

        assert _label(via_c("make_gloo", 16), p, in_c, "gloo") == "inline"
        assert _label(via_c("make_gloo", n), p, in_c, "gloo") == "gloo"
        assert _label(via_c("make_nixl", n), p, in_c, "nixl") == "nixl"
        assert _label(via_c("make_shm", n), p, in_c, "shm") == _cma_expected()
        ray.get([a.configure.remote(shm_cma=False) for a in (p, c)], timeout=30)
        assert _label(via_c("make_shm", n), p, in_c, "shm") == "shm-segment"
        ref = p.make_gloo.remote(n)
        assert _label(lambda: ray.get(ref, timeout=60), p, rdt.stats, "gloo") == "object_store (fallback)"
    finally:
        rdt.destroy_collective_group(group)
        for a in (p, c):
            ray.kill(a)


@pytest.mark.parametrize("shm", [True, False], ids=["shm-allreduce", "gloo-allreduce"])
def test_collective_mechanism_labels(ray_cluster, shm: bool) -> None:
    """rdt-gloo's allreduce is labelled by what the group set up: the same-node shared-memory allreduce, or Gloo
    where it is turned off (RDT_GLOO_SHM=0); p2p algorithms and p2p are labelled by backend."""
    import ray
    import rdt_transports as rt
    import torch

    from benchmarks._cluster import BenchWorker
    from benchmarks._collectives import _rdt_mechanism

    env = {} if shm else {"runtime_env": {"env_vars": {"RDT_GLOO_SHM": "0"}}}
    cls = ray.remote(num_cpus=0)(BenchWorker)
    actors = [cls.options(**env).remote() for _ in range(2)]
    try:
        h = rt.create_collective_group(actors, backend="gloo", timeout=60)

        def ask(op: str, algorithm: str) -> List[str]:
            return ray.get([a.__ray_call__.remote(_rdt_mechanism, h.name, op, 4096, algorithm) for a in actors],
                           timeout=60)

        def allreduce(self: Any, name: str) -> float:
            t = torch.ones(1024)
            rt.allreduce(t, name, timeout=30)
            return float(t[0])

        assert ray.get([a.__ray_call__.remote(allreduce, h.name) for a in actors], timeout=60) == [2.0, 2.0]
        assert ask("allreduce", "native") == ["shm-allreduce" if shm else "gloo"] * 2
        assert ask("allreduce", "ring") == ["gloo-p2p/ring"] * 2
        assert ask("p2p", "native") == ["gloo"] * 2
        h.destroy(timeout=30)
    finally:
        for a in actors:
            ray.kill(a)


# ---------------------------------------------------------------------- comparison logic
def _row(suite: str, impl: str, mechanism: str, size: int, latency_us: float, mode: str = "barrier",
         ws: int = 2, **extra: Any) -> Dict[str, Any]:
    """A result row in rdt-bench's JSON shape."""
    sec = latency_us / 1e6
    return {"suite": suite, "op": suite, "impl": impl, "family": "rdt" if impl.startswith("rdt-") else "baseline",
            "backend": "gloo", "algorithm": "native", "mechanism": mechanism, "mode": mode, "size": size,
            "world_size": ws, "warmup": 1, "iters": 3, "seconds": sec, "seconds_min": sec, "seconds_all": [sec] * 3,
            "latency_us": latency_us, "gbps": size / sec / 1e9, "gbps_best": size / sec / 1e9, **extra}


def test_targets_and_ratios_mark_cross_mechanism() -> None:
    """A target or ratio between different mechanism classes says so; gloo against gloo does not."""
    from benchmarks._report import compare
    from benchmarks._targets import check_targets

    mib = 1 << 20
    rows = [_row("allreduce", "rdt-gloo", "shm-allreduce", 16 * mib, 10e3, ws=4),
            _row("allreduce", "ray.collective-gloo", "gloo", 16 * mib, 20e3, ws=4),
            _row("allreduce", "ray-objstore", "object_store", 16 * mib, 200e3, ws=4),
            _row("p2p", "rdt-gloo", "gloo", 4 * KiB, 100.0, "back-to-back"),
            _row("p2p", "ray.collective-gloo", "gloo", 4 * KiB, 100.0, "back-to-back"),
            _row("p2p", "rdt-ucx", "ucx", 4 * KiB, 120.0, "barrier")]
    targets = {t["target"]: t for t in check_targets(rows)}
    shm = targets["allreduce n=4 16 MiB >= 1x ray.util.collective"]
    assert shm["met"] and shm["ratio"] == 2.0 and shm["cross_mechanism"]
    assert shm["mechanisms"] == "shm-allreduce vs gloo (cross-mechanism)"
    p2p = targets["gloo p2p back-to-back 4 KiB >= 0.95x ray.util.collective"]
    assert p2p["met"] and p2p["ratio"] == 1.0 and not p2p["cross_mechanism"] and p2p["mechanisms"] == "gloo vs gloo"
    ucx = targets["ucx p2p barrier 4 KiB <= 150 us"]
    assert ucx["met"] and ucx["unit"] == "us" and ucx["ratio"] == 120.0
    assert "gloo p2p barrier 4 KiB >= 0.95x ray.util.collective" not in targets  # no baseline in that mode
    lines = compare(rows)
    assert any("[cross-mechanism: shm-allreduce vs gloo]" in ln and "ray.collective-gloo" in ln for ln in lines)
    assert any("back-to-back" in ln and "1.00x" in ln and "cross-mechanism" not in ln for ln in lines)


def test_compare_two_runs(tmp_path: Path) -> None:
    """--compare prints B/A speed-ups of the cells in both files, mechanism changes, failures, and the cells
    in one run only; exit 0, with no Ray cluster (RAY_ADDRESS points nowhere, so ray.init would fail)."""
    a_rows = [_row("p2p", "rdt-gloo", "gloo", 4 * KiB, 400.0, "back-to-back"),
              _row("p2p", "rdt-gloo", "gloo", 4 * KiB, 500.0, "barrier"),
              _row("objects", "rdt-shm", "shm-segment", 1 << 20, 10e3, "round-trip"),
              _row("allreduce", "rdt-gloo", "shm-allreduce", 64 * KiB, 300.0, ws=4),
              _row("p2p", "rdt-ucx", "ucx", 4 * KiB, 900.0, "barrier")]
    b_rows = [_row("p2p", "rdt-gloo", "gloo", 4 * KiB, 100.0, "back-to-back"),
              _row("p2p", "rdt-gloo", "gloo", 4 * KiB, 1000.0, "barrier"),
              _row("objects", "rdt-shm", "cma", 1 << 20, 5e3, "round-trip"),
              _row("p2p", "rdt-nixl", "nixl", 4 * KiB, 80.0, "barrier"),
              {**_row("p2p", "rdt-ucx", "ucx", 4 * KiB, 900.0, "barrier"), "error": "TimeoutError: boom"}]
    paths = []
    for name, rows in (("A.json", a_rows), ("B.json", b_rows)):
        path = tmp_path / name
        path.write_text(json.dumps({"machine": {"date": "2026-11-23"}, "results": rows}))
        paths.append(str(path))
    env = dict(os.environ, RAY_ADDRESS="127.0.0.1:1")
    proc = _bench("--compare", *paths, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    lines = out.splitlines()

    def line(*words: str) -> str:
        hits = [ln for ln in lines if all(w in ln for w in words)]
        assert len(hits) == 1, (words, out)
        return hits[0]

    assert "B median throughput / A median throughput" in out
    assert line("p2p", "back-to-back", "rdt-gloo", " 4 KiB").rstrip().endswith("4.00x")
    assert line("p2p", "barrier", "rdt-gloo", " 4 KiB").rstrip().endswith("0.50x")
    assert "geometric mean speed-up 1.41x" in out
    assert line("rdt-shm", "shm-segment", "-> cma").rstrip().endswith("2.00x (cross-mechanism)")
    assert "error: TimeoutError: boom" in line("rdt-ucx", "A: ", "B: ")
    only_a = out.split("== only in A (2) ==")[1].split("== only in B")[0]
    assert "shm-allreduce" in only_a and "shm-segment" in only_a
    only_b = out.split("== only in B (2) ==")[1]
    assert "rdt-nixl" in only_b and "cma" in only_b

    # A run recorded before labels existed: matched by (suite, impl, size, world size) to every mode of the other
    legacy = {k: v for k, v in _row("p2p", "rdt-gloo", "gloo", 4 * KiB, 200.0, "barrier").items()
              if k not in ("mechanism", "mode")}
    old_path = tmp_path / "old.json"
    old_path.write_text(json.dumps({"machine": {"date": "2026-11-21"}, "results": [legacy]}))
    proc = _bench("--compare", str(old_path), paths[1], timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    matched = proc.stdout.split("recorded without labels (mode and mechanism unknown there) ==")[1]
    hits = [ln for ln in matched.splitlines() if "rdt-gloo" in ln and "A recorded without labels" in ln]
    assert len(hits) == 2 and any("2.00x" in h for h in hits) and any("0.20x" in h for h in hits), matched

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    proc = _bench("--compare", paths[0], str(bad), timeout=60, env=env)
    assert proc.returncode == 2 and "cannot read" in proc.stderr


def test_interleaved_p2p_drops_a_failing_library(ray_cluster) -> None:
    """A library that fails in the interleaved rounds gets error rows and the size is re-run without it; the
    others are still measured both ways in the same actors."""
    from benchmarks._cluster import ActorPool
    from benchmarks._collectives import BenchConfig, BenchContext, RdtImpl
    from benchmarks._p2p import Lib, _lib, _measure_sizes

    ctx = BenchContext(BenchConfig(sizes=[4 * KiB, 64 * KiB], world_sizes=[2], backends=["gloo"], quick=True,
                                   group_timeout=60), ActorPool())
    good, broken = RdtImpl("gloo", "native"), RdtImpl("ucx", "auto")  # broken: its group was never created
    good.setup(ctx, 2)
    try:
        rows = _measure_sizes(ctx, [(broken, Lib(broken.name, "rdt", "no-such-group")), (good, _lib(good))])
    finally:
        good.teardown(ctx)
        ctx.pool.shutdown()
    errors = [r for r in rows if "error" in r]
    assert {(r["impl"], r["mode"], r["size"]) for r in errors} == {("rdt-ucx", m, 4 * KiB)
                                                                   for m in ("back-to-back", "barrier")}
    assert all("no-such-group" in r["error"] for r in errors), errors  # the library's own error
    ok = [r for r in rows if "error" not in r]
    assert sorted((r["impl"], r["mode"], r["size"]) for r in ok) == sorted(
        ("rdt-gloo", m, s) for m in ("back-to-back", "barrier") for s in (4 * KiB, 64 * KiB))
    assert all(r["gbps"] > 0 and r["mechanism"] == "gloo" and r["interleaved"] for r in ok)


def test_sharded_delta_targets_read_their_rows() -> None:
    """The sharded-delta suite's targets (benchmarks/_sharded_delta_report.py): each is checked on its row, a row
    that did not run is reported as not run, never as met."""
    from benchmarks._sharded_delta_report import sharded_delta_markdown, sharded_delta_targets

    def row(name, t, **kw):
        base = {"suite": "sharded-delta", "impl": f"delta-{name}-{t}", "transport": t, "mode": name,
                "bytes_ratio": 0.03, "step_ratio": 0.1, "trainer_delta_ratio": 0.5, "wrong_bytes": 0,
                "mechanism": "shm-direct", "read_mode": "delta", "changed_fraction": 0.01, "seconds": 0.01,
                "full_seconds": 0.1, "trainer_delta_s": 0.05, "bytes_compared": 10}
        base.update(kw)
        return base

    rows = [row("1%", "shm"), row("5%", "shm", bytes_ratio=0.3), row("20%", "shm", step_ratio=1.2),
            row("adamw", "shm", error="boom"),
            {"suite": "sharded-delta", "impl": "checksum-crc32c", "mode": "checksum", "gbps_core": 10.9,
             "zlib_gbps_core": 2.4, "mechanism": "crc32c"}]
    got = {t["target"]: t for t in sharded_delta_targets(rows)}
    assert got["1% (shm): bytes moved per engine rank / its full slices <= 0.05x"]["met"] is True
    assert got["5% (shm): bytes moved per engine rank / its full slices <= 0.2x"]["met"] is False
    assert got["20% (shm): delta step / full step <= 1.05x"]["met"] is False
    assert got["adamw (shm): trainer's delta computation / full step <= 1.0x"]["met"] is None
    assert got["1% (nixl): delta step / full step <= 0.15x"]["met"] is None  # not run
    assert got["checksum >= 8.0 GB/s a core"]["met"] is True
    assert "checksum: CRC-32C 10.94" not in sharded_delta_markdown(rows, list(got.values()))
