"""Planning a sharded load: a loader's wants (regions of global parameters, concatenated for fused targets) against
a manifest's layout become, per producer rank, the byte runs of that rank's published leaves to land in the
targets. Made once per layout and replayed; the consumer's range road (``rdt._consumer.ranges``) reads them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from .._consumer import cover
from .._consumer.ranges import RangeRead, Runs
from ..errors import InvalidArgumentError
from .layout import Region, intersect, runs
from .publish import Manifest, ParamInfo


@dataclass
class Want:
    """One target and the regions it receives, concatenated along ``dim``."""

    name: str
    target: torch.Tensor
    regions: Tuple[Region, ...]
    dim: int
    cast: bool
    landing: Optional[torch.Tensor] = None  # where a cast target's bytes land first (the source dtype)


def _form(t: torch.Tensor) -> Tuple[Any, ...]:
    """What a target must keep between loads for the plan's runs to stay right (its address may change)."""
    return t.dtype, t.shape, t.stride(), t.device


@dataclass
class Plan:
    """Everything a load derives from the wants and a manifest's layout, made once and replayed: per producer rank
    the runs it serves (with what the road keeps for them), and the tensors the bytes land in."""

    key: Any
    reads: List[Tuple[int, RangeRead]]  # (rank, its runs), by rank
    keep: List[torch.Tensor]  # where each want's bytes land: its target, or a cast target's landing
    nbytes: int
    names: List[str]
    targets: List[torch.Tensor]  # the wants' targets, as keep
    forms: List[Tuple[Any, ...]] = field(default_factory=list)
    ptrs: List[int] = field(default_factory=list)
    addrs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    moved: bool = False  # a landing tensor moved to other storage at the last addresses() (it holds no version)
    delta_runs: Dict[int, Any] = field(default_factory=dict)  # per rank: its runs as delta loads read them (once)

    def __post_init__(self) -> None:
        self.forms = [_form(t) for t in self.targets]

    def addresses(self) -> np.ndarray:
        """The landing tensors' base addresses (recomputed when one moved). A target whose dtype, shape, strides or
        device changed since it was wanted (``param.data`` swapped, even at the same byte count) is refused
        (InvalidArgumentError) before a byte moves: the runs were planned for its old form."""
        forms = [_form(t) for t in self.targets]
        if forms != self.forms:
            for name, t, (dtype, shape, stride, device) in zip(self.names, self.targets, self.forms):
                if _form(t) != (dtype, shape, stride, device):
                    raise InvalidArgumentError(
                        f"target {name!r} changed since it was wanted: it is now {t.dtype} {tuple(t.shape)} "
                        f"(strides {t.stride()}) on {t.device}, it was {dtype} {tuple(shape)} (strides {stride}) "
                        f"on {device}; nothing was moved",
                        hint="want the parameter's current tensor in a new rdt.WeightLoader (its dtype or shape "
                             "changed, e.g. param.data was swapped)")
        ptrs = [t.data_ptr() for t in self.keep]
        self.moved = bool(self.ptrs) and ptrs != self.ptrs
        if ptrs != self.ptrs:
            self.addrs, self.ptrs = np.array(ptrs, dtype=np.uint64), ptrs
        return self.addrs

    @property
    def device(self) -> torch.device:
        """Where the bytes land: the targets' one device (``want`` refuses targets on another)."""
        return self.keep[0].device if self.keep else torch.device("cpu")

    def stagings(self) -> List[torch.Tensor]:
        """The covering reads' staging buffers (a failed read may still land in them)."""
        return [t for _, r in self.reads for t in r.stagings()]


def make(wants: List[Want], manifest: Manifest) -> Plan:
    """Check every want against the manifest and turn them into runs per producer rank (before any byte moves)."""
    by_rank: Dict[int, List[Tuple[np.ndarray, ...]]] = {}
    for ti, w in enumerate(wants):
        src_dtype = _check(w, manifest)
        itemsize = torch.empty((), dtype=src_dtype).element_size()
        cat_at = 0
        for region in w.regions:
            info = manifest.holders[region.param][0][1]
            box = region.box(info.global_shape, w.name)
            dst_shape = list(w.target.shape) or [1]
            for rank, leaf, pinfo in _holders(manifest, region.param, box, ti):
                part = intersect(box, pinfo.box)
                assert part is not None
                src_shape = [hi - lo for lo, hi in pinfo.box]
                src_lo = [a - b for (a, _), (b, _) in zip(part, pinfo.box)]
                dst_lo = [a - b for (a, _), (b, _) in zip(part, box)]
                if w.target.dim():
                    dst_lo[w.dim] += cat_at
                s, d, length = runs(src_shape, src_lo, dst_shape if w.target.dim() else [], dst_lo,
                                    [hi - lo for lo, hi in part])
                by_rank.setdefault(rank, []).append(
                    (np.full(len(s), leaf, np.int64), s * itemsize, np.full(len(s), ti, np.int64), d * itemsize,
                     np.full(len(s), length * itemsize, np.int64)))
            if w.target.dim():
                cat_at += box[w.dim][1] - box[w.dim][0]
        w.landing = torch.empty(w.target.shape, dtype=src_dtype, device=w.target.device) if w.cast else None
    reads = []
    for rank, parts in sorted(by_rank.items()):
        cols = [np.concatenate(c) for c in zip(*parts)]
        reads.append((rank, RangeRead(Runs(*cover.merge(*cols), groups=cover.groups(parts)))))
    keep = [w.landing if w.landing is not None else w.target for w in wants]
    return Plan(manifest.layout_key, reads, keep, sum(r.runs.nbytes for _, r in reads), [w.name for w in wants],
                [w.target for w in wants])


def _check(w: Want, manifest: Manifest) -> torch.dtype:
    """The source dtype of ``w`` after checking its regions exist, agree, fit the target and its dtype."""
    infos: List[ParamInfo] = []
    for r in w.regions:
        held = manifest.holders.get(r.param)
        if held is None:
            raise InvalidArgumentError(f"target {w.name!r} wants {r.param!r}, which no rank of version "
                                       f"{manifest.version} publishes", hint="check the parameter's name")
        infos.append(held[0][1])
    dtypes = {i.dtype for i in infos}
    if len(dtypes) > 1:
        raise InvalidArgumentError(f"target {w.name!r} concatenates parameters of dtypes {sorted(dtypes)}",
                                   hint="fuse parameters of one dtype into one target")
    src = getattr(torch, dtypes.pop())
    if src != w.target.dtype and not w.cast:
        raise InvalidArgumentError(f"target {w.name!r} is {w.target.dtype}, {infos[0].name!r} is published as {src}",
                                   hint="pass cast=True to convert, or want into a target of the published dtype")
    shape: Optional[List[int]] = None
    for r, i in zip(w.regions, infos):
        ext = [hi - lo for lo, hi in r.box(i.global_shape, w.name)]
        if w.target.dim() == 0:
            ext = ext or [1]
        if shape is None:
            shape = ext
        elif len(ext) != len(shape) or any(a != b for k, (a, b) in enumerate(zip(ext, shape)) if k != w.dim):
            raise InvalidArgumentError(f"target {w.name!r}: region of {r.param!r} is {ext}, the first is {shape}; "
                                       f"they must agree except along dim {w.dim}", hint="check the narrows")
        else:
            shape[w.dim] += ext[w.dim]
    want = list(w.target.shape) or [1]
    if shape != want:
        raise InvalidArgumentError(f"target {w.name!r} is {tuple(w.target.shape)}, its regions make {tuple(shape)}",
                                   hint="size the target as the regions concatenated along dim")
    return src


def _holders(manifest: Manifest, param: str, box: Any, salt: int) -> List[Tuple[int, int, ParamInfo]]:
    """(rank, leaf index, param info) of one holder per distinct shard box meeting ``box`` (replicas: spread by
    ``salt`` so that targets read from different replicas)."""
    by_box: Dict[Any, List[Tuple[int, int, ParamInfo]]] = {}
    for shards, info in manifest.holders[param]:
        if intersect(box, info.box) is not None:
            leaf = next(i for i, p in enumerate(shards.params) if p.name == param)
            by_box.setdefault(info.box, []).append((shards.rank, leaf, info))
    return [held[salt % len(held)] for held in by_box.values()]
