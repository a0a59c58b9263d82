"""Local Ray cluster start-up, the benchmark worker actors, and a small rendezvous (mailbox) actor."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import ray

from ._progress import emit

# Environment the benchmark sets before Ray starts (a local cluster inherits it; a joined one gets it through the
# job's runtime_env).
BENCH_ENV: Dict[str, str] = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "GLOO_SOCKET_IFNAME": "lo",
    "UCX_NET_DEVICES": "lo",
    "NIXL_LOG_LEVEL": "WARN",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}

# Local mode only: UCX_NET_DEVICES=lo limits UCX to loopback, so the ucx backend must advertise 127.0.0.1
# (it advertises Ray's node IP otherwise, which UCX then cannot reach: "Destination is unreachable").
LOCAL_ONLY_ENV: Dict[str, str] = {"RDT_UCX_HOST": "127.0.0.1"}

READY_TIMEOUT_S = 120.0


def log(msg: str) -> None:
    """One log line on stderr (above the progress bar when there is one)."""
    emit(msg)


def start_ray(address: Optional[str], num_cpus: int, object_store_bytes: int) -> Dict[str, Any]:
    """Start a small local Ray cluster (or join ``address``); returns what was started, for the report."""
    env = dict(BENCH_ENV, **(LOCAL_ONLY_ENV if address is None else {}))
    if address is None:
        os.environ.update(env)
    if address is None:  # the local cluster's processes inherit os.environ: no runtime_env (it costs every
        # worker an extra interpreter start through Ray's setup_worker)
        ray.init(num_cpus=num_cpus, object_store_memory=object_store_bytes, include_dashboard=False,
                 log_to_driver=False, logging_level="ERROR")
    else:
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False, logging_level="ERROR")
    return {"address": address or "local", "num_cpus": num_cpus if address is None else None,
            "object_store_bytes": object_store_bytes if address is None else None,
            "cluster_resources": {k: v for k, v in ray.cluster_resources().items() if "node:" not in k}}


class BenchWorker:
    """A bare actor: case functions run in it through ``__ray_call__`` and keep their state in ``self.state``."""

    def __init__(self) -> None:
        self.state: Dict[str, Any] = {}

    def trim(self) -> int:
        """Between cases: drop the case state, collect, and give glibc's freed heap back (malloc_trim); returns the
        RSS after, in bytes. Freed 32-128 MiB buffers otherwise stay in the heap arenas of the threads that freed
        them, and four workers grew to ~20 GB over the n=4 128 MiB allreduce cases."""
        import ctypes
        import gc

        self.state.clear()
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def ready(self) -> Dict[str, Any]:
        """Liveness probe that also reports what the worker sees (pid, node, benchmark env vars)."""
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "env": {k: os.environ.get(k) for k in (*BENCH_ENV, *LOCAL_ONLY_ENV)}}


class Mailbox:
    """Async rendezvous actor: ``exchange(key, rank, value, n)`` returns all n ranks' values once all posted."""

    def __init__(self) -> None:
        self._slots: Dict[str, Dict[int, Any]] = {}
        self._events: Dict[str, asyncio.Event] = {}
        self._taken: Dict[str, int] = {}

    async def exchange(self, key: str, rank: int, value: Any, n: int, timeout: float) -> List[Any]:
        """Post ``value`` for ``rank`` under ``key``; wait for all ``n`` ranks; return the values in rank order."""
        slot = self._slots.setdefault(key, {})
        event = self._events.setdefault(key, asyncio.Event())
        slot[rank] = value
        if len(slot) == n:
            event.set()
        await asyncio.wait_for(event.wait(), timeout)
        out = [slot[r] for r in range(n)]
        self._taken[key] = self._taken.get(key, 0) + 1
        if self._taken[key] == n:  # everybody has its copy: forget the key (and the refs in it)
            del self._slots[key], self._events[key], self._taken[key]
        return out


@dataclass
class ActorPool:
    """The worker actors for one world size at a time (created once, reused across cases) plus one mailbox."""

    max_cpus_per_actor: float = 1.0
    world_size: int = 0
    actors: List[Any] = field(default_factory=list)
    info: List[Dict[str, Any]] = field(default_factory=list)
    mailbox: Optional[Any] = None

    def get(self, world_size: int) -> List[Any]:
        """Actors for ``world_size`` (kills the set of another world size first, to keep the CPUs free)."""
        if self.world_size == world_size and self.actors:
            return self.actors
        self.reset()
        cls = ray.remote(num_cpus=self.max_cpus_per_actor, max_restarts=0)(BenchWorker)
        self.actors = [cls.options(name=None).remote() for _ in range(world_size)]
        self.info = ray.get([a.ready.remote() for a in self.actors], timeout=READY_TIMEOUT_S)
        self.world_size = world_size
        return self.actors

    def get_mailbox(self) -> Any:
        """The (lazily created) rendezvous actor."""
        if self.mailbox is None:
            self.mailbox = ray.remote(num_cpus=0, max_concurrency=1000)(Mailbox).remote()
        return self.mailbox

    def reset(self) -> None:
        """Kill the current actors (after a hang or when the world size changes)."""
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
        self.actors, self.info, self.world_size = [], [], 0

    def shutdown(self) -> None:
        """Kill every actor the pool made."""
        self.reset()
        if self.mailbox is not None:
            try:
                ray.kill(self.mailbox)
            except Exception:  # noqa: BLE001
                pass
            self.mailbox = None


def env_mismatch(info: List[Dict[str, Any]]) -> List[str]:
    """Benchmark env vars that some worker does not see with the expected value."""
    bad = []
    for i, w in enumerate(info):
        for k, v in BENCH_ENV.items():
            if w.get("env", {}).get(k) != v:
                bad.append(f"actor {i}: {k}={w.get('env', {}).get(k)!r}")
    return bad
