"""Shared fixtures: one real local Ray cluster per test module, bound to loopback."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

# Loopback only, set before Ray (and thus its workers) start.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Workers start when an actor needs one: a prestarted pool (one per CPU of the cluster, 16 here) is thrown away
# whenever a module restarts the cluster, and on two cores its start-up delays the actors a test is waiting for.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config: pytest.Config) -> None:
    """Compile the project's modules once, in the controller, before any worker or actor starts: with
    PYTHONDONTWRITEBYTECODE set (as on CI) every actor process would compile them again from source."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller did it
        return
    import compileall

    for package in ("rdt", "rdt_transports", "tests", "benchmarks", "doc_code"):
        compileall.compile_dir(os.path.join(ROOT, package), quiet=2, workers=1)


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


HAS_NIXL = _has_module("nixl_cu13") or _has_module("nixl") or _has_module("nixl_cu12")
HAS_UCXX = _has_module("ucxx")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_ray() -> None:
    """Start the shared local cluster (small explicit resources, loopback) if it is not running."""
    import ray

    if ray.is_initialized():
        return
    # The cluster's processes inherit the loopback variables set above: no job runtime_env, which would start
    # every worker through Ray's setup_worker (an extra interpreter: about a quarter more per actor here).
    # address="local": always a cluster of our own, never one that `ray start` (a netns case, a benchmark, the
    # user) left running on this machine.
    ray.init(address="local", num_cpus=16, include_dashboard=False, object_store_memory=1 << 30,
             log_to_driver=False, _metrics_export_port=_free_port())


@contextlib.contextmanager
def local_ray_with_env(**env: str) -> Iterator[None]:
    """The shared cluster, restarted with ``env`` set for its processes; afterwards stopped, with the environment as
    it was (the next module's ``ray_cluster`` starts a plain one)."""
    import ray

    before = {name: os.environ.get(name) for name in env}
    ray.shutdown()
    os.environ.update(env)
    try:
        start_local_ray()
        yield
    finally:
        ray.shutdown()
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="session")
def ray_session():
    """One real local Ray cluster shared by the whole session (actor start-up dominates test time)."""
    import ray

    start_local_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(ray_session):
    """The shared cluster, (re)started if a previous module shut it down (e.g. the multi-node tests)."""
    start_local_ray()
    return ray_session


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.1):
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` passes; return the last value."""
    import time

    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value
