"""Reliability of collective groups under slow, stuck and dead members (issue 12, collective-group items).

Everything runs on the shared local Ray cluster with real Gloo / NIXL / UCX groups. A "slow consumer" is a real
consumer process frozen with SIGSTOP by its producer right after the producer has posted an object's sends, so
the request and the receives are made by rdt's own code. Every test that leaves its actors alive shares three
(``trio``): it forms a group of its own (errored, stuck or not) and destroys it, and the fixture resumes the actors
and restores their config afterwards. Throwaway actors are used wherever an actor is killed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import pytest
import ray
import torch

import rdt_transports as rt
from rdt_transports import errors as rte

from . import _fault_actors as fa
from ._stop import freeze
from .conftest import HAS_NIXL, HAS_UCXX, wait_for

SLACK_S = 5.0  # how much later than its deadline a call may return on a loaded 2-core machine
MiB = 1 << 20


def _peers(n: int, **options: Any) -> List[Any]:
    actors = [fa.Peer.options(**options).remote() if options else fa.Peer.remote() for _ in range(n)]
    ray.get([a.ping.remote() for a in actors], timeout=120)
    return actors


def _kill(actors: List[Any]) -> None:
    for a in actors:
        try:
            ray.kill(a)
        except Exception:  # noqa: BLE001 - already dead
            pass


def _call(actor: Any, fn: Any, *args: Any, timeout: float = 90.0, **kw: Any) -> Tuple[Any, Any, float]:
    return ray.get(actor.call.remote(fn, *args, **kw), timeout=timeout)


def _state(actor: Any, name: str) -> Optional[str]:
    err, value, _ = _call(actor, fa.group_state, name)
    assert err is None, err
    return value


# ---------------------------------------------------------------------------------------------- worker side
def freeze_consumer_on_next_fetch(consumer_pid: int, seconds: float) -> None:
    """(producer side) once the next group fetch has posted its sends, SIGSTOP the consumer for ``seconds``.

    The consumer then posts its receives (rdt's own code) only after it is resumed: a real slow consumer."""
    from rdt._process.context import get_context

    ctx = get_context()
    ctx.producer_info()  # starts the control server
    server = ctx._server
    original = server._handlers[1]  # REQ_FETCH_GROUP

    def hooked(key_id: int, payload: bytes) -> Any:
        server._handlers[1] = original
        out = original(key_id, payload)
        try:
            freeze(consumer_pid, timeout=5.0)  # every thread of it stopped before this answer goes out
        except AssertionError:
            pass  # it did not stop in time (freeze resumed it): a consumer merely slow, still a valid case
        resume = threading.Timer(seconds, os.kill, (consumer_pid, signal.SIGCONT))
        resume.daemon = True
        resume.start()
        return out

    server._handlers[1] = hooked


def timed_allreduce(name: str, timeout: float, algorithm: str = "auto") -> float:
    t = torch.ones(4)
    rt.allreduce(t, name, timeout=timeout, algorithm=algorithm)
    return float(t[0])


# ---------------------------------------------------------------------------------------------- item 1
def _config() -> Dict[str, Any]:
    """(worker side) the settings the tests change."""
    from rdt._process.context import get_context

    config = get_context().config
    return dict(transfer_timeout=config.transfer_timeout, relay=config.relay)


@pytest.fixture(scope="module")
def _shared_trio(ray_cluster):
    actors = _peers(3)
    pids = ray.get([a.pid.remote() for a in actors], timeout=60)
    configs = [_call(a, _config)[1] for a in actors]
    yield actors, pids, configs
    _kill(actors)


@pytest.fixture
def trio(_shared_trio):
    """Three actors shared by the module's tests that kill none: each test forms (and destroys) a group of its
    own; afterwards every actor is resumed (SIGCONT) and gets back the config it started with."""
    actors, pids, configs = _shared_trio
    yield actors
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    ray.get([a.configure.remote(**c) for a, c in zip(actors, configs)], timeout=60)


@pytest.mark.parametrize("nbytes", [MiB, 32 * MiB], ids=["direct", "go"])
def test_object_send_timeout_errors_producer_group_and_peers_fail_fast(trio, nbytes: int) -> None:
    """A consumer that never posts its receives in time: the producer's send wait ends at the consumer's deadline
    (not its own 60 s transfer timeout), its group is ERRORED, and another member's next collective fails fast."""
    p, c, o = trio
    name = f"rel-send-timeout-{nbytes}"
    handle = rt.create_collective_group([p, c, o], backend="gloo", group_name=name)
    try:
        _assert_allreduce([p, c, o], name)
        consumer_timeout = 2.0
        ray.get(c.configure.remote(transfer_timeout=consumer_timeout))
        c_pid = ray.get(c.pid.remote())
        assert _call(p, freeze_consumer_on_next_fetch, c_pid, consumer_timeout + 4.0)[0] is None
        ref = p.make_gloo.remote(7, nbytes)
        ray.wait([ref], timeout=30)
        t0 = time.monotonic()
        fetch = c.try_digest.remote([ref], 60)
        errored = wait_for(lambda: _state(p, name) == "errored", timeout=consumer_timeout + 3 * SLACK_S)
        elapsed = time.monotonic() - t0
        assert errored, "the producer's group stayed healthy after its object send timed out"
        assert elapsed < consumer_timeout + SLACK_S, f"the producer waited {elapsed:.1f}s, not the consumer's 2 s"
        err, _, seconds = _call(o, timed_allreduce, name, 30.0)
        assert err is not None, "a collective succeeded although a member's group is errored"
        assert issubclass(err.cls, (rte.CommunicationError, rte.GroupError)), repr(err)
        assert seconds < SLACK_S, f"the other member took {seconds:.1f}s to notice (timeout 30 s)"
        assert _state(o, name) == "errored"
        status, value, _ = ray.get(fetch, timeout=60)
        assert status == "err", "the frozen consumer got the object after its deadline"
    finally:
        _resume_all(c)
        handle.destroy(timeout=10)


def _assert_allreduce(actors: List[Any], name: str, timeout: float = 30.0, algorithm: str = "auto") -> None:
    out = ray.get([a.call.remote(timed_allreduce, name, timeout, algorithm) for a in actors], timeout=timeout + 30)
    for err, value, _ in out:
        assert err is None, f"allreduce on {name!r} failed: {err!r}"
        assert value == float(len(actors))


def _resume_all(actor: Any) -> None:
    try:
        pid = ray.get(actor.pid.remote(), timeout=1)
    except Exception:  # noqa: BLE001 - frozen: the call cannot run
        pid = None
    for proc in ([pid] if pid else []):
        try:
            os.kill(proc, signal.SIGCONT)
        except ProcessLookupError:
            pass


def hold_send_waiters(seconds: float) -> None:
    """(producer side) keep every thread this process waits on object sends with busy for ``seconds``: a large
    gloo object's data leaves only after that."""
    from rdt._process.context import SEND_WAITERS, get_context

    gate = threading.Barrier(SEND_WAITERS + 1)
    for _ in range(SEND_WAITERS):
        get_context().send_waiters.submit(lambda: (gate.wait(), time.sleep(seconds)))
    gate.wait(10.0)


_KEPT: Dict[str, torch.Tensor] = {}


def interrupted_then_other(stuck: List[Any], other: List[Any], nbytes: int, relay: bool) -> Tuple[str, str]:
    """(consumer side) fetch ``stuck`` into a target on a thread and interrupt it after 0.5 s (KeyboardInterrupt,
    as Ctrl-C or ray.cancel deliver), then fetch ``other`` into the same target: (the first fetch's error type,
    "ok" or the second's error). The target stays here for :func:`kept_checksum`. ``relay``: the fetch is offered
    to the producer's chain (a lone consumer is its head, fed by the producer) or not."""
    import ctypes

    import rdt

    rdt.configure(relay=relay)
    target = _KEPT["t"] = torch.zeros(nbytes, dtype=torch.uint8)
    first: List[str] = []

    def fetch() -> None:
        try:
            rdt.get(stuck[0], into={"t": target}, timeout=30.0)
            first.append("finished")
        except BaseException as e:  # noqa: BLE001 - reported
            first.append(type(e).__name__)

    th = threading.Thread(target=fetch)
    th.start()
    time.sleep(0.5)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(th.ident), ctypes.py_object(KeyboardInterrupt))
    th.join(30.0)
    try:
        rdt.get(other[0], into={"t": target}, timeout=30.0)
        second = "ok"
    except rdt.RdtError as e:
        second = f"{type(e).__name__}: {e}"
    return first[0] if first else "still running", second


def kept_checksum() -> str:
    return fa.checksum(_KEPT["t"])


@pytest.mark.parametrize("relay", [False, True], ids=["unchained", "chain-head"])
def test_an_interrupted_group_fetch_keeps_its_targets_busy_until_its_receive_ends(trio, relay: bool) -> None:
    """Before: a gloo fetch into rdt.get(into=) targets whose wait was interrupted left its receives posted on
    the targets, unmarked: a later fetch into them landed at once, and the abandoned receive overwrote it when
    the producer's data came (the targets held the abandoned object's bytes). The later fetch now waits until
    the receive ended, then lands."""
    p, c = trio[:2]
    name = f"rel-interrupted-{relay}"
    handle = rt.create_collective_group([p, c], backend="gloo", group_name=name)
    nbytes = 32 * MiB  # large: the data leaves once the consumer said its receives are posted, on a send waiter
    try:
        stuck, other = p.make_gloo.remote(21, nbytes), p.make_shm.remote(22, nbytes)
        assert len(ray.wait([stuck, other], num_returns=2, timeout=60)[0]) == 2
        assert _call(p, hold_send_waiters, 3.0)[0] is None
        err, value, _ = _call(c, interrupted_then_other, [stuck], [other], nbytes, relay)
        assert err is None, err
        assert value[0] == "KeyboardInterrupt" and value[1] == "ok", value
        time.sleep(4.0)  # the held sends went out by now: had the receive not been waited for, it landed since
        err, digest, _ = _call(c, kept_checksum)
        assert err is None and digest == fa.expected_checksum(22, nbytes), "the abandoned receive wrote last"
    finally:
        handle.destroy(timeout=10)


def test_producer_waits_as_long_as_the_consumer(trio) -> None:
    """A producer with a 1 s transfer timeout serves a consumer that allows 10 s and is frozen for 3 s."""
    p, c = trio[:2]
    name = "rel-consumer-deadline"
    handle = rt.create_collective_group([p, c], backend="gloo", group_name=name)
    try:
        ray.get([p.configure.remote(transfer_timeout=1.0), c.configure.remote(transfer_timeout=10.0)])
        assert _call(p, freeze_consumer_on_next_fetch, ray.get(c.pid.remote()), 3.0)[0] is None
        ref = p.make_gloo.remote(11, MiB)
        status, value, seconds = ray.get(c.try_digest.remote([ref], 60), timeout=60)
        assert status == "ok", f"the fetch failed: {value!r}"
        assert value == (11, fa.expected_checksum(11, MiB))
        assert seconds >= 2.5
        assert _state(p, name) == "healthy"
    finally:
        handle.destroy(timeout=10)


# ---------------------------------------------------------------------------------------------- item 2
SEND_WAIT_BOUND = 16  # rdt-send-wait threads a producer may run at once, whatever the number of fetches


def delay_fetch_responses(seconds: float, count: int) -> None:
    """(producer side) the next ``count`` group fetches post their sends at once but answer only ``seconds``
    later, so each consumer posts its receives late: ``count`` slow consumers at the same time."""
    from rdt._process.context import get_context

    ctx = get_context()
    ctx.producer_info()
    server = ctx._server
    original = server._handlers[1]
    left = [count]
    lock = threading.Lock()

    def hooked(key_id: int, payload: bytes) -> Any:
        with lock:
            left[0] -= 1
            if left[0] <= 0:
                server._handlers[1] = original
        out = original(key_id, payload)
        time.sleep(seconds)
        return out

    server._handlers[1] = hooked


_sampler: Dict[str, Any] = {}


def start_thread_sampler(prefix: str, seconds: float) -> None:
    """(worker side) sample, every 10 ms for at most ``seconds``, all threads and those named ``prefix*``."""
    stop = threading.Event()
    peak = {"all": threading.active_count(), "named": 0}

    def loop() -> None:
        end = time.monotonic() + seconds
        while not stop.is_set() and time.monotonic() < end:
            threads = threading.enumerate()
            peak["all"] = max(peak["all"], len(threads))
            peak["named"] = max(peak["named"], sum(1 for t in threads if t.name.startswith(prefix)))
            stop.wait(0.01)

    thread = threading.Thread(target=loop, name="test-thread-sampler", daemon=True)
    _sampler.update(stop=stop, peak=peak, thread=thread)
    thread.start()


def stop_thread_sampler() -> Dict[str, int]:
    _sampler["stop"].set()
    _sampler["thread"].join(timeout=5)
    return dict(_sampler["peak"])


def produce_states(seeds: List[int], nbytes: int) -> List[Dict[str, Any]]:
    """(producer side) make one "gloo" object per seed; return each metadata's fields (a plain dict, so it
    crosses Ray without being fetched on the way)."""
    from rdt._process.context import get_context
    from rdt._producer.produce import produce

    ctx = get_context()
    return [dict(produce(ctx, {"t": fa.pattern(s, nbytes), "seed": s}, "gloo").__dict__) for s in seeds]


def _fetch_state(state: Dict[str, Any]) -> str:
    """(consumer side) fetch one object by its metadata with rdt's own fetch code; the checksum of what came."""
    from rdt._consumer import resolve as _consumer
    from rdt._process.context import get_context
    from rdt._objects.meta import ObjectMeta

    meta = ObjectMeta.__new__(ObjectMeta)
    object.__setattr__(meta, "__dict__", dict(state))
    fetched, name = _consumer.fetch_buffers(get_context(), meta)
    assert name == "gloo", name
    return fa.checksum(fetched.buffers[0])


def fetch_concurrently_with_allreduce(states: List[Dict[str, Any]], name: str, after: float,
                                      timeout: float) -> Tuple[Any, List[Any]]:
    """(consumer side) fetch every object at once from its own thread (Ray's ray.get would fetch them one at a
    time), and ``after`` seconds later join an allreduce; (allreduce error or value, checksums or errors)."""
    results: List[Any] = [None] * len(states)

    def one(i: int) -> None:
        try:
            results[i] = _fetch_state(states[i])
        except Exception as e:  # noqa: BLE001 - reported to the test
            results[i] = fa.Caught(e)

    threads = [threading.Thread(target=one, args=(i,), name=f"test-fetch-{i}") for i in range(len(states))]
    for t in threads:
        t.start()
    time.sleep(after)
    try:
        reduced: Any = timed_allreduce(name, timeout, "ring")
    except Exception as e:  # noqa: BLE001
        reduced = fa.Caught(e)
    for t in threads:
        t.join(timeout=120)
    return reduced, results


def fetch_repeatedly(states: List[Dict[str, Any]], n: int) -> int:
    """(consumer side) fetch the objects round robin ``n`` times, one after another."""
    for i in range(n):
        _fetch_state(states[i % len(states)])
    return n


def test_slow_consumers_do_not_starve_collectives(trio) -> None:
    """24 fetches slow to post their receives hold object sends open; an allreduce on the same group must still
    finish, the producer's send waiters stay bounded, and every object arrives intact afterwards."""
    p, c = trio[:2]
    name = "rel-starve"
    n, nbytes = 24, 256 << 10
    handle = rt.create_collective_group([p, c], backend="gloo", group_name=name)
    try:
        err, states, _ = _call(p, produce_states, list(range(100, 100 + n)), nbytes)
        assert err is None, err
        assert _call(p, delay_fetch_responses, 6.0, n)[0] is None
        assert _call(p, start_thread_sampler, "rdt-send-wait", 60.0)[0] is None
        consumer = c.call.remote(fetch_concurrently_with_allreduce, states, name, 2.0, 4.0)
        time.sleep(2.0)  # every fetch's sends are posted; no receive is
        err, value, _ = _call(p, timed_allreduce, name, 4.0, "ring")
        assert err is None, f"the producer's allreduce starved behind {n} slow object sends: {err!r}"
        err, (reduced, checksums), _ = ray.get(consumer, timeout=120)
        assert err is None, err
        assert value == 2.0 and reduced == 2.0, (value, reduced)
        assert checksums == [fa.expected_checksum(100 + i, nbytes) for i in range(n)]
        err, peak, _ = _call(p, stop_thread_sampler)
        assert err is None
        assert peak["named"] <= SEND_WAIT_BOUND, f"{peak['named']} send-wait threads for {n} fetches"
        assert _state(p, name) == "healthy" and _state(c, name) == "healthy"
        # thousands of fetches: the producer's thread count stays bounded
        base = _call(p, threading.active_count)[1]
        assert _call(p, start_thread_sampler, "rdt-", 120.0)[0] is None
        err, done, _ = _call(c, fetch_repeatedly, states[:4], 2000, timeout=300)
        assert err is None and done == 2000, err
        peak = _call(p, stop_thread_sampler)[1]
        assert peak["all"] <= base + SEND_WAIT_BOUND + 8, f"{peak['all']} threads (from {base})"
    finally:
        handle.destroy(timeout=10)


# ---------------------------------------------------------------------------------------------- item 3
def _backend_param(backend: str) -> Any:
    marks = []
    if backend == "nixl" and not HAS_NIXL:
        marks.append(pytest.mark.skip(reason="nixl is not installed (pip install 'ray-direct-transport[nixl]')"))
    if backend == "ucx" and not HAS_UCXX:
        marks.append(pytest.mark.skip(reason="ucxx is not installed (pip install 'ray-direct-transport[ucx]')"))
    return pytest.param(backend, marks=marks, id=backend)


def init_alone(backend: str, name: str, timeout: float) -> Tuple[Any, bool, List[str]]:
    """(worker side) join a 2-rank group as rank 0 while rank 1 never comes: (error, still a member, GCS keys)."""
    import ray.experimental.internal_kv as kv

    try:
        rt.init_collective_group(2, 0, backend=backend, group_name=name, timeout=timeout)
        err = None
    except Exception as e:  # noqa: BLE001
        err = fa.Caught(e)
    keys = [k.decode() for k in kv._internal_kv_list("rdt/", namespace="rdt")]
    return err, rt.is_group_initialized(name), keys


@pytest.fixture
def lone_rank(trio):
    """One actor for every backend's lone rank 0: a failed init leaves it no member of anything."""
    return trio[2]


@pytest.mark.parametrize("backend", [_backend_param("gloo"), _backend_param("nixl"), _backend_param("ucx")])
def test_init_blocks_until_every_rank_joined(lone_rank, backend: str) -> None:
    """init_collective_group with a rank that never joins raises CollectiveTimeoutError naming it, at the timeout."""
    name = f"rel-alone-{backend}"
    err, (caught, member, keys), seconds = _call(lone_rank, init_alone, backend, name, 3.0)
    assert err is None, err
    assert caught is not None, f"rank 0 of {backend} got a group although rank 1 never joined"
    assert caught.cls is rte.CollectiveTimeoutError, repr(caught)
    assert "rank(s) [1]" in caught.message and f"group={name!r}" in caught.message, caught.message
    assert 2.5 <= seconds < 3.0 + SLACK_S, f"init returned after {seconds:.1f}s (timeout 3 s)"
    assert not member


# ---------------------------------------------------------------------------------------------- item 4
def group_uid(name: str) -> Optional[str]:
    return rt.get_group(name).uid if rt.is_group_initialized(name) else None


def gcs_keys(prefix: str = "rdt/") -> List[str]:
    import ray.experimental.internal_kv as kv

    return [k.decode() for k in kv._internal_kv_list(prefix, namespace="rdt")]


def init_group(world_size: int, rank: int, name: str, timeout: float) -> int:
    rt.init_collective_group(world_size, rank, "gloo", name, timeout)
    return rank


def _init_actor_side(actors: List[Any], name: str, timeout: float, stagger: float = 0.0) -> List[Any]:
    """Every actor joins as its list index; rank 0 last, ``stagger`` seconds after the others."""
    refs = [a.call.remote(init_group, len(actors), r, name, timeout)
            for r, a in enumerate(actors) if r != 0]
    time.sleep(stagger)
    refs.insert(0, actors[0].call.remote(init_group, len(actors), 0, name, timeout))
    return ray.get(refs, timeout=timeout + 60)


def test_recreate_after_rank0_crash_and_destroy_leaves_nothing(ray_cluster) -> None:
    """Kill rank 0 of an actor-initialised group; a new incarnation with the same name and new actors works even
    when its rank 1 looks the name up first; after destroy on every member no GCS key of either incarnation is left."""
    old = _peers(2)
    new = _peers(2)
    name = "rel-stale"
    try:
        for err, _, _ in _init_actor_side(old, name, 20.0):
            assert err is None, err
        _assert_allreduce(old, name)
        old_uid = _call(old[1], group_uid, name)[1]
        ray.kill(old[0])
        wait_for(lambda: fa.actor_dead(old[0]), timeout=20)
        # rank 1 of the new incarnation finds the dead incarnation's record first
        for err, _, seconds in _init_actor_side(new, name, 20.0, stagger=1.5):
            assert err is None, f"re-creating {name!r} after its rank 0 died failed: {err!r}"
        _assert_allreduce(new, name)
        new_uid = _call(new[0], group_uid, name)[1]
        assert new_uid != old_uid
        for a in (old[1], *new):
            err, _, _ = _call(a, rt.destroy_collective_group, name)
            assert err is None, err
        left = [k for k in _call(new[0], gcs_keys)[1]
                if k.startswith((f"rdt/{old_uid}/", f"rdt/{new_uid}/")) or k == f"rdt/name/{name}"]
        assert not left, f"destroy left {len(left)} GCS keys behind: {left[:8]}"
    finally:
        _kill(old + new)


# ---------------------------------------------------------------------------------------------- item 5
def busy(seconds: float) -> float:
    """(worker side) a long user method that holds the actor's queue."""
    time.sleep(seconds)
    return seconds


def test_driver_destroy_reaches_members_stuck_in_a_collective(trio) -> None:
    """Two members block in an allreduce waiting for a third that is alive but busy in a long user method:
    ``handle.destroy(timeout=...)`` returns in bounded time and both stuck calls raise GroupDestroyedError."""
    actors = trio
    name = "rel-stuck"
    handle = rt.create_collective_group(actors, backend="gloo", group_name=name)
    try:
        _assert_allreduce(actors, name)
        busy_ref = actors[2].call.remote(busy, 8.0)  # still busy 2.5 s after the destroy's timeout, as before
        stuck = [a.call.remote(timed_allreduce, name, 60.0) for a in actors[:2]]
        time.sleep(1.5)  # both are blocked in the allreduce now
        t0 = time.monotonic()
        handle.destroy(timeout=4.0)
        took = time.monotonic() - t0
        assert took < 4.0 + SLACK_S, f"destroy took {took:.1f}s"
        ready, _ = ray.wait(stuck, num_returns=2, timeout=SLACK_S)
        assert len(ready) == 2, f"the stuck allreduce calls still run {time.monotonic() - t0:.1f}s after destroy"
        for err, value, seconds in ray.get(stuck):
            assert err is not None and err.cls is rte.GroupDestroyedError, repr(err or value)
            assert f"group={name!r}" in err.message and "op='allreduce'" in err.message, err.message
        for a in actors[:2]:
            assert _state(a, name) is None
        assert ray.get(busy_ref, timeout=60)[0] is None
        assert wait_for(lambda: _state(actors[2], name) is None, timeout=30)  # its queued destroy ran
    finally:
        handle.destroy(timeout=10)  # a no-op once destroyed


# ---------------------------------------------------------------------------------------------- item 1, nixl
def timed_recv(name: str, src: int, timeout: float) -> None:
    rt.recv(torch.zeros(4), src, name, timeout=timeout)


@pytest.mark.skipif(not HAS_NIXL, reason="nixl is not installed (pip install 'ray-direct-transport[nixl]')")
def test_nixl_peer_of_a_timed_out_member_fails_fast(trio) -> None:
    """Rank 0's recv times out; rank 1, blocked in a recv with a 30 s timeout, fails within about a second after."""
    a, b = trio[:2]
    name = "rel-nixl-timeout"
    handle = rt.create_collective_group([a, b], backend="nixl", group_name=name)
    try:
        _assert_allreduce([a, b], name)
        blocked = b.call.remote(timed_recv, name, 0, 30.0)
        time.sleep(0.5)
        err, _, seconds = _call(a, timed_recv, name, 1, 2.0)
        assert err is not None and err.cls is rte.CollectiveTimeoutError, repr(err)
        ready, _ = ray.wait([blocked], timeout=SLACK_S)
        assert ready, "rank 1 still waits although rank 0's group errored"
        err, _, seconds = ray.get(blocked)
        assert err is not None and issubclass(err.cls, rte.CommunicationError), repr(err)
        assert "rank 0" in err.message and f"group={name!r}" in err.message, err.message
        assert _state(b, name) == "errored"
    finally:
        handle.destroy(timeout=10)
