"""An object freed while a consumer's request attaches an export to it on demand (a shm segment, NIXL
registrations) leaves nothing behind: the export is refused or released, whichever side comes second.

A real producer context in this process (no Ray: the prepare handlers are called as the control server calls
them), real segments in /dev/shm, a real NIXL agent over DRAM. Each interleaving is forced with a hook on the real
component, then both sides also run concurrently from threads.
"""

from __future__ import annotations

import os
import secrets
import threading
from typing import Any, Callable, Iterator, List, Tuple

import pytest
import torch

from rdt import transports
from rdt._control import wire as _control
from rdt._objects.flatten import flatten
from rdt._objects.table import Entry
from rdt._process.context import RdtContext
from rdt.transports.nixl import agent as nixl_agent, transport as nixl_transport
from rdt.transports.shm import segments as _shm, transport as shm_transport
from rdt.transports.shm.segment_pool import SegmentPool
from rdt.transports.shm.state import state as shm_state

from ..conftest import HAS_NIXL

JOIN_S = 10.0


@pytest.fixture
def ctx() -> Iterator[RdtContext]:
    transports.get("shm")  # in use, as in a producer that serves them: their release runs when an object is freed
    if HAS_NIXL:
        transports.get("nixl")
    c = RdtContext()
    shm_state(c).pool = SegmentPool(0, 1.0)  # no pooling: a released segment is unlinked, so live files are the leaks
    yield c
    c.shutdown()


def _segments() -> List[str]:
    """This process's object segments in /dev/shm."""
    return [n for n in os.listdir(_shm.SHM_DIR) if n.startswith(f"{_shm.PREFIX}{os.getpid()}-")]


def _add(ctx: RdtContext, fill: float) -> bytes:
    obj_id = secrets.token_bytes(16)
    ctx.table.add(Entry(obj_id, flatten({"w": torch.full((1 << 14,), fill)}), "auto"))
    return obj_id


def _free_on_another_thread(ctx: RdtContext, obj_id: bytes) -> None:
    """Free the object as Ray's callback thread does, and wait for that to finish (a deadlock fails the test)."""
    t = threading.Thread(target=ctx.table.free, args=(obj_id,), daemon=True)
    t.start()
    t.join(JOIN_S)
    assert not t.is_alive(), "freeing the object waited for the request that attaches an export"


def _after_lookup(ctx: RdtContext, obj_id: bytes) -> None:
    """The request finds the entry, then the object is freed before the request attaches its export."""
    get = ctx.table.get

    def get_then_free(oid: bytes) -> Any:
        entry = get(oid)
        if oid == obj_id:
            _free_on_another_thread(ctx, oid)
        return entry

    ctx.table.get = get_then_free  # type: ignore[method-assign]


def _during(owner: Any, name: str, ctx: RdtContext, obj_id: bytes) -> None:
    """The object is freed while the request attaches its export (inside ``owner.name``)."""
    real: Callable[..., Any] = getattr(owner, name)

    def attach_while_freed(*args: Any, **kwargs: Any) -> Any:
        _free_on_another_thread(ctx, obj_id)
        return real(*args, **kwargs)

    setattr(owner, name, attach_while_freed)


def _answer(resp: Tuple[int, bytes]) -> str:
    status, body = resp
    if status == _control.RESP_OK:
        return "ok"
    assert status == _control.RESP_ERR and int.from_bytes(body[:2], "big") == _control.ERR_NOT_FOUND, resp
    return "not found"


def _prepare_shm(ctx: RdtContext, obj_id: bytes) -> Tuple[int, bytes]:
    return shm_transport._serve_prepare(ctx, _control.KEY_PROCESS, obj_id)


def _prepare_nixl(ctx: RdtContext, obj_id: bytes) -> Tuple[int, bytes]:
    return nixl_transport._serve_prepare(ctx, _control.KEY_PROCESS, obj_id)


def test_shm_segment_requested_after_the_object_was_freed_is_refused(ctx: RdtContext) -> None:
    assert _segments() == []
    obj_id = _add(ctx, 1.0)
    _after_lookup(ctx, obj_id)
    assert _answer(_prepare_shm(ctx, obj_id)) == "not found"
    assert _segments() == [] and len(ctx.table) == 0


def test_shm_segment_written_while_the_object_is_freed_is_released(ctx: RdtContext) -> None:
    assert _segments() == []
    obj_id = _add(ctx, 2.0)
    _during(shm_state(ctx).pool, "write", ctx, obj_id)
    _answer(_prepare_shm(ctx, obj_id))  # answered before the free took effect, or refused: no segment left either way
    assert len(ctx.table) == 0
    assert _segments() == [], "a segment written for a freed object was never released"


@pytest.mark.skipif(not HAS_NIXL, reason="nixl not installed")
def test_nixl_registration_requested_after_the_object_was_freed_is_refused(ctx: RdtContext) -> None:
    regs = nixl_agent.agent(ctx).registrations
    obj_id = _add(ctx, 1.0)
    _after_lookup(ctx, obj_id)
    assert _answer(_prepare_nixl(ctx, obj_id)) == "not found"
    assert len(regs) == 0 and len(ctx.table) == 0


@pytest.mark.skipif(not HAS_NIXL, reason="nixl not installed")
def test_nixl_registration_made_while_the_object_is_freed_is_released(ctx: RdtContext) -> None:
    regs = nixl_agent.agent(ctx).registrations
    obj_id = _add(ctx, 2.0)
    _during(regs, "acquire_many", ctx, obj_id)
    _answer(_prepare_nixl(ctx, obj_id))
    assert len(ctx.table) == 0
    assert len(regs) == 0, "a NIXL registration made for a freed object was never released"


@pytest.mark.parametrize("transport", ["shm", "nixl"])
def test_concurrent_prepares_and_frees_leave_no_export(ctx: RdtContext, transport: str) -> None:
    if transport == "nixl" and not HAS_NIXL:
        pytest.skip("nixl not installed")
    prepare = _prepare_shm if transport == "shm" else _prepare_nixl
    ids = [_add(ctx, float(i)) for i in range(200)]
    answers: List[str] = []
    errors: List[BaseException] = []

    def serve() -> None:
        try:
            for oid in ids:
                answers.append(_answer(prepare(ctx, oid)))
        except BaseException as e:  # surfaced below
            errors.append(e)

    def free() -> None:
        for oid in ids:
            ctx.table.free(oid)

    threads = [threading.Thread(target=serve, daemon=True), threading.Thread(target=free, daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert len(answers) == len(ids) and len(ctx.table) == 0
    if transport == "shm":
        assert _segments() == []
    else:
        ag = ctx.peek_transport_state("nixl")
        assert ag is not None and len(ag.registrations) == 0
