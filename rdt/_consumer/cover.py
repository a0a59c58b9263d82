"""Covering reads. A strided set of runs (a row-parallel slice of a row-major shard: one short run per row) can be
read as the one contiguous range that covers it, into a staging buffer, and narrowed here. Which is cheaper depends
on the transport: what one more range costs it against what one more byte costs. Each transport declares those two
constants (``Capabilities.range_run_s`` and ``range_bytes_per_s``, measured by ``rdt-bench --suites sharded-sync``;
``rdt.configure(range_costs={name: (run_s, bytes_per_s)})`` overrides them); a transport that declares none is read
in exact runs. Decided once per plan, object and transport by the consumer's range road (``ranges``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from rdt_transports._memcopy import copy_parts

# The local narrow (copy_parts from the staging buffer into the targets): per run and per byte, measured by
# rdt-bench's calibration on the 2-core reference machine.
LOCAL_RUN_S = 0.2e-6
LOCAL_BYTES_PER_S = 4e9


@dataclass
class Groups:
    """One producer rank's runs before merging, grouped by the box intersection they copy (a group's runs have one
    leaf, one target and one length): per run its group, leaf, source offset, target, destination offset, length;
    per group its first source byte, the bytes covering it, and its run count."""

    gid: np.ndarray
    leaf: np.ndarray
    src: np.ndarray
    target: np.ndarray
    dst: np.ndarray
    n: np.ndarray
    g_leaf: np.ndarray
    g_src0: np.ndarray
    g_cover: np.ndarray
    g_k: np.ndarray
    g_bytes: np.ndarray


@dataclass
class ReadPlan:
    """What one transport reads from one producer rank: runs (``target`` index ``len(keep)`` is the staging buffer)
    and, for the covered groups, the local narrow from the staging buffer (target, destination, staging offset,
    length)."""

    leaf: np.ndarray
    src: np.ndarray
    target: np.ndarray
    dst: np.ndarray
    n: np.ndarray
    narrow: Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # runs of covered groups without one stride
    covered: int  # groups read as one covering range
    staging_bytes: int
    read_bytes: int
    used: Tuple[int, ...] = ()  # the target indexes the runs land in, ascending
    # covered groups whose runs step by one stride on both sides, narrowed as one strided copy each:
    # (target, first destination byte, destination stride, first staging byte, staging stride, runs, run bytes)
    strided: List[Tuple[int, int, int, int, int, int, int]] = field(default_factory=list)
    staging: Optional[torch.Tensor] = None

    def staging_tensor(self) -> torch.Tensor:
        """The staging buffer, made on first use and kept with the plan (its bytes: ``staging_bytes``)."""
        if self.staging is None:
            self.staging = torch.empty(self.staging_bytes, dtype=torch.uint8)
        return self.staging


def groups(parts: List[Tuple[np.ndarray, ...]]) -> Groups:
    """``parts``: per box intersection (leaf, src, target, dst, n) arrays of its runs (bytes)."""
    sizes = np.array([len(p[0]) for p in parts], np.int64)
    gid = np.repeat(np.arange(len(parts), dtype=np.int64), sizes)
    leaf, src, target, dst, n = (np.concatenate(c) for c in zip(*parts))
    firsts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    lasts = firsts + sizes - 1
    return Groups(gid, leaf, src, target, dst, n, leaf[firsts], src[firsts], src[lasts] + n[lasts] - src[firsts],
                  sizes, np.add.reduceat(n, firsts))


def decide(g: Groups, run_s: float, bytes_per_s: float) -> np.ndarray:
    """Per group: read it covering (True) rather than in exact runs."""
    exact = g.g_k * run_s + g.g_bytes / bytes_per_s
    cover = run_s + g.g_cover / bytes_per_s + g.g_k * LOCAL_RUN_S + g.g_bytes / LOCAL_BYTES_PER_S
    return (g.g_k > 1) & (cover < exact)


def merge(leaf: np.ndarray, src: np.ndarray, target: np.ndarray, dst: np.ndarray,
          n: np.ndarray) -> Tuple[np.ndarray, ...]:
    """Adjacent runs (same leaf and target, contiguous on both sides) joined into one, sorted by leaf and source."""
    order = np.lexsort((src, leaf))
    leaf, src, target, dst, n = leaf[order], src[order], target[order], dst[order], n[order]
    if len(n) < 2:
        return leaf, src, target, dst, n
    joins = (leaf[1:] == leaf[:-1]) & (target[1:] == target[:-1]) & (src[1:] == src[:-1] + n[:-1]) \
        & (dst[1:] == dst[:-1] + n[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    total = np.add.reduceat(n, starts)
    return leaf[starts], src[starts], target[starts], dst[starts], total


def plan(g: Groups, covered: np.ndarray, staging_index: int) -> ReadPlan:
    """The runs a transport reads when ``covered`` groups are read covering (adjacent exact runs merged)."""
    keep = ~covered[g.gid]
    exact = merge(g.leaf[keep], g.src[keep], g.target[keep], g.dst[keep], g.n[keep])
    idx = np.flatnonzero(covered)
    stage_at = np.concatenate(([0], np.cumsum(g.g_cover[idx])[:-1])).astype(np.int64) if len(idx) else \
        np.zeros(0, np.int64)
    cov = (g.g_leaf[idx], g.g_src0[idx], np.full(len(idx), staging_index, np.int64), stage_at, g.g_cover[idx])
    leaf, src, target, dst, n = (np.concatenate((a, b)) for a, b in zip(exact, cov))
    where = np.zeros(len(covered), np.int64)
    where[idx] = stage_at
    firsts = np.concatenate(([0], np.cumsum(g.g_k)[:-1])).astype(np.int64)
    strided: List[Tuple[int, int, int, int, int, int, int]] = []
    irregular = np.zeros(len(covered), dtype=bool)
    for j in idx.tolist():  # once per plan: a group's runs are contiguous in the arrays
        a, k = int(firsts[j]), int(g.g_k[j])
        ds, ss = np.diff(g.dst[a:a + k]), np.diff(g.src[a:a + k])
        if (ds == ds[0]).all() and (ss == ss[0]).all() and ds[0] >= g.n[a]:
            strided.append((int(g.target[a]), int(g.dst[a]), int(ds[0]), int(where[j]), int(ss[0]), k, int(g.n[a])))
        else:
            irregular[j] = True
    runs = np.flatnonzero(irregular[g.gid])
    grp = g.gid[runs]
    narrow = (g.target[runs], g.dst[runs], where[grp] + g.src[runs] - g.g_src0[grp], g.n[runs])
    staging = int(g.g_cover[idx].sum())
    return ReadPlan(leaf, src, target, dst, n, narrow, len(idx), staging, int(n.sum()),
                    tuple(np.unique(target).tolist()), strided)


def narrow(rp: ReadPlan, keep: Sequence[torch.Tensor], addrs: np.ndarray) -> None:
    """Copy the covered groups' runs from the staging buffer into the targets (``addrs``: their base addresses):
    one strided copy per group whose runs step by one stride (a row-parallel slice), range by range for the
    others."""
    stage = rp.staging_tensor()
    flat: Dict[int, torch.Tensor] = {}
    for t, d0, ds, s0, ss, k, n in rp.strided:
        into = flat.get(t)
        if into is None:
            into = flat[t] = keep[t].reshape(-1).view(torch.uint8)
        torch.as_strided(into, (k, n), (ds, 1), into.storage_offset() + d0).copy_(
            torch.as_strided(stage, (k, n), (ss, 1), s0))
    target, dst, at, n = rp.narrow
    if len(n):
        base = stage.data_ptr()
        copy_parts(list(zip((addrs[target] + dst.astype(np.uint64)).tolist(), (at + base).tolist(), n.tolist())))
