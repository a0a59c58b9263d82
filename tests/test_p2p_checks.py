"""send/recv size and dtype checks on every backend, over sequences of messages on one pair.

Gloo's checks agree on a (size, dtype) once per direction and then send without a header (rdt_transports/
_checked_p2p.py); these tests walk every way the two sides can disagree after an agreement and check who raises
and when: the receiver at once with its tensor untouched, the sender at once for a large message or a changed
shape, and at its next send to that peer for a small one. Shape changes that both sides make are not errors.
"""

from __future__ import annotations

import threading
import time
from typing import Any, List, Optional, Sequence, Tuple

import pytest
import ray
import torch

import rdt_transports as rt
from rdt_transports import GroupDestroyedError

from . import _collective_cases as cc
from .conftest import HAS_NIXL, HAS_UCXX

Step = Tuple[int, str]  # (number of elements, dtype name)
SMALL = (1024, "float32")  # 4 KiB
LARGE = (4 << 20, "float32")  # 16 MiB: the sender learns of a mismatch at once


def _require(backend: str) -> None:
    if backend == "nixl" and not HAS_NIXL:
        pytest.skip("nixl is not installed (pip install 'ray-direct-transport[nixl]')")
    if backend == "ucx" and not HAS_UCXX:
        pytest.skip("ucxx is not installed (pip install 'ray-direct-transport[ucx]')")


@pytest.fixture(scope="module")
def pair(ray_cluster):
    actors = [cc.CollectiveWorker.remote() for _ in range(2)]
    ray.get([a.ping.remote() for a in actors], timeout=120)
    yield actors
    for a in actors:
        ray.kill(a)


def send_steps(name: str, steps: Sequence[Step], timeout: float) -> List[Any]:
    """Send each step (filled with its index + 1); stop at the first error, recording it and when it came."""
    out: List[Any] = []
    for i, (n, dtype) in enumerate(steps):
        t0 = time.monotonic()
        try:
            rt.send(torch.full((n,), i + 1, dtype=cc.DTYPES[dtype]), 1, name, timeout=timeout)
            out.append("ok")
        except Exception as e:  # noqa: BLE001 - carried to the driver
            out.append((type(e).__name__, str(e), time.monotonic() - t0))
            break
    return out


def recv_steps(name: str, steps: Sequence[Step], timeout: float) -> List[Any]:
    """Receive each step into a tensor of -1s; record whether the values arrived, or the error and the tensor."""
    out: List[Any] = []
    for i, (n, dtype) in enumerate(steps):
        t = torch.full((n,), -1, dtype=cc.DTYPES[dtype])
        t0 = time.monotonic()
        try:
            rt.recv(t, 0, name, timeout=timeout)
            out.append("ok" if bool((t == i + 1).all()) else f"wrong values at step {i}: {t[:4].tolist()}")
        except Exception as e:  # noqa: BLE001 - carried to the driver
            out.append((type(e).__name__, str(e), time.monotonic() - t0, bool((t == -1).all())))
            break
    return out


def _run(pair: List[Any], backend: str, name: str, sends: Sequence[Step], recvs: Sequence[Step],
         timeout: float = 20.0) -> Tuple[List[Any], List[Any]]:
    handle = rt.create_collective_group(pair, backend=backend, group_name=name)
    try:
        (e0, sent, _), (e1, got, _) = ray.get([pair[0].call.remote(send_steps, name, sends, timeout),
                                               pair[1].call.remote(recv_steps, name, recvs, timeout)], timeout=120)
        assert e0 is None and e1 is None, (e0, e1)
        return sent, got
    finally:
        handle.destroy(timeout=20)


BACKENDS = ["gloo", "nixl", "ucx"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes_both_sides_change_are_not_errors(pair, backend: str) -> None:
    _require(backend)
    steps = [SMALL, SMALL, (16384, "float32"), (16384, "float32"), (1024, "int32"), SMALL, LARGE, LARGE, SMALL]
    sent, got = _run(pair, backend, f"chk-ok-{backend}", steps, steps)
    assert sent == ["ok"] * len(steps) and got == ["ok"] * len(steps), (sent, got)


def test_gloo_many_fresh_receive_tensors_and_size_changes(pair) -> None:
    """Gloo's receiver keeps a canary window per receive address: 300 receives into fresh tensors (freed addresses
    come back, and more addresses than it keeps windows for), the size changing twice, all arrive intact."""
    from rdt_transports._checked_p2p import WINDOWS

    steps = [SMALL] * 100 + [(16384, "float32")] * 100 + [(512, "float64")] * 100
    assert len(steps) > 2 * WINDOWS
    sent, got = _run(pair, "gloo", "chk-fresh-gloo", steps, steps)
    assert sent == ["ok"] * len(steps) and got == ["ok"] * len(steps), (sent[-3:], got[-3:])


def _is_mismatch(entry: Any, *, fast: bool = True, untouched: Optional[bool] = None) -> str:
    assert isinstance(entry, tuple) and entry[0] == "TensorMismatchError", entry
    assert "Fix:" in entry[1], entry[1]
    if fast:
        assert entry[2] < 10.0, f"raised only after {entry[2]:.1f}s (its timeout is 20 s): {entry[1]}"
    if untouched is not None:
        assert entry[3] is untouched, f"receive tensor {'modified' if untouched else 'untouched'}: {entry[1]}"
    return entry[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_receiver_changes_small(pair, backend: str) -> None:
    """After two agreed messages the receiver expects another size: it raises at once with its tensor untouched;
    the sender's small send completes and its next send to that peer raises."""
    _require(backend)
    sent, got = _run(pair, backend, f"chk-rs-{backend}", [SMALL, SMALL, SMALL, SMALL], [SMALL, (2048, "float32")])
    assert got[0] == "ok", got
    _is_mismatch(got[1], untouched=True)
    assert sent[0] == "ok" and len(sent) <= 3, sent
    _is_mismatch(sent[-1])  # at the second send (it knows at once) or at the third (the next one on that pair)


@pytest.mark.parametrize("backend", BACKENDS)
def test_receiver_changes_dtype_large(pair, backend: str) -> None:
    """Same bytes, another dtype, 16 MiB: both sides raise on that very message."""
    _require(backend)
    sent, got = _run(pair, backend, f"chk-rl-{backend}", [LARGE, LARGE, LARGE], [LARGE, (4 << 20, "int32")])
    assert got[0] == "ok" and sent[0] == "ok", (sent, got)
    _is_mismatch(got[1], untouched=True)
    assert len(sent) == 2, f"the sender did not raise on the mismatched large message: {sent}"
    _is_mismatch(sent[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_changes(pair, backend: str) -> None:
    """After an agreement the sender changes size: both raise on that message; the receiver's tensor untouched."""
    _require(backend)
    sent, got = _run(pair, backend, f"chk-sc-{backend}", [SMALL, (512, "float32")], [SMALL, SMALL])
    assert got[0] == "ok" and sent[0] == "ok", (sent, got)
    _is_mismatch(got[1], untouched=True)
    assert len(sent) == 2, sent
    _is_mismatch(sent[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_changes_after_a_large_agreement(pair, backend: str) -> None:
    """After a 16 MiB agreement the sender sends another size while the receiver keeps 16 MiB: both raise on that
    message (Gloo: the receiver's verdict went out before the message), the receiver's tensor untouched."""
    _require(backend)
    sent, got = _run(pair, backend, f"chk-sl-{backend}", [LARGE, SMALL], [LARGE, LARGE])
    assert got[0] == "ok" and sent[0] == "ok", (sent, got)
    _is_mismatch(got[1], untouched=True)
    assert len(sent) == 2, sent
    _is_mismatch(sent[1])


def test_gloo_small_mismatch_names_the_earlier_send(pair) -> None:
    """Gloo's sender learns of a small message's mismatch at its next send, which says so and sends nothing."""
    sent, got = _run(pair, "gloo", "chk-late-gloo", [SMALL, SMALL, SMALL], [SMALL, (2048, "float32")])
    assert sent[:2] == ["ok", "ok"], sent
    msg = _is_mismatch(sent[2])
    assert "refused an earlier send" in msg and "2048 elements" not in msg and "8192 bytes" in msg, msg


# ---------------------------------------------------------------------------------------------- gloo waits
def _pairs_known(name: str) -> int:
    pairs = rt.get_group(name).backend._pairs
    return -1 if pairs is None else len(pairs)


def recv_blocked(name: str, timeout: float) -> Tuple[str, float]:
    t0 = time.monotonic()
    try:
        rt.recv(torch.zeros(16), 0, name, timeout=timeout)
        return "returned", time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - carried to the driver
        return type(e).__name__, time.monotonic() - t0


def test_gloo_waits_in_place_and_abort_wakes_them(pair) -> None:
    """Gloo's waits run in the caller's thread (its pair sockets are known), and an abort still ends a receive
    that is blocked inside Gloo at once, on the rank that aborts and on the one that was never told."""
    name = "chk-abort-gloo"
    handle = rt.create_collective_group(pair, backend="gloo", group_name=name)
    try:
        known = ray.get([a.call.remote(_pairs_known, name) for a in pair], timeout=60)
        assert [k for _, k, _ in known] == [1, 1], known
        blocked = pair[1].call.remote(recv_blocked, name, 60.0)
        time.sleep(1.5)  # let it block in Gloo
        t0 = time.monotonic()
        handle.abort("test: abort a blocked recv")
        err, (what, took), _ = ray.get(blocked, timeout=60)
        assert err is None, err
        assert what == GroupDestroyedError.__name__ and time.monotonic() - t0 < 10.0, (what, took)
    finally:
        handle.destroy(timeout=20)


def local_group_abort(name: str) -> Tuple[str, float]:
    """In one actor: a thread blocks in recv, this thread aborts the group locally; the recv must end at once."""
    result: List[Any] = []

    def blocked() -> None:
        result.append(recv_blocked(name, 60.0))

    th = threading.Thread(target=blocked)
    th.start()
    time.sleep(1.0)
    rt.get_group(name).abort("test")
    th.join(30)
    return result[0] if result else ("still blocked", 30.0)


def test_gloo_local_abort_wakes_blocked_recv(pair) -> None:
    name = "chk-local-abort-gloo"
    handle = rt.create_collective_group(pair, backend="gloo", group_name=name)
    try:
        err, (what, took), _ = ray.get(pair[1].call.remote(local_group_abort, name), timeout=60)
        assert err is None, err
        assert what == GroupDestroyedError.__name__ and took < 5.0, (what, took)
    finally:
        handle.destroy(timeout=20)
