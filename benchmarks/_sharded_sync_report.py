"""The sharded-sync suite's targets (issue 30) and its table (stdout and Markdown). A row that did not run says why;
a target whose rows did not run is reported as not run, never as met."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from ._mechanism import comparable, describe_pair

SUITE = "sharded-sync"
MB, MiB = 1e6, 1 << 20
BYTES_NEED = 1.01
TRAINER_USS_NEED = 0.05
GLOO_STAGING_MIB = 2 * 4  # per consumer
HAND_NEED, RAY_RDT_NEED, WHOLE_NEED = 3.0, 5.0, 0.6
REPLAY_MS_NEED = 2.0
REPLICA_LINK_NEED = 1.02  # bytes the trainer ranks send / the distinct slices wanted
SCHEMES = (
    "hand-written: one ray.util.collective Gloo group of the 8 actors; for each parameter, each trainer rank in "
    "turn broadcasts its rows to the group (4 broadcasts per parameter; the other trainer ranks receive them into "
    "a scratch buffer); each engine rank receives into the whole model, then narrows its slices out.",
    "ray-rdt: trainer ranks 1-3 return their shards with @ray.method(tensor_transport=\"gloo\") to rank 0 (the "
    "gather), rank 0 returns the whole model the same way to each engine rank, which narrows.",
    "rdt-whole-<t>: ranks 1-3 rdt.put their shards, rank 0 rdt.get(into=) them into its rows of the whole model and "
    "rdt.puts it; each engine rank rdt.get(into=) the whole model, then narrows.",
    "rdt-sharded-<t>: rdt.put_shards on each trainer rank, rdt.Manifest on the driver, WeightLoader.load on each "
    "engine rank (mechanism: the loader's report; whole:<path> = the rank's shards fetched whole and narrowed).",
    "rdt-sharded-replicas-<t>: as rdt-sharded-<t> for engine 0's ranks, which then share() what they landed; "
    "engine 1's same rank loads that offer (mechanism replica:<path>), so each slice leaves the trainers once.",
)


def _rows(rows: List[Mapping[str, Any]]) -> Dict[str, Mapping[str, Any]]:
    return {r["impl"]: r for r in rows if r.get("suite") == SUITE}


def _ok(r: Optional[Mapping[str, Any]]) -> bool:
    return r is not None and "error" not in r


def _target(desc: str, need: float, unit: str, inverse: bool, value: Optional[float] = None,
            best: Optional[float] = None, mechs: str = "", cross: bool = False, why: str = "") -> Dict[str, Any]:
    """One target; ``why`` (value None): not run, and why."""
    if value is None:
        return {"target": desc, "ratio": None, "ratio_best": None, "required": need, "met": None, "met_best": None,
                "inverse": inverse, "unit": unit, "mechanisms": why or "not run", "cross_mechanism": False,
                "status": why or "not run"}
    best = value if best is None else best
    met = (lambda v: v <= need) if inverse else (lambda v: v >= need)
    return {"target": desc, "ratio": round(value, 4), "ratio_best": round(best, 4), "required": need,
            "met": met(value), "met_best": met(best), "inverse": inverse, "unit": unit, "mechanisms": mechs,
            "cross_mechanism": cross}


def _control(r: Mapping[str, Any]) -> str:
    """The version begin/end round trips of a row's replayed loads (not part of the plan's replay), if measured."""
    ctl = [c for c in r.get("replay_control_s") or [] if c is not None]
    return f"; begin/end round trips apart: {max(ctl) * 1e3:.2f} ms (worst consumer)" if ctl else ""


def _why(*rs: Optional[Mapping[str, Any]]) -> str:
    for r in rs:
        if r is None:
            return "not run: row missing"
        if "error" in r:
            return f"{r['impl']}: {r['error']}"
    return ""


def _speed(desc: str, need: float, x: Optional[Mapping[str, Any]], y: Optional[Mapping[str, Any]],
           inverse: bool) -> Dict[str, Any]:
    """x's step against y's: y/x (speed-up, >= need) or, ``inverse``, x/y (<= need)."""
    why = _why(x, y)
    if why:
        return _target(desc, need, "x", inverse, why=why)
    assert x is not None and y is not None
    a, b = (x, y) if inverse else (y, x)
    mechs = f"{x['impl']} vs {y['impl']} ({describe_pair(x.get('mechanism'), y.get('mechanism'))})"
    return _target(desc, need, "x", inverse, a["seconds"] / b["seconds"], a["seconds_best"] / b["seconds_best"],
                   mechs, not comparable(x.get("mechanism"), y.get("mechanism")))


def received_ratio(r: Mapping[str, Any]) -> float:
    """The largest bytes received / its targets' bytes over the engine ranks, covering reads' excess counted apart."""
    excess = r.get("bytes_covering_excess") or [0] * len(r["bytes_received"])
    return max((g - x) / t for g, x, t in zip(r["bytes_received"], excess, r["target_bytes"]))


def covering_ratio(r: Mapping[str, Any]) -> float:
    """The largest covering reads' excess / its targets' bytes over the engine ranks (0: exact runs only)."""
    excess = r.get("bytes_covering_excess") or [0] * len(r["bytes_received"])
    return max(x / t for x, t in zip(excess, r["target_bytes"]))


def _calibration(r: Mapping[str, Any]) -> str:
    """The calibration row as one line: each transport's measured cost per range and bandwidth."""
    if r.get("declared"):
        return "range costs: the transports' declared ones (this run does not measure them; --full does)"
    parts = []
    for name, c in (r.get("calibration") or {}).items():
        parts.append(f"{name}: error {c['error'][:60]}" if "error" in c else
                     f"{name}: {c['run_s'] * 1e6:.2f} us/range, {c['bytes_per_s'] / 1e9:.2f} GB/s")
    return "range costs measured (exact runs): " + ("; ".join(parts) or "none (no sharded row selected)")


def trainer_growth(r: Mapping[str, Any]) -> float:
    """The largest trainer USS growth during the sampled sync, as a fraction of that rank's shard."""
    return max(g / s for g, s in zip(r["trainer_uss_growth_bytes"], r["shard_bytes"]))


def sharded_sync_targets(rows: List[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Issue 30's targets on one run's rows; every one is listed (not run where its rows did not run)."""
    by = _rows(rows)
    if not by:
        return []
    sharded = [r for impl, r in by.items() if impl.startswith("rdt-sharded-") and r.get("kind") == "sharded"]
    out = []
    for r in sharded:
        t = r["transport"]
        mode = r.get("read_mode", "?")
        apart = f"; covering reads' excess apart: {covering_ratio(r):.2f}x" if _ok(r) and covering_ratio(r) else ""
        out.append(_target(f"{SUITE} {r['impl']}: bytes received per consumer <= {BYTES_NEED}x its targets", BYTES_NEED,
                           "x", True, received_ratio(r) if _ok(r) else None, None,
                           f"{r.get('mechanism', '?')}, {mode}{apart}", why=_why(r)))
        if t == "gloo":
            counted = r.get("staging_stream_peak_bytes") if _ok(r) else None
            proxy = max(r["trainer_uss_growth_bytes"]) / 4 / MiB if _ok(r) else None
            value = counted / MiB if counted else proxy
            how = (f"rdt's staging_stream_peak on trainer rank 0; USS growth per consumer {proxy:.2f} MiB (also "
                   "holds the cached plans)" if counted else "USS growth per consumer (no staging counter)")
            out.append(_target(f"{SUITE} {r['impl']}: trainer staging <= 2 x 4 MiB per consumer", GLOO_STAGING_MIB,
                               "MiB", True, value, None, f"{r.get('mechanism', '?')}; {how}" if _ok(r) else "",
                               why=_why(r)))
        else:
            out.append(_target(f"{SUITE} {r['impl']}: trainer USS growth <= 5% of its shard", TRAINER_USS_NEED,
                               "of shard", True, trainer_growth(r) if _ok(r) else None, None,
                               str(r.get("mechanism", "?")), why=_why(r)))
    for r in (r for impl, r in by.items() if r.get("kind") == "replicas"):
        sent = r["trainer_sent_bytes"] / r["distinct_slice_bytes"] if _ok(r) else None
        out.append(_target(f"{SUITE} {r['impl']}: trainer ranks send <= {REPLICA_LINK_NEED}x the distinct slices",
                           REPLICA_LINK_NEED, "x", True, sent, None,
                           f"{r.get('mechanism', '?')}; one node, rdt's received counters of the engine ranks that "
                           "read the trainers, against one replica's targets" if _ok(r) else "", why=_why(r)))
    ok = [r for r in sharded if _ok(r)]
    best = min(ok, key=lambda r: r["seconds"]) if ok else (sharded[0] if sharded else None)
    out.append(_speed(f"{SUITE}: best rdt sharded >= {HAND_NEED:g}x hand-written", HAND_NEED, best,
                      by.get("hand-written"), False))
    out.append(_speed(f"{SUITE}: best rdt sharded >= {RAY_RDT_NEED:g}x Ray's RDT", RAY_RDT_NEED, best,
                      by.get("ray-rdt"), False))
    for r in sharded:
        out.append(_speed(f"{SUITE} {r['impl']}: <= {WHOLE_NEED}x rdt-whole-{r['transport']}", WHOLE_NEED, r,
                          by.get(f"rdt-whole-{r['transport']}"), True))
    for r in sharded:
        solo = [o for o in r.get("replay_solo_overhead_s") or [] if o is not None] if _ok(r) else []
        over = [o for o in r.get("replay_overhead_s") or [] if o is not None] if _ok(r) else []
        why = _why(r) or ("" if solo or over else "not measured: this build's loader cannot be timed around its "
                                                    "reads")
        how = ("load() outside the transports' reads and the version begin/end round trips, median of "
               + (f"{r.get('replay_solo_loads', 3)} replayed loads per engine rank with the other engine ranks idle, "
                  f"worst engine rank; with all four loading at once (8 actors on the machine's cores): "
                  f"{max(over) * 1e3:.2f} ms" if solo and over else "replayed steps, worst consumer"))
        value = max(solo) if solo else max(over) if over else None
        out.append(_target(f"{SUITE} {r['impl']}: replayed plan <= {REPLAY_MS_NEED:g} ms per consumer per step",
                           REPLAY_MS_NEED, "ms", True, value * 1e3 if value is not None else None, None,
                           how + _control(r), why=why))
    soak = next((r for impl, r in by.items() if r.get("kind") == "soak"), None)
    ran = soak is not None and "error" not in soak and soak["loads_landed"] > 0  # none landed: nothing shown
    wrong = soak["wrong_reads"] + sum(soak["other_errors"].values()) if ran else None
    out.append(_target(f"{SUITE}: 200 steps, in-place updates during pulls, verify on: 0 torn or wrong reads", 0,
                       "torn or wrong reads", True, wrong, None,
                       f"{soak['steps']} steps over {soak['transport']}: {soak['loads_landed']} loads landed (every "
                       f"byte compared), {soak['loads_version_gone']} refused (VersionGoneError), "
                       f"{soak['torn_reads']} torn, {soak['checksum_mismatches']} checksum mismatches"
                       + (f", other errors {soak['other_errors']}" if soak["other_errors"] else "") if ran else "",
                       why="" if ran else str(soak["error"]) if soak is not None and "error" in soak else
                       "no load landed" if soak is not None else "not run"))
    return out


# ---------------------------------------------------------------------- tables
def _cell_time(r: Mapping[str, Any]) -> str:
    s = r["seconds"]
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _columns(r: Mapping[str, Any], hand: Optional[Mapping[str, Any]]) -> List[str]:
    """median step, vs hand-written, received/targets, trainer USS growth, peak RSS, replayed load (the soak: its
    counts in the first cell)."""
    if r.get("kind") == "calibration":
        return [_calibration(r)] + [""] * (len(HEAD) - 1)
    if r.get("kind") == "soak":
        summary = (f"{r['steps']} steps in {r['seconds']:.1f} s: {r['loads_landed']}/{r['loads']} landed, "
                   f"{r['loads_version_gone']} VersionGone, {r['torn_reads']} torn, {r['checksum_mismatches']} "
                   f"checksum mismatches" + (f", other {r['other_errors']}" if r["other_errors"] else ""))
        return [summary] + [""] * (len(HEAD) - 1)
    speed = f"{hand['seconds'] / r['seconds']:.2f}x" if _ok(hand) else "-"
    over = [o for o in r.get("replay_overhead_s") or [] if o is not None]
    solo = [o for o in r.get("replay_solo_overhead_s") or [] if o is not None]
    cover = covering_ratio(r) if r.get("bytes_covering_excess") else 0.0
    return [_cell_time(r), speed, f"{received_ratio(r):.3f}x" + (" (computed)" if r.get("bytes_received_computed")
                                                                  else f" + {cover:.2f}x covering" if cover else ""),
            f"{max(r['trainer_uss_growth_bytes']) / MB:.1f} MB ({trainer_growth(r):.1%})",
            f"{max(r['trainer_rss_peak_bytes']) / MB:.0f} / {max(r['engine_rss_peak_bytes']) / MB:.0f} MB",
            (f"{max(solo) * 1e3:.2f} / " if solo else "") + (f"{max(over) * 1e3:.2f} ms" if over else "-")]


HEAD = ["median step", "vs hand-written", "received / targets", "trainer USS growth (max)",
        "peak RSS trainer / engine", "replayed load (worst; alone / all engine ranks at once)"]


def _model(rows: List[Mapping[str, Any]]) -> str:
    r = next((r for r in rows if r.get("suite") == SUITE), None)
    if r is None:
        return "?"
    return (f"{r['tensors']} tensors, {r['size'] / MB:.1f} MB bf16, scale {r['scale']:g}; {r['trainers']} trainer "
            f"ranks -> {r['engines']} engines x TP {r['tp']}")


def actors_note(rows: List[Mapping[str, Any]]) -> str:
    """How the rows that ran got their actors: '' when each had fresh ones (the full matrix), else a line saying
    which rows shared one set and that each row's state was freed before the next one's set-up."""
    ran = [r for r in _rows(rows).values() if r.get("actors")]
    shared = [r["impl"] for r in ran if r["actors"] == "shared"]
    if not shared:
        return ""
    fresh = [r["impl"] for r in ran if r["actors"] != "shared"]
    return (f"actors: {', '.join(shared)} ran on one shared set of 8 actors, in that order (each row's tensors, "
            "loader and rdt pools freed and the heap trimmed before the next row's set-up; the Ray groups formed "
            "once and kept)"
            + (f"; fresh actors: {', '.join(fresh)}" if fresh else ""))


def format_sharded_sync(rows: List[Mapping[str, Any]]) -> str:
    """The stdout table; the rows not selected named on one line."""
    by = _rows(rows)
    hand = by.get("hand-written")
    out = [f"\n== {SUITE} ({_model(rows)}) ==",
           f"{'row':<26}{'mechanism':<28}" + "".join(f"{h:>28}" for h in HEAD)]
    unselected = [impl for impl, r in by.items() if not _ok(r) and "not selected" in str(r["error"])]
    for impl, r in by.items():
        if impl in unselected:
            continue
        if _ok(r):
            cells = _columns(r, hand)
            out.append(f"{impl:<26}{str(r['mechanism'])[:27]:<28}" + (cells[0] if r.get("kind") in ("soak",
                                                                                                "calibration") else
                                                                     "".join(f"{c:>28}" for c in cells)))
        else:
            out.append(f"{impl:<26}{'-':<28}{str(r['error'])[:120]}")
    if unselected:
        out.append(f"not selected (--sharded-sync-rows; --full runs every row): {', '.join(unselected)}")
    note = actors_note(rows)
    return "\n".join(out + ([note] if note else []) + ["", *SCHEMES])


def sharded_sync_markdown(rows: List[Mapping[str, Any]], targets: List[Mapping[str, Any]]) -> str:
    """The same as Markdown, with the suite's targets."""
    by = _rows(rows)
    hand = by.get("hand-written")
    out = [f"### {SUITE} ({_model(rows)})", "", "| row | mechanism | " + " | ".join(HEAD) + " |",
           "|---|---|" + "---|" * len(HEAD)]
    for impl, r in by.items():
        cells = _columns(r, hand) if _ok(r) else [f"not run: {r['error']}"] + [""] * (len(HEAD) - 1)
        out.append(f"| {impl} | {r.get('mechanism', '-') if _ok(r) else '-'} | " + " | ".join(cells) + " |")
    note = actors_note(rows)
    if note:
        out += ["", note[0].upper() + note[1:] + "."]
    out += ["", "| target | needed | value | status |", "|---|---|---|---|"]
    for t in targets:
        if not str(t["target"]).startswith(SUITE):
            continue
        value = "-" if t["ratio"] is None else f"{t['ratio']:g} {t['unit']}"
        status = t.get("status") or ("met" if t["met"] else "MISSED")
        out.append(f"| {t['target']} ({t['mechanisms']}) | {'<=' if t['inverse'] else '>='} {t['required']:g} "
                   f"| {value} | {status} |")
    return "\n".join(out + [""] + [f"- {s}" for s in SCHEMES]) + "\n"
