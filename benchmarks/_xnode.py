"""The cross-node suite (issue 15): Ray nodes in network namespaces joined by 2 Gbit/s ``tbf`` links
(benchmarks/_netns.py). A 128 MiB object n1 -> n2 per transport, as a fraction of the shaped link rate, and the
weight sync with the trainer on n1 and 1, 2, 4 workers on other nodes, and the sharded-sync suite's rows
(benchmarks/_sharded_sync.py) with the 4 trainer ranks on n1 and the 2 engines x TP 2 on n2, where n1's outbound
``tc`` counter over the timed steps, against the distinct slices (one engine's targets), shows what replicas save
on the trainer node's link. Every object fetch checks that both ends of the link counted at least the payload (a
path through shared memory between namespaces would not), and every row names the path that served it. Needs root
and iproute2; not in the default run (``rdt-bench --suites xnode``).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Dict, List, Optional, Tuple

import ray
import torch

import rdt

from . import _netns
from . import _sharded_sync as _ss
from ._cluster import log
from ._weight_sync import CASES, World, _error, model_shape, run_case

SUITE = "xnode"
SHARDED = "xnode-sharded"
MiB = 1 << 20
OBJECT_BYTES = 128 * MiB
LINK_BITS_PER_S = 2e9  # _netns.RATE
OBJECT_TARGET = 0.8  # of the link rate
FANOUT_TARGET = 1.6  # 4 workers / 1 worker
VS_RAY_TARGET = 3.0  # Ray's built-in RDT over Gloo / rdt, at 4 workers
WS_CASES = ("ray-rdt-gloo", "ray.collective-broadcast", "rdt-gloo+copy", "rdt-gloo+into", "rdt-nixl+copy",
            "rdt-nixl+into")
REPLICA_LINK_NEED = 1.02  # the trainer node's out-link bytes per step / the distinct slices it serves
# Transports that serve ranges across nodes here (shm-direct does not cross nodes): NIXL READ (UCX over TCP on the
# veth) and gloo ranges over an rdt gloo group of the 8 actors; each with and without replicas.
SHARDED_CASES: Tuple[_ss.Case, ...] = tuple(_ss.Case(f"rdt-sharded-{r}{t}", k, t) for t in ("nixl", "gloo")
                                            for r, k in (("", "sharded"), ("replicas-", "replicas")))
# (label, producer method, group backend or None): ucx can only be reached through `auto` with a ucx group
OBJECT_CASES: Tuple[Tuple[str, str, Optional[str]], ...] = (
    ("gloo", "make_gloo", "gloo"), ("nixl", "make_nixl", None), ("ucx (auto)", "make_auto", "ucx"))


def _make(transport: str) -> Any:
    @rdt.tensor_method(tensor_transport=transport)
    def make(self: Any, nbytes: int, value: float) -> Dict[str, Any]:
        return {"t": torch.full((nbytes // 4,), value, dtype=torch.float32)}

    return make


@ray.remote(num_cpus=0)
class XPeer:
    """Producer (``make_<transport>``) and consumer (``fetch``) pinned to one node."""

    make_gloo = _make("gloo")
    make_nixl = _make("nixl")
    make_auto = _make("auto")

    def ifname(self) -> str:
        return os.environ.get("GLOO_SOCKET_IFNAME", "")

    def fetch(self, refs: List[Any], value: float, timeout: float) -> Tuple[float, Dict[str, int]]:
        """Seconds to fetch ``refs[0]`` (checked by its first and last element) and rdt's path counters after."""
        t0 = time.monotonic()
        t = ray.get(refs[0], timeout=timeout)["t"]
        dt = time.monotonic() - t0
        if float(t[0]) != value or float(t[-1]) != value:
            raise ValueError(f"wrong data: {float(t[0])}, {float(t[-1])} != {value}")
        return dt, dict(rdt.stats()["paths"])


def _object_case(net: _netns.NetnsCluster, prod: Any, cons: Any, label: str, method: str, iters: int,
                 timeout: float) -> Dict[str, Any]:
    """Warm-up plus ``iters`` timed fetches of one 128 MiB object n1 -> n2; each checks the link counters."""
    n1, n2 = net.nodes[0], net.nodes[1]
    times: List[float] = []
    paths: Dict[str, int] = {}
    short: List[Dict[str, int]] = []
    last: Dict[str, int] = {}
    for i in range(iters + 1):
        c1, c2 = n1.counters(), n2.counters()
        ref = getattr(prod, method).remote(OBJECT_BYTES, float(i + 1))
        ray.wait([ref], timeout=timeout, fetch_local=False)
        dt, after = ray.get(cons.fetch.remote([ref], float(i + 1), timeout), timeout=timeout + 30)
        del ref
        grew = {"n1_out": n1.counters()["out"] - c1["out"], "n2_into": n2.counters()["into"] - c2["into"]}
        if min(grew.values()) < OBJECT_BYTES:
            short.append(grew)
        if i:
            times.append(dt)
            paths.update({p: n - last.get(p, 0) for p, n in after.items() if n - last.get(p, 0)})
        last = after
    med = statistics.median(times)
    rate = OBJECT_BYTES * 8 / med
    return {"suite": SUITE, "impl": f"rdt-{label}", "op": "object n1->n2", "size": OBJECT_BYTES, "mode": "fetch",
            "family": "rdt", "mechanism": "/".join(sorted(paths)), "seconds": med, "seconds_best": min(times),
            "times_s": [round(t, 4) for t in times], "gbps": OBJECT_BYTES / med / 1e9,
            "link_fraction": rate / LINK_BITS_PER_S, "link_counters_ok": not short, "short_counters": short}


def object_rows(net: _netns.NetnsCluster, iters: int, timeout: float) -> List[Dict[str, Any]]:
    """One row per transport: 128 MiB n1 -> n2 (an error row where the transport is missing or fails)."""
    prod, cons = (XPeer.options(resources={r: 1}).remote() for r in ("n1", "n2"))
    rows: List[Dict[str, Any]] = []
    try:
        assert ray.get([prod.ifname.remote(), cons.ifname.remote()], timeout=120) == ["rdtv1p", "rdtv2p"]
        for label, method, backend in OBJECT_CASES:
            group = None
            try:
                if backend is not None:
                    group = rdt.create_collective_group([prod, cons], backend=backend, name=f"xnode-{label[:4]}")
                row = _object_case(net, prod, cons, label, method, iters, timeout)
            except Exception as e:  # noqa: BLE001 - recorded as the row's error
                row = {"suite": SUITE, "impl": f"rdt-{label}", "op": "object n1->n2", "size": OBJECT_BYTES,
                       "error": _error(e)}
            finally:
                if group is not None:
                    group.destroy(timeout=30)
            log(f"xnode object {label:<12} " + (f"ERROR {row['error']}" if "error" in row else
                f"median {row['seconds'] * 1e3:7.1f} ms  {row['link_fraction'] * 100:5.1f} % of the link  "
                f"counters {'ok' if row['link_counters_ok'] else 'SHORT'}  [{row['mechanism']}]"))
            rows.append(row)
    finally:
        for a in (prod, cons):
            ray.kill(a)
    return rows


def weight_sync_rows(scale: float, workers: List[int], warmup: int, iters: int, group_timeout: float
                     ) -> List[Dict[str, Any]]:
    """The weight-sync cases with the trainer on n1 and worker k on node n(k+1)."""
    shape = model_shape(scale)
    log(f"xnode weight-sync: {shape.describe()}; trainer on n1, workers {workers} on n2..")
    cases = [c for c in CASES if c.impl in WS_CASES]
    rows: List[Dict[str, Any]] = []
    step = 0
    for n in workers:
        try:
            world = World(shape, n, group_timeout, nodes=[f"n{k}" for k in range(1, n + 2)])
        except Exception as e:  # noqa: BLE001
            rows += [{"suite": "weight-sync", "impl": c.impl, "world_size": n, "workers": n, "mode": "sync",
                      "size": shape.nbytes, "error": f"setup: {_error(e)}"} for c in cases]
            continue
        try:
            for case in cases:
                rows.append(dict(run_case(world, case, warmup, iters, step), cluster="netns"))
                step += warmup + iters + 1
        finally:
            world.close()
    return rows


def sharded_rows(net: _netns.NetnsCluster, scale: float, warmup: int, iters: int, group_timeout: float,
                 chosen: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """The sharded-sync rows (``chosen``: their names, default all) with the trainer ranks on n1 and the engine
    ranks on n2; n1's outbound and n2's inbound counters read around each timed step."""
    shape = model_shape(scale)
    log(f"{SHARDED}: {shape.describe()}; {_ss.TRAINERS} trainer ranks on n1 -> {_ss.ENGINES} engines x TP {_ss.TP} "
        f"on n2; {warmup} warm-up + {iters} timed steps per row")
    n1, n2 = net.nodes[0], net.nodes[1]
    nodes = [n1.resource] * _ss.TRAINERS + [n2.resource] * (_ss.ENGINES * _ss.TP)

    def link() -> Dict[str, int]:
        return link_counters(n1, n2)

    # Exact runs: the target counts the distinct slices that cross the trainer node's link (the transports'
    # declared range costs are loopback's; covering reads would trade link bytes for fewer ranges).
    costs = {t: (1e-9, 1e12) for t in ("nixl", "gloo")}
    rows = []
    for case in SHARDED_CASES:
        if chosen is not None and case.impl not in chosen:
            continue
        row = _ss.run_case(shape, case, warmup, iters, group_timeout, range_costs=costs, nodes=nodes, link=link)
        row.update(suite=SHARDED, cluster="netns", trainer_node=n1.resource, engine_node=n2.resource)
        if "error" not in row:
            row.update(link_fields(row))
            log(f"{SHARDED} {case.impl:<26} median {row['seconds'] * 1e3:7.0f} ms  n1 out-link payload "
                f"{row['link_ratio']:.3f}x the distinct slices (wire {row['link_wire_ratio']:.3f}x; "
                f"{max(row['n1_out_payload_bytes']) / 1e6:.1f} MB/step, distinct "
                f"{row['distinct_slice_bytes'] / 1e6:.1f} MB), {row['bytes_checked'] / 1e6:.1f} MB compared "
                f"[{row['mechanism']}, {row['read_mode']}]")
        rows.append(row)
    return rows


def link_counters(trainer: _netns.Node, engine: _netns.Node) -> Dict[str, int]:
    """The trainer node's outbound counters (bytes on the wire, packets, payload) and the engine node's inbound
    bytes."""
    out = trainer.out_stats()
    return {"n1_out": out["bytes"], "n1_out_packets": out["packets"], "n1_out_payload": out["payload"],
            "n2_into": engine.counters()["into"]}


def link_fields(row: Dict[str, Any]) -> Dict[str, Any]:
    """Per timed step: what left the trainer node (payload: the wire bytes less each packet's headers; and the wire
    bytes) and the bytes into the engine node; the worst step's payload over the distinct slices (one engine's
    targets) is the row's link ratio, the wire bytes' beside it."""
    distinct = row["distinct_slice_bytes"]
    steps = row["link_bytes"]
    payload = [g["n1_out_payload"] for g in steps]
    wire = [g["n1_out"] for g in steps]
    return {"n1_out_payload_bytes": payload, "n1_out_bytes": wire,
            "n1_out_packets": [g["n1_out_packets"] for g in steps],
            "n2_into_bytes": [g["n2_into"] for g in steps], "link_ratio": max(payload) / distinct,
            "link_ratio_best": min(payload) / distinct, "link_wire_ratio": max(wire) / distinct}


def xnode_targets(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The issue's targets, measured: objects >= 80 % of the link; weight sync 4 vs 1 worker, and vs Ray's RDT;
    the sharded replicas rows' trainer out-link <= 1.02x the distinct slices."""
    out: List[Dict[str, Any]] = []
    for r in rows:
        if r.get("suite") == SHARDED and r.get("kind") == "replicas":
            desc = (f"{r['impl']}: each trainer node's out-link carries <= {REPLICA_LINK_NEED}x the distinct "
                    "slices it serves")
            if "error" in r:
                out.append({"target": desc, "value": None, "met": None, "status": r["error"]})
            else:
                out.append({"target": desc, "value": round(r["link_ratio"], 4),
                            "met": r["link_ratio"] <= REPLICA_LINK_NEED})
    for r in rows:
        if r.get("suite") == SUITE and "error" not in r:
            out.append({"target": f"{r['impl']} 128 MiB n1->n2 >= {OBJECT_TARGET:.0%} of link",
                        "value": round(r["link_fraction"], 3), "met": r["link_fraction"] >= OBJECT_TARGET})
    ws = {(r["impl"], r["workers"]): r["seconds"] for r in rows
          if r.get("suite") == "weight-sync" and "seconds" in r}
    top = max((r.get("workers", 0) for r in rows if r.get("suite") == "weight-sync"), default=0)
    for impl in {i for i, _ in ws}:
        if impl.startswith("rdt-") and (impl, 1) in ws and (impl, top) in ws and top > 1:
            ratio = ws[(impl, top)] / ws[(impl, 1)]
            out.append({"target": f"{impl} {top} workers / 1 worker <= {FANOUT_TARGET}x", "value": round(ratio, 2),
                        "met": ratio <= FANOUT_TARGET})
            ray_rdt = ws.get(("ray-rdt-gloo", top))
            if ray_rdt is not None:
                speedup = ray_rdt / ws[(impl, top)]
                out.append({"target": f"{impl} >= {VS_RAY_TARGET}x Ray's RDT over Gloo at {top} workers",
                            "value": round(speedup, 2), "met": speedup >= VS_RAY_TARGET})
    return sorted(out, key=lambda t: t["target"])


def start_cluster(n_nodes: int, object_store_mib: int) -> _netns.NetnsCluster:
    """The namespace cluster, with this driver connected on the bridge (the caller stops it in ``finally``)."""
    reason = _netns.unavailable_reason()
    if reason:
        raise RuntimeError(f"the xnode suite cannot run here: {reason}")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # as on the nodes
    for k in ("RAY_ADDRESS", "GLOO_SOCKET_IFNAME", "UCX_NET_DEVICES"):
        os.environ.pop(k, None)
    cluster = _netns.NetnsCluster(n_nodes, object_store_mib=object_store_mib)
    try:
        cluster.start()
        ray.init(address=cluster.address, _node_ip_address=_netns.HOST_IP, log_to_driver=False,
                 logging_level="ERROR",
                 runtime_env={"env_vars": {"UCX_WARN_UNUSED_ENV_VARS": "n", "NIXL_LOG_LEVEL": "WARN"}})
        cluster.wait_for_nodes(ray)
    except BaseException:
        ray.shutdown()
        cluster.stop()
        raise
    return cluster


def xnode_markdown(rows: List[Dict[str, Any]], targets: List[Dict[str, Any]]) -> str:
    """The object table, the targets and the sharded rows as Markdown (the weight-sync rows use
    _weight_sync_report's table)."""
    lines = ["| transport | median | best | rate | of 2 Gbit/s link | link counters | path |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("suite") != SUITE:
            continue
        if "error" in r:
            lines.append(f"| {r['impl']} | error: {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['impl']} | {r['seconds'] * 1e3:.1f} ms | {r['seconds_best'] * 1e3:.1f} ms | "
                     f"{r['gbps']:.3f} GB/s | {r['link_fraction'] * 100:.1f} % | "
                     f"{'ok' if r['link_counters_ok'] else 'SHORT'} | {r['mechanism']} |")
    lines += ["", "| target | value | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['value']} | {_met(t)} |" for t in targets]
    sharded = [r for r in rows if r.get("suite") == SHARDED]
    return "\n".join(lines + (["", sharded_markdown(sharded)] if sharded else []))


def _met(t: Dict[str, Any]) -> str:
    return "yes" if t["met"] else f"not run: {t.get('status', '')}" if t["met"] is None else "NO"


def sharded_markdown(rows: List[Dict[str, Any]]) -> str:
    """The sharded rows: step time, the trainer node's out-link (and the engine node's in-link) per timed step
    against the distinct slices, rdt's own count of what left the trainer ranks, and the bytes compared."""
    lines = ["| row (trainers n1 -> engines n2) | path, reads | median step | best | distinct slices | "
             "n1 out-link payload / step | / distinct (worst step) | n1 out-link wire bytes / distinct | "
             "n2 in-link / step | rdt: sent by trainers / distinct | bytes compared |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | error: {r['error']} | | | | | | | | | |")
            continue
        mb = 1e6
        lines.append(
            f"| {r['impl']} | {r['mechanism']}, {r['read_mode']} | {r['seconds'] * 1e3:.0f} ms | "
            f"{r['seconds_best'] * 1e3:.0f} ms | {r['distinct_slice_bytes'] / mb:.1f} MB | "
            f"{max(r['n1_out_payload_bytes']) / mb:.1f} MB | {r['link_ratio']:.3f}x | {r['link_wire_ratio']:.3f}x | "
            f"{max(r['n2_into_bytes']) / mb:.1f} MB | {r['trainer_sent_bytes'] / r['distinct_slice_bytes']:.3f}x | "
            f"{r['bytes_checked'] / mb:.1f} MB |")
    return "\n".join(lines)


def write_object_png(path: Any, rows: List[Dict[str, Any]]) -> Optional[Any]:
    """Bars: each transport's 128 MiB n1 -> n2 rate as a fraction of the link, with the 80 % target line."""
    ok = [r for r in rows if r.get("suite") == SUITE and "error" not in r]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not ok:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([f"{r['impl']}\n[{r['mechanism']}]" for r in ok], [r["link_fraction"] * 100 for r in ok])
    ax.axhline(OBJECT_TARGET * 100, color="red", linestyle="--", label=f"target {OBJECT_TARGET:.0%}")
    ax.set_ylabel("% of the 2 Gbit/s shaped link")
    ax.set_title("128 MiB object n1 -> n2 across namespaces (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
