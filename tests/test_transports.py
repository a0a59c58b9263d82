"""The object layer's transport contract: declared capabilities, the registry, auto's chain, user transports.

On a real local Ray cluster with real transports; the user transports are in tests/_transport_actors.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import ray

import rdt
from rdt import transports
from rdt.errors import InvalidArgumentError, UnsupportedError
from tests import _transport_actors as ta
from tests._object_actors import Node

ROOT = Path(__file__).resolve().parents[1]


def test_every_builtin_transport_declares_capabilities():
    for name in transports.names():
        if name == "auto":
            continue
        caps = transports.get(name).capabilities
        assert isinstance(caps, transports.Capabilities) and caps.name == name
        assert caps.devices and caps.devices <= {"cpu", "cuda"}
    assert transports.fallback().capabilities.universal
    chain = [t.capabilities.auto_priority for t in transports.auto_chain()]
    assert chain == sorted(chain) and transports.fallback() is transports.auto_chain()[-1]


def test_cores_name_no_transport():
    """The producer and consumer cores dispatch only through the registry: no transport name appears in them."""
    names = {n for n in transports.names() if n != "auto"}
    for module in ("_producer/produce.py", "_consumer/resolve.py", "_process/context.py"):
        tree = ast.parse((ROOT / "rdt" / module).read_text())
        found = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in names}
        assert not found, f"rdt/{module} names transports {found}: dispatch through rdt.transports instead"


def test_transports_never_import_the_cores():
    for path in (ROOT / "rdt" / "transports").rglob("*.py"):  # every transport's folder (tests/test_layering.py: more)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("rdt_transports"):
                assert not {"_producer", "_consumer", "_process"} & set(node.module.split(".")), (path.name, node.module)


def test_register_transport_refuses_bad_input():
    with pytest.raises(InvalidArgumentError):
        rdt.register_transport(object())  # type: ignore[arg-type]

    class Shadow(transports.Transport):
        capabilities = transports.Capabilities(name="shm", devices=frozenset({"cpu"}))

        def fetch(self, ctx, meta, site, deadline):  # pragma: no cover - never called
            raise AssertionError

    with pytest.raises(InvalidArgumentError, match="taken"):
        rdt.register_transport(Shadow())
    with pytest.raises(UnsupportedError, match="not registered"):
        transports.get("no_such_transport")


def test_two_handlers_for_one_control_message_are_refused():
    """A transport may not take a control message another handler serves (a built-in's, or the channel's own);
    the group transports, which share one handler per message, are one server of it."""
    from rdt._control.wire import REQ_PING, USER_MESSAGES_FROM

    def serve(ctx, key_id, payload):  # pragma: no cover - never called
        raise AssertionError

    class Taker(transports.Transport):
        capabilities = transports.Capabilities(name="taker", devices=frozenset({"cpu"}))

        def __init__(self, msg: int) -> None:
            self.msg = msg

        def fetch(self, ctx, meta, site, deadline):  # pragma: no cover - never called
            raise AssertionError

        def handlers(self):
            return {self.msg: (serve, (0,))}

    group_msgs = set(transports.get("gloo").handlers())  # whole fetches, relay, range reads: nccl serves the same
    assert set(transports.get("nccl").handlers()) == group_msgs and set(transports.served()) >= group_msgs
    for msg, owner in ((min(group_msgs), "'gloo'"), (REQ_PING, "control channel")):
        with pytest.raises(InvalidArgumentError, match=owner):
            rdt.register_transport(Taker(msg))
        assert "taker" not in transports.names()
    rdt.register_transport(Taker(USER_MESSAGES_FROM))
    try:
        assert transports.served()[USER_MESSAGES_FROM][0] == "taker"
        assert "taker" in rdt.TRANSPORTS and rdt.TRANSPORTS[-1] == "auto"  # the list is the registry's
    finally:
        transports.unregister_transport("taker")
    assert "taker" not in rdt.TRANSPORTS


@pytest.fixture(scope="module")
def nodes(ray_cluster):
    actors = [Node.remote() for _ in range(2)]
    ray.get([a.configure.remote(inline_threshold=0) for a in actors])
    yield actors
    for a in actors:
        ray.kill(a)


def test_auto_moves_on_when_the_first_transport_cannot_set_up(nodes):
    """A transport first in auto's chain that fails to set up in the consumer: the next one serves the fetch."""
    producer, consumer = nodes
    ray.get([a.__ray_call__.remote(ta.register, "never") for a in nodes])
    try:
        ref = producer.make_auto.remote(1 << 16, 2.0)
        assert ray.get(consumer.total.remote(ref)) == 2.0 * (1 << 16)
        paths = ray.get(consumer.stats.remote())["paths"]
        assert "never" not in paths and any(p.startswith("shm") for p in paths), paths
    finally:
        ray.get([a.__ray_call__.remote(ta.unregister, "never") for a in nodes])


def test_a_process_without_the_users_transport_gets_a_typed_error(nodes):
    producer, consumer = nodes
    ray.get(producer.__ray_call__.remote(ta.register, "producer_only"))
    try:
        [ref] = ray.get(producer.__ray_call__.remote(ta.put_with, "producer_only", 1 << 16))
        with pytest.raises(UnsupportedError, match="'producer_only' is not registered"):
            ray.get(consumer.total.remote(ref))
    finally:
        ray.get(producer.__ray_call__.remote(ta.unregister, "producer_only"))


def test_stats_name_the_path_that_served(nodes):
    producer, consumer = nodes
    before = ray.get(consumer.stats.remote())["paths"]
    ref = producer.make_shm.remote(1 << 16, 1.0)
    assert ray.get(consumer.total.remote(ref)) == float(1 << 16)
    after = ray.get(consumer.stats.remote())["paths"]
    served = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert sum(served.values()) == 1 and (served.get("shm-direct") or served.get("shm-segment")), served
    ray.get(producer.configure.remote(inline_threshold=1 << 16))  # 64 bytes: carried in the metadata
    try:
        ref = producer.make_gloo.remote(16, 1.0)
        assert ray.get(consumer.total.remote(ref)) == 16.0
        assert ray.get(consumer.stats.remote())["paths"].get("inline", 0) >= 1
    finally:
        ray.get(producer.configure.remote(inline_threshold=0))
