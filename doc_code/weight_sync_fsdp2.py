"""Sharded weight sync from an FSDP2 trainer: two trainer ranks train a small Llama-shaped model wrapped with
``fully_shard`` (a torch.distributed gloo group on CPU), so ``model.state_dict()`` holds DTensors, ``Shard(0)`` of
every parameter (the 1001-row embedding unevenly: 501 + 500 rows). Each rank publishes its local shards as they are
(``rdt.put_shards``: the layout comes from the placements, nothing is gathered). Two tensor-parallel engine ranks
pull only their slices into vLLM-style parameters: fused ``qkv_proj`` and ``gate_up_proj`` (column-parallel),
row-parallel ``o_proj`` and ``down_proj`` (a column slice: one short run per row), a vocabulary-parallel embedding
and whole norms. Every step the engines' bytes are compared against the full model.

Run: python doc_code/weight_sync_fsdp2.py
"""

import os
import socket

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"

import ray  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import rdt  # noqa: E402

VOCAB, HIDDEN, KV, INTER, LAYERS = 1001, 256, 64, 512, 2
TRAINERS, TP, STEPS = 2, 2, 2


class Block(nn.Module):
    """A decoder layer's weights, named as in Llama/Qwen2 checkpoints (attention reduced to a gated product)."""

    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.q_proj, self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False), nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj, self.v_proj = nn.Linear(HIDDEN, KV, bias=False), nn.Linear(HIDDEN, KV, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(HIDDEN, INTER, bias=False), nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(h)
        kv = (self.k_proj(x) * self.v_proj(x)).repeat_interleave(HIDDEN // KV, dim=-1)
        h = h + self.o_proj(self.q_proj(x) * torch.sigmoid(kv))
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(HIDDEN)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


@ray.remote
class Trainer:
    """One FSDP2 rank: every parameter is a DTensor, Shard(0) over the two ranks."""

    def __init__(self, rank: int, port: int) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=TRAINERS)
        mesh = init_device_mesh("cpu", (TRAINERS,))
        torch.manual_seed(0)  # every rank starts from the same full model, then keeps its shard
        self.model = Model()
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.rank = rank

    def train_step(self, step: int) -> None:
        tokens = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(step * 10 + self.rank))
        self.model(tokens).pow(2).mean().backward()  # FSDP2: gathers, reduce-scatters the gradients
        self.opt.step()  # in place, on the local shards
        self.opt.zero_grad()

    def publish(self, step: int) -> rdt.Shards:
        return rdt.put_shards(self.model.state_dict(), version=step)  # DTensor leaves: local shards + layout

    def full_state(self) -> dict:
        """The whole model (an all-gather): only to check the engines' bytes."""
        return {k: v.full_tensor() for k, v in self.model.state_dict().items()}


def engine_wants(tp_rank: int):
    """(target name, shape, regions, cat dim) of tensor-parallel rank ``tp_rank``, as vLLM lays out Llama/Qwen2."""
    q, kv, inter, cols = HIDDEN // TP, KV // TP, INTER // TP, HIDDEN // TP
    vocab = [c.shape[0] for c in torch.arange(VOCAB).chunk(TP)]
    out = [("embed_tokens", (vocab[tp_rank], HIDDEN), [("embed_tokens.weight", 0, sum(vocab[:tp_rank]),
                                                         vocab[tp_rank])]),
           ("norm", (HIDDEN,), [("norm.weight", None, 0, 0)])]
    for i in range(LAYERS):
        p = f"layers.{i}."
        out += [
            (p + "qkv_proj", (q + 2 * kv, HIDDEN), [(p + "q_proj.weight", 0, tp_rank * q, q),
                                                    (p + "k_proj.weight", 0, tp_rank * kv, kv),
                                                    (p + "v_proj.weight", 0, tp_rank * kv, kv)]),
            (p + "o_proj", (HIDDEN, cols), [(p + "o_proj.weight", 1, tp_rank * cols, cols)]),
            (p + "gate_up_proj", (2 * inter, HIDDEN), [(p + "gate_proj.weight", 0, tp_rank * inter, inter),
                                                       (p + "up_proj.weight", 0, tp_rank * inter, inter)]),
            (p + "down_proj", (HIDDEN, inter), [(p + "down_proj.weight", 1, tp_rank * inter, inter)]),
            (p + "input_layernorm", (HIDDEN,), [(p + "input_layernorm.weight", None, 0, 0)]),
            (p + "post_attention_layernorm", (HIDDEN,), [(p + "post_attention_layernorm.weight", None, 0, 0)]),
        ]
    return out


def regions(spec):
    return [rdt.Region(name) if dim is None else rdt.Region(name, dim, start, n) for name, dim, start, n in spec]


@ray.remote
class EngineRank:
    """A tensor-parallel engine rank (a plain actor): its parameters, and a loader that fills them every step."""

    def __init__(self, tp_rank: int) -> None:
        self.params = {}
        self.loader = rdt.WeightLoader()
        for name, shape, spec in engine_wants(tp_rank):
            self.params[name] = torch.empty(shape)
            self.loader.want(self.params[name], regions(spec), name=name)

    def load(self, manifest: rdt.Manifest) -> rdt.LoadReport:
        return self.loader.load(manifest, timeout=30.0)

    def weights(self) -> dict:
        return self.params


def expected(full: dict, tp_rank: int) -> dict:
    return {name: torch.cat([full[p] if d is None else full[p].narrow(d, s, n) for p, d, s, n in spec])
            for name, _, spec in engine_wants(tp_rank)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
port = free_port()
trainers = [Trainer.remote(r, port) for r in range(TRAINERS)]
engines = [EngineRank.remote(r) for r in range(TP)]
for step in range(STEPS):
    if step:
        ray.get([t.train_step.remote(step) for t in trainers])
    manifest = rdt.Manifest(ray.get([t.publish.remote(step) for t in trainers]))
    reports = ray.get([e.load.remote(manifest) for e in engines])  # each engine rank reads from both trainers
    full = ray.get([t.full_state.remote() for t in trainers])[0]
    model_bytes = sum(t.nbytes for t in full.values())
    for r, e in enumerate(engines):
        got, want = ray.get(e.weights.remote()), expected(full, r)
        assert all(torch.equal(got[k], want[k]) for k in want), f"engine rank {r}, step {step}: wrong bytes"
    rep = reports[0]
    print(f"step {step}: engine rank 0 pulled {rep.nbytes / 1e6:.2f} MB of the {model_bytes / 1e6:.2f} MB model "
          f"from trainer ranks {sorted(rep.paths)} via {sorted(set(rep.paths.values()))}, "
          f"{'planned' if rep.planned else 'replayed'} in {rep.seconds * 1e3:.1f} ms; bytes match the full model")
    assert rep.planned == (step == 0)
ray.shutdown()
print("weight_sync_fsdp2: OK")
