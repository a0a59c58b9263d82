"""GPU data paths: cuda_ipc and NIXL VRAM between two actors sharing one GPU, NCCL between two GPUs, ray.get of a
GPU object on the driver, device-mismatch errors with real CUDA tensors.

Every test here is marked ``gpu`` (NCCL ones also ``multi_gpu``) and skips with the reason where CUDA, a second
GPU, cupy or NIXL is missing. Run them with ``pytest -m gpu`` on a GPU machine.
"""

from __future__ import annotations

import importlib.util

import pytest
import ray
import torch

import rdt
import rdt_transports
from rdt.errors import UnsupportedError

from .conftest import HAS_NIXL

HAS_CUDA = torch.cuda.is_available()
N_GPUS = torch.cuda.device_count() if HAS_CUDA else 0
HAS_CUPY = importlib.util.find_spec("cupy") is not None
N = 1 << 20  # 4 MiB of float32: out of band

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA (torch.cuda.is_available() is False)"),
]


@ray.remote(num_gpus=0.5)
class GpuNode:
    @rdt.tensor_method(tensor_transport="cuda_ipc")
    def make_ipc(self, n, v):
        return {"w": torch.full((n,), v, device="cuda"), "b": torch.arange(8, device="cuda")}

    @rdt.tensor_method(tensor_transport="cuda_ipc", ipc_map=True)
    def make_ipc_map(self, n, v):
        self.kept = torch.full((n,), v, device="cuda")
        return self.kept

    @rdt.tensor_method(tensor_transport="nixl")
    def make_nixl(self, n, v):
        return torch.full((n,), v, device="cuda")

    @rdt.tensor_method(tensor_transport="auto")
    def make_auto(self, n, v):
        return torch.full((n,), v, device="cuda")

    @rdt.tensor_method(tensor_transport="nccl")
    def make_nccl(self, n, v):
        return torch.full((n,), v, device="cuda")

    def _slow_fill(self, n, v):
        """The same storage every call, filled by a kernel still running at return on a stream that stays current
        after it (what rdt/_ready covers: every path must wait for it before reading)."""
        if getattr(self, "side", None) is None:
            self.side = torch.cuda.Stream()
            torch.cuda.set_stream(self.side)
            self.slow_buf = torch.zeros(n, device="cuda")
        torch.cuda._sleep(int(5e8))  # ~0.25 s of GPU time queued before the write
        self.slow_buf.fill_(v)
        return self.slow_buf

    @rdt.tensor_method(tensor_transport="cuda_ipc")
    def slow_ipc(self, n, v):
        return self._slow_fill(n, v)

    @rdt.tensor_method(tensor_transport="nixl")
    def slow_nixl(self, n, v):
        return self._slow_fill(n, v)

    @rdt.tensor_method(tensor_transport="auto")
    def slow_auto(self, n, v):
        return self._slow_fill(n, v)

    @rdt.tensor_method(tensor_transport="object_store")
    def slow_store(self, n, v):
        return self._slow_fill(n, v)

    @rdt.tensor_method(tensor_transport="gloo")
    def cuda_on_gloo(self):
        return torch.ones(4, device="cuda")

    @rdt.tensor_method(tensor_transport="shm")
    def cuda_on_shm(self):
        return torch.ones(4, device="cuda")

    def describe(self, x):
        t = x["w"] if isinstance(x, dict) else x
        return {"device": str(t.device), "sum": float(t.sum().item()), "path": self.last_path(),
                "current": torch.cuda.current_device()}

    def landing(self):
        """This process's NIXL landing blocks (rdt.stats()["nixl_landing"])."""
        return rdt.stats()["nixl_landing"]

    def keep(self, x):
        """Keep a fetched tensor (its landing block stays lent); its sum now."""
        self.kept = x
        return float(x.sum().item())

    def kept_sum(self):
        return float(self.kept.sum().item())

    def last_path(self):
        """The path that served this actor's latest fetch (the one whose count grew since the previous call)."""
        paths = rdt.stats()["paths"]
        grown = [p for p, n in paths.items() if n > getattr(self, "_paths", {}).get(p, 0)]
        self._paths = paths
        return grown[0] if len(grown) == 1 else ",".join(sorted(grown))

    # ---- rdt_transports collectives inside the actor
    def run_collectives(self, group, rank, world):
        g, dev = group, torch.device("cuda", torch.cuda.current_device())
        out = {}
        x = torch.full((4,), float(rank + 1), device=dev)
        rdt_transports.allreduce(x, g)
        out["allreduce"] = x.tolist()
        y = torch.full((4,), float(rank), device=dev)
        rdt_transports.broadcast(y, 1, g)
        out["broadcast"] = y.tolist()
        lst = [torch.zeros(2, device=dev) for _ in range(world)]
        rdt_transports.allgather(lst, torch.full((2,), float(rank), device=dev), g)
        out["allgather"] = [t.tolist() for t in lst]
        rs = torch.zeros(2, device=dev)
        rdt_transports.reducescatter(rs, [torch.full((2,), float(r + 1), device=dev) for r in range(world)], g)
        out["reducescatter"] = rs.tolist()
        red = torch.full((2,), 2.0, device=dev)
        rdt_transports.reduce(red, 0, g, rdt_transports.ReduceOp.MAX)
        out["reduce"] = red.tolist()
        gl = [torch.zeros(1, device=dev) for _ in range(world)] if rank == 0 else None
        rdt_transports.gather(torch.full((1,), float(rank), device=dev), gl, 0, g)
        out["gather"] = [t.tolist() for t in gl] if gl else None
        sc = torch.zeros(1, device=dev)
        rdt_transports.scatter(sc, [torch.full((1,), float(r * 10), device=dev) for r in range(world)]
                               if rank == 0 else None, 0, g)
        out["scatter"] = sc.tolist()
        outs = [torch.zeros(1, device=dev) for _ in range(world)]
        rdt_transports.alltoall(outs, [torch.full((1,), float(rank * 10 + j), device=dev) for j in range(world)], g)
        out["alltoall"] = [t.tolist() for t in outs]
        rdt_transports.barrier(g)
        # both ranks send to each other at once, then receive: must not deadlock
        peer = 1 - rank
        buf = torch.zeros(N, device=dev)
        import threading

        t = threading.Thread(target=rdt_transports.send, args=(torch.full((N,), float(rank), device=dev), peer, g))
        t.start()
        rdt_transports.recv(buf, peer, g)
        t.join()
        out["exchange"] = float(buf[0].item())
        return out

    def recv_nothing(self, group):
        try:
            rdt_transports.recv(torch.zeros(4, device="cuda"), 1, group, timeout=3)
        except rdt_transports.CollectiveTimeoutError as e:
            return type(e).__name__
        return "no error"


@pytest.fixture(scope="module")
def shared_gpu(ray_cluster):
    """Two actors on one GPU (num_gpus=0.5 each)."""
    a, b = GpuNode.remote(), GpuNode.remote()
    yield a, b
    ray.kill(a)
    ray.kill(b)


def test_cuda_ipc_copy_between_actors_on_one_gpu(shared_gpu):
    a, b = shared_gpu
    info = ray.get(b.describe.remote(a.make_ipc.remote(N, 2.0)), timeout=120)
    assert info["path"] == "cuda_ipc"
    assert info["device"] == f"cuda:{info['current']}"
    assert info["sum"] == 2.0 * N


def test_cuda_ipc_map(shared_gpu):
    a, b = shared_gpu
    info = ray.get(b.describe.remote(a.make_ipc_map.remote(N, 3.0)), timeout=120)
    assert info["path"] == "cuda_ipc-map" and info["sum"] == 3.0 * N


def test_auto_prefers_cuda_ipc_on_one_node(shared_gpu):
    a, b = shared_gpu
    info = ray.get(b.describe.remote(a.make_auto.remote(N, 1.5)), timeout=120)
    assert info["path"] == "cuda_ipc" and info["sum"] == 1.5 * N


@pytest.mark.skipif(not HAS_NIXL, reason="nixl not installed: pip install 'ray-direct-transport[nixl]'")
def test_nixl_vram_between_actors_on_one_gpu(shared_gpu):
    a, b = shared_gpu
    info = ray.get(b.describe.remote(a.make_nixl.remote(N, 4.0)), timeout=120)
    assert info["path"] == "nixl" and info["device"].startswith("cuda") and info["sum"] == 4.0 * N


@pytest.mark.skipif(not HAS_NIXL, reason="nixl not installed: pip install 'ray-direct-transport[nixl]'")
def test_nixl_vram_fetched_every_step_lands_in_one_registered_block(shared_gpu):
    """Fresh VRAM destinations are byte ranges of a registered block, reused once the fetched tensor died (not one
    GPUDirect registration per READ); a tensor the consumer keeps is never written by a later READ."""
    a, b = shared_gpu
    before = ray.get(b.landing.remote(), timeout=60)
    for i in range(20):
        info = ray.get(b.describe.remote(a.make_nixl.remote(N, float(i))), timeout=120)
        assert info["path"] == "nixl" and info["device"].startswith("cuda") and info["sum"] == float(i) * N
    after = ray.get(b.landing.remote(), timeout=60)
    assert after["made"] - before["made"] <= 2 and after["hits"] - before["hits"] >= 18, (before, after)
    assert ray.get(b.keep.remote(a.make_nixl.remote(N, 7.0)), timeout=120) == 7.0 * N
    for i in range(3):
        assert ray.get(b.describe.remote(a.make_nixl.remote(N, 8.0)), timeout=120)["sum"] == 8.0 * N
    assert ray.get(b.kept_sum.remote(), timeout=60) == 7.0 * N


def test_ray_get_of_gpu_object_on_the_driver(shared_gpu):
    a, _ = shared_gpu
    value = ray.get(a.make_ipc.remote(N, 5.0), timeout=120)
    w = value["w"]
    # The driver gets GPU objects on its current GPU when it has one (this test process does), else on CPU.
    assert w.device.type == "cuda"
    assert float(w.sum()) == 5.0 * N and value["b"].tolist() == list(range(8))


@pytest.mark.parametrize("method", ["slow_ipc", "slow_auto", "slow_store", pytest.param(
    "slow_nixl", marks=pytest.mark.skipif(not HAS_NIXL,
                                          reason="nixl not installed: pip install 'ray-direct-transport[nixl]'"))])
def test_kernels_pending_at_return_are_done_before_anyone_reads(shared_gpu, method):
    """Stream discipline (rdt/_ready): the producer's pending write lands before a consumer or the driver reads, the
    second time too (the same storage's cached IPC share / NIXL registration carries no event of its own)."""
    a, b = shared_gpu
    for v in (7.0, 8.0):
        ref = getattr(a, method).remote(N, v)
        assert ray.get(b.describe.remote(ref), timeout=120)["sum"] == v * N
        assert float(ray.get(ref, timeout=120).sum()) == v * N  # the driver: streamed through host memory


@pytest.mark.parametrize("method", ["cuda_on_gloo", "cuda_on_shm"])
def test_cuda_tensor_on_cpu_only_transport_fails(shared_gpu, method):
    with pytest.raises(UnsupportedError, match="CPU tensors only"):
        ray.get(getattr(shared_gpu[0], method).remote(), timeout=60)


def test_cpu_only_backend_refuses_a_real_cuda_tensor():
    from rdt_transports._tensors import check_tensor

    with pytest.raises(rdt_transports.UnsupportedError, match="cannot move cuda tensors"):
        check_tensor(torch.zeros(4, device="cuda"), what="tensor", devices=frozenset({"cpu"}), backend="gloo")


@pytest.fixture(scope="module")
def two_gpus(ray_cluster):
    if N_GPUS < 2 or not HAS_CUPY:
        pytest.skip("needs two CUDA GPUs and cupy")
    a, b = (GpuNode.options(num_gpus=1).remote() for _ in range(2))
    group = rdt_transports.create_collective_group([a, b], backend="nccl", group_name="nccl-test", timeout=120)
    yield a, b, group
    group.destroy()
    ray.kill(a)
    ray.kill(b)


@pytest.mark.multi_gpu
@pytest.mark.skipif(N_GPUS < 2, reason=f"needs two CUDA GPUs, found {N_GPUS}")
@pytest.mark.skipif(not HAS_CUPY, reason="the nccl backend needs cupy: pip install 'ray-direct-transport[gpu]'")
def test_nccl_collectives(two_gpus):
    a, b, _ = two_gpus
    r0, r1 = ray.get([a.run_collectives.remote("nccl-test", 0, 2), b.run_collectives.remote("nccl-test", 1, 2)],
                     timeout=300)
    assert r0["allreduce"] == r1["allreduce"] == [3.0] * 4
    assert r0["broadcast"] == r1["broadcast"] == [1.0] * 4
    assert r0["allgather"] == [[0.0, 0.0], [1.0, 1.0]]
    assert r0["reducescatter"] == [2.0, 2.0] and r1["reducescatter"] == [4.0, 4.0]
    assert r0["reduce"] == [2.0, 2.0]
    assert r0["gather"] == [[0.0], [1.0]]
    assert r0["scatter"] == [0.0] and r1["scatter"] == [10.0]
    assert r0["alltoall"] == [[0.0], [10.0]] and r1["alltoall"] == [[1.0], [11.0]]
    assert r0["exchange"] == 1.0 and r1["exchange"] == 0.0


@pytest.mark.multi_gpu
@pytest.mark.skipif(N_GPUS < 2, reason=f"needs two CUDA GPUs, found {N_GPUS}")
@pytest.mark.skipif(not HAS_CUPY, reason="the nccl backend needs cupy: pip install 'ray-direct-transport[gpu]'")
def test_nccl_object_transfer(two_gpus):
    a, b, _ = two_gpus
    info = ray.get(b.describe.remote(a.make_nccl.remote(N, 6.0)), timeout=120)
    assert info["path"] == "nccl" and info["device"].startswith("cuda") and info["sum"] == 6.0 * N


@pytest.mark.multi_gpu
@pytest.mark.skipif(N_GPUS < 2, reason=f"needs two CUDA GPUs, found {N_GPUS}")
@pytest.mark.skipif(not HAS_CUPY, reason="the nccl backend needs cupy: pip install 'ray-direct-transport[gpu]'")
def test_nccl_timeout_aborts_instead_of_hanging(ray_cluster):
    a, b = (GpuNode.options(num_gpus=1).remote() for _ in range(2))
    group = rdt_transports.create_collective_group([a, b], backend="nccl", group_name="nccl-timeout", timeout=120)
    try:
        assert ray.get(a.recv_nothing.remote("nccl-timeout"), timeout=60) == "CollectiveTimeoutError"
    finally:
        group.destroy()
        ray.kill(a)
        ray.kill(b)


def _nccl_both_ways(name: str) -> dict:
    """(actor side) send to the other rank on one thread while receiving from it on another (issue 13)."""
    import threading

    group = rdt_transports.get_group(name)
    me, other = group.rank, 1 - group.rank
    sizes = [3, 1 << 10, (1 << 20) // 4 + 5, 1 << 19]
    dev = torch.device("cuda", torch.cuda.current_device())
    got = [torch.zeros(n, device=dev) for n in sizes]
    errors: list = []

    def send() -> None:
        try:
            for i, n in enumerate(sizes):
                rdt_transports.send(torch.arange(n, dtype=torch.float32, device=dev) + 100 * i + me, other, name,
                                    timeout=60)
        except Exception as e:  # noqa: BLE001 - reported to the driver
            errors.append(f"send: {e!r}")

    def recv() -> None:
        try:
            for t in got:
                rdt_transports.recv(t, other, name, timeout=60)
        except Exception as e:  # noqa: BLE001
            errors.append(f"recv: {e!r}")

    threads = [threading.Thread(target=send), threading.Thread(target=recv)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    ok = all(torch.equal(got[i].cpu(), torch.arange(n, dtype=torch.float32) + 100 * i + other)
             for i, n in enumerate(sizes))
    return {"errors": errors, "ok": ok, "pending": group.backend._matcher.pending(), "state": group.state.value}


@pytest.mark.multi_gpu
@pytest.mark.skipif(N_GPUS < 2, reason=f"needs two CUDA GPUs, found {N_GPUS}")
@pytest.mark.skipif(not HAS_CUPY, reason="the nccl backend needs cupy: pip install 'ray-direct-transport[gpu]'")
def test_nccl_p2p_both_ways_from_two_threads(two_gpus):
    """Issue 13 on the real NCCL backend: matching is by (peer, tag) whatever thread posts first."""
    a, b, _ = two_gpus
    for _ in range(3):
        out = ray.get([x.__ray_call__.remote(lambda _self: _nccl_both_ways("nccl-test")) for x in (a, b)],
                      timeout=300)
        for rank, r in enumerate(out):
            assert r["errors"] == [], f"rank {rank}: {r['errors']}"
            assert r["ok"] and r["pending"] == 0 and r["state"] == "healthy", (rank, r)
