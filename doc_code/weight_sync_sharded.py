"""Sharded weight sync with plain tensors: two trainer ranks each hold half the rows of every weight; two
tensor-parallel engine ranks pull only their slices (a fused qkv, a row-parallel o_proj) straight from both
trainers, every step, with the plan made once. A second engine (a data-parallel replica) loads the same slices
from the first engine's ranks, so each slice leaves a trainer once.

Each trainer publishes its shards with their place in the global weights (``rdt.put_shards`` with ``rdt.Layout``);
the driver gathers the ranks' publications into an ``rdt.Manifest``; each engine rank states what its parameters
want (``rdt.Region``) once, and ``WeightLoader.load(manifest)`` reads exactly those bytes into them.

Run: python doc_code/weight_sync_sharded.py
"""

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"

import ray  # noqa: E402
import torch  # noqa: E402

import rdt  # noqa: E402

HIDDEN, TRAINERS, TP = 1024, 2, 2
SHAPES = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (HIDDEN // 4, HIDDEN), "v_proj": (HIDDEN // 4, HIDDEN),
          "o_proj": (HIDDEN, HIDDEN)}


def full(name: str, step: int) -> torch.Tensor:
    """The whole weight at ``step`` (the trainers' and the check's common truth)."""
    return torch.ones(SHAPES[name]) * step + torch.arange(SHAPES[name][1])  # integers: exact in float32


@ray.remote
class Trainer:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.rows = {n: s[0] // TRAINERS for n, s in SHAPES.items()}  # Shard(0): this rank's rows
        self.shards = {n: full(n, 0)[rank * r:(rank + 1) * r].clone() for n, r in self.rows.items()}
        self.published = None

    def train_step(self) -> None:
        self.published.fence(timeout=30.0)  # engines still reading the last version finish first; later ones fail
        for t in self.shards.values():
            t.add_(1.0)  # the optimizer, in place

    def publish(self, step: int) -> rdt.Shards:
        layouts = {n: rdt.Layout(SHAPES[n], (self.rank * r, 0)) for n, r in self.rows.items()}
        self.published = rdt.put_shards(self.shards, version=step, layouts=layouts, rank=self.rank,
                                        tensor_transport="shm")
        return self.published


@ray.remote
class EngineRank:
    def __init__(self, tp_rank: int) -> None:
        q, kv, cols = HIDDEN // TP, HIDDEN // 4 // TP, HIDDEN // TP
        self.qkv = torch.empty(q + 2 * kv, HIDDEN)  # column-parallel, fused: [q; k; v] slices
        self.o_proj = torch.empty(HIDDEN, cols)  # row-parallel: a column slice (one short run per row)
        self.loader = rdt.WeightLoader()
        self.loader.want(self.qkv, [rdt.Region("q_proj", 0, tp_rank * q, q), rdt.Region("k_proj", 0, tp_rank * kv, kv),
                                    rdt.Region("v_proj", 0, tp_rank * kv, kv)])
        self.loader.want(self.o_proj, rdt.Region("o_proj", 1, tp_rank * cols, cols))
        self.tp_rank = tp_rank

    def load(self, source) -> rdt.LoadReport:
        """Load a manifest from the trainers, or a replica from the same rank of another engine."""
        return self.loader.load(source, timeout=30.0)

    def load_and_share(self, manifest: rdt.Manifest) -> rdt.Replica:
        self.loader.load(manifest, timeout=30.0)
        return self.loader.share()  # the same rank of the other engines loads from here

    def check(self, step: int) -> bool:
        q, kv, cols = HIDDEN // TP, HIDDEN // 4 // TP, HIDDEN // TP
        r = self.tp_rank
        qkv = torch.cat([full("q_proj", step)[r * q:(r + 1) * q], full("k_proj", step)[r * kv:(r + 1) * kv],
                         full("v_proj", step)[r * kv:(r + 1) * kv]])
        return torch.equal(self.qkv, qkv) and torch.equal(self.o_proj, full("o_proj", step)[:, r * cols:(r + 1) * cols])


ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
trainers = [Trainer.remote(r) for r in range(TRAINERS)]
engines = [EngineRank.remote(r) for r in range(TP)]
replicas = [EngineRank.remote(r) for r in range(TP)]  # engine 1: the same tensor-parallel ranks
for step in range(3):
    if step:
        ray.get([t.train_step.remote() for t in trainers])
    manifest = rdt.Manifest(ray.get([t.publish.remote(step) for t in trainers]))
    offers = [e.load_and_share.remote(manifest) for e in engines]
    reports = ray.get([c.load.remote(o) for c, o in zip(replicas, offers)])  # each starts once its offer exists
    assert all(ray.get([e.check.remote(step) for e in engines + replicas]))
    r = reports[0]
    print(f"step {step}: engine 1 rank 0 got {r.nbytes} bytes from engine 0 rank 0 via {r.paths[0]}, "
          f"{'planned' if r.planned else 'replayed'} in {r.seconds * 1e3:.1f} ms")
    assert r.planned == (step == 0)
ray.shutdown()
print("weight_sync_sharded: OK")
