"""Data-integrity soak: random state dicts over every CPU path, with injected timeouts and killed consumers.

Real parts only: producer and consumer actors on the shared local cluster, one real Gloo group, real NIXL agents,
direct reads of the producer's memory, shared-memory segments and mappings, Ray's object store. Producers return
random-shaped state dicts (1-1 000 tensors, mixed dtypes, views, tied storages) with and without
``snapshot=True`` and change or free them where that is allowed (snapshotted ones at any time, from a background
thread; the others after ``rdt.wait_tensor_freed``). Consumers fetch with ``rdt.get`` (into kept targets and
without) and as task arguments, some with tiny timeouts; a consumer is killed mid-wave and replaced (the group
re-formed). Every value received without an error must match the digests the producer took at return; after a
failed fetch into targets no target byte may change (re-checked after twice its timeout), except the documented
case of a timed-out NIXL READ, whose targets a later successful fetch must own for good (checked before every
reuse and at the end). One line sums up transfers, bytes, paths, faults and mismatches, which must be 0.

CI runs a short variant (a few seconds of waves); ``RDT_SOAK=1`` runs the full one (``RDT_SOAK_TRANSFERS``,
default 10 000; ``RDT_SOAK_SEED``).
"""

from __future__ import annotations

import collections
import datetime
import os
import platform
import random
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import pytest
import ray

import rdt

from ._soak_actors import Job, SoakConsumer, SoakProducer
from .conftest import HAS_NIXL

GROUP = "soak"
# Every actor: "big" models (5-14 MiB) are relayed when fetched together; objects over 16 KiB travel out of band.
CONFIG = {"relay_min_bytes": 4 << 20, "inline_threshold": 16 << 10}
TINY = (0.0002, 0.001, 0.005, 0.02, 0.1)  # injected timeouts, seconds
STOP_S = 0.5  # a producer stopped (SIGSTOP) while a forced NIXL fetch from it times out
FORCED = object()  # _job(tiny=FORCED): TINY[1], a timeout a large READ over UCX/TCP always misses
TRANSPORTS = ("shm", "gloo", "object_store", "auto") + (("nixl",) if HAS_NIXL else ())
CPU_PATHS = {"shm-direct", "shm-segment", "shm-map", "gloo", "object_store", "inline"} | ({"nixl"} if HAS_NIXL else set())


@dataclass
class Tally:
    """What the soak did and found."""

    transfers: int = 0
    ok: int = 0
    nbytes: int = 0
    paths: collections.Counter = field(default_factory=collections.Counter)
    errors: collections.Counter = field(default_factory=collections.Counter)
    faults: collections.Counter = field(default_factory=collections.Counter)
    mismatches: List[str] = field(default_factory=list)
    waves: int = 0
    phases: collections.Counter = field(default_factory=collections.Counter)
    samples: Dict[str, str] = field(default_factory=dict)  # an error message per error type
    tiny: collections.Counter = field(default_factory=collections.Counter)  # (transport mode, failed?) of tiny ones
    consumer_counts: collections.Counter = field(default_factory=collections.Counter)  # the consumers' own checks

    def line(self, seed: int, seconds: float, extra: str = "") -> str:
        errors = ", ".join(f"{k} {v}" for k, v in self.errors.most_common())
        return (f"soak: seed={seed} transfers={self.transfers} ok={self.ok} bytes={self.nbytes} "
                f"({self.nbytes / 2**30:.2f} GiB) waves={self.waves} seconds={seconds:.0f} "
                f"paths={dict(sorted(self.paths.items()))} faults={dict(sorted(self.faults.items()))} "
                f"errors={{{errors}}}{extra} phases_s={{{', '.join(f'{k} {v:.1f}' for k, v in self.phases.items())}}} "
                f"mismatches={len(self.mismatches)}")


@dataclass
class Obj:
    """One object of a wave: its ref (inside a list, so Ray does not resolve it), digests taken at return."""

    producer: int
    mid: int
    transport: str
    snap: bool
    refs: List[Any]
    info: Dict[str, Any]


class Soak:
    """The driver: actors, the group, and the waves."""

    def __init__(self, seed: int, n_producers: int, n_consumers: int, normal_timeout: float) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.normal_timeout = normal_timeout
        self.tally = Tally()
        self.progress = False
        self.jid = 0
        self.producers = [SoakProducer.remote(seed, seed * 100 + i, CONFIG) for i in range(n_producers)]
        self.catalogs = ray.get([p.catalog.remote() for p in self.producers], timeout=180)
        assert all(c == self.catalogs[0] for c in self.catalogs), "the producers' models differ in structure"
        self.pids = ray.get([p.pid.remote() for p in self.producers], timeout=180)
        self.consumers = [self._consumer(i) for i in range(n_consumers)]
        where = ray.get([a.where.remote() for a in self.producers + self.consumers], timeout=180)
        assert set(where) == {rdt.__file__}, where  # every actor runs this checkout's rdt
        self.group = rdt.create_collective_group(self.producers + self.consumers, backend="gloo", name=GROUP,
                                                 timeout=120)

    def _consumer(self, index: int) -> Any:
        """Consumer ``index``; consumer 1 runs UCX over TCP only, so its NIXL READs need the producer to progress
        (as across nodes) and one that timed out stays in flight a while."""
        options = {"runtime_env": {"env_vars": {"UCX_TLS": "tcp"}}} if index == 1 else {}
        c = SoakConsumer.options(**options).remote(CONFIG, self.normal_timeout)
        ray.get([c.learn.remote(i, cat) for i, cat in enumerate(self.catalogs)], timeout=180)
        return c

    # ---- planning
    def _make(self, producer: int, mid: int, transport: str, how: str = "") -> Obj:
        """An object of model ``mid`` over ``transport``, by a tensor_method ("tm") or rdt.put ("put")."""
        snap = self.catalogs[producer][mid][1]
        p = self.producers[producer]
        if (how or self.rng.choice(["tm", "put"])) == "tm":
            value, info = getattr(p, f"tm_{transport}_{int(snap)}").remote(mid)
            return Obj(producer, mid, transport, snap, [value], info)
        return Obj(producer, mid, transport, snap, *self._put(p, mid, transport))

    @staticmethod
    def _put(p: Any, mid: int, transport: str) -> Tuple[List[Any], Any]:
        out = p.put.remote(mid, transport)
        return [out], out  # resolved below: ([ref], info)

    def _job(self, obj: Obj, consumer: int, mode: Optional[str] = None, start_at: float = 0.0,
             tiny: Any = None, shm_cma: Optional[bool] = None) -> Job:
        rng = self.rng
        self.jid += 1
        mode = mode or rng.choices(["get", "into", "arg"], [45, 45, 10])[0]
        timeout = self.normal_timeout
        if tiny is None:
            tiny = mode != "arg" and rng.random() < (0.05 if obj.transport == "gloo" else 0.2)
        if tiny:
            timeout = rng.choice(TINY) if tiny is not FORCED else TINY[1]
            self.tally.faults["tiny_timeouts"] += 1
        return Job(self.jid, (obj.producer, obj.mid), mode, timeout,
                   shm_cma=rng.random() > 0.3 if shm_cma is None else shm_cma, shm_map=rng.random() > 0.15,
                   relay=rng.random() > 0.2, start_at=start_at)

    def _wave_objects(self) -> List[Obj]:
        """Every other wave a big gloo object for every consumer at once (relayed); a few random objects per producer."""
        rng = self.rng
        objs = []
        if self.tally.waves % 2 == 0:
            p = rng.randrange(len(self.producers))
            big = [m[0] for m in self.catalogs[p] if m[3]]
            objs.append(self._make(p, rng.choice(big), "gloo"))
        for p in range(len(self.producers)):
            for _ in range(6):
                objs.append(self._make(p, rng.randrange(len(self.catalogs[p])), rng.choice(TRANSPORTS)))
        # Last: fetched into targets with a tiny timeout (the random ones rarely time out a large READ): every wave a
        # large snapshot model over NIXL (its next object differs, so a late READ would show), once the others.
        forced = ["nixl"] if HAS_NIXL else []
        forced += ["object_store", "shm"] if self.tally.waves == 0 else []
        for t in forced:  # by tensor_method: the driver owns the ref, its metadata needs no producer
            p = rng.randrange(len(self.producers))
            big = [m[0] for m in self.catalogs[p] if m[3] and (m[1] or t != "nixl")]
            objs.append(self._make(p, rng.choice(big), t, "tm"))
        return objs

    # ---- running
    def _resolve(self, objs: List[Obj]) -> None:
        """Every producer call was made first; now their results (put: ([ref], info); tensor_method: info)."""
        for o in objs:
            got = ray.get(o.info, timeout=120)
            if isinstance(got, tuple):
                o.refs, o.info = got
            else:
                o.info = got

    def wave(self, kill: bool) -> None:
        rng = self.rng
        ph, t0 = self.tally.phases, time.monotonic()
        objs = self._wave_objects()
        self._resolve(objs)
        relayed = 1 if self.tally.waves % 2 == 0 else 0
        forced = len(objs) - relayed - 6 * len(self.producers)
        plan: List[Tuple[Obj, int, Job]] = []
        for o in objs[:relayed]:  # every consumer at once (start_at set below)
            plan += [(o, ci, self._job(o, ci, rng.choice(["get", "into"]), 1.0)) for ci in range(len(self.consumers))]
        for o in objs[relayed:len(objs) - forced]:
            for ci in rng.sample(range(len(self.consumers)), rng.randint(1, len(self.consumers))):
                plan.append((o, ci, self._job(o, ci)))
        stop: List[int] = []
        for o in objs[len(objs) - forced:]:  # first in their consumer's queue (NIXL: the one on UCX/TCP)
            nixl = o.transport == "nixl"
            ci = 1 if nixl else rng.randrange(len(self.consumers))
            plan.insert(0, (o, ci, self._job(o, ci, "into", tiny=FORCED, shm_cma=nixl)))
            stop += [o.producer] if nixl else []
        # A fetch into targets with a tiny timeout carries the model's next object: the consumer fetches it into
        # the same targets at once if the first fails, and nothing may write over it afterwards. After a forced
        # NIXL timeout that next object comes from the other producer (running: it lands at once; the stopped
        # one's READ lands later, and must not land over it).
        other = {p: (p + 1) % len(self.producers) for p in range(len(self.producers))}
        follow = {i: self._make(other[o.producer], o.mid, "shm", "tm") if i < len(stop) and o.transport == "nixl"
                  else self._make(o.producer, o.mid, rng.choice(TRANSPORTS))
                  for i, (o, _, job) in enumerate(plan) if job.mode == "into" and job.timeout < self.normal_timeout}
        self._resolve(list(follow.values()))
        ph["make"] += time.monotonic() - t0
        t0 = time.monotonic()
        # Not in a wave that kills a consumer: a consumer on UCX/TCP that dies while its READ waits on a stopped
        # producer makes that producer abort when it resumes (test_nixl_tcp_consumer_death.py, strict xfail).
        for p in stop if not kill else ():  # stuck a moment (SIGSTOP): a timed-out NIXL READ stays in flight
            os.kill(self.pids[p], signal.SIGSTOP)
            threading.Timer(STOP_S, os.kill, (self.pids[p], signal.SIGCONT)).start()
            self.tally.faults["producer_stops"] += 1
        start = time.time() + STOP_S + 0.3  # the relayed fetches: every consumer at once, no producer stopped
        calls = []
        for i, (o, ci, job) in enumerate(plan):
            job.start_at = start if job.start_at else 0.0
            calls.append(self._submit([o] + ([follow[i]] if i in follow else []), ci, job))
        for p in self.producers:  # a bounded try while objects are in flight: mostly "in use"
            p.churn_live.remote(rng.randrange(1 << 30), 0.02)
        victim = None
        if kill:  # the consumer with the most fetches, while it fetches
            victim = collections.Counter(ci for _, _, ci, _ in calls).most_common(1)[0][0]
            time.sleep(rng.uniform(0.1, 0.5))
            ray.kill(self.consumers[victim], no_restart=True)
            self.tally.faults["consumer_kills"] += 1
        gloo_failed = self._collect(calls, victim)
        ph["fetch"] += time.monotonic() - t0
        t0 = time.monotonic()
        del objs, calls, follow, plan
        for p in self.producers:  # refs dropped: live models may change now
            p.churn_live.remote(rng.randrange(1 << 30), 0.2)
        if victim is not None:
            self.consumers[victim] = self._consumer(victim)
        if victim is not None or (gloo_failed and self._group_errored()):
            self._regroup()
        ph["recover"] += time.monotonic() - t0
        self.tally.waves += 1
        if self.progress and self.tally.waves % 50 == 0:
            print(f"  wave {self.tally.waves}: {self.tally.transfers} transfers, {len(self.tally.mismatches)} "
                  f"mismatches", flush=True)

    def _submit(self, objs: List[Obj], ci: int, job: Job) -> Tuple[List[Obj], Job, int, Any]:
        c = self.consumers[ci]
        if job.mode == "arg":
            call = c.fetch_arg.remote(objs[0].refs[0], job)
        else:
            call = c.fetch.remote([o.refs[0] for o in objs], job)
        return objs, job, ci, call

    def _collect(self, calls: List[Tuple[List[Obj], Job, int, Any]], victim: Optional[int]) -> bool:
        """Check every result; whether a gloo fetch failed (its group may be ERRORED)."""
        t = self.tally
        deadline = time.monotonic() + 60 + 4 * self.normal_timeout * len(calls) / max(len(self.consumers), 1)
        gloo_failed = False
        for objs, job, ci, call in calls:
            try:
                results, violations, counts = ray.get(call, timeout=max(1.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                t.transfers += 1
                t.mismatches.append(f"job {job.jid} ({objs[0].transport}, {job.mode}) did not return: a hang")
                continue
            except ray.exceptions.RayActorError:
                assert ci == victim, f"consumer {ci} died without being killed"
                t.transfers += 1
                t.errors["killed"] += 1
                continue
            except ray.exceptions.RayTaskError as e:  # an argument's fetch failed
                cause = getattr(e, "cause", None) or e
                results, violations, counts = [("err", type(cause).__name__, str(cause)[:400], "?")], [], {}
            t.mismatches.extend(f"consumer {ci}: {v}" for v in violations)
            t.consumer_counts.update(counts)
            for i, (o, res) in enumerate(zip(objs, results)):
                gloo_failed |= self._check(o, job, res, retry=i > 0)
        return gloo_failed

    def _check(self, o: Obj, job: Job, res: Tuple[Any, ...], retry: bool) -> bool:
        """Count one fetch's result; compare what arrived with the producer's digests; whether it failed on gloo."""
        t = self.tally
        t.transfers += 1
        tiny = job.timeout < self.normal_timeout and not retry
        what = f"job {job.jid}{' (retry)' if retry else ''}: {o.transport} {job.mode}"
        if tiny:
            t.tiny[f"{o.transport}/{job.mode}", res[0]] += 1
        if res[0] == "ok":
            _, path, digests, nbytes = res
            t.ok += 1
            t.nbytes += nbytes
            t.paths[path] += 1
            if digests != o.info["digests"]:
                bad = [k for (k, a), (_, b) in zip(digests, o.info["digests"]) if a != b]
                t.mismatches.append(
                    f"{what} snap={o.snap} producer {o.producer} model {o.mid} path {path}: {len(bad)} of "
                    f"{len(digests)} leaves differ from the producer's digests at return, e.g. {bad[:3]}")
            return False
        _, kind, msg, path = res
        t.errors[kind] += 1
        t.samples.setdefault(kind, f"{what} timeout {job.timeout if not retry else self.normal_timeout}: {msg}")
        if tiny:
            t.faults["tiny_timeouts_failed"] += 1
        return o.transport == "gloo"

    def _group_errored(self) -> bool:
        states = ray.get([a.group_state.remote(GROUP) for a in self.producers + self.consumers], timeout=120)
        return any(s != "healthy" for s in states)

    def _regroup(self) -> None:
        """Destroy the group and form it again with the current actors (the documented recovery)."""
        rdt.destroy_collective_group(self.group, timeout=60)
        self.group = rdt.create_collective_group(self.producers + self.consumers, backend="gloo", name=GROUP,
                                                 timeout=120)
        self.tally.faults["regroups"] += 1

    def finish(self) -> Dict[str, Any]:
        """Final re-checks in every consumer; counters from every actor; the actors and group torn down."""
        time.sleep(STOP_S)
        for pid in self.pids:  # no producer is left stopped
            os.kill(pid, signal.SIGCONT)
        wait_s = 2 * self.normal_timeout + 1
        finals = ray.get([c.final.remote(wait_s) for c in self.consumers], timeout=wait_s + 120)
        for ci, (violations, _) in enumerate(finals):
            self.tally.mismatches.extend(f"consumer {ci} (final): {v}" for v in violations)
        reports = ray.get([p.report.remote() for p in self.producers], timeout=120)
        ray.get([p.stop.remote() for p in self.producers], timeout=120)
        counts: collections.Counter = collections.Counter()
        for r in reports:
            counts.update(r["counts"])
            counts["relay_joined"] += r["stats"]["relay"]["joined"]
        for _, final in finals:
            counts["relay_fallbacks"] += final["stats"]["relay"]["fallbacks"]
            self.tally.consumer_counts.update(final["counts"])
        counts.update(self.tally.consumer_counts)
        rdt.destroy_collective_group(self.group, timeout=60)
        for a in self.producers + self.consumers:
            ray.kill(a)
        return dict(counts)


def run_soak(seed: int, transfers: int, seconds: float, normal_timeout: float, first_kill: int, kill_every: int,
             n_consumers: int = 3, covered: Any = None, max_waves: int = 0) -> Tuple[Tally, Dict[str, Any], float]:
    """Waves until ``transfers`` fetches or ``seconds`` passed, and beyond that (up to ``max_waves``) until
    ``covered(soak)`` holds, so that a slow machine still serves every path; a consumer killed in wave
    ``first_kill`` and every ``kill_every`` waves after it."""
    t0 = time.monotonic()
    soak = Soak(seed, 2, n_consumers, normal_timeout)
    soak.progress = transfers > 1000
    soak.tally.phases["setup"] += time.monotonic() - t0
    t1 = time.monotonic()
    while (soak.tally.transfers < transfers and time.monotonic() - t1 < seconds) or \
            (covered is not None and not covered(soak) and soak.tally.waves < max_waves):
        w = soak.tally.waves - first_kill
        soak.wave(kill=w >= 0 and w % kill_every == 0)
    t2 = time.monotonic()
    counts = soak.finish()
    soak.tally.phases["finish"] += time.monotonic() - t2
    return soak.tally, counts, time.monotonic() - t0


def _report(tally: Tally, counts: Dict[str, Any], seed: int, seconds: float) -> str:
    extra = (f" into={{failed {counts.get('into_failed', 0)}, re-checked after 2x timeout "
             f"{counts.get('into_failed_rechecked', 0)}, NIXL in flight {counts.get('into_in_flight', 0)}, "
             f"retried at once {counts.get('retries', 0)}, retries re-checked {counts.get('rechecked_after_retry', 0)}, "
             f"target sets checked {counts.get('sets_checked', 0)}}}"
             f" producer={{snapshot/live changes {counts.get('mutations', 0)}, frees {counts.get('frees', 0)}, "
             f"wait_tensor_freed ok {counts.get('wait_freed_ok', 0)} / in use {counts.get('in_use', 0)}}} "
             f"relay={{joined {counts.get('relay_joined', 0)}, fallbacks {counts.get('relay_fallbacks', 0)}}}")
    line = tally.line(seed, seconds, extra)
    print("\n" + line + f" | {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on "
          f"{socket.gethostname()} ({os.cpu_count()} cores, {platform.machine()})")
    print("  tiny timeouts (transport/mode: failed/injected): " + ", ".join(
        f"{k}: {tally.tiny[k, 'err']}/{tally.tiny[k, 'err'] + tally.tiny[k, 'ok']}"
        for k in sorted({k for k, _ in tally.tiny})))
    for kind, msg in sorted(tally.samples.items()):
        print(f"  e.g. {kind}: {msg[:300]}")
    for m in tally.mismatches[:20]:
        print("  MISMATCH", m)
    return line


def _all_paths_served(soak: "Soak") -> bool:
    """Every CPU path served, and at least one consumer chained behind another (the relay)."""
    served = {p for path in soak.tally.paths for p in path.split("+")}
    return CPU_PATHS <= served and sum(rdt.stats(p)["relay"]["joined"] for p in soak.producers) > 0


@pytest.mark.timeout(240)
def test_soak_short(ray_cluster):
    """CI: a few seconds of waves, one killed consumer; every CPU path served at least once; no mismatch."""
    seed = int(os.environ.get("RDT_SOAK_SEED", 29))
    tally, counts, seconds = run_soak(seed, transfers=400, seconds=float(os.environ.get("RDT_SOAK_CI_S", 5)),
                                      normal_timeout=6.0, first_kill=1, kill_every=1000, covered=_all_paths_served,
                                      max_waves=16)
    _report(tally, counts, seed, seconds)
    assert tally.mismatches == [], tally.mismatches[:20]
    assert tally.faults["consumer_kills"] >= 1 and tally.faults["tiny_timeouts"] >= 1
    assert tally.ok > tally.transfers // 2, tally.errors
    served = {p for path in tally.paths for p in path.split("+")}
    assert CPU_PATHS <= served, f"paths never served: {CPU_PATHS - served}"
    assert counts["relay_joined"] >= 1 and counts["wait_freed_ok"] >= 1 and counts["frees"] >= 1, counts


@pytest.mark.soak
@pytest.mark.timeout(3600)
@pytest.mark.skipif(os.environ.get("RDT_SOAK") != "1", reason="soak test: opt in with RDT_SOAK=1 (takes minutes)")
def test_soak_data_integrity(ray_cluster):
    """The full soak: RDT_SOAK_TRANSFERS (default 10 000) fetches; a consumer killed every 25 waves."""
    seed = int(os.environ.get("RDT_SOAK_SEED", 2929))
    transfers = int(os.environ.get("RDT_SOAK_TRANSFERS", 10_000))
    tally, counts, seconds = run_soak(seed, transfers=transfers, seconds=3000, normal_timeout=20.0,
                                      first_kill=3, kill_every=25)
    _report(tally, counts, seed, seconds)
    assert tally.mismatches == [], tally.mismatches[:20]
    assert tally.transfers >= transfers
