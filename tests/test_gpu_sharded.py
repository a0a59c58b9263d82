"""Sharded weight sync on GPUs (marked ``gpu``; ``multi_gpu`` where two GPUs are needed), each path checked byte
for byte against the narrowed full parameters (tests/_sharded_actors: fused qkv, a row-parallel slice, uneven
column-parallel shards, a cast to bf16, a vocabulary slice, a replicated norm):

* over CUDA IPC: GPU shards into GPU targets on one GPU, the trainer storages opened once and kept across replayed
  loads (and reopened by none), a replica loading a GPU loader's shared targets;
* over NIXL VRAM -> VRAM, exact runs READ into the targets;
* across devices: a CPU-offloaded trainer into GPU targets (host staging), GPU shards into CPU targets;
* a DTensor on a one-GPU mesh (a one-rank NCCL process group);
* the fence against an in-place update: the engine's copies held back on the device behind a kernel, the trainer's
  fence returns only once they finished, and the landed bytes are the fenced version's;
* verify=True checksumming GPU shards and targets on the device, and catching a flipped byte there;
* the copy descriptors on CUDA tensors landing what they land on the CPU;
* two GPUs only (never on the one-GPU lent machines): the NCCL ranges protocol, a DTensor on a two-GPU mesh.

The CPU side of every path is proven in CPU CI: tests/unit/test_device_runs.py, test_cuda_ipc_ranges.py,
test_nixl_ranges.py, test_device_fence.py, test_sharded_devices.py and tests/test_sharded.py's NCCL code over gloo.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any, Dict, List, Optional

import pytest
import ray
import torch

import rdt

from ._sharded_actors import REPLICATED, SHAPES, expected, full, rows_of, wants
from .conftest import HAS_NIXL, _free_port

HAS_CUDA = torch.cuda.is_available()
N_GPUS = torch.cuda.device_count() if HAS_CUDA else 0
HAS_CUPY = importlib.util.find_spec("cupy") is not None
TP = 2
SHARE = 0.16  # six actors share the one GPU

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA (torch.cuda.is_available() is "
                                                                       "False)")]
needs_nixl = pytest.mark.skipif(not HAS_NIXL, reason="nixl not installed: pip install 'ray-direct-transport[nixl]'")


@ray.remote(num_gpus=SHARE)
class Rank:
    """A trainer rank (shards on ``device``) or an engine rank (targets on ``device``)."""

    def trainer(self, rank: int, world: int, device: str, dims: Optional[Dict[str, int]] = None,
                mesh_port: int = 0) -> None:
        self.rank, self.world, self.device, self.dims = rank, world, torch.device(device), dict(dims or {})
        self.version, self.published, self.mesh = 0, None, None
        if mesh_port:  # DTensors on a CUDA mesh: one NCCL rank per GPU
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh

            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{mesh_port}", rank=rank, world_size=world)
            self.mesh = init_device_mesh("cuda", (world,))
        self.local = {n: self._slice(n, self.version).to(self.device) for n in SHAPES}

    def _slice(self, name: str, version: int) -> torch.Tensor:
        t = full(name, version)
        if name in REPLICATED:
            return t
        d = self.dims.get(name, 0)
        lo, hi = rows_of(name, self.rank, self.world, None, d)
        return t.narrow(d, lo, hi - lo).contiguous()

    def publish(self, transport: str) -> rdt.Shards:
        if self.mesh is not None:
            from torch.distributed.tensor import DTensor, Replicate, Shard

            state = {n: DTensor.from_local(t, self.mesh, [Replicate() if n in REPLICATED else
                                                          Shard(self.dims.get(n, 0))], run_check=False,
                                           shape=torch.Size(SHAPES[n]), stride=torch.empty(SHAPES[n]).stride())
                     for n, t in self.local.items()}
            self.published = rdt.put_shards(state, version=self.version, tensor_transport=transport)
            return self.published
        layouts = {}
        for n in SHAPES:
            start = [0] * len(SHAPES[n])
            if n not in REPLICATED:
                d = self.dims.get(n, 0)
                start[d] = rows_of(n, self.rank, self.world, None, d)[0]
            layouts[n] = rdt.Layout(SHAPES[n], tuple(start))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.published = rdt.put_shards(self.local, version=self.version, layouts=layouts, rank=self.rank,
                                        tensor_transport=transport)
        return self.published

    def fence_step(self, timeout: float = 30.0) -> float:
        """Fence the publication, then the optimizer's in-place update to the next version: when the fence
        returned (time.time())."""
        if self.published is not None:
            self.published.fence(timeout=timeout)
        fenced = time.time()
        self.version += 1
        for n, t in self.local.items():
            t.copy_(self._slice(n, self.version).to(self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return fenced

    def flip_a_byte(self, name: str) -> None:
        """An in-place change of one byte of a published shard without a fence (what verify must catch)."""
        self.local[name].view(-1).view(torch.uint8)[5] ^= 0x40
        torch.cuda.synchronize()

    # ---- engine
    def engine(self, rank: int, tp: int, device: str) -> None:
        self.loader = rdt.WeightLoader()
        self.targets: Dict[str, torch.Tensor] = {}
        ref = expected(rank, tp, 0)
        for target, regions, dim, dtype in wants(rank, tp):
            t = self.targets[target] = torch.full(ref[target].shape, -1.0, dtype=getattr(torch, dtype),
                                                  device=device)
            regs = [rdt.Region(p) if d < 0 else rdt.Region(p, d, s, n) for p, d, s, n in regions]
            self.loader.want(t, regs, dim=dim, cast=dtype != "float32", name=target)

    def load(self, source: Any, verify: bool = False, sleep_cycles: int = 0) -> Dict[str, Any]:
        started = time.time()
        if sleep_cycles:  # the caller's stream busy: the load's copies must wait for it on the device
            torch.cuda._sleep(sleep_cycles)
        report = self.loader.load(source, timeout=60.0, verify=verify)
        done = time.time()
        return {"report": report, "started": started, "done": done, "targets": {k: v.cpu() for k, v in self.targets.items()},
                "devices": sorted({str(v.device) for v in self.targets.values()}),
                "ipc": rdt.stats().get("cuda_ipc_ranges", {}), "plans": self.loader.plans}

    def try_load(self, source: Any, verify: bool = False) -> str:
        try:
            self.loader.load(source, timeout=60.0, verify=verify)
        except rdt.RdtError as e:
            return f"{type(e).__name__}: {e}"
        return "ok"

    def share(self, transport: str = "auto") -> rdt.Replica:
        return self.loader.share(tensor_transport=transport)

    def cycles_per_second(self) -> float:
        """torch.cuda._sleep's cycles in one second here (measured)."""
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        start = time.perf_counter()
        torch.cuda._sleep(100_000_000)
        torch.cuda.synchronize()
        return 100_000_000 / (time.perf_counter() - start)


def _check(out: Dict[str, Any], rank: int, version: int) -> None:
    want = expected(rank, TP, version)
    for name, t in out["targets"].items():
        assert torch.equal(t, want[name]), f"engine rank {rank}, target {name}, version {version}"


@pytest.fixture(scope="module")
def ranks(ray_cluster):
    """Two GPU trainer ranks, two GPU engine ranks, a GPU replica of engine rank 0, a CPU-target engine rank."""
    actors = [Rank.remote() for _ in range(6)]
    ts, es, replica, cpu_engine = actors[:2], actors[2:4], actors[4], actors[5]
    ray.get([t.trainer.remote(r, 2, "cuda") for r, t in enumerate(ts)]
            + [e.engine.remote(r, TP, "cuda") for r, e in enumerate(es)]
            + [replica.engine.remote(0, TP, "cuda"), cpu_engine.engine.remote(0, TP, "cpu")], timeout=120)
    yield ts, es, replica, cpu_engine
    for a in actors:
        ray.kill(a)


def _manifest(trainers: List[Any], transport: str) -> rdt.Manifest:
    return rdt.Manifest(ray.get([t.publish.remote(transport) for t in trainers], timeout=60))


def test_cuda_ipc_loads_keep_the_trainer_storages_open_across_replays(ranks):
    ts, es, replica, _ = ranks
    manifest = _manifest(ts, "cuda_ipc")
    outs = ray.get([e.load.remote(manifest) for e in es], timeout=120)
    for r, out in enumerate(outs):
        _check(out, r, manifest.version)
        assert out["devices"] == ["cuda:0"] and set(out["report"].paths.values()) == {"cuda_ipc"}, out["report"]
        assert out["report"].planned and out["ipc"]["opened"] > 0
    opened = [out["ipc"]["opened"] for out in outs]
    for _ in range(3):  # in-place updates, new publications of the same storages: replayed, nothing opened
        ray.get([t.fence_step.remote() for t in ts], timeout=60)
        manifest = _manifest(ts, "cuda_ipc")
        outs = ray.get([e.load.remote(manifest) for e in es], timeout=120)
        for r, out in enumerate(outs):
            _check(out, r, manifest.version)
            assert not out["report"].planned
    assert [out["ipc"]["opened"] for out in outs] == opened, [out["ipc"] for out in outs]
    assert all(out["ipc"]["reused"] >= 3 * o for out, o in zip(outs, opened))
    offer = ray.get(es[0].share.remote("cuda_ipc"), timeout=60)  # GPU targets offered to a replica
    got = ray.get(replica.load.remote(offer), timeout=120)
    _check(got, 0, manifest.version)
    assert got["report"].paths == {0: "cuda_ipc"}


@needs_nixl
def test_nixl_reads_exactly_the_runs_vram_to_vram(ranks):
    ts, es, _, _ = ranks
    manifest = _manifest(ts, "nixl")
    for r, out in enumerate(ray.get([e.load.remote(manifest) for e in es], timeout=120)):
        _check(out, r, manifest.version)
        assert set(out["report"].paths.values()) == {"nixl"} and out["report"].read_bytes == out["report"].nbytes


def test_a_cpu_offloaded_trainer_into_gpu_targets_and_gpu_shards_into_cpu_targets(ranks):
    ts, es, _, cpu_engine = ranks
    offloaded = Rank.options(num_gpus=0).remote()
    try:
        ray.get(offloaded.trainer.remote(0, 1, "cpu"), timeout=60)
        manifest = rdt.Manifest([ray.get(offloaded.publish.remote("shm"), timeout=60)])
        out = ray.get(es[0].load.remote(manifest), timeout=120)
        _check(out, 0, 0)
        assert out["report"].paths == {0: "shm-direct+h2d"}, out["report"].paths
    finally:
        ray.kill(offloaded)
    manifest = _manifest(ts, "cuda_ipc")
    out = ray.get(cpu_engine.load.remote(manifest), timeout=120)
    _check(out, 0, manifest.version)
    assert out["devices"] == ["cpu"] and set(out["report"].paths.values()) == {"cuda_ipc+d2h"}


def test_a_dtensor_on_a_one_gpu_mesh(ranks):
    _, es, _, _ = ranks
    t = Rank.options(num_gpus=0.02).remote()
    try:
        ray.get(t.trainer.remote(0, 1, "cuda", None, _free_port()), timeout=120)
        manifest = rdt.Manifest([ray.get(t.publish.remote("cuda_ipc"), timeout=60)])
        boxes = {p.name: p.box for p in manifest.shards[0].params}
        assert boxes["q"] == ((0, SHAPES["q"][0]), (0, SHAPES["q"][1]))
        for r, out in enumerate(ray.get([e.load.remote(manifest) for e in es], timeout=120)):
            _check(out, r, 0)
    finally:
        ray.kill(t)


def test_the_fence_waits_for_the_copies_still_queued_on_the_device(ranks):
    """The engine's stream holds a 0.5 s kernel when it loads: its copies out of the trainers' memory run after
    it. The trainers fence meanwhile and update in place right after: their fences return only once the copies
    finished (not before the kernel ended), and the landed bytes are the fenced version's, not the update's."""
    ts, es, _, _ = ranks
    cycles = int(ray.get(es[0].cycles_per_second.remote(), timeout=60) * 0.5)
    manifest = _manifest(ts, "cuda_ipc")
    loading = es[0].load.remote(manifest, False, cycles)
    time.sleep(0.2)  # the read is registered; its copies wait behind the kernel
    fenced = ray.get([t.fence_step.remote() for t in ts], timeout=60)
    out = ray.get(loading, timeout=120)
    _check(out, 0, manifest.version)
    assert min(fenced) >= out["started"] + 0.45, (fenced, out["started"], out["done"])


def test_verify_catches_a_flipped_byte_on_the_device(ranks):
    ts, es, _, _ = ranks
    manifest = _manifest(ts, "cuda_ipc")
    first = ray.get(es[0].try_load.remote(manifest, True), timeout=120)
    assert first == "ok", first
    ray.get(ts[1].flip_a_byte.remote("gate"), timeout=60)
    err = ray.get(es[0].try_load.remote(manifest, True), timeout=120)
    assert err.startswith("ChecksumMismatchError") and "'gate'" in err and "producer rank 1" in err, err


def test_copy_descriptors_on_cuda_land_what_they_land_on_the_cpu():
    import numpy as np

    from rdt._objects import device_runs

    rng = np.random.default_rng(2)
    src = torch.from_numpy(rng.integers(0, 255, 1 << 20, dtype=np.uint8))
    n = rng.integers(1, 9000, 300)
    soff = rng.integers(0, (1 << 20) - 9000, 300)
    doff = np.concatenate(([0], np.cumsum(n)[:-1]))
    copies = device_runs.batch(np.zeros(300), soff, np.zeros(300), doff, n)
    cpu, gpu = torch.zeros(int(n.sum()), dtype=torch.uint8), torch.zeros(int(n.sum()), dtype=torch.uint8,
                                                                          device="cuda")
    device_runs.apply(copies, [src], [cpu])
    device_runs.apply(copies, [src.cuda()], [gpu])
    torch.cuda.synchronize()
    assert torch.equal(gpu.cpu(), cpu)


@pytest.mark.multi_gpu
@pytest.mark.skipif(N_GPUS < 2, reason=f"needs two CUDA GPUs, found {N_GPUS}")
@pytest.mark.skipif(not HAS_CUPY, reason="the nccl backend needs cupy")
def test_nccl_ranges_between_two_gpus(ray_cluster):
    t, e = Rank.options(num_gpus=1).remote(), Rank.options(num_gpus=1).remote()
    group = rdt.create_collective_group([t, e], backend="nccl")
    try:
        ray.get([t.trainer.remote(0, 1, "cuda"), e.engine.remote(0, TP, "cuda")], timeout=120)
        manifest = rdt.Manifest([ray.get(t.publish.remote("nccl"), timeout=60)])
        out = ray.get(e.load.remote(manifest), timeout=120)
        _check(out, 0, 0)
        assert out["report"].paths == {0: "nccl-ranges"}
    finally:
        rdt.destroy_collective_group(group)
        ray.kill(t)
        ray.kill(e)


@pytest.mark.multi_gpu
@pytest.mark.skipif(N_GPUS < 2, reason=f"needs two CUDA GPUs, found {N_GPUS}")
def test_dtensors_on_a_two_gpu_mesh_tp_and_uneven_fsdp(ray_cluster):
    """Shard(0) (uneven) and Shard(1) DTensors on a two-GPU mesh, read over CUDA IPC across the two GPUs."""
    port = _free_port()
    ts = [Rank.options(num_gpus=1).remote() for _ in range(2)]  # one NCCL rank per GPU
    e = Rank.options(num_gpus=0, runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": "0,1"}}).remote()
    try:
        ray.get([t.trainer.remote(r, 2, "cuda", {"o": 1}, port) for r, t in enumerate(ts)]
                + [e.engine.remote(1, TP, "cuda")], timeout=120)
        manifest = _manifest(ts, "cuda_ipc")
        _check(ray.get(e.load.remote(manifest), timeout=120), 1, 0)
    finally:
        for a in ts + [e]:
            ray.kill(a)

