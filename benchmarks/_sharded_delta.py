"""The sharded-delta suite (``rdt-bench --suites sharded-delta``; not in the default run): delta pulls against the
full sharded load of the same step, on the sharded-sync suite's layout (4 trainer ranks holding ``Shard(0)`` of
Qwen2.5-0.5B's shapes in bf16, 2 engines x tensor-parallel 2 wanting vLLM's slices), per transport (shm, nixl, gloo
ranges: 8 fresh actors each).

Every step the trainer ranks fence their live publication, change their weights and publish with
``put_shards(delta=True)`` (timed in each trainer: the trainer's delta computation); then, timed from the driver,
all 4 engine ranks load the version in full (loader F: the publications stripped of their changes), then as deltas
(loader D, the targets it landed the step before); then every byte of D's targets is compared with F's (the
trainers' bf16 bytes as the full sharded load lands them). Rows: 1 %, 5 % and 20 % of the bf16 elements changed per
step (uniformly at random, the lowest bit flipped), and an optimizer row (fp32 master weights, std 0.02, AdamW at lr
1e-6 on synthetic gradients, published in bf16: the fraction changed is measured). Each row: one warm-up step, then
timed steps.

On the shm actors afterwards: the checksum's speed (CRC-32C vs zlib's CRC-32, per CPU-second of one core), verify's
cost (engine rank 0 alone: a replayed full load with and without verify=True, 1 % delta loads with and without),
and a soak of SOAK_STEPS steps at 1 % with verify=True where engine 0 loads every version, engine 1 skips versions
(sometimes more than the trainers keep), engine 2 restarts its loader now and then, and engine 3's targets are
changed behind its back now and then: every byte compared with loader F's, every provoked mismatch counted as
caught and repaired only where the load reported the repair.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from typing import Any, Dict, List, Optional, Tuple

import ray

import rdt

from ._cluster import log
from ._sharded_delta_actor import delta_actor_class
from ._sharded_sync_model import engine_wants, trainer_rows
from ._weight_sync import ModelShape, _error, close_actors, model_shape

SUITE = "sharded-delta"
TRAINERS, ENGINES, TP = 4, 2, 2
TRANSPORTS = ("shm", "nixl", "gloo")
ROWS: Tuple[Tuple[str, str, float], ...] = (("1%", "density", 0.01), ("5%", "density", 0.05),
                                            ("20%", "density", 0.20), ("adamw", "adamw", 0.0))
STEPS = 2  # timed steps per row (after one warm-up)
SOAK_STEPS = 100
SOAK_KEEP = 4  # delta_versions in the soak (engine 1 sometimes skips more)
DEFAULT_SCALE = 0.25


class World:
    """8 fresh actors over one transport: trainer ranks 0-3, engine ranks 0-3 (engine e, TP rank r is 2e + r)."""

    def __init__(self, shape: ModelShape, transport: str, group_timeout: float) -> None:
        self.shape, self.transport = shape, transport
        self.rows = [trainer_rows(shape, TRAINERS, r) for r in range(TRAINERS)]
        self.wants = [engine_wants(shape, TP, i % TP) for i in range(ENGINES * TP)]
        cls = delta_actor_class()
        self.trainers = [cls.remote() for _ in range(TRAINERS)]
        self.engines = [cls.remote() for _ in range(ENGINES * TP)]
        self.everyone = self.trainers + self.engines
        self.timeout = 120.0 + shape.nbytes * 8 / 50e6
        self.group: Any = None
        self.version = 0
        try:
            shapes = dict(shape.shapes())
            infos = ray.get([t.setup_trainer.remote(r, self.rows[r], False) for r, t in enumerate(self.trainers)]
                            + [e.setup_engine.remote(w, shapes, False, True) for e, w in zip(self.engines, self.wants)],
                            timeout=120 + self.timeout)
            ray.get([e.setup_delta_engine.remote(w) for e, w in zip(self.engines, self.wants)], timeout=self.timeout)
            if transport == "gloo":
                self.group = rdt.create_collective_group(self.everyone, backend="gloo", timeout=group_timeout)
                # exact runs over gloo ranges (their cost per range is below a covering read's here)
                ray.get([e.configure.remote(range_costs={"gloo": (0.6e-6, 2.4e9)}) for e in self.engines])
        except BaseException:
            self.close()
            raise
        self.shard_bytes = [i["shard_bytes"] for i in infos[:TRAINERS]]
        self.target_bytes = [i["target_bytes"] for i in infos[TRAINERS:]]

    def publish(self, how: str, density: float, seed: int, keep: int = 4) -> Tuple[Any, List[Dict[str, Any]]]:
        """The trainers' update (untimed), then put_shards(delta=True) in each (timed there)."""
        ray.get([t.delta_update.remote(how, density, seed, self.timeout) for t in self.trainers],
                timeout=self.timeout)
        self.version += 1
        got = ray.get([t.delta_publish.remote(self.version, self.transport, keep) for t in self.trainers],
                      timeout=self.timeout)
        return rdt.Manifest([s for s, _ in got]), [info for _, info in got]

    def load(self, method: str, manifest: Any, engines: Optional[List[Any]] = None,
             verify: bool = False) -> Tuple[float, List[Dict[str, Any]]]:
        """Every engine rank (or ``engines``) loads ``manifest`` with loader F ("load_full") or D ("load_delta");
        (seconds until all hold it, their reports)."""
        es = self.engines if engines is None else engines
        t0 = time.perf_counter()
        reps = ray.get([getattr(e, method).remote(manifest, self.timeout, verify) for e in es], timeout=self.timeout)
        return time.perf_counter() - t0, reps

    def compare(self, engines: Optional[List[Any]] = None) -> Tuple[int, int]:
        got = ray.get([e.compare.remote() for e in (self.engines if engines is None else engines)],
                      timeout=self.timeout)
        return sum(g["wrong"] for g in got), sum(g["compared"] for g in got)

    def close(self) -> None:
        close_actors(self.group, self.everyone, f"{SUITE} {self.transport}")
        self.group = None


def _base_row(shape: ModelShape, impl: str, transport: str, mode: str) -> Dict[str, Any]:
    return {"suite": SUITE, "impl": impl, "transport": transport, "mode": mode, "world_size": TRAINERS + ENGINES * TP,
            "trainers": TRAINERS, "engines": ENGINES, "tp": TP, "size": shape.nbytes, "params": shape.params,
            "scale": shape.scale, "family": "rdt", "mechanism": "?"}


def _row(world: World, shape: ModelShape, name: str, how: str, density: float) -> Dict[str, Any]:
    """One density (or the optimizer) on ``world``'s actors: a warm-up step, then STEPS timed steps."""
    row = _base_row(shape, f"delta-{name}-{world.transport}", world.transport, name)
    full_s, delta_s, publish_s, fractions, wrong, compared = [], [], [], [], 0, 0
    ratios: List[float] = []
    modes, paths, kinds = set(), set(), {}
    for i in range(1 + STEPS):
        manifest, infos = world.publish(how, density, seed=world.version * 7 + 1)
        tf, fulls = world.load("load_full", manifest)
        td, deltas = world.load("load_delta", manifest)
        w, c = world.compare()
        wrong += w
        compared += c
        if i == 0:
            continue
        full_s.append(tf)
        delta_s.append(td)
        publish_s.append(max(info["publish_s"] for info in infos))
        fractions.append(sum(info["changed"] for info in infos) / max(sum(info["elements"] for info in infos), 1))
        ratios.append(max(d["read_bytes"] / f["nbytes"] for d, f in zip(deltas, fulls)))
        modes |= {d["mode"] for d in deltas}
        paths |= {p for d in deltas for p in d["paths"].values()}
        for info in infos:
            for k, v in info["kinds"].items():
                kinds[str(k)] = kinds.get(str(k), 0) + v
        stats = infos[0]["stats"]
    row.update(
        seconds=statistics.median(delta_s), full_seconds=statistics.median(full_s),
        step_ratio=statistics.median(delta_s) / statistics.median(full_s),
        delta_times_s=[round(t, 6) for t in delta_s], full_times_s=[round(t, 6) for t in full_s],
        trainer_delta_s=statistics.median(publish_s), trainer_delta_times_s=[round(t, 6) for t in publish_s],
        trainer_delta_ratio=statistics.median(publish_s) / statistics.median(full_s),
        changed_fraction=statistics.median(fractions), bytes_ratio=max(ratios), bytes_ratios=ratios,
        read_mode="/".join(sorted(modes)), mechanism="/".join(sorted(paths)),
        param_kinds={"unchanged": kinds.get("0", 0), "records": kinds.get("1", 0), "whole": kinds.get("2", 0)},
        wrong_bytes=wrong, bytes_compared=compared, trainer_stats=stats)
    log(f"{SUITE} {row['impl']:<18} changed {row['changed_fraction'] * 100:5.2f} %  step {row['seconds'] * 1e3:7.1f} "
        f"ms vs full {row['full_seconds'] * 1e3:7.1f} ms ({row['step_ratio']:.2f}x)  bytes {row['bytes_ratio']:.3f}x  "
        f"trainer {row['trainer_delta_s'] * 1e3:.0f} ms ({row['trainer_delta_ratio']:.2f}x)  wrong {wrong} of "
        f"{compared}  [{row['read_mode']}; {row['mechanism']}]")
    return row


def _verify_rows(world: World, shape: ModelShape) -> List[Dict[str, Any]]:
    """Checksum speed, and verify's cost on engine rank 0 alone (replayed full loads; 1 % delta loads)."""
    e0 = world.engines[:1]
    speed = ray.get(e0[0].checksum_speed.remote(256 << 20), timeout=world.timeout)
    rows = [dict(_base_row(shape, "checksum-crc32c", world.transport, "checksum"), gbps_core=speed["crc32c"],
                 zlib_gbps_core=speed["zlib_crc32"], mechanism="crc32c library (hardware CRC), 256 MiB, thread CPU time")]
    log(f"{SUITE} checksum: CRC-32C {speed['crc32c']:.2f} GB/s a core (zlib CRC-32 {speed['zlib_crc32']:.2f})")
    manifest, _ = world.publish("density", 0.01, seed=991)
    world.load("load_full", manifest)
    world.load("load_delta", manifest)
    plain, checked = [], []
    for i in range(6):
        _, (rep,) = world.load("load_full", manifest, e0, verify=bool(i % 2))
        (checked if i % 2 else plain).append(rep["wall_s"])
    rows.append(dict(_base_row(shape, "verify-full-replay", world.transport, "verify"),
                     seconds=statistics.median(checked), plain_seconds=statistics.median(plain),
                     overhead=statistics.median(checked) / statistics.median(plain) - 1,
                     mechanism="engine rank 0 alone, replayed full load, verify=True vs False"))
    plain, checked = [], []
    for i in range(6):
        manifest, _ = world.publish("density", 0.01, seed=1000 + i)
        _, (rep,) = world.load("load_delta", manifest, e0, verify=bool(i % 2))
        if rep["mode"] != "delta":
            raise RuntimeError(f"verify's delta measure: a load was {rep['mode']}")
        (checked if i % 2 else plain).append(rep["wall_s"])
    rows.append(dict(_base_row(shape, "verify-delta-1%", world.transport, "verify"),
                     seconds=statistics.median(checked), plain_seconds=statistics.median(plain),
                     overhead=statistics.median(checked) / statistics.median(plain) - 1,
                     mechanism="engine rank 0 alone, 1 % delta load, verify=True (whole targets) vs False"))
    for r in rows[1:]:
        log(f"{SUITE} {r['impl']}: {r['seconds'] * 1e3:.1f} ms with verify, {r['plain_seconds'] * 1e3:.1f} ms "
            f"without (+{r['overhead'] * 100:.0f} %)")
    world.load("load_full", manifest)  # the other engine ranks catch up (several versions behind)
    world.load("load_delta", manifest)
    return rows


def _soak(world: World, shape: ModelShape, steps: int) -> Dict[str, Any]:
    """Delta and full loads mixed, verify=True on every delta load (see the module docstring)."""
    rng = random.Random(7)
    row = _base_row(shape, "delta-soak", world.transport, f"soak-{steps}")
    counts = {"loads": 0, "delta": 0, "full": 0, "wrong_bytes": 0, "compared": 0, "tampered": 0, "caught": 0,
              "repaired_ranks": 0, "restarts": 0, "skipped_versions": 0, "overwritten": 0}
    e = world.engines
    next_load = {1: 0}
    pending_tamper: Optional[int] = None
    t0 = time.monotonic()
    for step in range(steps):
        manifest, _ = world.publish("density", 0.01, seed=5000 + step, keep=SOAK_KEEP)
        loading = [e[0], e[2], e[3]]
        if step >= next_load[1]:
            loading.append(e[1])
            gap = rng.choice([1, 1, 2, 3, SOAK_KEEP + 2])
            counts["skipped_versions"] += gap - 1
            next_load[1] = step + gap
        if step % 10 == 5:
            ray.get(e[2].restart_dloader.remote(), timeout=world.timeout)
            counts["restarts"] += 1
        if pending_tamper is None and rng.random() < 0.2:
            ray.get(e[3].tamper.remote(step), timeout=world.timeout)
            pending_tamper = step
            counts["tampered"] += 1
        world.load("load_full", manifest, loading)
        _, reps = world.load("load_delta", manifest, loading, verify=True)
        got = ray.get([a.compare.remote() for a in loading], timeout=world.timeout)
        for actor, rep, cmp in zip(loading, reps, got):
            counts["loads"] += 1
            counts["delta" if rep["delta"] else "full"] += 1
            counts["wrong_bytes"] += cmp["wrong"]
            counts["compared"] += cmp["compared"]
            if rep["repaired"]:
                counts["repaired_ranks"] += len(rep["repaired"])
                if actor is e[3] and pending_tamper is not None:
                    counts["caught"] += 1
                    pending_tamper = None
            elif actor is e[3] and pending_tamper is not None and not rep["delta"]:
                counts["overwritten"] += 1  # a full load rewrote every byte: nothing left to catch
                pending_tamper = None
            elif actor is e[3] and pending_tamper is not None and cmp["wrong"] == 0:
                counts["overwritten"] += 1  # the version's own changes rewrote that element
                pending_tamper = None
    row.update(counts, seconds=time.monotonic() - t0, steps=steps, mechanism=f"{world.transport}, verify=True",
               uncaught=counts["tampered"] - counts["caught"] - counts["overwritten"])
    log(f"{SUITE} soak: {steps} steps, {counts['loads']} loads ({counts['delta']} delta, {counts['full']} full), "
        f"{counts['wrong_bytes']} wrong bytes of {counts['compared']}, {counts['tampered']} targets changed behind "
        f"the loader's back, {counts['caught']} caught and repaired, {counts['restarts']} restarts, "
        f"{counts['skipped_versions']} versions skipped")
    return row


def sharded_delta_suite(ctx: Any) -> List[Dict[str, Any]]:
    """Each transport in its own 8 fresh actors: the density rows and the optimizer row; on shm also the
    checksum, verify's cost and the soak. RDT_BENCH_DELTA_TRANSPORTS=shm,nixl picks transports (default all)."""
    config = ctx.config
    scale = config.weight_sync_scale if getattr(config, "weight_sync_scale_set", False) else DEFAULT_SCALE
    shape = model_shape(scale)
    log(f"{SUITE}: {shape.describe()}; {TRAINERS} trainer ranks -> {ENGINES} engines x TP {TP}; per transport "
        f"{len(ROWS)} rows of 1 warm-up + {STEPS} timed steps, fresh actors per transport")
    rows: List[Dict[str, Any]] = []
    chosen = [t for t in os.environ.get("RDT_BENCH_DELTA_TRANSPORTS", ",".join(TRANSPORTS)).split(",") if t]
    for transport in [t for t in TRANSPORTS if t in chosen]:
        try:
            world = World(shape, transport, config.group_timeout)
        except Exception as e:  # noqa: BLE001 - record and go on
            rows.append(dict(_base_row(shape, f"delta-{transport}", transport, "setup"), error=f"setup: {_error(e)}"))
            log(f"{SUITE} {transport} ERROR {rows[-1]['error']}")
            continue
        try:
            # peak RSS only, kept by the kernel: no sampling thread beside the timed steps
            ray.get([a.memory_start.remote(uss=False) for a in world.everyone], timeout=60)
            for name, how, density in ROWS:
                try:
                    rows.append(_row(world, shape, name, how, density))
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(_base_row(shape, f"delta-{name}-{transport}", transport, name),
                                     error=_error(e)))
                    log(f"{SUITE} {name} {transport} ERROR {rows[-1]['error']}")
                ctx.progress.done((SUITE, f"{transport}-{name}"))
            if transport == "shm":
                try:
                    rows += _verify_rows(world, shape)
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(_base_row(shape, "verify-full-replay", transport, "verify"), error=_error(e)))
                    log(f"{SUITE} verify ERROR {rows[-1]['error']}")
                try:
                    rows.append(_soak(world, shape, SOAK_STEPS))
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(_base_row(shape, "delta-soak", transport, "soak"), error=_error(e)))
                    log(f"{SUITE} soak ERROR {rows[-1]['error']}")
                ctx.progress.done((SUITE, "shm-verify-soak"))
            mem = ray.get([a.memory_stop.remote() for a in world.everyone], timeout=60)
            for r in rows:
                if r.get("transport") == transport and r["mode"] in [n for n, _, _ in ROWS]:
                    r["trainer_rss_peak_bytes"] = [m["rss_peak"] for m in mem[:TRAINERS]]
                    r["engine_rss_peak_bytes"] = [m["rss_peak"] for m in mem[TRAINERS:]]
        except Exception as e:  # noqa: BLE001
            rows.append(dict(_base_row(shape, f"delta-{transport}", transport, "run"), error=_error(e)))
            log(f"{SUITE} {transport} ERROR {rows[-1]['error']}")
        finally:
            world.close()
    return rows


def sharded_delta_plan(config: Any) -> List[Tuple[Any, float]]:
    """Progress keys and rough costs."""
    scale = config.weight_sync_scale if getattr(config, "weight_sync_scale_set", False) else DEFAULT_SCALE
    step = 4.0 * scale / 0.25
    return [((SUITE, f"{t}-{n}"), (1 + STEPS) * step) for t in TRANSPORTS for n, _, _ in ROWS] + \
        [((SUITE, "shm-verify-soak"), SOAK_STEPS * step / 2)]
