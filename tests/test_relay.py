"""Fan-out over a gloo group: one ref fetched by several consumers at once costs the producer about one object.

Real parts only: Ray actors on the shared local cluster, a real Gloo group, real processes stopped and killed.
Consumers that ask while another is still receiving are chained (producer -> c1 -> c2 -> ...), each forwarding
chunk k before waiting for chunk k+1; a relay that dies makes the consumers behind it fall back to the producer.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

import rdt
from rdt_transports._proc import pid_alive

from rdt._control import wire as _control

from ._relay_actors import (RelayNode, control_address, digests, hold_first_relay_post, nbytes, poll_relay_chain,
                            relay_chains, relay_state)
from ._stop import freeze
from .conftest import wait_for

BIG = 6 << 20  # float32 elements per large tensor: the object is about 75 MiB


def _relay(actor) -> dict:
    return rdt.stats(actor).get("relay", {})


def _shapes(value):
    return {k: (str(v.dtype), tuple(v.shape), "") for k, v in value.items()}


def _relay_group(n: int, seed: int, **config):
    """n actors in one gloo group (actor 1 will be the relay that fails), each fetch timing out after 30 s; the
    expected digests and size of the producer's state dict for ``seed``; actor 1's pid."""
    actors = [RelayNode.remote() for _ in range(n)]
    ray.get([a.pid.remote() for a in actors], timeout=180)  # started (a loaded machine takes its time) before the
    group = rdt.create_collective_group(actors, backend="gloo", timeout=60.0)  # group's join timeout runs
    value = relay_state(BIG * 2, seed)
    want, total = digests(value), nbytes(value)
    ray.get([a.expect.remote(_shapes(value)) for a in actors])
    del value
    ray.get([a.configure.remote(transfer_timeout=30.0, **config) for a in actors])
    return actors, group, want, total, ray.get(actors[1].pid.remote())


def _stop_while_receiving(p, victim, pid: int, ref):
    """The victim starts fetching ``ref`` and is stopped (SIGSTOP) while it is still receiving (skip if it finished
    first: nothing could be tested); its fetch call."""
    call = victim.fetch_at.remote([ref], time.time(), "get")
    assert wait_for(lambda: _relay(p).get("chains", 0) > 0, timeout=30, interval=0.002)
    freeze(pid)
    if _relay(p).get("open_tails", 0) == 0:
        pytest.skip("c1 finished before it could be stopped")
    return call


def _tear_down(pid: int, group, actors) -> None:
    """Kill the stopped or killed relay if it still lives, then the group and every actor."""
    if pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
    rdt.destroy_collective_group(group)
    for a in actors:
        ray.kill(a)


@pytest.fixture(scope="module")
def chain(ray_cluster):
    """p (producer) and c1..c3 (consumers) in one gloo group; the expected digests of the state dict."""
    actors = [RelayNode.remote() for _ in range(4)]
    where = ray.get([a.where.remote() for a in actors])
    assert all(w == rdt.__file__ for w in where), where  # the actors run this checkout's rdt
    group = rdt.create_collective_group(actors, backend="gloo")
    value = relay_state(BIG, 3)
    ray.get([a.expect.remote(_shapes(value)) for a in actors[1:]])
    yield {"p": actors[0], "cs": actors[1:], "group": group, "digests": digests(value), "nbytes": nbytes(value)}
    rdt.destroy_collective_group(group)
    for a in actors:
        ray.kill(a)


@pytest.mark.parametrize("mode", ["get", "into", "arg"])
def test_three_consumers_cost_the_producer_about_one_object(chain, mode):
    p, cs = chain["p"], chain["cs"]
    held = rdt.stats(p)["objects"]
    ref = p.state.remote(BIG, 3)
    ray.wait([ref], timeout=60)
    before = _relay(p).get("served_bytes", 0)
    if mode == "arg":
        calls = [c.digest_arg.remote(ref) for c in cs]
    else:
        start = time.time() + 1.0  # every consumer asks at this moment
        calls = [c.fetch_at.remote([ref], start, mode) for c in cs]
    results = ray.get(calls, timeout=120)
    for r in results:
        assert r[0] == "ok", r
        assert r[1] == chain["digests"]  # bit-exact, every tensor, every consumer
    served = _relay(p)["served_bytes"] - before
    assert 0 < served < 1.5 * chain["nbytes"], (served, chain["nbytes"])
    assert sum(_relay(c).get("relayed_bytes", 0) for c in cs) > 0
    assert wait_for(lambda: _relay(p)["chains"] == 0, timeout=30)  # the serve state drains
    del ref
    assert wait_for(lambda: rdt.stats(p)["objects"] == held, timeout=30)


def test_a_relay_that_dies_mid_transfer_leaves_the_others_served(ray_cluster):
    """c1 asks first and is stopped while it receives; c2 and c3 join behind it; c1 is killed. The consumer behind
    c1 (and through it the last one) falls back to the producer for what they miss: the data arrives bit-exact, or a typed error names the
    dead relay, within the timeout; nobody hangs and the producer's serve state drains."""
    actors, group, want, total, pid = _relay_group(4, 5)
    p, victim, c2, c3 = actors
    try:
        ref = p.state.remote(BIG * 2, 5)
        ray.wait([ref], timeout=60)
        stopped = False
        for _ in range(3):  # bounded: c1 must still be receiving when it is stopped
            chains = _relay(p).get("chains", 0)
            first = victim.fetch_at.remote([ref], time.time(), "get")
            assert wait_for(lambda: _relay(p).get("chains", 0) > chains, timeout=30, interval=0.002)
            freeze(pid)
            if _relay(p).get("open_tails", 0) > 0:  # c1 did not finish before it was stopped
                stopped = True
                break
            os.kill(pid, signal.SIGCONT)
            assert ray.get(first, timeout=60)[0] == "ok"
            assert wait_for(lambda: _relay(p).get("chains", 0) == 0, timeout=30)
        assert stopped, "c1 finished every time before it could be stopped; use a larger object"
        joined = _relay(p).get("joined", 0)
        start = time.time()
        calls = [c.fetch_at.remote([ref], start, "get", 30.0) for c in (c2, c3)]
        assert wait_for(lambda: _relay(p).get("joined", 0) >= joined + 2, timeout=30, interval=0.01)
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        results = ray.get(calls, timeout=60)
        assert time.monotonic() - t0 < 35  # within the consumers' timeout, nobody hangs
        for r in results:
            if r[0] == "ok":
                assert r[1] == want
            else:  # a typed error that names the dead relay's rank
                assert r[1] in ("ObjectFetchError", "TransferTimeoutError"), r
                assert "rank 1" in r[2], r
        assert any(r[0] == "ok" for r in results), results  # c2's fallback to the producer works
        assert sum(_relay(c)["fallbacks"] for c in (c2, c3)) >= 1  # the one behind c1 asked the producer
        served = _relay(p)["served_bytes"]
        assert served < 3 * total, (served, total)
        assert wait_for(lambda: _relay(p)["chains"] == 0, timeout=40)
        del ref
        assert wait_for(lambda: rdt.stats(p)["objects"] == 0, timeout=30)
    finally:
        _tear_down(pid, group, actors)


def test_a_relay_already_dead_when_its_follower_posts_is_skipped(ray_cluster, tmp_path):
    """c2 is chained behind c1, and c1 is killed before c2 posts its receives (Gloo already knows c1's connection
    is closed, so posting fails at once): c2 gets everything from the producer, bit-exact, well within its
    timeout. (Once in CI the follower also sent the producer a "receives posted" message only a chain's head
    sends; nobody received it and the fetch timed out after its full 60 s.)"""
    actors, group, want, _, pid = _relay_group(3, 7)
    p, victim, c2 = actors
    marker = str(tmp_path / "relay-dead")
    try:
        ref = p.state.remote(BIG * 2, 7)
        ray.wait([ref], timeout=60)
        _stop_while_receiving(p, victim, pid, ref)
        ray.get(c2.call.remote(hold_first_relay_post, marker), timeout=30)
        joined = _relay(p).get("joined", 0)
        call = c2.fetch_at.remote([ref], time.time(), "get", 30.0)
        assert wait_for(lambda: _relay(p).get("joined", 0) > joined, timeout=30, interval=0.01)  # behind c1
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: not pid_alive(pid), timeout=10)
        time.sleep(1.0)  # c2's Gloo notices the closed connection
        open(marker, "w").close()
        result = ray.get(call, timeout=60)
        assert result[0] == "ok", result
        assert result[1] == want
        assert result[2] < 20, result[2]  # not the 30 s transfer timeout
        assert _relay(c2)["fallbacks"] == 1
        assert wait_for(lambda: _relay(p)["chains"] == 0, timeout=40)
    finally:
        _tear_down(pid, group, actors)


def test_a_stalled_relay_costs_its_followers_at_most_the_stall_timeout(ray_cluster):
    """c1 is stopped (alive, stuck) while it receives; c2 and c3 join behind it. The one behind c1 stops waiting
    after the stall timeout, without a Gloo timeout (its connections stay up), leaves its receives from c1 parked
    and gets the rest from the producer; the one behind it gets everything from it (or falls back too). Nobody
    waits for the transfer timeout, both get the object bit-exact, and once c1 is killed the parked receives end
    and the producer's chain drains."""
    actors, group, want, _, pid = _relay_group(4, 6, relay_stall_timeout=2.0)
    p, victim, c2, c3 = actors
    try:
        ref = p.state.remote(BIG * 2, 6)
        ray.wait([ref], timeout=60)
        _stop_while_receiving(p, victim, pid, ref)
        t0 = time.monotonic()
        results = ray.get([c.fetch_at.remote([ref], time.time(), "get", 30.0) for c in (c2, c3)], timeout=60)
        assert time.monotonic() - t0 < 15  # the stall timeout (2 s per place in the chain), not the 30 s one
        for r in results:
            assert r[0] == "ok", r
            assert r[1] == want
        assert sum(_relay(c)["fallbacks"] for c in (c2, c3)) >= 1
        assert sum(_relay(c)["parked"] for c in (c2, c3)) >= 1
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: all(_relay(c)["parked"] == 0 for c in (c2, c3)), timeout=30)
        assert ray.get([c.group_states.remote() for c in (c2, c3)], timeout=30) == [["healthy"]] * 2
        assert wait_for(lambda: _relay(p)["chains"] == 0, timeout=40)
    finally:
        _tear_down(pid, group, actors)


@pytest.mark.parametrize("behind", ["get", "into"])
def test_a_stalled_relay_is_bypassed_and_the_group_serves_the_next_step(ray_cluster, behind):
    """c1 is stopped (SIGSTOP: alive, stuck) while it receives; c2 (fetching as ``behind`` says) and c3 (the other
    way: plain, or into targets) join behind it. They must get the object bit-exact from the producer within
    their timeout, without a Gloo timeout (which would close every connection of their rank and break the
    group). Once c1 is continued it forwards what it owed c2: those bytes must land nowhere the caller can see
    (the consumers overwrite what they got with sentinel bytes and re-check them once every parked receive has
    ended, and again after the next step).
    Then every member fetches the next step's object over the same group, and every member's view of the group
    is still HEALTHY."""
    actors, group, want, _, pid = _relay_group(4, 8, relay_stall_timeout=1.0)
    p, victim, c2, c3 = actors
    other = "into" if behind == "get" else "get"
    timeout = 8.0  # the producer serves them within about 2 s of the 1 s stall
    try:
        ref = p.state.remote(BIG * 2, 8)
        ray.wait([ref], timeout=60)
        first = _stop_while_receiving(p, victim, pid, ref)
        joined = _relay(p).get("joined", 0)
        calls = [c2.fetch_and_hold.remote([ref], time.time(), behind, timeout),
                 c3.fetch_and_hold.remote([ref], time.time() + 0.3, other, timeout)]
        results = ray.get(calls, timeout=60)
        assert _relay(p)["joined"] >= joined + 1, "nobody was chained behind the stopped relay"
        for r in results:
            assert r[0] == "ok", r  # from the producer, within the timeout: no error
            assert r[1] == want
        assert _relay(c2)["fallbacks"] == 1
        assert _relay(c2).get("parked") == 1  # c2's receives from c1 wait for c1, in memory nobody was given
        os.kill(pid, signal.SIGCONT)
        done = ray.get(first, timeout=60)
        assert done[0] == "ok" and done[1] == want, done[:3]
        assert _relay(victim)["relayed_bytes"] > 0  # c1 went on and forwarded to c2 what it owed
        # The late bytes' only writers are the parked receives: once none is left, nothing can land any more.
        # Checked then, and again after the next step (seconds later, with new receives on the same group).
        assert wait_for(lambda: all(_relay(c)["parked"] == 0 for c in (c2, c3)), timeout=30)
        assert ray.get([c.held_intact.remote() for c in (c2, c3)], timeout=30) == [True, True], \
            "bytes landed in what a fetch had returned, after it returned"
        ref2 = p.state.remote(BIG, 9)
        want2 = digests(relay_state(BIG, 9))
        start = time.time() + 1.0
        nxt = ray.get([c.fetch_at.remote([ref2], start, "get", 30.0) for c in (victim, c2, c3)], timeout=90)
        for r in nxt:
            assert r[0] == "ok" and r[1] == want2, r[:3]
        assert ray.get([c.held_intact.remote() for c in (c2, c3)], timeout=30) == [True, True], \
            "bytes landed in what a fetch had returned, after it returned"
        assert ray.get([a.group_states.remote() for a in actors], timeout=30) == [["healthy"]] * 4
        assert wait_for(lambda: _relay(p)["chains"] == 0, timeout=40)
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGCONT)
        _tear_down(pid, group, actors)


def _config() -> dict:
    """(in an actor) the settings the tests on ``nodes`` change."""
    from rdt._process.context import get_context

    config = get_context().config
    return dict(transfer_timeout=config.transfer_timeout, relay_min_bytes=config.relay_min_bytes)


@pytest.fixture(scope="module")
def _shared_nodes(ray_cluster):
    actors = [RelayNode.remote() for _ in range(4)]
    pids = ray.get([a.pid.remote() for a in actors], timeout=180)
    configs = ray.get([a.call.remote(_config) for a in actors], timeout=60)
    yield actors, pids, configs
    for a in actors:
        ray.kill(a)


@pytest.fixture
def nodes(_shared_nodes):
    """Four actors shared by the tests that stop (SIGSTOP) but kill none of them: each test forms (and destroys)
    groups of its own; afterwards every actor is resumed and gets back the config it started with."""
    actors, pids, configs = _shared_nodes
    yield actors
    for pid in pids:
        if pid_alive(pid):
            os.kill(pid, signal.SIGCONT)
    ray.get([a.configure.remote(**c) for a, c in zip(actors, configs)], timeout=60)


def test_held_relay_polls_leave_the_producers_control_plane_answering(nodes):
    """A relayed fetch asks its producer whom to forward to, and the producer holds that poll until a follower
    joins or the fetch says it is done. 16 lone relayed fetches of 16 objects at once (two consumers, 8 each,
    as many as their fetch threads) must each end well within their timeout, and the producer's control server
    must answer other requests (stats) promptly meanwhile."""
    actors = nodes[:3]
    p, cs = actors[0], actors[1:]
    group = rdt.create_collective_group(actors, backend="gloo")
    try:
        served_before = _relay(p).get("served_bytes", 0)
        ray.get([c.configure.remote(transfer_timeout=30.0, relay_min_bytes=1 << 20) for c in cs])
        refs = [p.state.remote(1 << 20, 100 + i) for i in range(16)]
        ray.wait(refs, num_returns=len(refs), timeout=60)
        start = time.time() + 1.0
        calls = [c.fetch_concurrently.remote(refs[i::2], start, 20.0) for i, c in enumerate(cs)]
        waits = []
        while len(ray.wait(calls, num_returns=2, timeout=0)[0]) < 2 and len(waits) < 200:
            t = time.monotonic()
            rdt.stats(p, timeout=30.0)
            waits.append(time.monotonic() - t)
            time.sleep(0.05)
        results = [r for rs in ray.get(calls, timeout=60) for r in rs]
        for i, r in enumerate(results):
            assert r[0] == "ok", r
            assert r[1] == digests(relay_state(1 << 20, 100 + 2 * (i % 8) + i // 8)), i
        slowest, stats_wait = max(r[2] for r in results), max(waits)
        assert slowest < 15 and stats_wait < 10, \
            f"a fetch took {slowest:.1f}s (timeout 20 s), a stats request {stats_wait:.1f}s: the producer's control " \
            "server was held"
        assert _relay(p)["served_bytes"] > served_before and wait_for(lambda: _relay(p)["chains"] == 0, timeout=30)
    finally:
        rdt.destroy_collective_group(group)


def test_a_member_of_another_group_cannot_poll_or_close_a_chain(nodes):
    """The producer is in group A (with c1, c2) and group B (with x). While c1 receives (stopped mid-chain), x
    polls c1's chain in A and asks to close it, signing with B's secret and naming the chain's id and c1's rank
    (the worst case: it knows them), and c2, a member of A, does the same for another object: the producer
    refuses each with a typed error, the chain stays open, and c2's fetch is still chained behind c1."""
    p, c1, c2, x = actors = nodes
    a = rdt.create_collective_group([p, c1, c2], backend="gloo")
    b = rdt.create_collective_group([p, x], backend="gloo")
    ray.get([n.configure.remote(transfer_timeout=30.0) for n in actors])
    pid = ray.get(c1.pid.remote())
    try:
        ref = p.state.remote(BIG * 2, 11)
        ray.wait([ref], timeout=60)
        first = _stop_while_receiving(p, c1, pid, ref)
        [(cid, obj, uid, ranks)] = ray.get(p.call.remote(relay_chains), timeout=30)
        assert uid == a.uid and ranks == [1]
        address = ray.get(p.call.remote(control_address), timeout=30)
        answers = [ray.get(x.call.remote(poll_relay_chain, address, obj, b.uid, 1, cid, final), timeout=30)
                   for final in (0, 1)]
        answers.append(ray.get(c2.call.remote(poll_relay_chain, address, "00" * 16, a.uid, 1, cid, 1), timeout=30))
        for answer in answers:
            assert answer[0] == "err" and answer[1] == _control.ERR_BAD_REQUEST, answer
            assert f"no chain {cid}" in answer[2], answer
        assert _relay(p)["open_tails"] == 1  # c1 is still the open tail of its chain
        joined = _relay(p)["joined"]
        second = c2.fetch_at.remote([ref], time.time(), "get", 30.0)
        assert wait_for(lambda: _relay(p)["joined"] > joined, timeout=30, interval=0.01)  # behind c1
        os.kill(pid, signal.SIGCONT)
        want = digests(relay_state(BIG * 2, 11))
        for r in ray.get([first, second], timeout=60):
            assert r[0] == "ok" and r[1] == want, r[:3]
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGCONT)
        for g in (a, b):
            rdt.destroy_collective_group(g)
