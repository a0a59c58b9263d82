"""The GPU features' CPU-checkable parts: NCCL import/availability, transport choice and metadata for CUDA
objects, cuda_ipc options, device errors at return time, and the p2p channel's device. No CUDA needed; the real
data paths are in tests/test_gpu.py.
"""

from __future__ import annotations

import importlib
import pickle
import sys
import time

import pytest
import ray
import torch

import rdt
import rdt_transports
from rdt._consumer import resolve as _consumer
from rdt.transports.cuda_ipc import shares as _cuda_ipc
from rdt.transports.nixl import agent as nixl_agent
from rdt._objects.specs import BufferSpec
from rdt._objects.meta import GroupRef, ObjectMeta, ProducerInfo
from rdt.transports import Site, receive
from rdt.errors import BackendUnavailableError, InvalidArgumentError, UnsupportedError

NO_CUDA = not torch.cuda.is_available()
HAS_CUPY = importlib.util.find_spec("cupy") is not None


# ------------------------------------------------------------------------------------------------ helpers
def _meta(device: str = "cuda:0", *, node: str = "node-A", nixl: bool = False, groups=(), ipc=None,
          transport: str = "auto") -> ObjectMeta:
    producer = ProducerInfo(b"p" * 8, 1234, node, "127.0.0.1:1", b"k" * 32, None, "a" * 32,
                            frozenset() if nixl else frozenset({"nixl"}))
    exports = (("cuda_ipc", ipc),) if ipc is not None else ()
    return ObjectMeta(b"\x01" * 16, transport, producer, b"", (), (BufferSpec(1 << 20, device),), tuple(groups),
                      None, exports)


def _site(*, same_node: bool = True, in_actor: bool = True, groups=None, cuda=torch.device("cuda", 0)) -> Site:
    return Site(same_node=same_node, in_actor=in_actor, task_argument=True, groups=groups or {}, cuda_device=cuda)


def _ipc_info(uuid: str = "GPU-0000", map_: bool = False) -> _cuda_ipc.CudaIpcInfo:
    buf = _cuda_ipc.IpcBuffer(uuid, 0, b"h" * 64, 1 << 21, 4096, b"/torch_1_2", 7, b"e" * 64, True, 128, 1 << 20)
    return _cuda_ipc.CudaIpcInfo((buf,), map_)


# ------------------------------------------------------------------------------------------------ NCCL backend
def test_nccl_module_imports_without_cupy_or_cuda():
    before = set(sys.modules)
    mod = importlib.import_module("rdt_transports.backends.nccl")
    assert hasattr(mod, "NcclBackend")
    if not HAS_CUPY:
        assert "cupy" not in set(sys.modules) - before  # the import of cupy is lazy


def test_nccl_capabilities_without_cuda():
    caps = rdt_transports.capabilities("nccl")
    assert caps.name == "nccl" and caps.devices == frozenset({"cuda"})
    assert caps.can_abort and caps.two_sided and not caps.one_sided
    assert {"allreduce", "broadcast", "reduce", "allgather", "reducescatter", "gather", "scatter", "alltoall",
            "barrier"} <= caps.native_collectives
    assert caps.checks_p2p_sizes  # the shared matcher compares size and dtype before NCCL moves a byte


@pytest.mark.skipif(not NO_CUDA, reason="checks the error on machines without CUDA")
def test_nccl_backend_unavailable_before_rendezvous():
    from rdt_transports.backends import BackendConfig
    from rdt_transports.backends.nccl import NcclBackend, check_available

    with pytest.raises(BackendUnavailableError) as ei:
        check_available()
    assert "ray-direct-transport[gpu]" in str(ei.value) and "cupy" in str(ei.value) or "CUDA" in str(ei.value)

    class Spy:
        calls = []

        def __getattr__(self, name):
            Spy.calls.append(name)
            raise AssertionError(f"rendezvous touched: {name}")

    cfg = BackendConfig("g", "0" * 32, 0, 2, 5.0, b"s" * 32, Spy())
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailableError) as ei:
        NcclBackend(cfg)
    assert time.monotonic() - t0 < 2.0
    assert Spy.calls == []
    assert ei.value.hint and "pip install" in ei.value.hint


def test_nccl_uid_encoding_accepts_bytes_and_tuples():
    from rdt_transports.backends import nccl

    raw = bytes(range(128))
    assert nccl._encode_uid(raw) == raw
    signed = tuple(((b + 128) % 256) - 128 for b in raw)
    assert nccl._encode_uid(signed) == raw
    assert nccl._decode_uid(raw) == raw
    with pytest.raises(rdt_transports.CommunicationError):
        nccl._decode_uid(b"short")


def test_op_channel_device_follows_tensors_and_gpu_only_backends():
    from rdt_transports.group import _device_of, _OpChannel
    from rdt_transports.types import Capabilities

    class FakeBackend:
        capabilities = Capabilities(name="fake", devices=frozenset({"cuda"}))
        device = 1
        rank, world_size = 0, 2

    class FakeGroup:
        backend = FakeBackend()
        rank, world_size = 0, 2

    assert _OpChannel(FakeGroup(), 0, time.monotonic() + 1, "barrier").device == torch.device("cuda", 1)
    t = torch.zeros(2)
    assert _OpChannel(FakeGroup(), 0, time.monotonic() + 1, "allreduce", _device_of({"tensor": t})).device == t.device
    assert _device_of({"outputs": [torch.zeros(1)], "root": 0}) == torch.device("cpu")
    assert _device_of({}) is None


# ------------------------------------------------------------------------------------------------ transport choice
def test_auto_prefers_cuda_ipc_on_one_node(monkeypatch):
    monkeypatch.setattr(_cuda_ipc, "visible_devices", lambda: {"GPU-0000": 0})
    assert _consumer.choose(_meta(ipc=_ipc_info()), _site()) == "cuda_ipc"


def test_auto_gpu_order_without_ipc(monkeypatch):
    monkeypatch.setattr(_cuda_ipc, "visible_devices", lambda: {})  # producer's GPU not visible here
    monkeypatch.setattr(nixl_agent, "available", lambda: True)
    assert _consumer.choose(_meta(ipc=_ipc_info(), nixl=True), _site()) == "nixl"
    monkeypatch.setattr(nixl_agent, "available", lambda: False)
    ref = GroupRef("u" * 32, "g", "nccl", 0)
    site = _site(groups={"nccl": (object(), ref)})
    assert _consumer.choose(_meta(ipc=_ipc_info(), nixl=True, groups=[ref]), site) == "nccl"
    assert _consumer.choose(_meta(ipc=_ipc_info()), _site()) == "object_store"


def test_auto_gpu_other_node_skips_ipc(monkeypatch):
    monkeypatch.setattr(_cuda_ipc, "visible_devices", lambda: {"GPU-0000": 0})
    monkeypatch.setattr(nixl_agent, "available", lambda: False)
    assert _consumer.choose(_meta(ipc=_ipc_info()), _site(same_node=False)) == "object_store"


def test_auto_cpu_order_unchanged():
    assert _consumer.choose(_meta("cpu"), _site(cuda=None)) == "shm"
    assert _consumer.choose(_meta("cpu"), _site(same_node=False, cuda=None)) == "object_store"


def test_gpu_objects_come_to_cpu_in_a_process_without_cuda(monkeypatch):
    monkeypatch.setattr(receive, "target_device", lambda: None)
    assert _consumer.site_for(_meta()).cuda_device is None
    monkeypatch.setattr(receive, "target_device", lambda: torch.device("cuda", 0))
    assert _consumer.site_for(_meta()).cuda_device == torch.device("cuda", 0)
    assert _consumer.site_for(_meta("cpu")).cuda_device is None  # CPU objects never ask for a GPU


def test_explicit_cuda_ipc_checks_before_anything_moves(monkeypatch):
    meta = _meta(ipc=_ipc_info(), transport="cuda_ipc")
    monkeypatch.setattr(_cuda_ipc, "visible_devices", lambda: {})
    with pytest.raises(UnsupportedError) as ei:
        _consumer.choose(meta, _site())
    assert "not visible" in str(ei.value) and ei.value.hint
    assert _consumer.choose(meta, _site(in_actor=False)) == "object_store"  # the driver: through host memory
    monkeypatch.setattr(_cuda_ipc, "visible_devices", lambda: {"GPU-0000": 3})
    assert _consumer.choose(meta, _site()) == "cuda_ipc"
    with pytest.raises(UnsupportedError, match="another node"):
        _consumer.choose(meta, _site(same_node=False))


def test_nixl_vram_object_reaches_a_consumer_without_cuda_through_host_memory(monkeypatch):
    """A GPU run (2026-11-27, H100) saw NIXL's READ of a producer's VRAM fail in a consumer with
    CUDA_VISIBLE_DEVICES="": such a consumer takes the fallback (host memory; tensors arrive on the CPU), for an
    explicit "nixl" object and under "auto"; a consumer with CUDA still READs over NIXL."""
    monkeypatch.setattr(nixl_agent, "available", lambda: True)
    monkeypatch.setattr(_cuda_ipc, "visible_devices", lambda: {})
    explicit = _meta(nixl=True, transport="nixl")
    assert _consumer.choose(explicit, _site(cuda=None)) == "object_store"
    assert _consumer.choose(explicit, _site(cuda=None, in_actor=False)) == "object_store"
    assert _consumer.choose(_meta(nixl=True), _site(cuda=None)) == "object_store"
    assert _consumer.choose(explicit, _site()) == "nixl"
    assert _consumer.choose(_meta("cpu", nixl=True, transport="nixl"), _site(cuda=None)) == "nixl"  # DRAM: NIXL


# ------------------------------------------------------------------------------------------------ metadata
def test_cuda_ipc_metadata_encoding():
    info = _ipc_info(map_=True)
    back = pickle.loads(pickle.dumps(info))
    assert back == info and back.map is True and back.uuids() == ("GPU-0000",)
    b = back.buffers[0]
    assert (b.storage_offset, b.buffer_offset, b.nbytes, b.event_sync_required) == (4096, 128, 1 << 20, True)
    meta = _meta(ipc=info)
    assert meta.export("cuda_ipc") is info and _meta().export("cuda_ipc") is None
    assert pickle.loads(pickle.dumps(meta.exports)) == meta.exports  # descriptors travel inside the metadata


def test_cuda_ipc_can_open_needs_every_gpu(monkeypatch):
    monkeypatch.setattr(_cuda_ipc, "visible_devices", lambda: {"GPU-0000": 0})
    assert _cuda_ipc.can_open(_ipc_info())
    assert not _cuda_ipc.can_open(_ipc_info("GPU-9999"))
    assert not _cuda_ipc.can_open(None)


@pytest.mark.skipif(not NO_CUDA, reason="checks the CPU-only answer")
def test_no_visible_gpus_without_cuda():
    assert _cuda_ipc.visible_devices() == {} and _cuda_ipc.target_device() is None


def test_ipc_map_option_validation():
    rdt.tensor_method(tensor_transport="cuda_ipc", ipc_map=True)
    rdt.tensor_method(tensor_transport="auto", ipc_map=True)
    with pytest.raises(InvalidArgumentError, match="ipc_map"):
        rdt.tensor_method(tensor_transport="gloo", ipc_map=True)
    with pytest.raises(InvalidArgumentError, match="ipc_map"):
        rdt.tensor_method(tensor_transport="cuda_ipc", ipc_map="yes")


# ------------------------------------------------------------------------------------------------ real actors
@ray.remote
class CpuNode:
    @rdt.tensor_method(tensor_transport="nccl")
    def cpu_on_nccl(self):
        return torch.ones(4)

    @rdt.tensor_method(tensor_transport="cuda_ipc", ipc_map=True)
    def cpu_on_cuda_ipc(self):
        return {"w": torch.ones(4)}

    def join_nccl(self):
        try:
            rdt_transports.init_collective_group(2, 0, backend="nccl", group_name="cpu-nccl", timeout=5)
        except BackendUnavailableError as e:
            return type(e).__name__, str(e)
        return None, ""

    def groups(self):
        from rdt_transports._context import get_context

        return get_context().names()


@pytest.fixture(scope="module")
def cpu_nodes(ray_cluster):
    actors = [CpuNode.remote() for _ in range(2)]
    yield actors
    for a in actors:
        ray.kill(a)


@pytest.mark.parametrize("method", ["cpu_on_nccl", "cpu_on_cuda_ipc"])
def test_cpu_tensor_on_gpu_only_transport_fails_in_the_actor(cpu_nodes, method):
    ref = getattr(cpu_nodes[0], method).remote()
    with pytest.raises(UnsupportedError) as ei:
        ray.get(ref, timeout=60)
    assert "CUDA tensors only" in str(ei.value)
    assert ei.value.hint and ".cuda()" in ei.value.hint


@pytest.mark.skipif(not NO_CUDA, reason="checks the CPU-only failure")
def test_create_nccl_group_on_cpu_fails_fast(cpu_nodes):
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailableError) as ei:
        rdt_transports.create_collective_group(cpu_nodes, backend="nccl", group_name="cpu-nccl", timeout=20)
    assert time.monotonic() - t0 < 15  # no rendezvous wait
    msg = str(ei.value)
    assert "rank 0" in msg and "rank 1" in msg and "pip install" in msg
    assert ray.get([a.groups.remote() for a in cpu_nodes]) == [[], []]  # nobody joined anything
    name, text = ray.get(cpu_nodes[0].join_nccl.remote(), timeout=30)
    assert name == "BackendUnavailableError" and "ray-direct-transport[gpu]" in text


def test_create_group_never_waits_past_its_timeout(cpu_nodes):
    """A member Ray cannot place (its resources do not exist) answers nothing: create_collective_group fails at its
    timeout naming that member, in the preflight (nccl) and in the join (gloo), instead of timeout + 10 s per phase
    (the first GPU run waited ~60 s for timeout=20)."""
    never = CpuNode.options(resources={"rdt_no_such_resource": 1}).remote()
    try:
        for backend in ("nccl", "gloo"):
            t0 = time.monotonic()
            with pytest.raises(rdt_transports.GroupError) as ei:
                rdt_transports.create_collective_group([cpu_nodes[0], never], backend=backend,
                                                       group_name=f"never-{backend}", timeout=3)
            took = time.monotonic() - t0
            assert took < 3 + 3.0, (backend, took)
            assert never._actor_id.hex() in str(ei.value) and "rank 1" in str(ei.value), str(ei.value)
    finally:
        ray.kill(never)
    ray.get(cpu_nodes[0].groups.remote(), timeout=30)  # the placed member is still usable
