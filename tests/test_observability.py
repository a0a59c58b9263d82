"""Metrics reach Ray's Prometheus endpoint, and failure log lines carry group, rank, peer, op and object."""

from __future__ import annotations

import glob
import os
import re
import time
import urllib.request
from typing import List

import pytest
import ray
import torch

import rdt
import rdt_transports as rt

from ._object_actors import Node
from .conftest import local_ray_with_env, wait_for


@ray.remote(num_cpus=0)
class Member:
    def allreduce(self, name: str) -> float:
        t = torch.ones(1024)
        rt.allreduce(t, name)
        return float(t[0])

    def lonely_recv(self, name: str) -> str:
        try:
            rt.recv(torch.zeros(4), 1, name, timeout=0.5)
        except rt.CollectiveTimeoutError as e:
            return type(e).__name__
        return "no error"


def _scrape() -> str:
    port = ray._private.worker.global_worker.node.metrics_export_port
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def _value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def fast_metrics_cluster():
    """Ray's default metrics interval is 10 s; this module's cluster reports every second (every other module's
    cluster keeps the default: a 1 s interval costs every live actor CPU for the whole run)."""
    with local_ray_with_env(RAY_metrics_report_interval_ms="1000"):
        yield ray


@pytest.fixture(scope="module")
def actors(fast_metrics_cluster):
    p, c = Node.remote(), Node.remote()
    m = [Member.remote() for _ in range(2)]
    group = rdt.create_collective_group([p, c], backend="gloo")
    handle = rt.create_collective_group(m, backend="gloo", group_name="obs-g")
    yield p, c, m
    rdt.destroy_collective_group(group)
    handle.destroy()
    for a in (p, c, *m):
        ray.kill(a)


def test_transfer_and_collective_metrics_reach_prometheus(actors):
    p, c, m = actors
    refs = [p.make_gloo.remote(1 << 16, 1.0) for _ in range(3)] + [p.make_shm.remote(1 << 16, 1.0)]
    assert ray.get([c.total.remote(r) for r in refs]) == [float(1 << 16)] * 4
    assert ray.get([a.allreduce.remote("obs-g") for a in m]) == [2.0, 2.0]

    last = {"text": ""}

    def missing(text: str) -> List[str]:
        """The series this test waits for that the scrape does not show yet."""
        wanted = {
            "gloo transfers in >= 3": _value(text, "ray_rdt_transfers_total", transport="gloo", direction="in") >= 3,
            "gloo transfers out >= 3": _value(text, "ray_rdt_transfers_total", transport="gloo", direction="out") >= 3,
            "gloo allreduce ok >= 2": _value(text, "ray_rdt_collective_ops_total", backend="gloo", op="allreduce",
                                             status="ok") >= 2,
            "objects_held gauge": re.search(r"^ray_rdt_objects_held\{", text, re.M) is not None,  # exported apart
        }
        return [k for k, ok in wanted.items() if not ok]

    def ready() -> str:
        text = last["text"] = _scrape()
        return "" if missing(text) else text

    text = wait_for(ready, timeout=60, interval=1.0)
    rdt_lines = [ln for ln in last["text"].splitlines() if ln.startswith("ray_rdt_")]
    if not text:  # pytrace=False: the message comes first in a CI log that keeps only the top of a failure
        pytest.fail(f"metrics did not reach the Prometheus endpoint within 60 s: missing {missing(last['text'])}; "
                    f"{len(last['text'])} bytes scraped, its ray_rdt_ lines: {rdt_lines[:40]}", pytrace=False)
    assert _value(text, "ray_rdt_transfer_bytes_total", transport="gloo", direction="in") >= 3 * 4 * (1 << 16)
    assert _value(text, "ray_rdt_transfers_total", transport="shm", direction="in") >= 1
    assert "ray_rdt_transfer_latency_seconds_bucket" in text
    assert "ray_rdt_collective_latency_seconds_bucket" in text
    assert re.search(r"^ray_rdt_objects_held\{", text, re.M) and re.search(r"^ray_rdt_bytes_held\{", text, re.M)
    del refs


def test_held_gauges_stay_on_prometheus_while_the_table_is_idle(actors):
    """Ray's metrics agent drops a gauge series two export intervals after its last report (Ray 2.60), so a gauge set
    only when the table changes vanished from Prometheus ~2 s after the last change while the objects were still held;
    rdt re-reports it. Here the producer holds 5 objects untouched for 3 agent TTLs, and every scrape must show them."""
    p, c, _ = actors
    refs = [p.make_gloo.remote(1 << 16, 1.0) for _ in range(5)]
    ray.get(refs)
    last = {"text": ""}

    def held(text: str) -> float:
        last["text"] = text
        return _value(text, "ray_rdt_objects_held")

    assert wait_for(lambda: held(_scrape()) >= 5, timeout=60, interval=0.5), (
        "the held-objects gauge never showed 5: "
        f"{[ln for ln in last['text'].splitlines() if ln.startswith('ray_rdt_objects_held')]}")
    time.sleep(6.0)  # the agent's TTL is 2 s (2 x the 1 s export interval): an unrefreshed gauge is gone by now
    seen = []
    for _ in range(4):
        seen.append(held(_scrape()))
        time.sleep(0.7)
    assert all(v >= 5 for v in seen), f"objects_held on four scrapes 0.7 s apart, with 5 objects held: {seen}"
    assert all(v > 0 for v in (_value(_scrape(), "ray_rdt_bytes_held"),)), "the held-bytes gauge vanished"
    del refs


def test_failure_log_line_names_group_rank_peer_op(actors):
    _, _, m = actors
    assert ray.get(m[0].lonely_recv.remote("obs-g")) == "CollectiveTimeoutError"
    logs = os.path.join(ray._private.worker.global_worker.node.get_logs_dir_path(), "worker-*.err")
    pattern = "rdt_transports: group=obs-g backend=gloo rank=0 peer=1 op=recv failed"

    def logged() -> bool:
        for path in glob.glob(logs):
            with open(path, errors="replace") as f:
                if pattern in f.read():
                    return True
        return False

    assert wait_for(logged, timeout=30), f"no log line {pattern!r} in {logs}"
    text = wait_for(lambda: (lambda t: t if _value(t, "ray_rdt_collective_ops_total", backend="gloo", op="recv",
                                                   status="error") >= 1 else "")(_scrape()), timeout=60, interval=1.0)
    assert text, "the failed op was not counted"
