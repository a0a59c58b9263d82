"""The sharded-delta suite's targets and table. A target whose rows did not run is reported as not run, never as
met."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from ._sharded_delta import SUITE, TRANSPORTS

BYTES_NEED = {"1%": 0.05, "5%": 0.2}
STEP_NEED = {"1%": 0.15, "5%": 0.35, "20%": 1.05}
TRAINER_NEED = 1.0
CHECKSUM_GBPS = 8.0
VERIFY_FULL_NEED, VERIFY_DELTA_NEED = 0.25, 0.50


def _rows(rows: List[Mapping[str, Any]]) -> Dict[str, Mapping[str, Any]]:
    return {r["impl"]: r for r in rows if r.get("suite") == SUITE}


def _t(desc: str, need: float, value: Optional[float], inverse: bool = True, unit: str = "x",
       why: str = "", mechs: str = "") -> Dict[str, Any]:
    if value is None:
        return {"target": desc, "ratio": None, "ratio_best": None, "required": need, "met": None, "met_best": None,
                "inverse": inverse, "unit": unit, "mechanisms": why or "not run", "cross_mechanism": False,
                "status": why or "not run"}
    met = value <= need if inverse else value >= need
    return {"target": desc, "ratio": round(value, 4), "ratio_best": round(value, 4), "required": need, "met": met,
            "met_best": met, "inverse": inverse, "unit": unit, "mechanisms": mechs, "cross_mechanism": False}


def _get(by: Dict[str, Mapping[str, Any]], impl: str) -> "tuple[Optional[Mapping[str, Any]], str]":
    r = by.get(impl)
    if r is None:
        return None, "not run: row missing"
    if "error" in r:
        return None, f"{impl}: {r['error']}"
    return r, ""


def sharded_delta_targets(rows: List[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    by = _rows(rows)
    if not by:
        return []
    out: List[Dict[str, Any]] = []
    for t in TRANSPORTS:
        for name, need in BYTES_NEED.items():
            r, why = _get(by, f"delta-{name}-{t}")
            out.append(_t(f"{name} ({t}): bytes moved per engine rank / its full slices <= {need}x", need,
                          r["bytes_ratio"] if r else None, why=why, mechs=r["mechanism"] if r else ""))
        for name, need in STEP_NEED.items():
            r, why = _get(by, f"delta-{name}-{t}")
            out.append(_t(f"{name} ({t}): delta step / full step <= {need}x", need, r["step_ratio"] if r else None,
                          why=why, mechs=f"{r['read_mode']} vs full" if r else ""))
        for name in ("1%", "5%", "20%", "adamw"):
            r, why = _get(by, f"delta-{name}-{t}")
            out.append(_t(f"{name} ({t}): trainer's delta computation / full step <= {TRAINER_NEED}x", TRAINER_NEED,
                          r["trainer_delta_ratio"] if r else None, why=why,
                          mechs=f"put_shards(delta=True), slowest trainer rank" if r else ""))
        for name in ("1%", "5%", "20%", "adamw"):
            r, why = _get(by, f"delta-{name}-{t}")
            out.append(_t(f"{name} ({t}): wrong bytes (delta targets vs the full load's)", 0,
                          float(r["wrong_bytes"]) if r else None, why=why, unit="bytes"))
    r, why = _get(by, "checksum-crc32c")
    out.append(_t(f"checksum >= {CHECKSUM_GBPS} GB/s a core", CHECKSUM_GBPS, r["gbps_core"] if r else None,
                  inverse=False, unit="GB/s", why=why, mechs=r["mechanism"] if r else ""))
    r, why = _get(by, "verify-full-replay")
    out.append(_t(f"verify=True adds <= {VERIFY_FULL_NEED:.0%} to a replayed full load", VERIFY_FULL_NEED,
                  r["overhead"] if r else None, why=why, mechs=r["mechanism"] if r else ""))
    r, why = _get(by, "verify-delta-1%")
    out.append(_t(f"verify=True adds <= {VERIFY_DELTA_NEED:.0%} to a 1 % delta load", VERIFY_DELTA_NEED,
                  r["overhead"] if r else None, why=why, mechs=r["mechanism"] if r else ""))
    r, why = _get(by, "delta-soak")
    out.append(_t("soak (verify=True, deltas and full loads mixed): wrong bytes + provoked mismatches not caught",
                  0, float(r["wrong_bytes"] + r["uncaught"]) if r else None, why=why, unit="count",
                  mechs=f"{r['tampered']} provoked, {r['caught']} caught and repaired" if r else ""))
    return out


def sharded_delta_markdown(rows: List[Mapping[str, Any]], targets: List[Dict[str, Any]]) -> str:
    by = _rows(rows)
    lines = ["## sharded-delta", "", "| row | changed | delta step | full step | step ratio | bytes / full slices | "
             "trainer delta | peak RSS trainer / engine | wrong bytes | read mode (mechanism) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for impl, r in by.items():
        if r.get("mode") not in ("1%", "5%", "20%", "adamw"):
            continue
        if "error" in r:
            lines.append(f"| {impl} | error: {r['error']} |")
            continue
        rss = f"{max(r.get('trainer_rss_peak_bytes') or [0]) / 1e6:.0f} / {max(r.get('engine_rss_peak_bytes') or [0]) / 1e6:.0f} MB"
        lines.append(f"| {impl} | {r['changed_fraction'] * 100:.2f} % | {r['seconds'] * 1e3:.1f} ms | "
                     f"{r['full_seconds'] * 1e3:.1f} ms | {r['step_ratio']:.3f}x | {r['bytes_ratio']:.4f}x | "
                     f"{r['trainer_delta_s'] * 1e3:.0f} ms ({r['trainer_delta_ratio']:.2f}x) | {rss} | "
                     f"{r['wrong_bytes']} of {r['bytes_compared']} | {r['read_mode']} ({r['mechanism']}) |")
    for impl in ("checksum-crc32c", "verify-full-replay", "verify-delta-1%", "delta-soak"):
        r = by.get(impl)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"\n{impl}: error: {r['error']}")
        elif impl == "checksum-crc32c":
            lines.append(f"\nchecksum: CRC-32C {r['gbps_core']:.2f} GB/s a core (zlib CRC-32 {r['zlib_gbps_core']:.2f})")
        elif impl.startswith("verify"):
            lines.append(f"\n{impl}: {r['seconds'] * 1e3:.1f} ms with verify, {r['plain_seconds'] * 1e3:.1f} ms "
                         f"without (+{r['overhead'] * 100:.0f} %; {r['mechanism']})")
        else:
            lines.append(f"\nsoak: {r['steps']} steps, {r['loads']} loads ({r['delta']} delta, {r['full']} full), "
                         f"{r['wrong_bytes']} wrong bytes of {r['compared']}, {r['tampered']} provoked mismatches, "
                         f"{r['caught']} caught and repaired, {r['restarts']} restarts, {r['skipped_versions']} "
                         f"versions skipped, {r['seconds']:.0f} s")
    mine = [t for t in targets if t in sharded_delta_targets(rows)]
    if mine:
        met = sum(1 for t in mine if t["met"])
        lines += ["", f"| target ({met} of {len(mine)} met) | needed | this run | met |", "|---|---|---|---|"]
        for t in mine:
            value = "not run: " + t["status"] if t["ratio"] is None else f"{t['ratio']}{t['unit'] if t['unit'] != 'x' else 'x'}"
            lines.append(f"| {t['target']} | {t['required']} | {value} | {t['met']} |")
    return "\n".join(lines)


def format_sharded_delta(rows: List[Mapping[str, Any]]) -> str:
    return sharded_delta_markdown(rows, sharded_delta_targets(rows))
