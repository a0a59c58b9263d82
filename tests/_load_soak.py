"""A chaos soak of sharded loads (Reliability IV): loads over shm, nixl, gloo and auto while faults are injected,
every successful load compared byte for byte, every failed one watched for late writes.

Faults: an interrupt (KeyboardInterrupt, as Ctrl-C) and another exception raised in the loading thread while a
read is in flight; an async load whose caller is cancelled; a trainer rank stopped (SIGSTOP) or killed; a trainer
that fences and updates its live weights during a load; a target swapped for another dtype at the same byte count
(``param.data = ...``); ``want()`` between a load and a ``share()``. A fault counts only when it took effect (the
load failed as the fault makes it fail, or the cancel caught the load running). After every failed load the targets
are checksummed, again one second later, and the next load (of a newer version) must land every byte.

Run in CI by ``tests/test_load_soak.py`` (>= 100 loads); at full scale: ``python -m tests._load_soak --loads 2000``
(prints the counts as JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Tuple

import ray
import torch

import rdt

from ._sharded_actors import SHAPES, Trainer, delayed_reads, expected, full, wants
from ._stop import freeze

TP = 2
FAULTS = ("interrupt", "raise", "async", "stop", "kill", "fence", "swap", "want_share")
TRANSPORTS = ("shm", "nixl", "gloo", "auto")
TIMEOUT = 10.0  # a load's own timeout (a stopped trainer's: STOP_TIMEOUT)
STOP_TIMEOUT = 1.0
DELAY = 0.4  # a delayed read starts this late; the fault lands INJECT_AT into the load
INJECT_AT = 0.15


@dataclass
class Step:
    """What one soak step saw."""

    kind: str
    transport: str
    outcome: str  # "ok" or the error's type name
    effect: bool  # the fault took effect
    loads: int
    torn: bool = False  # a load that reported success held other bytes than its version's
    late: bool = False  # a failed load's targets changed after it raised
    silent: bool = False  # a load that succeeded on a changed target
    overtime: bool = False  # a load that outlived its timeout by more than 5 s
    seconds: float = 0.0


@ray.remote(num_cpus=0)
class Engine:
    """Engine rank 0 of ``TP``: its targets, its loader, and the faults a consumer can suffer."""

    def __init__(self) -> None:
        self.loader = rdt.WeightLoader()
        self.targets: Dict[str, torch.Tensor] = {}
        self.extra: Dict[str, str] = {}  # target name -> the parameter it receives whole
        for target, regions, dim, dtype in wants(0, TP):
            t = self.targets[target] = torch.full(expected(0, TP, 0)[target].shape, -1.0,
                                                  dtype=getattr(torch, dtype))
            regs = [rdt.Region(p) if d < 0 else rdt.Region(p, d, s, n) for p, d, s, n in regions]
            self.loader.want(t, regs, dim=dim, cast=dtype != "float32", name=target)
        self._failed: Optional[Tuple[float, str]] = None  # (when, the targets' digest) of the last failed load
        self._abandoned = False  # the last async load was cancelled while it ran

    def pid(self) -> int:
        return os.getpid()

    def _exact(self, version: int) -> bool:
        want = expected(0, TP, version)
        want.update({name: full(param, version) for name, param in self.extra.items()})
        return all(torch.equal(self.targets[k], v) for k, v in want.items())

    def _digest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for name in sorted(self.targets):
            h.update(self.targets[name].reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def _timed(self, fn: Any, timeout: float) -> Dict[str, Any]:
        """Run a load; its outcome, and whether it outlived its timeout by more than 5 s."""
        t0 = time.monotonic()
        try:
            fn()
            outcome = "ok"
        except BaseException as e:  # noqa: BLE001 - every outcome is recorded
            outcome = type(e).__name__
        took = time.monotonic() - t0
        return {"outcome": outcome, "overtime": took > timeout + 5.0, "seconds": took}

    def step(self, kind: str, transport: str, fault: Any, trainer: Any = None) -> Dict[str, Any]:
        """Load ``fault`` (a Manifest) with fault ``kind`` injected (``trainer``: the rank a fence fault fences);
        a load that failed is checksummed now, and again by :meth:`settle_then_load`."""
        rec = Step(kind, transport, "ok", False, 1)
        obj = fault.shards[1].meta.obj_id if fault.shards[1].meta is not None else b""
        timeout = STOP_TIMEOUT if kind == "stop" else TIMEOUT
        if kind in ("interrupt", "raise"):
            with delayed_reads(transport, obj, DELAY):
                got = self._interrupted(fault, KeyboardInterrupt if kind == "interrupt" else RuntimeError)
            rec.effect = got["outcome"] == ("KeyboardInterrupt" if kind == "interrupt" else "RuntimeError")
        elif kind == "async":
            loop = asyncio.new_event_loop()  # not asyncio.run: it would wait for the executor's load at its end
            with delayed_reads(transport, obj, DELAY):
                got = self._timed(lambda: loop.run_until_complete(_abandon(self, fault)), timeout)
            loop.close()
            rec.effect = got["outcome"] == "CancelledError"
        elif kind == "fence":
            fenced = threading.Timer(INJECT_AT, lambda: ray.get(trainer.fence_step.remote(0.05), timeout=30))
            with delayed_reads(transport, obj, DELAY):
                fenced.start()
                got = self._timed(lambda: self.loader.load(fault, timeout=timeout), timeout)
                fenced.join(30.0)
            rec.effect = got["outcome"] == "VersionGoneError"
        elif kind == "swap":
            t = self.targets["o"]
            t.data = t.data.view(torch.int32)  # the same bytes seen as another dtype
            got = self._timed(lambda: self.loader.load(fault, timeout=timeout), timeout)
            t.data = t.data.view(torch.float32)
            rec.effect = got["outcome"] == "InvalidArgumentError"
            rec.silent = got["outcome"] == "ok"
        elif kind == "want_share":
            got = self._timed(lambda: self.loader.load(fault, timeout=timeout), timeout)
            name = f"extra{len(self.extra)}"
            self.targets[name] = torch.full(SHAPES["norm"], -1.0)
            self.loader.want(self.targets[name], rdt.Region("norm"), name=name)
            self.extra[name] = "norm"
            try:
                self.loader.share()
                rec.silent = True  # offered a target no load filled
            except rdt.InvalidArgumentError:
                rec.effect = got["outcome"] == "ok"
        else:  # stop, kill: the driver did it to the trainer; clean: nothing
            got = self._timed(lambda: self.loader.load(fault, timeout=timeout), timeout)
            rec.effect = kind != "clean" and got["outcome"] != "ok"
        rec.outcome, rec.overtime, rec.seconds = got["outcome"], got["overtime"], got["seconds"]
        if got["outcome"] == "ok" and kind != "want_share":
            rec.torn = not self._exact(fault.version)
        self._failed = (time.monotonic(), self._digest()) if got["outcome"] not in ("ok", "CancelledError") else None
        return asdict(rec)

    def settle_then_load(self, after: Any) -> Dict[str, Any]:
        """After a failed load: its targets one second after it raised, unchanged? Then load ``after`` (a newer
        version) and compare every byte, right away and one second later (a cancelled async load goes on by
        design: the load after it must wait for it)."""
        out = {"late": False, "torn": False, "overtime": False, "outcome": "ok"}
        if self._failed is not None:
            at, digest = self._failed
            time.sleep(max(at + 1.0 - time.monotonic(), 0.0))
            out["late"] = self._digest() != digest
        got = self._timed(lambda: self.loader.load(after, timeout=TIMEOUT), TIMEOUT)
        out["overtime"], out["outcome"] = got["overtime"], got["outcome"]
        out["torn"] = got["outcome"] != "ok" or not self._exact(after.version)
        if self._abandoned:
            time.sleep(1.0)
            out["late"] = out["late"] or not self._exact(after.version)
        self._failed, self._abandoned = None, False
        return out

    def _interrupted(self, source: Any, error: type) -> Dict[str, Any]:
        """Load ``source`` in this (the main) thread and raise ``error`` in it ``INJECT_AT`` s in (Ray keeps SIGINT
        blocked in actors: SIGUSR1's handler raises it instead, as Python's does KeyboardInterrupt)."""
        def interrupt(_sig: int, _frame: Any) -> None:
            raise error("injected into the loading thread")

        old = signal.signal(signal.SIGUSR1, interrupt)
        main = threading.main_thread().ident
        timer = threading.Timer(INJECT_AT, lambda: signal.pthread_kill(main, signal.SIGUSR1))
        timer.start()
        try:
            return self._timed(lambda: self.loader.load(source, timeout=TIMEOUT), TIMEOUT)
        finally:
            timer.cancel()
            signal.signal(signal.SIGUSR1, old)


async def _abandon(engine: Any, source: Any) -> None:
    """An async load whose awaiting task is cancelled while it runs (a module function: an async method would make
    the engine an async actor, whose methods leave the main thread)."""
    task = asyncio.ensure_future(engine.loader.load_async(source, timeout=TIMEOUT))
    await asyncio.sleep(INJECT_AT)
    engine._abandoned = not task.done()
    task.cancel()
    await task


class Soak:
    """The driver's side: two trainer ranks (a warm spare replaces a killed one), one engine, a gloo group."""

    def __init__(self, seed: int = 0) -> None:
        self.trainers = [Trainer.remote(r, 2) for r in range(2)]
        self.spare = Trainer.remote(1, 2)
        self.engine = Engine.remote()
        ray.get([a.pid.remote() for a in self.trainers + [self.spare, self.engine]], timeout=180)
        self.version = 0
        self.group: Optional[str] = None
        self.members: List[Any] = []
        self.steps: List[Dict[str, Any]] = []
        self.pids: Dict[str, int] = {}  # trainer actor id -> its pid
        self.seed = seed

    def _group(self) -> None:
        """A gloo group of the trainers and the engine, made again after a trainer was replaced."""
        members = self.trainers + [self.engine]
        if self.group is not None and members == self.members:
            return
        if self.group is not None:
            try:
                rdt.destroy_collective_group(self.group)
            except rdt.RdtError:
                pass
        self.group = rdt.create_collective_group(members, backend="gloo", timeout=120.0)
        self.members = members

    def _replace_rank1(self) -> None:
        """Kill trainer rank 1 (SIGKILL) and put the warm spare, at the current version, in its place."""
        pid = ray.get(self.trainers[1].pid.remote(), timeout=30)
        os.kill(pid, signal.SIGKILL)
        ray.get(self.spare.set_version.remote(self.version), timeout=60)
        self.trainers[1], self.spare = self.spare, Trainer.remote(1, 2)

    def step(self, kind: str, transport: str) -> Dict[str, Any]:
        """One fault (or a clean load) of the current version, then a clean load of the next one."""
        if transport == "gloo":
            self._group()
        self.version += 1
        fault = rdt.Manifest(ray.get([t.step_publish.remote(transport, 0 if kind == "fence" else 2)  # a fence
                                      for t in self.trainers], timeout=60))  # fences live weights
        trainer1 = self.trainers[1]
        if kind == "kill":
            self._replace_rank1()
        key = trainer1._actor_id.hex()
        pid = self.pids.get(key) if kind == "stop" else None
        if kind == "stop" and pid is None:
            pid = self.pids[key] = ray.get(trainer1.pid.remote(), timeout=30)
        if pid is not None:
            freeze(pid)
        try:
            rec = ray.get(self.engine.step.remote(kind, transport, fault, trainer1), timeout=120)
        finally:
            if pid is not None:
                os.kill(pid, signal.SIGCONT)
        if kind == "fence":  # rank 1 stepped in place: rank 0 follows
            ray.get(self.trainers[0].step.remote(), timeout=60)
            self.version += 1
        self.version += 1
        how = ("shm" if kind == "kill" and transport == "gloo" else transport, 2)
        after = rdt.Manifest(ray.get([t.step_publish.remote(*how) for t in self.trainers], timeout=60))
        then = ray.get(self.engine.settle_then_load.remote(after), timeout=120)
        rec["loads"] += 1
        rec["late"] |= then["late"]
        rec["torn"] |= then["torn"]
        rec["overtime"] |= then["overtime"]
        if then["outcome"] != "ok":
            rec["outcome"] += f" / next load: {then['outcome']}"
        self.steps.append(rec)
        return rec

    def run(self, loads: int) -> Dict[str, Any]:
        """Steps (every fault in turn, a clean load between, each on every transport in turn) until ``loads``
        loads ran and every fault took effect at least five times; the counts."""
        kinds = FAULTS + ("clean",)
        i = 0
        while True:
            effects = Counter(s["kind"] for s in self.steps if s["effect"])
            if sum(s["loads"] for s in self.steps) >= loads and all(effects[k] >= 5 for k in FAULTS):
                break
            if i > 4 * max(loads, 100):
                raise AssertionError(f"the soak did not reach its counts in {i} steps: {dict(effects)}")
            self.step(kinds[i % len(kinds)], TRANSPORTS[i % len(TRANSPORTS)])
            i += 1
        return self.summary()

    def summary(self) -> Dict[str, Any]:
        s = self.steps
        return {"loads": sum(x["loads"] for x in s), "steps": len(s),
                "effects": dict(Counter(x["kind"] for x in s if x["effect"])),
                "by_transport": dict(Counter(x["transport"] for x in s)),
                "torn": sum(x["torn"] for x in s), "late": sum(x["late"] for x in s),
                "silent": sum(x["silent"] for x in s), "overtime": sum(x["overtime"] for x in s),
                "bad": [x for x in s if x["torn"] or x["late"] or x["silent"] or x["overtime"]][:5]}

    def close(self) -> None:
        if self.group is not None:
            try:
                rdt.destroy_collective_group(self.group)
            except rdt.RdtError:
                pass
        for a in self.trainers + [self.spare, self.engine]:
            ray.kill(a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", type=int, default=2000)
    args = parser.parse_args()
    from .conftest import start_local_ray

    start_local_ray()
    soak = Soak()
    t0 = time.monotonic()
    try:
        out = soak.run(args.loads)
    finally:
        soak.close()
    out["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
