"""GPU paths that had never run, each on one GPU: a one-rank NCCL group (every collective, a timeout while an NCCL
call is really queued, abort), two NCCL ranks on one GPU refused before NCCL is called, a mixed CPU+CUDA dict over
``auto`` and ``object_store``, VRAM ``into=`` targets over NIXL and CUDA IPC, GPU tensors streamed through host
memory to a driver without CUDA, and the CUDA IPC share count of weights returned 1 000 times.

Marked ``gpu``; skipped with the reason where CUDA (or cupy, or NIXL) is missing. Every wait is bounded, so a broken
path fails with its message instead of hanging (scripts/gpu-check also gives each test 60 s).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import ray
import torch

import rdt
import rdt_transports

from .conftest import HAS_NIXL, wait_for

HAS_CUDA = torch.cuda.is_available()
HAS_CUPY = importlib.util.find_spec("cupy") is not None
N = 1 << 20  # 4 MiB of float32: out of band
NAMESPACE = "rdt-gpu-paths"
STEPS = 1000

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA (torch.cuda.is_available() is False)"),
]
needs_cupy = pytest.mark.skipif(not HAS_CUPY, reason="the nccl backend needs cupy: pip install 'ray-direct-transport[gpu]'")
needs_nixl = pytest.mark.skipif(not HAS_NIXL, reason="nixl not installed: pip install 'ray-direct-transport[nixl]'")


def _mixed(n: int, v: float) -> dict:
    return {"w": torch.full((n,), v, device="cuda"), "step": torch.tensor([7], dtype=torch.int64),
            "cpu": torch.full((n,), v + 1)}


@ray.remote(num_gpus=0.5)
class Node:
    """A producer or consumer sharing the one GPU (num_gpus=0.5)."""

    @rdt.tensor_method(tensor_transport="auto")
    def mixed_auto(self, n, v):
        return _mixed(n, v)

    @rdt.tensor_method(tensor_transport="object_store")
    def mixed_store(self, n, v):
        return _mixed(n, v)

    @rdt.tensor_method(tensor_transport="nixl")
    def vram_nixl(self, n, v):
        return torch.full((n,), v, device="cuda")

    @rdt.tensor_method(tensor_transport="cuda_ipc")
    def vram_ipc(self, n, v):
        return torch.full((n,), v, device="cuda")

    def set_weights(self, n):
        self.w = {"a": torch.ones(n, device="cuda"), "b": torch.full((n // 2,), 2.0, device="cuda")}
        torch.cuda.synchronize()

    @rdt.tensor_method(tensor_transport="cuda_ipc")
    def weights(self):
        return self.w

    def drop_weights(self):
        self.w = None
        gc.collect()
        torch.cuda.synchronize()

    def share_stats(self):
        """The producer's CUDA IPC shares: made over its life, and exported now (rdt's share cache)."""
        from rdt import transports
        from rdt._process.context import get_context

        ctx = get_context()
        cache = ctx.peek_transport_state("cuda_ipc")
        if cache is not None:
            cache.sweep()
        return {"made": cache.made if cache is not None else 0,
                "exported": transports.get("cuda_ipc").exported(ctx)}

    def describe(self, x):
        leaves = x if isinstance(x, dict) else {"t": x}
        return {"devices": {k: str(t.device) for k, t in leaves.items()},
                "sums": {k: float(t.double().sum()) for k, t in leaves.items()}, "path": self.last_path()}

    def consume_sum(self, x):
        return float(sum(float(t.sum()) for t in x.values()))

    def get_into(self, refs, n):
        """rdt.get(ref, into=) a tensor on this actor's GPU: the value must be that very tensor, filled."""
        target = torch.full((n,), -1.0, device="cuda")
        out = rdt.get(refs[0], into=target, timeout=30)
        torch.cuda.synchronize()
        return {"same": out is target or out.data_ptr() == target.data_ptr(), "sum": float(target.sum()),
                "device": str(target.device), "path": self.last_path()}

    def last_path(self):
        paths = rdt.stats()["paths"]
        grown = [p for p, k in paths.items() if k > getattr(self, "_paths", {}).get(p, 0)]
        self._paths = paths
        return ",".join(sorted(grown))

    # ---- a one-rank NCCL group, run inside the actor
    def nccl_all(self, name):
        dev = torch.device("cuda", torch.cuda.current_device())
        out = {}
        x = torch.full((4,), 3.0, device=dev)
        rdt_transports.allreduce(x, name, timeout=30)
        out["allreduce"] = x.tolist()
        y = torch.full((4,), 5.0, device=dev)
        rdt_transports.broadcast(y, 0, name, timeout=30)
        out["broadcast"] = y.tolist()
        lst = [torch.zeros(2, device=dev)]
        rdt_transports.allgather(lst, torch.full((2,), 6.0, device=dev), name, timeout=30)
        out["allgather"] = [t.tolist() for t in lst]
        rs = torch.zeros(2, device=dev)
        rdt_transports.reducescatter(rs, [torch.full((2,), 4.0, device=dev)], name, timeout=30)
        out["reducescatter"] = rs.tolist()
        red = torch.full((2,), 2.0, device=dev)
        rdt_transports.reduce(red, 0, name, rdt_transports.ReduceOp.MAX, timeout=30)
        out["reduce"] = red.tolist()
        gl = [torch.zeros(1, device=dev)]
        rdt_transports.gather(torch.full((1,), 8.0, device=dev), gl, 0, name, timeout=30)
        out["gather"] = [t.tolist() for t in gl]
        sc = torch.zeros(1, device=dev)
        rdt_transports.scatter(sc, [torch.full((1,), 9.0, device=dev)], 0, name, timeout=30)
        out["scatter"] = sc.tolist()
        outs = [torch.zeros(1, device=dev)]
        rdt_transports.alltoall(outs, [torch.full((1,), 10.0, device=dev)], name, timeout=30)
        out["alltoall"] = [t.tolist() for t in outs]
        rdt_transports.barrier(name, timeout=30)
        big = torch.arange(N, dtype=torch.float32, device=dev)
        rdt_transports.allreduce(big, name, timeout=30)
        out["big_ok"] = bool(torch.equal(big, torch.arange(N, dtype=torch.float32, device=dev)))
        return out

    def nccl_timeout(self, name):
        """A kernel of ~4 s on the caller's stream, then an allreduce with a 1 s timeout: the communicator's stream
        waits for the caller's, so the NCCL call is issued but cannot complete in time."""
        dev = torch.device("cuda", torch.cuda.current_device())
        x = torch.ones(4, device=dev)
        torch.cuda._sleep(int(8e9))
        start = time.monotonic()
        try:
            rdt_transports.allreduce(x, name, timeout=1.0)
        except Exception as e:  # noqa: BLE001 - reported to the driver
            err = {"type": type(e).__name__, "message": str(e)}
        else:
            err = {"type": "no error", "message": ""}
        err["seconds"] = time.monotonic() - start
        err["state"] = rdt_transports.get_group(name).state.value
        return err

    def nccl_after_abort(self, name):
        """A collective on a group the driver aborted: it must raise, not hang."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                rdt_transports.allreduce(torch.ones(4, device="cuda"), name, timeout=5)
            except Exception as e:  # noqa: BLE001 - reported to the driver
                return {"type": type(e).__name__, "message": str(e)}
            time.sleep(0.5)
        return {"type": "no error", "message": "collectives still ran 20 s after abort"}


@pytest.fixture(scope="module")
def pair(ray_cluster):
    """Producer and consumer on one GPU; the producer is named so another driver can call it."""
    a = Node.options(name="producer", namespace=NAMESPACE).remote()
    b = Node.remote()
    ray.get([a.last_path.remote(), b.last_path.remote()], timeout=60)
    yield a, b
    ray.kill(a)
    ray.kill(b)


# ------------------------------------------------------------------------------------------------ NCCL, one GPU
@needs_cupy
def test_one_rank_nccl_group_runs_every_collective(ray_cluster):
    a = Node.remote()
    group = rdt_transports.create_collective_group([a], backend="nccl", group_name="nccl-one", timeout=30)
    try:
        out = ray.get(a.nccl_all.remote("nccl-one"), timeout=45)
    finally:
        group.destroy(timeout=10)
        ray.kill(a)
    assert out["allreduce"] == [3.0] * 4 and out["broadcast"] == [5.0] * 4
    assert out["allgather"] == [[6.0, 6.0]] and out["reducescatter"] == [4.0, 4.0] and out["reduce"] == [2.0, 2.0]
    assert out["gather"] == [[8.0]] and out["scatter"] == [9.0] and out["alltoall"] == [[10.0]]
    assert out["big_ok"]


@needs_cupy
def test_one_rank_nccl_timeout_while_the_call_is_queued_then_abort(ray_cluster):
    """The timeout fires while NCCL's kernel waits behind the caller's stream (ncclCommAbort on a live call); a
    second group aborted from the driver fails its member's next collective."""
    a = Node.remote()
    try:  # the actor holds half the GPU: killed whatever fails, or the next test cannot place its two actors
        group = rdt_transports.create_collective_group([a], backend="nccl", group_name="nccl-slow", timeout=30)
        try:
            err = ray.get(a.nccl_timeout.remote("nccl-slow"), timeout=45)
        finally:
            group.destroy(timeout=15)
        assert err["type"] == "CollectiveTimeoutError", err
        assert err["seconds"] < 3.5, f"the 1 s timeout took {err['seconds']:.1f} s (waited for the 4 s kernel?)"
        assert "nccl-slow" in err["message"] and err["state"] == "errored", err
        group2 = rdt_transports.create_collective_group([a], backend="nccl", group_name="nccl-abort", timeout=30)
        try:
            group2.abort("aborted by the test")
            after = ray.get(a.nccl_after_abort.remote("nccl-abort"), timeout=45)
        finally:
            group2.destroy(timeout=15)
        assert after["type"] in ("GroupDestroyedError", "GroupErroredError"), after
        assert "nccl-abort" in after["message"], after
    finally:
        ray.kill(a)


@needs_cupy
def test_two_nccl_ranks_on_one_gpu_are_refused_before_nccl(ray_cluster):
    """Two actors with num_gpus=0.5 see the same GPU: NCCL cannot put two ranks of one communicator on one device,
    so the group must be refused before any NCCL call, naming both actors and the device."""
    a, b = Node.remote(), Node.remote()
    try:
        start = time.monotonic()
        with pytest.raises(rdt_transports.RdtError) as ei:
            g = rdt_transports.create_collective_group([a, b], backend="nccl", group_name="nccl-dup", timeout=20)
            g.destroy(timeout=10)
        took = time.monotonic() - start
    finally:
        ray.kill(a)
        ray.kill(b)
    msg = str(ei.value)
    assert type(ei.value).__name__ == "SharedDeviceError", msg
    assert "could not create the group" not in msg, f"refused only after NCCL ran (join phase): {msg}"
    assert a._actor_id.hex() in msg and b._actor_id.hex() in msg, msg
    assert "GPU" in msg or "cuda" in msg, msg
    assert took < 20, took


# ------------------------------------------------------------------------------------------------ objects
@pytest.mark.parametrize("method", ["mixed_auto", "mixed_store"])
def test_mixed_cpu_and_cuda_dict(pair, method):
    a, b = pair
    info = ray.get(b.describe.remote(getattr(a, method).remote(N, 2.0)), timeout=60)
    assert info["devices"]["w"].startswith("cuda") and info["devices"]["step"] == "cpu"
    assert info["devices"]["cpu"] == "cpu", info
    assert info["sums"] == {"w": 2.0 * N, "step": 7.0, "cpu": 3.0 * N}, info
    value = ray.get(getattr(a, method).remote(N, 4.0), timeout=60)  # the driver (it has the GPU)
    assert value["w"].device.type == "cuda" and value["step"].device.type == "cpu"
    assert float(value["w"].sum()) == 4.0 * N and float(value["cpu"].sum()) == 5.0 * N


@pytest.mark.parametrize("method,path", [("vram_ipc", "cuda_ipc"), pytest.param("vram_nixl", "nixl",
                                                                                marks=needs_nixl)])
def test_into_a_vram_target(pair, method, path):
    a, b = pair
    for v in (3.0, 5.0):  # the second read reuses the producer's share / registration
        out = ray.get(b.get_into.remote([getattr(a, method).remote(N, v)], N), timeout=60)
        assert out["same"] and out["device"].startswith("cuda") and out["sum"] == v * N, out
        assert path in out["path"], out


def test_gpu_tensors_reach_a_driver_without_cuda_through_host_memory(pair):
    """A second driver with no visible GPU (it cannot open CUDA IPC handles) gets a cuda_ipc object's tensors
    streamed through host memory, on the CPU, with the right bytes."""
    code = (
        "import json, ray, torch, rdt\n"
        f"ray.init(address={ray.get_runtime_context().gcs_address!r}, namespace={NAMESPACE!r}, "
        "log_to_driver=False)\n"
        "a = ray.get_actor('producer')\n"
        f"t = ray.get(a.vram_ipc.remote({N}, 9.0), timeout=40)\n"
        "print(json.dumps({'cuda': torch.cuda.is_available(), 'device': str(t.device), 'sum': float(t.sum()),"
        " 'paths': rdt.stats()['paths']}))\n"
        "ray.shutdown()\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=55, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["cuda"] is False and got["device"] == "cpu" and got["sum"] == 9.0 * N, got


def test_ipc_shares_one_per_storage_across_1000_returns_and_none_once_freed(pair):
    """Leak check: a share is kept for its storage's life. Weights of two storages returned 1 000 times, each
    step's object consumed and freed before the next: the producer makes 2 shares (counted from before the loop:
    the module's producer shared other storages in earlier tests), and none stays exported once the weights die."""
    a, b = pair
    ray.get(a.set_weights.remote(N), timeout=60)
    made_before = ray.get(a.share_stats.remote(), timeout=30)["made"]
    want = float(N + N // 2 * 2.0)
    for step in range(STEPS):
        ref = a.weights.remote()
        assert ray.get(b.consume_sum.remote(ref), timeout=30) == want, step
        del ref
    stats = ray.get(a.share_stats.remote(), timeout=30)
    made = stats["made"] - made_before
    assert made == 2, (f"{made} CUDA IPC shares made for 2 storages over {STEPS} returns "
                       "(each share adds an entry torch keeps until the storage dies)")
    ray.get(a.drop_weights.remote(), timeout=30)
    left = wait_for(lambda: ray.get(a.share_stats.remote(), timeout=30)["exported"] == 0, timeout=20)
    assert left, f"shares still exported after the weights were freed: {ray.get(a.share_stats.remote())}"
