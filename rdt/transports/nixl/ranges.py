"""Byte ranges of a NIXL object READ one-sidedly into local addresses: sharded weight sync's path over NIXL, for
DRAM and VRAM on both sides. The local tensors the ranges land in are registered once per storage (as
``rdt.get(into=)`` targets are), GPU targets as VRAM. A NIXL descriptor list has one memory type, so the ranges are
grouped by the memory type of the producer buffer they come from (:func:`descriptor_lists`): one READ per group.

Into GPU targets the READ starts only once the caller's work queued before the load is done (NIXL moves device memory
outside streams), and once NIXL says DONE the bytes are on the device."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..._objects import device_order
from ..base import Ranges
from .agent import agent, release_all
from .descriptors import NixlInfo
from .read import _transfer, was_parked

Descs = List[Tuple[int, int, int]]  # (address, bytes, device id), as NIXL's get_xfer_descs takes them


def local_memory(device: torch.device) -> Tuple[str, int]:
    """NIXL's memory type and device id of targets on ``device``."""
    if device.type == "cuda":
        return "VRAM", int(device.index or 0)
    return "DRAM", 0


def descriptor_lists(info: NixlInfo, ranges: Ranges, local_type: str,
                     local_dev: int) -> List[Tuple[Descs, Descs, str, str]]:
    """The READs of ``ranges`` from the object ``info`` describes into local memory of ``local_type`` on device
    ``local_dev``: per memory type of the producer's buffers, (local descriptors, remote descriptors, local type,
    remote type), each range in both at the same position, in the ranges' order within a group."""
    buf = np.asarray(ranges.buf, np.int64)
    off = np.asarray(ranges.off, np.int64)
    n = np.asarray(ranges.n, np.int64)
    dst = np.asarray(ranges.dst, np.uint64)
    if not len(n):
        return []
    descs = info.descs
    bases = np.array([d[0] for d in descs], np.uint64) if len(descs) else np.zeros(0, np.uint64)
    devs = np.array([d[2] for d in descs], np.int64) if len(descs) else np.zeros(0, np.int64)
    kinds = np.array([1 if t == "VRAM" else 0 for t in info.mem_types], np.int64)
    remote_addr = (bases[buf] + off.astype(np.uint64)).tolist()
    remote_dev = devs[buf].tolist()
    out: List[Tuple[Descs, Descs, str, str]] = []
    for kind, name in ((1, "VRAM"), (0, "DRAM")):
        sel = np.flatnonzero(kinds[buf] == kind)
        if not len(sel):
            continue
        sizes = n[sel].tolist()
        local = list(zip(dst[sel].tolist(), sizes, [local_dev] * len(sel)))
        remote = list(zip([remote_addr[i] for i in sel], sizes, [remote_dev[i] for i in sel]))
        out.append((local, remote, local_type, name))
    return out


def read_ranges(ctx: Any, info: NixlInfo, ranges: Ranges, timeout: float) -> Optional[str]:
    """"nixl" once every range landed. Raises TimeoutError (the READ is parked until NIXL finishes it) or
    RuntimeError (NIXL's own failure)."""
    device = ranges.device
    if device.type not in ("cpu", "cuda"):
        return None
    local_type, local_dev = local_memory(device)
    ag = agent(ctx)
    ag.ensure_remote(info.agent, info.agent_md, *info.extra_md)
    parked = False
    regs: List[Any] = []
    try:
        targets: Sequence[torch.Tensor] = list(ranges.targets)
        with ag.lock:
            missing = [t for t, ok in zip(targets, ag.targets.cover(targets)) if not ok]
            if missing:
                regs.append(ag.agent.register_memory(missing))
        plan = descriptor_lists(info, ranges, local_type, local_dev)
        if local_type == "VRAM":
            device_order.current().wait_host(ranges.after)  # the caller's queued work on the targets is done
        held, regs = regs, []
        _transfer(ag, info, plan, held, list(targets), timeout, targets=list(targets), label="a sharded load")
    except BaseException as e:
        parked = was_parked(e)
        raise
    finally:
        if regs:
            with ag.lock:
                release_all(ag.agent, [], regs)
        if not parked:
            ag.done_remote(info.agent)
    return "nixl"


__all__ = ["descriptor_lists", "local_memory", "read_ranges"]
