"""A real model end to end: a Qwen2 causal LM (transformers' ``Qwen2ForCausalLM``, tied embeddings as in
Qwen2.5-0.5B, grouped-query attention, built from a small config with random initial weights: nothing is
downloaded) is trained by two FSDP2 trainer ranks on CPU and served, after every optimizer step, by engines that
hold the weights in vLLM's layout and run their own forward over them. Two ways to move the weights, side by side:

* **sharded** (``rdt.put_shards`` / ``rdt.Manifest`` / ``rdt.WeightLoader``): each trainer rank publishes its FSDP2
  shards as they are; two tensor-parallel engine ranks pull only their slices into fused ``qkv_proj`` (weight and
  bias: this rank's q, k and v heads concatenated) and ``gate_up_proj``, row-parallel ``o_proj`` and
  ``down_proj`` (their outputs all-reduced between the engine ranks over an ``rdt_transports`` gloo group), and a
  vocabulary-parallel embedding that is also the tied ``lm_head`` (each rank's logits for its vocabulary slice,
  all-gathered). Each trainer rank fences its publication before ``optimizer.step()`` updates the weights in place.
* **whole** (``@rdt.tensor_method`` + ``rdt.get(ref, into=...)``): the trainer gathers the full state dict (FSDP2's
  ``full_tensor()``) and returns it from a tensor method; a single-rank engine receives it straight into its own
  preallocated fused parameters (each checkpoint tensor lands in its rows of the fused tensor; the tied
  ``lm_head.weight`` and the embedding share one target).

After every step, in fp32, every engine's logits on fixed prompts (prompt and greedy continuation) equal the
trainer's model's (transformers' forward through FSDP2) within ``torch.testing.assert_close``'s default fp32
tolerance, and the engines' greedy continuations equal the trainer's token for token wherever the trainer's top
two logits are further apart than that tolerance (where they are not, the two may pick differently and the
comparison of that prompt stops there). After the fence, a load of the fenced version is refused
(``rdt.VersionGoneError``): the engines can never see a half-updated step.

Install (transformers is in the ``test`` extra):
    pip install torch==2.13.0 -e ".[test]"            # or: pip install torch==2.13.0 transformers==5.24.0

Run: python doc_code/weight_sync_qwen2.py [--steps N --hidden H --layers L ...]  (``--help``); the defaults are the
CI size. ``examples/weight_sync_qwen2_long.py`` runs this file with more steps and a bigger model.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"

import ray  # noqa: E402
import torch  # noqa: E402

import rdt  # noqa: E402
import rdt_transports as col  # noqa: E402

TRAINERS, TP = 2, 2
TP_GROUP = "qwen2-tp"


@dataclass(frozen=True)
class Size:
    """The model's shape (a Qwen2 config) and the run's: what the command line sets."""

    vocab: int = 512
    hidden: int = 128
    inter: int = 384
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4  # grouped-query attention: 2 query heads per KV head, 2 KV heads per engine rank
    rope_theta: float = 1e6
    eps: float = 1e-6
    steps: int = 2  # optimizer steps; the engines are checked after each (and before the first)
    batch: int = 8  # training sequences per trainer rank per step
    seq: int = 32
    lr: float = 3e-3
    prompts: int = 4  # fixed prompts the engines are checked on
    prompt_len: int = 8
    new_tokens: int = 8  # greedy continuation

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def qwen2_config(size: Size):
    """transformers' Qwen2 config for ``size`` (tied embeddings, fp32, eager attention)."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.inter,
                       num_hidden_layers=size.layers, num_attention_heads=size.heads,
                       num_key_value_heads=size.kv_heads, max_position_embeddings=max(size.seq, 64) * 2,
                       rope_parameters={"rope_type": "default", "rope_theta": size.rope_theta},
                       rms_norm_eps=size.eps, tie_word_embeddings=True, attn_implementation="eager",
                       dtype=torch.float32)


def batch(size: Size, n: int, length: int, seed: int) -> torch.Tensor:
    """Synthetic token sequences a model can learn: arithmetic progressions mod the vocabulary (a random start and
    a stride of 1..7 per sequence), so the loss falls and the greedy continuations mean something."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, size.vocab, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    return (start + stride * torch.arange(length)) % size.vocab


# ---------------------------------------------------------------------------------------------------- the trainer


@ray.remote
class Trainer:
    """One FSDP2 rank of a data-parallel trainer of ``Qwen2ForCausalLM``: every parameter is a DTensor, Shard(0)
    over the two ranks (``fully_shard`` per decoder layer and at the root, a torch.distributed gloo group on CPU)."""

    def __init__(self, rank: int, port: int, size: Size) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import Qwen2ForCausalLM

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=TRAINERS)
        mesh = init_device_mesh("cpu", (TRAINERS,))
        torch.manual_seed(0)  # every rank builds the same full model, then keeps its shard
        self.model = Qwen2ForCausalLM(qwen2_config(size))
        assert self.model.lm_head.weight is self.model.model.embed_tokens.weight  # tied, as in Qwen2.5-0.5B
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=size.lr, weight_decay=0.01)
        self.rank, self.size = rank, size
        self.shards: Optional[rdt.Shards] = None

    def publish(self, step: int) -> rdt.Shards:
        """Sharded path: this rank's local shards, as they are (no gather, no copy), as version ``step``. The
        Shards are kept here too: ``train_step`` fences them before updating the weights in place."""
        self.shards = rdt.put_shards(self.model.state_dict(), version=step)
        return self.shards

    @rdt.tensor_method(tensor_transport="auto")
    def full_state(self, step: int) -> dict:
        """Whole path: the full state dict (gathered: a collective, every rank calls it; rank 0's is the one
        served). A fresh copy, so the trainer may update its weights while a consumer still holds it. The tied
        ``lm_head.weight`` stays the very tensor ``model.embed_tokens.weight`` is, as in the model."""
        gathered: Dict[int, torch.Tensor] = {}
        state = {}
        for name, value in self.model.state_dict().items():
            key = value.to_local().data_ptr()  # tied names: one local shard, gathered once
            if key not in gathered:
                gathered[key] = value.full_tensor()
            state[name] = gathered[key]
        return {"state": state if self.rank == 0 else {}, "step": step}

    def train_step(self, step: int) -> float:
        """Forward, backward, fence the published version, then AdamW updates the weights in place."""
        tokens = batch(self.size, self.size.batch, self.size.seq, seed=1000 * step + self.rank)
        loss = self.model(input_ids=tokens, labels=tokens).loss
        loss.backward()  # FSDP2: all-gathers the layers, reduce-scatters the gradients
        if self.shards is not None:
            self.shards.fence(timeout=30.0)  # the readers of the last version are done; later ones are refused
        self.opt.step()  # in place, on the local shards the publication pointed at
        self.opt.zero_grad()
        return float(loss)

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, new_tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The reference: greedy decoding with transformers' own forward (through FSDP2: a collective, every rank
        calls it), then the logits of the final sequences at every position. Recomputes the whole sequence per
        token, as the engines do."""
        self.model.eval()
        tokens = prompts
        for _ in range(new_tokens):
            logits = self.model(input_ids=tokens, use_cache=False).logits
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        logits = self.model(input_ids=tokens, use_cache=False).logits
        self.model.train()
        return tokens, logits


# -------------------------------------------------------------------------------------- the engines' weight layout


def engine_wants(size: Size, tp: int, rank: int) -> List[Tuple[str, Tuple[int, ...], List[rdt.Region]]]:
    """(target name, target shape, regions of checkpoint parameters concatenated along dim 0) of tensor-parallel
    rank ``rank`` of ``tp``, in vLLM's layout of Qwen2. With ``tp == 1`` every region is a whole parameter."""
    hd, h = size.head_dim, size.hidden
    q, kv = size.heads // tp * hd, size.kv_heads // tp * hd  # this rank's query rows, key (and value) rows
    inter, vocab = size.inter // tp, size.vocab // tp

    def rows(param: str, n: int) -> rdt.Region:  # column-parallel: this rank's block of output rows
        return rdt.Region(param, 0, rank * n, n)

    out = [("embed_tokens", (vocab, h), [rows("model.embed_tokens.weight", vocab)]),  # also the tied lm_head
           ("norm", (h,), [rdt.Region("model.norm.weight")])]
    for i in range(size.layers):
        a, m, p = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"layers.{i}."
        out += [
            (p + "qkv_proj.weight", (q + 2 * kv, h),
             [rows(a + "q_proj.weight", q), rows(a + "k_proj.weight", kv), rows(a + "v_proj.weight", kv)]),
            (p + "qkv_proj.bias", (q + 2 * kv,),
             [rows(a + "q_proj.bias", q), rows(a + "k_proj.bias", kv), rows(a + "v_proj.bias", kv)]),
            (p + "o_proj.weight", (h, q), [rdt.Region(a + "o_proj.weight", 1, rank * q, q)]),  # row-parallel
            (p + "gate_up_proj.weight", (2 * inter, h), [rows(m + "gate_proj.weight", inter),
                                                          rows(m + "up_proj.weight", inter)]),
            (p + "down_proj.weight", (h, inter), [rdt.Region(m + "down_proj.weight", 1, rank * inter, inter)]),
            (p + "input_layernorm.weight", (h,), [rdt.Region(f"model.layers.{i}.input_layernorm.weight")]),
            (p + "post_attention_layernorm.weight", (h,),
             [rdt.Region(f"model.layers.{i}.post_attention_layernorm.weight")]),
        ]
    return out


def checkpoint_views(params: Dict[str, torch.Tensor], size: Size) -> Dict[str, torch.Tensor]:
    """For a single-rank engine: each checkpoint parameter's place inside the fused targets, as a view (rows of a
    row-major tensor: contiguous), so ``rdt.get(into=...)`` lands the full state dict straight in the fused
    layout. ``lm_head.weight`` is tied to the embedding: one target for both."""
    views = {}
    for target, _, regions in engine_wants(size, 1, 0):
        offset = 0
        for region in regions:
            n = region.length if region.dim == 0 else params[target].shape[0]  # a dim-1 region is whole here
            views[region.param] = params[target].narrow(0, offset, n)
            offset += n
    views["lm_head.weight"] = views["model.embed_tokens.weight"]
    return views


# --------------------------------------------------------------------------------- the engines' tensor-parallel forward


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2's RMSNorm: scale by the reciprocal root mean square over the hidden dimension, then by the weight."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotary(length: int, size: Size) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary position embedding (the "rotate half" form: frequency j drives dimensions j and
    j + head_dim/2), one row per position."""
    inv_freq = 1.0 / size.rope_theta ** (torch.arange(0, size.head_dim, 2).float() / size.head_dim)
    angles = torch.arange(length).float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's (j, j + head_dim/2) pairs of ``x`` (batch, heads, length, head_dim) by the position angle."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class TPQwen2:
    """Qwen2's forward over one tensor-parallel rank's slices (``engine_wants``' targets), fp32, no KV cache.

    Per decoder layer: the fused qkv projection gives this rank's query heads and their KV heads (grouped-query:
    query head j uses KV head j // (heads / kv_heads), locally as globally since a rank holds whole groups), causal
    attention over them, then the row-parallel ``o_proj`` gives a partial sum that is all-reduced; the MLP's fused
    gate/up gives this rank's intermediate slice, the row-parallel ``down_proj`` a partial sum, all-reduced. The
    embedding is vocabulary-parallel (rows outside this rank's slice contribute zeros; all-reduced) and, tied, is
    the ``lm_head``: this rank's slice of the logits, all-gathered."""

    def __init__(self, params: Dict[str, torch.Tensor], size: Size, tp: int, rank: int,
                 all_reduce: Callable[[torch.Tensor], None],
                 all_gather: Callable[[torch.Tensor], List[torch.Tensor]]) -> None:
        self.p, self.size, self.tp, self.rank = params, size, tp, rank
        self.all_reduce, self.all_gather = all_reduce, all_gather
        self.heads, self.kv_heads = size.heads // tp, size.kv_heads // tp

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.p["embed_tokens"].shape[0]
        local = tokens - self.rank * rows
        mine = (local >= 0) & (local < rows)
        h = self.p["embed_tokens"][local.clamp(0, rows - 1)] * mine[..., None]
        self.all_reduce(h)
        return h

    def attention(self, x: torch.Tensor, i: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        hd, p = self.size.head_dim, f"layers.{i}."
        qkv = x @ self.p[p + "qkv_proj.weight"].T + self.p[p + "qkv_proj.bias"]
        q, k, v = qkv.split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], dim=-1)
        q, k, v = (t.reshape(b, n, -1, hd).transpose(1, 2) for t in (q, k, v))  # (batch, heads, length, head_dim)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * hd ** -0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, n, self.heads * hd)
        out = out @ self.p[p + "o_proj.weight"].T  # this rank's heads' share of o_proj's output
        self.all_reduce(out)
        return out

    def mlp(self, x: torch.Tensor, i: int) -> torch.Tensor:
        gate, up = (x @ self.p[f"layers.{i}.gate_up_proj.weight"].T).chunk(2, dim=-1)
        out = (torch.nn.functional.silu(gate) * up) @ self.p[f"layers.{i}.down_proj.weight"].T
        self.all_reduce(out)
        return out

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, length, vocab) of ``tokens`` (batch, length)."""
        cos, sin = rotary(tokens.shape[1], self.size)
        h, eps = self.embed(tokens), self.size.eps
        for i in range(self.size.layers):
            h = h + self.attention(rms_norm(h, self.p[f"layers.{i}.input_layernorm.weight"], eps), i, cos, sin)
            h = h + self.mlp(rms_norm(h, self.p[f"layers.{i}.post_attention_layernorm.weight"], eps), i)
        logits = rms_norm(h, self.p["norm"], eps) @ self.p["embed_tokens"].T  # this rank's vocabulary slice
        return torch.cat(self.all_gather(logits.contiguous()), dim=-1)

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, new_tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Greedy decoding (the whole sequence recomputed per token), then the final sequences' logits."""
        tokens = prompts
        for _ in range(new_tokens):
            tokens = torch.cat([tokens, self.forward(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return tokens, self.forward(tokens)


@ray.remote
class Engine:
    """An inference engine rank (a plain actor): its preallocated parameters in the fused layout, the way weights
    reach them (a ``WeightLoader`` of its slices, or ``rdt.get(into=)`` of the whole state dict for a single-rank
    engine) and the forward that serves them."""

    def __init__(self, size: Size, tp: int, rank: int) -> None:
        self.size, self.tp, self.rank = size, tp, rank
        self.params: Dict[str, torch.Tensor] = {}
        self.loader = rdt.WeightLoader()
        for name, shape, regions in engine_wants(size, tp, rank):
            self.params[name] = torch.empty(shape)
            if tp > 1:
                self.loader.want(self.params[name], regions, name=name)
        self.views = checkpoint_views(self.params, size) if tp == 1 else {}

        def all_reduce(t: torch.Tensor) -> None:
            if tp > 1:
                col.allreduce(t, TP_GROUP, timeout=60.0)

        def all_gather(t: torch.Tensor) -> List[torch.Tensor]:
            if tp == 1:
                return [t]
            out = [torch.empty_like(t) for _ in range(tp)]
            col.allgather(out, t, TP_GROUP, timeout=60.0)
            return out

        self.model = TPQwen2(self.params, size, tp, rank, all_reduce, all_gather)

    def load(self, manifest: rdt.Manifest) -> rdt.LoadReport:
        """Sharded path: pull this rank's slices of the manifest's version into the fused targets (and check
        every landed byte against the trainer's checksums)."""
        return self.loader.load(manifest, timeout=30.0, verify=True)

    def load_stale(self, manifest: rdt.Manifest) -> str:
        """Try to load a version the trainers have fenced since: the error's name (it must be refused)."""
        try:
            self.loader.load(manifest, timeout=30.0)
        except rdt.VersionGoneError as e:
            return type(e).__name__
        return "loaded"

    def receive(self, refs: list) -> Tuple[int, float]:
        """Whole path: the full state dict straight into this engine's own fused parameters (``rdt.get`` with
        ``into=``: the bytes land in the views, nothing is allocated). Returns the step and the seconds it took."""
        t0 = time.perf_counter()
        value = rdt.get(refs[0], into={"state": self.views}, timeout=30.0)  # nested in a list: Ray left it alone
        assert all(value["state"][k] is self.views[k] for k in self.views)
        return value["step"], time.perf_counter() - t0

    def generate(self, prompts: torch.Tensor, new_tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.model.generate(prompts, new_tokens)


# ------------------------------------------------------------------------------------------------------ the check


def check(name: str, got: Tuple[torch.Tensor, torch.Tensor], want: Tuple[torch.Tensor, torch.Tensor],
          prompt_len: int) -> Tuple[int, int, float]:
    """Assert that an engine's greedy continuation and logits match the trainer's: per prompt, tokens agree up to
    the first position where the trainer's top two logits are within the fp32 tolerance of each other (a near
    tie: the engine may pick the other one, and the prompt is compared no further), and the logits of every
    position before that agree within ``assert_close``'s default fp32 tolerance. Returns (tokens compared, near
    ties, largest logit difference)."""
    (tokens, logits), (ref_tokens, ref_logits) = got, want
    atol, rtol = 1e-5, 1.3e-6  # torch.testing.assert_close's defaults for float32
    compared = ties = 0
    worst = 0.0
    for b in range(tokens.shape[0]):
        end = tokens.shape[1]  # positions whose context is the same on both sides
        for t in range(prompt_len, tokens.shape[1]):
            top2 = ref_logits[b, t - 1].topk(2).values
            if top2[0] - top2[1] <= atol + rtol * top2[0].abs():
                ties += 1
                end = t
                break
            assert tokens[b, t] == ref_tokens[b, t], f"{name}: prompt {b}, token {t}: {int(tokens[b, t])} != " \
                                                     f"{int(ref_tokens[b, t])} (trainer's top two {top2.tolist()})"
            compared += 1
        torch.testing.assert_close(logits[b, :end], ref_logits[b, :end], msg=lambda m: f"{name}, prompt {b}: {m}")
        worst = max(worst, float((logits[b, :end] - ref_logits[b, :end]).abs().max()))
    return compared, ties, worst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse(argv: Optional[Sequence[str]] = None) -> Size:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for field, default in Size.__dataclass_fields__.items():
        parser.add_argument("--" + field.replace("_", "-"), type=type(default.default), default=default.default)
    size = Size(**vars(parser.parse_args(argv)))
    assert size.hidden % size.heads == 0 and size.heads % size.kv_heads == 0, "heads must divide evenly"
    for n in (size.vocab, size.inter, size.kv_heads):
        assert n % TP == 0, f"{n} does not split over {TP} tensor-parallel ranks"
    return size


def main(argv: Optional[Sequence[str]] = None) -> None:
    size = parse(argv)
    if importlib.util.find_spec("transformers") is None:
        print('weight_sync_qwen2: skipping, transformers is not installed (pip install torch==2.13.0 -e ".[test]")')
        return
    started = time.perf_counter()
    ray.init(num_cpus=5, include_dashboard=False, log_to_driver=False)
    port = free_port()
    trainers = [Trainer.remote(r, port, size) for r in range(TRAINERS)]
    tp_engine = [Engine.remote(size, TP, r) for r in range(TP)]  # sharded: two tensor-parallel ranks
    whole_engine = Engine.remote(size, 1, 0)  # whole: one rank holding the whole model
    ray.get([e.__ray_ready__.remote() for e in tp_engine])
    col.create_collective_group(tp_engine, backend="gloo", group_name=TP_GROUP)  # the engines' all-reduces
    ray.get([a.__ray_ready__.remote() for a in [*trainers, whole_engine]])
    print(f"{TRAINERS} trainer ranks and {TP + 1} engine ranks up in {time.perf_counter() - started:.1f} s",
          flush=True)
    prompts = batch(size, size.prompts, size.prompt_len, seed=12345)
    slice_bytes = sum(4 * torch.Size(shape).numel() for _, shape, _ in engine_wants(size, TP, 0))
    timings: Dict[str, List[float]] = {"sharded load": [], "whole receive": [], "train step": []}
    loss = 0.0
    for step in range(size.steps + 1):
        # Sharded: every trainer rank publishes its shards, the driver checks them into a manifest, both engine
        # ranks pull their slices from both trainer ranks at once.
        manifest = rdt.Manifest(ray.get([t.publish.remote(step) for t in trainers]))
        reports = ray.get([e.load.remote(manifest) for e in tp_engine])
        assert all(r.version == step and r.planned == (step == 0) for r in reports), reports
        assert reports[0].nbytes == slice_bytes  # only this rank's slices moved
        # Whole: the full state dict from a tensor method, received into the single-rank engine's parameters.
        refs = [t.full_state.remote(step) for t in trainers]  # FSDP2's gather: both ranks take part
        ray.wait(refs, num_returns=len(refs))  # gathered (so that the timing below is the receive alone)
        got_step, whole_s = ray.get(whole_engine.receive.remote(refs[:1]))
        assert got_step == step
        del refs  # the gathered copy is freed in the trainer
        # Serve: greedy continuations of the fixed prompts on both engines and on the trainer's own model.
        want = ray.get([t.generate.remote(prompts, size.new_tokens) for t in trainers])[0]
        sharded = ray.get([e.generate.remote(prompts, size.new_tokens) for e in tp_engine])
        assert torch.equal(sharded[0][0], sharded[1][0]), "the tensor-parallel ranks decoded differently"
        whole = ray.get(whole_engine.generate.remote(prompts, size.new_tokens))
        results = {"tp engine": check("tp engine", sharded[0], want, size.prompt_len),
                   "whole engine": check("whole engine", whole, want, size.prompt_len)}
        timings["sharded load"].append(max(r.seconds for r in reports))
        timings["whole receive"].append(whole_s)
        rep = reports[0]
        print(f"step {step} ({f'trained, loss {loss:.3f}' if step else 'initial weights'}): tp engine rank 0 "
              f"loaded its slices ({rep.nbytes / 1e6:.2f} MB) via {sorted(set(rep.paths.values()))}, "
              f"{'planned' if rep.planned else 'replayed'}, verified, in {rep.seconds * 1e3:.1f} ms; the whole "
              f"engine received the full state in {whole_s * 1e3:.1f} ms; "
              + "; ".join(f"{k}: {c} greedy tokens equal, {t} near ties, max |dlogit| {w:.1e}"
                          for k, (c, t, w) in results.items()), flush=True)
        if step == size.steps:
            break
        t0 = time.perf_counter()
        loss = ray.get([t.train_step.remote(step) for t in trainers])[0]  # fences, then updates in place
        timings["train step"].append(time.perf_counter() - t0)
        # The fence made this version gone: a late load of it is refused before a byte moves.
        assert ray.get(tp_engine[0].load_stale.remote(manifest)) == "VersionGoneError"
    medians = ", ".join(f"{k} {sorted(v)[len(v) // 2] * 1e3:.1f}" for k, v in timings.items())
    print(f"{size.steps} steps in {time.perf_counter() - started:.1f} s; median ms: {medians}")
    ray.shutdown()
    print("weight_sync_qwen2: OK")


if __name__ == "__main__":
    main()
