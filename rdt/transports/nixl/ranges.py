"""Byte ranges of a NIXL object READ one-sidedly into local addresses: sharded weight sync's path over NIXL. The
local tensors the ranges land in are registered once per storage (as ``rdt.get(into=)`` targets are)."""

from __future__ import annotations

from typing import Any, List, Optional

from ..base import Ranges
from .agent import agent, release_all
from .descriptors import NixlInfo
from .read import _transfer, was_parked


def read_ranges(ctx: Any, info: NixlInfo, ranges: Ranges, timeout: float) -> Optional[str]:
    """"nixl" once every range landed; None for objects with VRAM buffers (not served by range yet).
    Raises TimeoutError (the READ is parked until NIXL finishes it) or RuntimeError (NIXL's own failure)."""
    if set(info.mem_types) != {"DRAM"} or any(t.device.type != "cpu" for t in ranges.targets):
        return None
    ag = agent(ctx)
    ag.ensure_remote(info.agent, info.agent_md, *info.extra_md)
    parked = False
    regs: List[Any] = []
    try:
        with ag.lock:
            targets = list(ranges.targets)
            missing = [t for t, ok in zip(targets, ag.targets.cover(targets)) if not ok]
            if missing:
                regs.append(ag.agent.register_memory(missing))
        descs = info.descs
        remote = [(descs[b][0] + o, n, descs[b][2]) for b, o, n in
                  zip(ranges.buf.tolist(), ranges.off.tolist(), ranges.n.tolist())]
        local = [(d, n, 0) for d, n in zip(ranges.dst.tolist(), ranges.n.tolist())]
        held, regs = regs, []
        _transfer(ag, info, [(local, remote, "DRAM", "DRAM")], held, targets, timeout, targets=targets,
                  label="a sharded load")
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
