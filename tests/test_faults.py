"""Groups that survive a member's death, on a real local Ray cluster.

A 3-rank group (Gloo, NIXL) loses its middle rank to ``ray.kill`` or to SIGKILL of the worker process while both
survivors are blocked in an allreduce. The survivors' calls fail in time with a typed error whose ``dead_ranks``
names rank 1; the group turns ERRORED and refuses further calls; destroying it through the driver's handle and
creating it again under the same name with the survivors plus a fresh replacement gives a working group, without
restarting the cluster and without rdt killing anyone (the survivors still answer).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import ray

import rdt
import rdt_transports as rt
from rdt_transports import CollectiveTimeoutError, GroupErroredError, PeerUnavailableError

from ._fault_actors import Peer, allreduce, dead_ranks, expected_checksum, group_state, pid_gone, sigkill
from .conftest import HAS_NIXL, wait_for

CALL_TIMEOUT_S = {"gloo": 10.0, "nixl": 4.0}
SLACK_S = 6.0  # how much later than expected a call may return on a loaded 2-core machine
# What a survivor sees: Gloo notices the closed connection at once. A same-node NIXL group (no UCX error handling)
# watches the peer's pid: a rank waiting on the dead one gets PeerUnavailableError at once, a rank waiting only on
# another survivor runs into the call's timeout; at least one survivor must see the death itself.
SURVIVOR_ERRORS = {"gloo": (PeerUnavailableError,), "nixl": (PeerUnavailableError, CollectiveTimeoutError)}

BACKENDS = ["gloo", pytest.param("nixl", marks=pytest.mark.skipif(not HAS_NIXL, reason="nixl not installed"))]


@pytest.fixture(scope="module")
def survivors(ray_cluster):
    actors = [Peer.remote() for _ in range(2)]
    ray.get([a.ping.remote() for a in actors], timeout=120)
    yield actors
    for a in actors:
        ray.kill(a)


def _kill(actor: Any, pid: int, how: str) -> None:
    if how == "ray.kill":
        ray.kill(actor)
    else:
        sigkill(pid)


def _all_reduce(actors: Any, name: str, values: Any, timeout: float = 20.0) -> list:
    out = ray.get([a.call.remote(allreduce, name, v, timeout) for a, v in zip(actors, values)], timeout=timeout + 60)
    for err, _, _ in out:
        assert err is None, f"allreduce over {name!r} failed: {err!r}"
    return [value for _, value, _ in out]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["ray.kill", "sigkill"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_group_survives_member_death(survivors, backend: str, how: str) -> None:
    s0, s1 = survivors
    name = f"faults-{backend}"
    call_timeout = CALL_TIMEOUT_S[backend]
    victim = Peer.remote()
    vpid = ray.get(victim.pid.remote(), timeout=60)
    handle = rt.create_collective_group([s0, victim, s1], backend=backend, group_name=name, timeout=60)
    replacement = None
    try:
        assert _all_reduce([s0, victim, s1], name, [1.0, 2.0, 3.0]) == [[6.0] * 4] * 3  # connections are up

        pending = [a.call.remote(allreduce, name, 1.0, call_timeout) for a in (s0, s1)]
        time.sleep(0.5)  # both survivors are now blocked in the allreduce, waiting for rank 1
        _kill(victim, vpid, how)
        out = ray.get(pending, timeout=call_timeout + 60)
        unnamed = []
        for rank, (err, _, seconds) in zip((0, 2), out):
            assert err is not None, f"rank {rank}'s allreduce returned although rank 1 was killed"
            assert err.cls in SURVIVOR_ERRORS[backend], repr(err)
            assert err.attrs["op"] == "allreduce" and err.attrs["group"] == name and f"rank={rank}" in err.message
            assert seconds < call_timeout + SLACK_S, f"rank {rank} took {seconds:.1f}s to fail"
            if err.attrs["dead_ranks"] != [1]:
                unnamed.append((rank, err))
            else:
                assert "dead member rank(s): [1]" in err.message
        assert any(err.cls is PeerUnavailableError for err, _, _ in out), [err for err, _, _ in out]
        assert wait_for(lambda: pid_gone(vpid), timeout=30)
        # Once Ray's GCS has recorded the death, the survivors' group names the dead rank.
        assert wait_for(lambda: all(ray.get(a.call.remote(dead_ranks, name))[1] == [1] for a in (s0, s1)),
                        timeout=30)

        # ERRORED: refused at once, typed, with the way out in the message.
        assert ray.get([a.call.remote(group_state, name) for a in (s0, s1)])[0][1] == "errored"
        err, _, seconds = ray.get(s1.call.remote(allreduce, name, 1.0, call_timeout), timeout=60)
        assert err is not None and err.cls is GroupErroredError and seconds < 1.0, repr(err)
        assert "destroy_collective_group" in err.message

        # Re-form: destroy through the handle (the dead member is skipped), same name, a fresh replacement.
        handle.destroy(timeout=20)
        assert [ray.get(a.call.remote(group_state, name))[1] for a in (s0, s1)] == [None, None]
        replacement = Peer.remote()
        handle = rt.create_collective_group([s0, replacement, s1], backend=backend, group_name=name, timeout=60)
        assert _all_reduce([s0, replacement, s1], name, [1.0, 2.0, 3.0]) == [[6.0] * 4] * 3
        if backend == "gloo":  # the re-formed group carries objects too
            ref = s0.make_gloo.remote(11, 1 << 20)
            assert ray.get(replacement.digest.remote(ref), timeout=60) == (11, expected_checksum(11, 1 << 20))
            assert rdt.stats(replacement)["transfers"]["gloo"]["in"] == 1
        # Nobody but the victim died: rdt killed no actor.
        assert len(set(ray.get([a.ping.remote() for a in (s0, s1, replacement)], timeout=30))) == 3
        assert not unnamed, f"the error did not name the dead rank: {unnamed}"
    finally:
        handle.destroy(timeout=20)
        for a in (victim, replacement):
            if a is not None:
                ray.kill(a)
