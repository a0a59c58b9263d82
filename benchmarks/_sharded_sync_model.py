"""The sharded-sync suite's model layout: which rows of every parameter each trainer rank holds (``Shard(0)``), what
each engine rank of a tensor-parallel engine wants (vLLM's Qwen2 layout: q/k/v and gate/up fused and
column-parallel, o_proj and down_proj row-parallel, the embedding vocabulary-parallel and tied with lm_head, the
norms replicated), and the values every element holds at a step, so that a check knows what it must read.

Pure functions of the shapes (no Ray, no actors): the driver, the trainers and the engines all compute the same.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from rdt import Region

from ._weight_sync import ModelShape

Shape = Tuple[int, ...]
Want = Tuple[str, Shape, Tuple[Region, ...]]  # target name, target shape, regions concatenated along dim 0
PATTERN_MOD = 128  # element values are (index pattern % 128) + step: integers below 256, exact in bf16
MAX_STEPS = 256 - PATTERN_MOD


def chunk(n: int, parts: int, i: int) -> Tuple[int, int]:
    """(start, length) of part ``i`` of ``n`` split as torch.chunk / DTensor ``Shard`` split it (ceil-sized parts,
    the last ones shorter or empty)."""
    size = -(-n // parts)
    start = min(i * size, n)
    return start, min(size, n - start)


def trainer_rows(shape: ModelShape, trainers: int, rank: int) -> Dict[str, Tuple[Shape, int, int]]:
    """{name: (global shape, first row, rows)} of the parameters trainer ``rank`` holds (``Shard(0)``; a rank whose
    chunk of a parameter is empty holds none of it)."""
    out = {}
    for name, gshape in shape.shapes():
        start, n = chunk(gshape[0], trainers, rank)
        if n:
            out[name] = (gshape, start, n)
    return out


def engine_wants(shape: ModelShape, tp: int, r: int) -> List[Want]:
    """What tensor-parallel rank ``r`` of ``tp`` holds, as vLLM's Qwen2 lays it out (lm_head tied: no tensor)."""
    h, kv, ff, vocab = shape.hidden, shape.kv, shape.inter, shape.vocab
    q0, qn = chunk(h, tp, r)
    k0, kn = chunk(kv, tp, r)
    f0, fn = chunk(ff, tp, r)
    c0, cn = chunk(h, tp, r)
    v0, vn = chunk(vocab, tp, r)
    out: List[Want] = [("model.embed_tokens.weight", (vn, h), (Region("model.embed_tokens.weight", 0, v0, vn),))]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        for kind in ("weight", "bias"):
            regs = (Region(a + "q_proj." + kind, 0, q0, qn), Region(a + "k_proj." + kind, 0, k0, kn),
                    Region(a + "v_proj." + kind, 0, k0, kn))
            out.append((a + "qkv_proj." + kind, (qn + 2 * kn, h) if kind == "weight" else (qn + 2 * kn,), regs))
        out.append((a + "o_proj.weight", (h, cn), (Region(a + "o_proj.weight", 1, c0, cn),)))
        out.append((m + "gate_up_proj.weight", (2 * fn, h),
                    (Region(m + "gate_proj.weight", 0, f0, fn), Region(m + "up_proj.weight", 0, f0, fn))))
        out.append((m + "down_proj.weight", (h, fn), (Region(m + "down_proj.weight", 1, f0, fn),)))
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out.append((p + norm, (h,), (Region(p + norm),)))
    out.append(("model.norm.weight", (h,), (Region("model.norm.weight"),)))
    return out


def target_bytes(wants: Sequence[Want]) -> int:
    """Bytes of an engine rank's targets in bf16."""
    total = 0
    for _, tshape, _ in wants:
        n = 1
        for d in tshape:
            n *= d
        total += 2 * n
    return total


# ---------------------------------------------------------------------- values
def pattern(box: Sequence[Tuple[int, int]], global_shape: Shape, step: int) -> torch.Tensor:
    """The bf16 values of ``box`` of a global parameter at ``step``: ``(row * 7 + col) % 128 + step`` (2-D) or
    ``index % 128 + step`` (1-D); every element of a row-parallel or fused slice differs from its neighbours."""
    if len(global_shape) == 1:
        (lo, hi), = box
        v = torch.arange(lo, hi, dtype=torch.int32) % PATTERN_MOD
    else:
        (r0, r1), (c0, c1) = box
        rows = (torch.arange(r0, r1, dtype=torch.int32) * 7 % PATTERN_MOD).unsqueeze(1)
        v = (rows + torch.arange(c0, c1, dtype=torch.int32).unsqueeze(0)) % PATTERN_MOD
    return (v + step).to(torch.bfloat16)


def value_at(index: Sequence[int], global_shape: Shape, step: int) -> float:
    """One element of :func:`pattern`."""
    if len(global_shape) == 1:
        return float(index[0] % PATTERN_MOD + step)
    return float((index[0] * 7 % PATTERN_MOD + index[1]) % PATTERN_MOD + step)


def region_views(target: torch.Tensor, regions: Sequence[Region], shapes: Dict[str, Shape],
                 name: str) -> List[Tuple[torch.Tensor, Region, Tuple[Tuple[int, int], ...]]]:
    """(the part of ``target`` a region lands in, the region, its box in the global parameter), in order."""
    out, at = [], 0
    for reg in regions:
        box = reg.box(shapes[reg.param], name)
        n = box[0][1] - box[0][0]
        out.append((target.narrow(0, at, n), reg, box))
        at += n
    return out


def narrow_into(target: torch.Tensor, regions: Sequence[Region], full: Dict[str, torch.Tensor], name: str) -> None:
    """The baselines' last stage: copy each region out of the whole parameters into its place in ``target``."""
    shapes = {k: tuple(v.shape) for k, v in full.items()}
    for view, reg, box in region_views(target, regions, shapes, name):
        src = full[reg.param]
        for d, (lo, hi) in enumerate(box):
            src = src.narrow(d, lo, hi - lo)
        view.copy_(src)
