"""The sharded-sync suite (issue 30): 4 trainer ranks each hold ``Shard(0)`` of every parameter of Qwen2.5-0.5B's
shapes in bf16; 2 engines x tensor-parallel 2 = 4 engine ranks each want their slices in vLLM's Qwen2 layout
(:mod:`._sharded_sync_model`). A step ends when all 4 engine ranks hold the new weights and includes whatever
gathering a row needs. Every row runs in 8 fresh actors, side by side in one run; in the default run the rows
share one set of 8 actors instead (:class:`Crew`: each row's state is freed before the next row's set-up; Ray's
torch Gloo groups build on the process's torch default group, so the rows' groups keep the same ranks):

- ``hand-written``: one ``ray.util.collective`` Gloo group of all 8 actors; for every parameter, every trainer rank
  in turn broadcasts its rows (4 x 290 broadcasts a step; the other trainer ranks receive them into a scratch
  buffer, as a broadcast goes to the whole group); each engine rank receives the rows into the whole model and
  narrows its targets out of it;
- ``ray-rdt``: Ray's built-in RDT over its torch Gloo group: trainer ranks 1-3 return their shards with
  ``@ray.method(tensor_transport="gloo")`` to rank 0 (the gather), rank 0 returns the whole model the same way,
  and each engine rank receives it as a task argument and narrows;
- ``rdt-whole-<t>``: rdt's whole-object path over transport t: ranks 1-3 ``rdt.put`` their shards, rank 0
  ``rdt.get(into=)`` them straight into its rows of the whole model and ``rdt.put``s it; each engine rank
  ``rdt.get(into=)`` the whole model, then narrows;
- ``rdt-sharded-<t>``: ``rdt.put_shards`` on each trainer rank, the driver's ``rdt.Manifest``, and each engine
  rank's ``rdt.WeightLoader.load`` (its mechanism is the loader's report: ``shm-direct``, ``nixl``, or
  ``whole:<path>`` where the transport is served by the whole-fetch fallback);
- ``rdt-sharded-replicas-<t>``: the same, but only engine 0's ranks load from the trainer ranks; each then
  ``share()``s what it landed and engine 1's same rank loads that offer (``load(replica)``, passed as the
  ObjectRef of the offer so that it starts as soon as the offer exists): each slice leaves the trainers once.

After the timed steps one more step runs with every actor sampling its RSS and private memory (rdt's pools off),
then every byte of every engine target is compared with the values the trainers hold.
"""

from __future__ import annotations

import random
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import ray

import rdt

from ._cluster import log
from ._collectives import EST_ACTOR_S, EST_COPY_BYTES_PER_S, EST_SETUP_S
from ._mechanism import object_mechanism
from ._range_costs import ROWS as CAL_ROWS, SMALL_ROWS as CAL_SMALL_ROWS, calibrate, costs as range_costs
from ._sharded_sync_actor import actor_class
from ._sharded_sync_model import MAX_STEPS, engine_wants, trainer_rows
from ._weight_sync import ModelShape, _error, close_actors, model_shape

SUITE = "sharded-sync"
TRAINERS, ENGINES, TP = 4, 2, 2
TRANSPORTS = ("shm", "nixl", "gloo", "auto")
POOL_BYTES = 1 << 30
SOLO_LOADS = 3  # replayed loads per engine rank, one engine rank at a time (Row.replay_solo)
SOAK_STEPS = 200
SOAK_TRANSPORT = "shm"
SOAK_VERSION0 = 1000  # the soak publishes versions 1000 + step (above the timed steps' versions)
SOAK_HOST = "rdt-sharded-shm"  # the soak runs on this row's actors, after its timed steps
SOAK_ROW = "rdt-sharded-soak"  # its row: with --sharded-sync-rows, it runs only when named (with its host row)
NOT_SELECTED = "not run: not selected (--sharded-sync-rows)"


@dataclass(frozen=True)
class Case:
    """One row: ``kind`` is hand / ray-rdt / whole / sharded; ``transport`` for rdt's rows."""

    impl: str
    kind: str
    transport: str = ""

    @property
    def is_rdt(self) -> bool:
        return self.kind in ("whole", "sharded", "replicas")

    @property
    def loads(self) -> bool:
        """Whether the engines load with an rdt.WeightLoader."""
        return self.kind in ("sharded", "replicas")


CASES: Tuple[Case, ...] = (
    Case("hand-written", "hand"),
    Case("ray-rdt", "ray-rdt"),
    *(Case(f"rdt-whole-{t}", "whole", t) for t in TRANSPORTS),
    *(Case(f"rdt-sharded-{t}", "sharded", t) for t in TRANSPORTS),
    Case("rdt-sharded-replicas-shm", "replicas", "shm"),
)


def iterations(config: Any) -> Tuple[int, int]:
    """(warm-up, timed steps): few, since a full-size step moves the model several times over."""
    warmup = config.warmup if config.warmup is not None else 1
    return warmup, config.iters or 3


class Crew:
    """Eight actors: trainer ranks 0-3 and engine ranks 0-3 (engine e, TP rank r is 2e + r), all ranks in that
    order in every group. Rows that share a crew (the default run's) form the Ray groups they need on it once and
    keep them: Ray's torch Gloo groups (``ray.util.collective``'s and Ray's RDT's) build on one torch default group
    per process and coexist when every group has the same ranks, as here."""

    def __init__(self, nodes: Optional[List[str]] = None) -> None:
        """``nodes``: a custom resource per actor (trainer ranks first, then engine ranks) to pin each to a node (the
        cross-node suite)."""
        cls = actor_class()
        place = [cls.options(resources={r: 1}) for r in nodes] if nodes else [cls] * (TRAINERS + ENGINES * TP)
        if len(place) != TRAINERS + ENGINES * TP:
            raise ValueError(f"nodes: one resource per actor ({TRAINERS + ENGINES * TP}), got {len(place)}")
        self.trainers = [a.remote() for a in place[:TRAINERS]]
        self.engines = [a.remote() for a in place[TRAINERS:]]
        self.everyone = self.trainers + self.engines
        self.col_group = ""  # the hand-written row's ray.util.collective group, once formed
        self.ray_rdt = False  # Ray's RDT torch Gloo group, once formed
        self.rows = 0  # rows set up on these actors
        self.alive = True  # False once killed (a failed row's, or the suite's end)

    def close(self) -> None:
        """Kill the actors (Ray's groups go with their processes)."""
        if self.alive:
            close_actors(None, self.everyone, SUITE)
        self.alive = False


class Row:
    """One case on a crew of eight actors, with the groups the case needs: fresh actors (``crew`` None; closing
    the row kills them), or the shared ``crew`` (closing the row frees what it held in them)."""

    def __init__(self, shape: ModelShape, case: Case, group_timeout: float,
                 range_costs: Optional[Dict[str, Tuple[float, float]]] = None,
                 nodes: Optional[List[str]] = None, crew: Optional[Crew] = None) -> None:
        """``range_costs``: the engine ranks' rdt.configure(range_costs=); ``nodes``: see :class:`Crew`; ``crew``:
        actors shared with other rows, idle (a row before released them)."""
        self.shape, self.case = shape, case
        self.rows = [trainer_rows(shape, TRAINERS, r) for r in range(TRAINERS)]
        self.wants = [engine_wants(shape, TP, i % TP) for i in range(ENGINES * TP)]
        self.shapes = dict(shape.shapes())
        self.shared = crew is not None
        self.crew = crew if crew is not None else Crew(nodes)
        self.trainers, self.engines, self.everyone = self.crew.trainers, self.crew.engines, self.crew.everyone
        self.timeout = 120.0 + shape.nbytes * 8 / 50e6
        self.group: Any = None
        self.col_group = ""
        try:
            gather = case.kind in ("whole", "ray-rdt")
            infos = ray.get([t.setup_trainer.remote(r, self.rows[r], gather and r == 0)
                             for r, t in enumerate(self.trainers)]
                            + [e.setup_engine.remote(w, self.shapes, not case.loads, case.loads)
                               for e, w in zip(self.engines, self.wants)], timeout=120 + self.timeout)
            self._groups(group_timeout)
            if case.loads and range_costs:  # this machine's measured range costs (exact runs vs covering reads)
                ray.get([e.configure.remote(range_costs=range_costs) for e in self.engines], timeout=60)
        except BaseException:
            self.close(failed=True)
            raise
        self.crew.rows += 1
        self.pids = [i["pid"] for i in infos]
        self.shard_bytes = [i["shard_bytes"] for i in infos[:TRAINERS]]
        self.target_bytes = [i["target_bytes"] for i in infos[TRAINERS:]]
        self.order = [(name, [(r, self.rows[r][name][1], self.rows[r][name][2]) for r in range(TRAINERS)
                              if name in self.rows[r]]) for name, _ in shape.shapes()]
        self.gather_rows = [{name: (s, n) for name, (_, s, n) in self.rows[r].items()} for r in range(1, TRAINERS)]
        self.k = 0

    def _groups(self, group_timeout: float) -> None:
        crew = self.crew
        if self.case.kind == "hand":
            if not crew.col_group:
                group = f"sharded-bcast-{uuid.uuid4().hex[:8]}"
                ray.get([a.col_join.remote(len(self.everyone), r, group, int(group_timeout * 1000))
                         for r, a in enumerate(self.everyone)], timeout=group_timeout + 30)
                crew.col_group = group
            self.col_group = crew.col_group
        elif self.case.kind == "ray-rdt":
            if not crew.ray_rdt:
                from ray.experimental.collective import create_collective_group

                create_collective_group(self.everyone, backend="torch_gloo")
                crew.ray_rdt = True
        elif self.case.transport == "gloo":
            self.group = rdt.create_collective_group(self.everyone, backend="gloo", timeout=group_timeout)

    # ------------------------------------------------------------------ one step
    def step(self) -> Tuple[float, List[Dict[str, Any]]]:
        """The trainers' untimed in-place update, then one timed sync; (seconds, each engine's load report for
        the sharded rows)."""
        ray.get([t.update.remote(self.case.is_rdt, self.timeout) for t in self.trainers], timeout=self.timeout)
        self.k += 1
        k, case, to = self.k, self.case, self.timeout
        t0 = time.perf_counter()
        reports: List[Dict[str, Any]] = []
        if case.kind == "hand":
            ray.get([t.bcast_trainer.remote(self.col_group, TRAINERS, self.order) for t in self.trainers]
                    + [e.bcast_engine.remote(self.col_group, self.order, k) for e in self.engines], timeout=to)
        elif case.kind == "ray-rdt":
            parts = [t.ray_rdt_shard.remote() for t in self.trainers[1:]]
            gathered = self.trainers[0].ray_rdt_gather.remote(self.gather_rows, *parts)
            full = self.trainers[0].ray_rdt_full.remote()
            ray.get([gathered] + [e.ray_rdt_load.remote(full, k) for e in self.engines], timeout=to)
            del parts, full
        elif case.kind == "whole":
            refs = [r for box in ray.get([t.put_shard.remote(case.transport) for t in self.trainers[1:]], timeout=to)
                    for r in box]
            (full,) = ray.get(self.trainers[0].gather_put.remote(refs, self.gather_rows, case.transport, to),
                              timeout=to)
            ray.get([e.whole_load.remote([full], k, to) for e in self.engines], timeout=to)
            del refs, full
        elif case.kind == "sharded":
            manifest = rdt.Manifest(ray.get([t.publish_shards.remote(k, case.transport) for t in self.trainers],
                                            timeout=to))
            reports = ray.get([e.sharded_load.remote(manifest, k, to) for e in self.engines], timeout=to)
            del manifest
        else:  # replicas: engine 0's ranks from the trainers, engine e's rank r from engine 0's rank r
            manifest = rdt.Manifest(ray.get([t.publish_shards.remote(k, case.transport) for t in self.trainers],
                                            timeout=to))
            offers = [e.sharded_load_share.remote(manifest, k, to, case.transport) for e in self.engines[:TP]]
            reports = ray.get([e.sharded_load.remote(offers[i % TP], k, to)
                               for i, e in enumerate(self.engines) if i >= TP], timeout=to)
            dt = time.perf_counter() - t0
            reports = ray.get([e.last_report.remote() for e in self.engines[:TP]], timeout=to) + reports
            del manifest, offers
            return dt, reports
        return time.perf_counter() - t0, reports

    def replay_solo(self, loads: int) -> List[Optional[float]]:
        """The plan's replay timed in each engine rank with the other engine ranks idle: one more version, loaded
        by one engine rank at a time, ``loads`` times each (the median of its overhead per engine rank). With all
        four loading at once, 8 actors share the reference machine's 2 cores and the overhead measures the
        scheduler; this measures the load's own work."""
        ray.get([t.update.remote(True, self.timeout) for t in self.trainers], timeout=self.timeout)
        self.k += 1
        k, to = self.k, self.timeout
        manifest = rdt.Manifest(ray.get([t.publish_shards.remote(k, self.case.transport) for t in self.trainers],
                                        timeout=to))
        out: List[Optional[float]] = []
        for e in self.engines:
            reps = [ray.get(e.sharded_load.remote(manifest, k, to), timeout=to) for _ in range(loads)]
            over = [r["overhead_s"] for r in reps if r["overhead_s"] is not None and not r["planned"]]
            out.append(statistics.median(over) if over else None)
        del manifest
        return out

    def memory_step(self) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
        """One more step with every actor sampling its RSS and USS (rdt's pools off: fresh buffers count)."""
        ray.get([a.configure.remote(pool_bytes=0) for a in self.everyone], timeout=60)
        try:
            ray.get([a.memory_start.remote() for a in self.everyone], timeout=60)
            try:
                _, reports = self.step()
            finally:
                mem = ray.get([a.memory_stop.remote() for a in self.everyone], timeout=60)
        finally:
            ray.get([a.configure.remote(pool_bytes=POOL_BYTES) for a in self.everyone], timeout=60)
        t, e = mem[:TRAINERS], mem[TRAINERS:]
        return {"trainer_rss_peak_bytes": [m["rss_peak"] for m in t],
                "trainer_uss_growth_bytes": [m["uss_peak"] - m["uss_before"] for m in t],
                "engine_rss_peak_bytes": [m["rss_peak"] for m in e],
                "engine_uss_growth_bytes": [m["uss_peak"] - m["uss_before"] for m in e]}, reports

    def check_all(self) -> int:
        """Every byte of every engine's targets against the trainers' values; bytes compared."""
        return sum(ray.get([e.check_all.remote(self.k) for e in self.engines], timeout=self.timeout))

    def stats(self) -> List[Dict[str, Any]]:
        """rdt.stats() of trainer rank 0 and every engine rank."""
        return [rdt.stats(a, timeout=30) for a in [self.trainers[0]] + self.engines]

    def close(self, failed: bool = False) -> bool:
        """Destroy rdt's group; fresh actors: kill them; a shared crew: free what this row held in its actors
        (:meth:`ShardedActor.release`), or kill them where the row ``failed`` or the release does (a failed step
        can leave a group mid-operation: the next row then starts fresh actors). Whether the crew is still usable."""
        label = f"{SUITE} {self.case.impl}"
        group, self.group = self.group, None
        close_actors(group, [], label)
        if not self.shared or failed:
            self.crew.close()
            return False
        try:
            ray.get([a.release.remote(POOL_BYTES) for a in self.everyone], timeout=60)
        except Exception as e:  # noqa: BLE001 - the next row starts fresh actors
            log(f"{label}: freeing the shared actors failed ({_error(e)}); the next row starts fresh ones")
            self.crew.close()
            return False
        return True


# ---------------------------------------------------------------------- rows
def _base_row(shape: ModelShape, case: Case) -> Dict[str, Any]:
    return {"suite": SUITE, "impl": case.impl, "kind": case.kind, "transport": case.transport, "mode": "sync",
            "world_size": TRAINERS + ENGINES * TP, "trainers": TRAINERS, "engines": ENGINES, "tp": TP,
            "size": shape.nbytes, "tensors": len(shape.shapes()), "params": shape.params, "scale": shape.scale,
            "family": "rdt" if case.is_rdt else "baseline", "mechanism": "?"}


def _timing(times: List[float]) -> Dict[str, Any]:
    med, best = statistics.median(times), min(times)
    return {"seconds": med, "seconds_best": best, "seconds_min": best, "latency_us": med * 1e6,
            "iters": len(times), "times_s": [round(t, 6) for t in times]}


def _mechanism(case: Case, before: List[Dict[str, Any]], after: List[Dict[str, Any]],
               reports: List[List[Dict[str, Any]]]) -> str:
    """What served the row: the baselines' fixed paths, the whole-object fetch read from rdt.stats() of the
    engines and trainer rank 0, or the loader's reported path per trainer rank."""
    if case.kind == "hand":
        return "gloo (ray.util.collective)"
    if case.kind == "ray-rdt":
        return "ray-rdt (gloo)"
    if case.kind == "whole":
        labels = {object_mechanism(case.transport, b, a, before[0], after[0]) for b, a in zip(before[1:], after[1:])}
    else:
        labels = {("replica:" if rep.get("from") == "replica" else "") + p
                  for step in reports for rep in step for p in rep["paths"].values()}
    return "/".join(sorted(labels)) or "?"


def _sharded_fields(row: Dict[str, Any], timed: List[List[Dict[str, Any]]], sampled: List[Dict[str, Any]]) -> None:
    """Per engine: bytes received per step (rdt's counters, every step), the load's own cost on the replayed steps
    before the memory step (its sampling thread would be counted) outside the transports' reads and the version
    begin/end round trips to the trainer ranks (those reported apart), the plan's first load."""
    reports = timed + [sampled]
    n = len(reports[0])
    replays = [[s[i] for s in timed if not s[i]["planned"]] for i in range(n)]
    row["bytes_received"] = [max(r["received"] for r in (s[i] for s in reports)) for i in range(n)]
    # Covering reads move the bytes between a strided slice's runs too: counted apart (the row names the mode).
    row["bytes_covering_excess"] = [max(r.get("covering_excess", 0) for r in (s[i] for s in reports))
                                    for i in range(n)]
    row["bytes_landed"] = [reports[0][i]["nbytes"] for i in range(n)]
    row["read_mode"] = "/".join(sorted({r["mode"] for s in reports for r in s}))
    row["planned_steps"] = sum(1 for s in reports for r in s if r["planned"])
    over = [[r["overhead_s"] for r in rs if r["overhead_s"] is not None] for rs in replays]
    row["replay_overhead_s"] = [statistics.median(o) if o else None for o in over]
    ctl = [[r["control_s"] for r in rs if r.get("control_s") is not None] for rs in replays]
    row["replay_control_s"] = [statistics.median(c) if c else None for c in ctl]  # begin/end round trips, apart
    row["plan_overhead_s"] = [next((r["overhead_s"] for s in reports for r in [s[i]] if r["planned"]), None)
                              for i in range(n)]
    # What left the trainer ranks per step (the engine ranks that loaded from them; rdt's counters, covering reads'
    # excess apart as in the bytes target) against the distinct slices wanted (one data-parallel replica's
    # targets): 2x without replicas here, 1x with.
    from_trainers = [sum(r["received"] - r.get("covering_excess", 0) for r in s
                         if r.get("from", "trainers") == "trainers") for s in reports]  # covering reads apart
    row["trainer_sent_bytes"] = max(from_trainers)
    row["distinct_slice_bytes"] = sum(row["target_bytes"][:TP])


def run_case(shape: ModelShape, case: Case, warmup: int, iters: int, group_timeout: float,
             then: Optional[Callable[[Row], None]] = None,
             range_costs: Optional[Dict[str, Tuple[float, float]]] = None, nodes: Optional[List[str]] = None,
             link: Optional[Callable[[], Dict[str, int]]] = None, crew: Optional[Crew] = None) -> Dict[str, Any]:
    """Fresh actors (or the shared ``crew``'s: see :class:`Row`), warm-up, timed steps, the memory step and the
    byte check of one case, then ``then`` on the same actors (the soak; its errors are its own); an error row
    when the case fails (a wrong byte lands here too; a shared crew is then killed). ``nodes``: see :class:`Crew`;
    ``link``: byte counters (the cross-node suite's ``tc`` counters) read around each timed step, their growth
    per step in ``row["link_bytes"]``. ``row["actors"]``: "fresh", or "shared" with the number of rows set up on
    the crew before this one in ``row["actors_rows_before"]`` (0: this row's set-up started them)."""
    row = _base_row(shape, case)
    if warmup + iters + 3 >= MAX_STEPS:
        row["error"] = f"at most {MAX_STEPS - 4} steps (warm-up + timed) per row"
        return row
    row["actors"] = "fresh" if crew is None else "shared"
    if crew is not None:
        row["actors_rows_before"] = crew.rows
    t0 = time.monotonic()
    try:
        world = Row(shape, case, group_timeout, range_costs, nodes, crew)
    except Exception as e:  # noqa: BLE001
        row["error"] = f"setup: {_error(e)}"
        log(f"{SUITE} {case.impl:<18} ERROR {row['error']}")
        return row
    failed = True
    try:
        row["setup_s"] = round(time.monotonic() - t0, 2)
        row["actor_pids"] = world.pids
        row["shard_bytes"], row["target_bytes"] = world.shard_bytes, world.target_bytes
        before = world.stats() if case.is_rdt else []
        times, reports = [], []
        grew: List[Dict[str, int]] = []
        phase = time.monotonic()
        for i in range(warmup + iters):
            counted = link() if link is not None and i >= warmup else None
            dt, reps = world.step()
            reports.append(reps)
            if i >= warmup:
                times.append(dt)
            if counted is not None and link is not None:
                grew.append({k: v - counted[k] for k, v in link().items()})
        if grew:
            row["link_bytes"] = grew
        after = world.stats() if case.is_rdt else []
        if case.loads and after:  # rdt's own count of one engine rank's staging on trainer rank 0 (gloo-ranges)
            row["staging_stream_peak_bytes"] = (after[0].get("gloo_ranges") or {}).get("staging_stream_peak")
        row.update(_timing(times))
        if case.kind == "whole":
            got = [sum(int(v.get("in_bytes", 0)) for v in (a.get("transfers") or {}).values())
                   - sum(int(v.get("in_bytes", 0)) for v in (b.get("transfers") or {}).values())
                   for b, a in zip(before[1:], after[1:])]
            row["bytes_received"] = [g // (warmup + iters) for g in got]
        elif not case.loads:
            row["bytes_received"] = [shape.nbytes] * len(world.engines)  # the whole model, by construction
            row["bytes_received_computed"] = True
        row["phases_s"] = {"steps": round(time.monotonic() - phase, 2)}  # warm-up and timed, with the updates
        phase = time.monotonic()
        if case.kind == "sharded":
            row["replay_solo_overhead_s"] = world.replay_solo(SOLO_LOADS)
            row["replay_solo_loads"] = SOLO_LOADS
            row["phases_s"]["replay_solo"] = round(time.monotonic() - phase, 2)
            phase = time.monotonic()
        mem, last = world.memory_step()
        row["phases_s"]["memory_step"] = round(time.monotonic() - phase, 2)
        phase = time.monotonic()
        row.update(mem)
        if case.loads:
            _sharded_fields(row, reports, last)
        row["mechanism"] = _mechanism(case, before, after, reports + [last])
        row["bytes_checked"] = world.check_all()
        row["phases_s"]["byte_check"] = round(time.monotonic() - phase, 2)
        if then is not None:
            try:
                then(world)
            except Exception as e:  # noqa: BLE001 - the soak's failure is its row's, not this case's
                log(f"{SUITE} soak on {case.impl}'s actors ERROR {_error(e)}")
        excess = row.get("bytes_covering_excess") or [0] * len(row["bytes_received"])
        log(f"{SUITE} {case.impl:<18} median {row['seconds'] * 1e3:9.1f} ms  received/targets "
            f"{max((r - x) / t for r, x, t in zip(row['bytes_received'], excess, row['target_bytes'])):.3f}x"
            f"{' + %.2fx covering' % max(x / t for x, t in zip(excess, row['target_bytes'])) if any(excess) else ''}"
            f"  trainer USS +"
            f"{max(row['trainer_uss_growth_bytes']) / 1e6:.1f} MB  peak RSS trainer/engine "
            f"{max(row['trainer_rss_peak_bytes']) / 1e6:.0f}/{max(row['engine_rss_peak_bytes']) / 1e6:.0f} MB  "
            f"[{row['mechanism']}]  set-up {row['setup_s']:.1f} s, {_actors(row)}")
        failed = False
    except Exception as e:  # noqa: BLE001 - record and go on
        row["error"] = _error(e)
        log(f"{SUITE} {case.impl:<18} ERROR {row['error']}")
    finally:
        phase = time.monotonic()
        world.close(failed)
        row.setdefault("phases_s", {})["close"] = round(time.monotonic() - phase, 2)
    return row


def _actors(row: Dict[str, Any]) -> str:
    """How a row got its actors, for the log: 'fresh actors', 'shared actors (started here)', 'shared actors (2
    rows before)'."""
    if row.get("actors") != "shared":
        return "fresh actors"
    before = row.get("actors_rows_before", 0)
    return f"shared actors ({f'{before} row(s) before' if before else 'started here'})"


def soak_steps(scale: float) -> int:
    """The soak's steps: SOAK_STEPS from a tenth of the model up, fewer below (at least 20)."""
    return max(20, min(SOAK_STEPS, round(SOAK_STEPS * scale * 10)))


def calibrated(config: Any) -> List[str]:
    """The transports whose range costs this run measures: those of the selected rows that load, unless the
    calibration is off (``config.sharded_sync_calibrate``)."""
    if not getattr(config, "sharded_sync_calibrate", True):
        return []
    chosen = getattr(config, "sharded_sync_rows", None)
    return [t for t in ("shm", "nixl", "gloo") if any(c.loads and c.transport in (t, "auto") and
                                                     (chosen is None or c.impl in chosen) for c in CASES)]


def run_soak(world: Row, steps: int) -> Dict[str, Any]:
    """Issue 30's soak on ``world``'s actors over ``SOAK_TRANSPORT``: every step the trainer ranks publish their
    version, the engine ranks ``load(manifest, verify=True)`` it while the trainers, after a random "backward
    pass" of up to 1.5x a load (twice the last bound after a step where no load landed), fence that version and
    update their weights in place to the next. A load that returned is compared byte for byte with its step's
    values (a difference is a torn read); VersionGoneError is a legitimate refusal (the fence came first), counted;
    ChecksumMismatchError is a detected wrong read."""
    rng = random.Random(30)
    counts = {"ok": 0, "VersionGoneError": 0, "ChecksumMismatchError": 0, "torn": 0}
    other: Dict[str, int] = {}
    first_bad: List[str] = []
    fence_s: List[float] = []
    load_s: List[float] = [0.01]
    # After a step where no load landed the backward pass's bound doubles: a slow machine's loads would otherwise
    # lose every race to a bound made from loads that never landed.
    floor = 0.0
    t0 = time.monotonic()
    for _ in range(steps):
        k = world.k
        manifest = rdt.Manifest(ray.get([t.soak_publish.remote(SOAK_VERSION0 + k, SOAK_TRANSPORT)
                                         for t in world.trainers],
                                        timeout=world.timeout))
        loads = [e.soak_load.remote(manifest, k, world.timeout) for e in world.engines]
        most = max(1.5 * statistics.median(load_s[-20:]), floor)
        updates = [t.soak_update.remote(rng.uniform(0, most), world.timeout) for t in world.trainers]
        landed = counts["ok"]
        for kind, msg, seconds in ray.get(loads, timeout=world.timeout):
            if kind in counts:
                counts[kind] += 1
            else:
                other[kind] = other.get(kind, 0) + 1
            if kind == "ok":
                load_s.append(seconds)
            elif kind != "VersionGoneError" and not first_bad:
                first_bad.append(f"{kind}: {msg}")
        fence_s += ray.get(updates, timeout=world.timeout)
        floor = 0.0 if counts["ok"] > landed else min(2 * most, 5.0)
        world.k += 1
        del manifest
    return {"steps": steps, "transport": SOAK_TRANSPORT, "seconds": time.monotonic() - t0,
            "loads": steps * len(world.engines), "loads_landed": counts["ok"],
            "loads_version_gone": counts["VersionGoneError"], "checksum_mismatches": counts["ChecksumMismatchError"],
            "torn_reads": counts["torn"], "other_errors": other, "first_bad": first_bad[0] if first_bad else "",
            "bytes_compared": counts["ok"] * world.target_bytes[0] if len(set(world.target_bytes)) == 1
            else None, "load_s_median": statistics.median(load_s[1:]) if len(load_s) > 1 else None,
            "fence_s_max": max(fence_s) if fence_s else None}


def _soak_into(out: Dict[str, Any], world: Row, steps: int) -> None:
    """run_soak's result, or its error, into ``out``."""
    try:
        out["result"] = run_soak(world, steps)
    except Exception as e:  # noqa: BLE001 - reported in the soak's row
        out["error"] = _error(e)


def soak_row(shape: ModelShape, result: Optional[Dict[str, Any]], why: str = "", error: str = "") -> Dict[str, Any]:
    """Issue 30's '200 steps with in-place updates concurrent with pulls, verify on: 0 torn or wrong reads', as
    run by :func:`run_soak` on the rdt-sharded-shm row's actors (``result``); ``why`` when it did not run."""
    row = _base_row(shape, Case(SOAK_ROW, "soak", SOAK_TRANSPORT))
    steps = soak_steps(shape.scale)
    row.update(mode=f"soak-{steps}", steps=steps, family="rdt")
    if error:
        row["error"] = f"soak: {error}"
        return row
    if result is None:
        row["error"] = f"not run: {why or 'it runs on the ' + SOAK_HOST + ' row actors'}"
        return row
    row.update(result)
    row["mechanism"] = f"{SOAK_TRANSPORT}, verify=True"
    row["wrong_reads"] = result["torn_reads"] + result["checksum_mismatches"]
    log(f"{SUITE} soak: {steps} steps over {SOAK_TRANSPORT} in {result['seconds']:.1f} s: {result['loads_landed']} "
        f"loads landed and compared, {result['loads_version_gone']} refused (VersionGoneError), "
        f"{result['torn_reads']} torn, {result['checksum_mismatches']} checksum mismatches, other errors "
        f"{result['other_errors'] or 'none'}")
    return row


def sharded_sync_suite(ctx: Any) -> List[Dict[str, Any]]:
    """Every case in its own fresh actors, or (``config.sharded_sync_shared``, the default run) every case on one
    shared set of 8 actors, each row's state freed before the next row's set-up; then the soak's row."""
    config = ctx.config
    shape = model_shape(config.weight_sync_scale)
    warmup, iters = iterations(config)
    shared = getattr(config, "sharded_sync_shared", False)
    log(f"{SUITE}: {shape.describe()}; {TRAINERS} trainer ranks (Shard(0)) -> {ENGINES} engines x TP {TP}; "
        f"{warmup} warm-up + {iters} timed steps per row, "
        + ("the rows share one set of 8 actors (each row's tensors, loader and pools freed before the next row's "
           "set-up; the Ray groups kept; fresh ones after a failed row)" if shared else "fresh actors per row"))
    rows = []
    chosen = getattr(config, "sharded_sync_rows", None)
    soak: Dict[str, Any] = {}
    wanted = calibrated(config)
    rows_ = CAL_ROWS if shape.scale >= 0.1 else CAL_SMALL_ROWS
    measured = calibrate(wanted, config.group_timeout, rows_) if wanted else {}
    declared = not getattr(config, "sharded_sync_calibrate", True)
    rows.append(dict(_base_row(shape, Case("rdt-range-costs", "calibration")), mode="calibration", family="rdt",
                     mechanism="declared range costs" if declared else
                     "exact runs, 2 fresh actors per transport", calibration=measured, declared=declared))
    crew: Optional[Crew] = None
    try:
        for case in CASES:
            if chosen is not None and case.impl not in chosen:
                rows.append(dict(_base_row(shape, case), error=NOT_SELECTED))
                continue
            host = case.impl == SOAK_HOST and (chosen is None or SOAK_ROW in chosen)
            if shared and (crew is None or not crew.alive):
                crew = Crew()
            rows.append(run_case(shape, case, warmup, iters, config.group_timeout,
                                 (lambda w: _soak_into(soak, w, soak_steps(shape.scale))) if host else None,
                                 range_costs(measured), crew=crew))
            ctx.progress.done((SUITE, case.impl))
    finally:
        if crew is not None:
            crew.close()
    host_row = next((r for r in rows if r["impl"] == SOAK_HOST), None)
    why = f"its host row {SOAK_HOST} was not selected" if host_row is None or "error" in host_row and \
        host_row["error"] == NOT_SELECTED else f"its host row {SOAK_HOST} failed" if "error" in host_row else \
        "not selected (--sharded-sync-rows)" if chosen is not None and SOAK_ROW not in chosen else ""
    rows.append(soak_row(shape, soak.get("result"), why, soak.get("error", "")))
    ctx.progress.done((SUITE, "soak"))
    return rows


# For the time-left estimate: a step of each row in in-process copies of the model, from the 2026-11-27 22:49 run at
# full scale (2-core reference machine); a step's per-tensor cost (8 actors on 2 cores); one transport's
# calibration (2 fresh actors, 18 loads); a soak step in copies of the model (200 steps: 614 s at full scale).
EST_STEP_COPIES: Dict[Tuple[str, str], float] = {
    ("hand", ""): 42.0, ("ray-rdt", ""): 68.0, ("whole", "shm"): 9.0, ("whole", "nixl"): 12.0,
    ("whole", "gloo"): 24.0, ("whole", "auto"): 10.0, ("sharded", "shm"): 4.5, ("sharded", "nixl"): 6.5,
    ("sharded", "gloo"): 11.5, ("sharded", "auto"): 5.5, ("replicas", "shm"): 5.0}
EST_TENSOR_S = 0.002
# A row's byte check, stats and (shared actors) release: 4-6 s a row in a loaded default run of 2026-11-29, at about
# 8x a quiet run's pace. (The memory step costs about one plain step: its sampler reads /proc/self/status every 3 ms
# and smaps_rollup at most a twentieth of a core.)
EST_ROW_S = 2.5
EST_CALIBRATION_S = 2 * EST_ACTOR_S + 2.0
EST_SOAK_STEP_COPIES = 31.0


def sharded_sync_plan(config: Any) -> List[Tuple[Any, float]]:
    """Progress keys and rough costs: each case (8 fresh actors, or the first case only where the rows share them;
    the model's shards and targets written, its timed and memory steps, the replayed loads and the byte check; the
    first also the calibration), and the soak."""
    shape = model_shape(config.weight_sync_scale)
    copy_s = shape.nbytes / EST_COPY_BYTES_PER_S
    tensors = len(shape.shapes())
    warmup, iters = iterations(config)
    # 8 fresh actors at 1.25x EST_ACTOR_S each: 8 processes starting at once on 2 cores took 1.1-1.5x what the
    # other suites' cases did, relative to their estimates, in four loaded default runs (2026-11-29); quiet, at full
    # scale, a row's setup took 13.5-18 s (2026-11-27 22:49). Rows that share the actors start them once.
    start = 1.25 * (TRAINERS + ENGINES * TP) * EST_ACTOR_S
    setup = 3 * copy_s + EST_SETUP_S
    shared = getattr(config, "sharded_sync_shared", False)
    chosen = getattr(config, "sharded_sync_rows", None)
    cases = [c for c in CASES if chosen is None or c.impl in chosen]
    calibration = len(calibrated(config)) * EST_CALIBRATION_S
    out: List[Tuple[Any, float]] = []
    for i, c in enumerate(cases):
        step = EST_STEP_COPIES.get((c.kind, c.transport), 10.0) * copy_s + tensors * EST_TENSOR_S
        solo = SOLO_LOADS * ENGINES * TP * step / 2 if c.kind == "sharded" else 0.0
        out.append(((SUITE, c.impl), (calibration if i == 0 else 0.0) + (start if i == 0 or not shared else 0.0)
                    + setup + (warmup + iters + 1) * step + solo + 2 * copy_s + EST_ROW_S))
    soak = chosen is None or SOAK_ROW in chosen
    return out + [((SUITE, "soak"), soak_steps(config.weight_sync_scale) * (EST_SOAK_STEP_COPIES * copy_s + 0.05)
                   if soak else 0.0)]
