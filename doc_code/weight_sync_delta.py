"""Sharded weight sync with delta pulls: two trainer ranks each hold half the rows of every bf16 weight and change
about 1 % of its elements per step (as an RL optimizer step does); they publish with ``delta=True``. Two
tensor-parallel engine ranks (a fused qkv, a row-parallel o_proj) load every step: the first load is full, every
later one reads only the changes inside the engine rank's slices, verifies every byte of its targets against the
trainers' checksums (``verify=True``), and is compared byte for byte with the trainers' weights here.

Run: python doc_code/weight_sync_delta.py
"""

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"

import ray  # noqa: E402
import torch  # noqa: E402

import rdt  # noqa: E402

HIDDEN, TRAINERS, TP, STEPS = 1024, 2, 2, 4
SHAPES = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (HIDDEN // 4, HIDDEN), "v_proj": (HIDDEN // 4, HIDDEN),
          "o_proj": (HIDDEN, HIDDEN)}


def full(name: str, step: int) -> torch.Tensor:
    """The whole bf16 weight at ``step``: random at 0, then about 1 % of its elements change each step."""
    g = torch.Generator().manual_seed(len(name))
    w = torch.randn(SHAPES[name], generator=g).to(torch.bfloat16)
    for s in range(1, step + 1):
        g.manual_seed(1000 * len(name) + s)
        changed = torch.rand(SHAPES[name], generator=g) < 0.01
        w[changed] = torch.randn(int(changed.sum()), generator=g).to(torch.bfloat16)
    return w


@ray.remote
class Trainer:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.rows = {n: s[0] // TRAINERS for n, s in SHAPES.items()}  # Shard(0): this rank's rows
        self.step = 0
        self.shards = {n: full(n, 0)[rank * r:(rank + 1) * r].clone() for n, r in self.rows.items()}
        self.published = None

    def train_step(self) -> None:
        self.published.fence(timeout=30.0)  # engines still reading the last version finish first
        self.step += 1
        for n, t in self.shards.items():  # the optimizer, in place
            r = self.rows[n]
            t.copy_(full(n, self.step)[self.rank * r:(self.rank + 1) * r])

    def publish(self) -> rdt.Shards:
        layouts = {n: rdt.Layout(SHAPES[n], (self.rank * r, 0)) for n, r in self.rows.items()}
        self.published = rdt.put_shards(self.shards, version=self.step, layouts=layouts, rank=self.rank,
                                        tensor_transport="shm", delta=True)  # + the changes since the last one
        return self.published

    def kept(self) -> dict:
        return rdt.stats()["sharded"]


@ray.remote
class EngineRank:
    def __init__(self, tp_rank: int) -> None:
        q, kv, cols = HIDDEN // TP, HIDDEN // 4 // TP, HIDDEN // TP
        self.qkv = torch.empty(q + 2 * kv, HIDDEN, dtype=torch.bfloat16)
        self.o_proj = torch.empty(HIDDEN, cols, dtype=torch.bfloat16)
        self.loader = rdt.WeightLoader()
        self.loader.want(self.qkv, [rdt.Region("q_proj", 0, tp_rank * q, q), rdt.Region("k_proj", 0, tp_rank * kv, kv),
                                    rdt.Region("v_proj", 0, tp_rank * kv, kv)])
        self.loader.want(self.o_proj, rdt.Region("o_proj", 1, tp_rank * cols, cols))
        self.tp_rank = tp_rank

    def load(self, manifest: rdt.Manifest) -> rdt.LoadReport:
        return self.loader.load(manifest, timeout=30.0, verify=True)  # every target byte checked, deltas too

    def check(self, step: int) -> bool:
        """Every byte against the trainers' weights (bitwise: bf16 viewed as int16)."""
        q, kv, cols = HIDDEN // TP, HIDDEN // 4 // TP, HIDDEN // TP
        r = self.tp_rank
        qkv = torch.cat([full("q_proj", step)[r * q:(r + 1) * q], full("k_proj", step)[r * kv:(r + 1) * kv],
                         full("v_proj", step)[r * kv:(r + 1) * kv]])
        o = full("o_proj", step)[:, r * cols:(r + 1) * cols]
        return torch.equal(self.qkv.view(torch.int16), qkv.view(torch.int16)) and \
            torch.equal(self.o_proj.view(torch.int16), o.view(torch.int16))


ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
trainers = [Trainer.remote(r) for r in range(TRAINERS)]
engines = [EngineRank.remote(r) for r in range(TP)]
for step in range(STEPS):
    if step:
        ray.get([t.train_step.remote() for t in trainers])
    manifest = rdt.Manifest(ray.get([t.publish.remote() for t in trainers]))
    reports = ray.get([e.load.remote(manifest) for e in engines])
    assert all(ray.get([e.check.remote(step) for e in engines]))
    r = reports[0]
    print(f"step {step}: engine rank 0 {r.mode}: {r.read_bytes} bytes moved for {r.nbytes} bytes of targets"
          + (f", {r.changed_fraction:.2%} of its elements changed" if r.changed_fraction is not None else "")
          + f", {r.verified_bytes} bytes verified")
    assert (r.mode == "delta") == (step > 0)  # the first load is full, every later one only the changes
    if step:
        assert r.read_bytes < 0.1 * r.nbytes
stats = ray.get(trainers[0].kept.remote())
print(f"trainer rank 0 keeps a {stats['delta_base_bytes']} byte base and the changes of {stats['delta_versions']} "
      f"versions ({stats['delta_bytes']} bytes)")
ray.shutdown()
print("weight_sync_delta: OK")
