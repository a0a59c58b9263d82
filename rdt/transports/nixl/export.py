"""The producer's side of a NIXL object: register its buffers (whole storages, shared by every live object that
uses them, or one pooled block for an object of many small CPU buffers) and describe them for consumers; release
them when the object is freed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from rdt_transports._memcopy import copy_parts

from ..._objects.stream_ready import wait_ready
from ..base import Context, SetupFailed
from ..receive import padded_offsets
from .agent import NixlAgent, RegKey, agent
from .descriptors import NixlInfo, PackedDescs, group_by_mem_type, mem_type_of

if TYPE_CHECKING:
    from ..._objects.table import Entry

def register(ctx: "Context", entry: "Entry") -> NixlInfo:
    """Describe an object's buffers for consumers (once per object), registering each storage it uses unless a live
    object registered it already; the object counts as one user of each (see :func:`release`). An object of many
    small CPU buffers is packed into one registered block instead (:func:`_packs`)."""
    known = entry.exports.get("nixl")
    if known is not None:
        return known[1]
    spans = entry.flat.spans  # one buffer per storage: (a tensor on it, first byte, end byte); no view made
    if not spans:  # only empty tensors: such objects travel inline, never here
        raise SetupFailed(f"object {entry.obj_id.hex()} has no bytes to register with NIXL")
    wait_ready(entry)  # a one-sided READ follows no stream: the writes queued before the return must be done
    ag = agent(ctx)
    if _packs(entry):
        return _register_packed(ag, entry)
    types: List[str] = []
    keys: List[RegKey] = []
    items: List[Tuple[RegKey, Any]] = []
    descs: List[Tuple[int, int, int]] = []
    for owner, lo, hi in spans:
        storage = owner.untyped_storage()
        mem = "DRAM" if owner.is_cpu else mem_type_of(owner)
        dev = 0 if owner.is_cpu else max(owner.get_device(), 0)
        base = storage.data_ptr()
        key = (mem, dev, base, storage.nbytes())
        types.append(mem)
        keys.append(key)
        items.append((key, storage))
        descs.append((base + lo, hi - lo, dev))
    regs = ag.registrations.acquire_many(items)
    try:
        # The same registrations as the previous object (the same weights returned again): the same metadata.
        same = ag.last_md is not None and ag.last_md[0] == keys and all(a is b for a, b in zip(ag.last_md[1], regs))
        if same:
            mds = ag.last_md[2]
        else:
            with ag.lock:
                # Partial metadata: connection info plus just this object's storages' registrations, so it stays
                # small however many objects are alive, and is never stale (full metadata fetched once would miss
                # later ones). NIXL's partial metadata covers one memory type per call: one blob per type, in order
                # of appearance.
                mds = [ag.agent.get_partial_agent_metadata(
                    ag.agent.get_reg_descs([(k[2], k[3], k[1], "") for k in keys if k[0] == mem], mem), True)
                    for mem, _ in group_by_mem_type(types)]
            ag.last_md = (keys, regs, mds)  # holds the registration objects: their identity cannot be reused
    except BaseException:
        ag.registrations.release_many(keys)
        raise
    info = NixlInfo(ag.name, mds[0], "VRAM" if "VRAM" in types else "DRAM", tuple(descs), tuple(types),
                    tuple(mds[1:]))
    entry.exports["nixl"] = (tuple(keys), info)
    return info


# An object is packed when it has at least PACK_MIN buffers, all in CPU memory, of PACK_MEAN bytes or less on
# average and PACK_MAX in all: NIXL posts one UCX operation per descriptor (~4 us each here) and registers each
# storage, while one copy into a registered block costs ~0.1 ms per MB. The copy is made at registration, so
# such an object's consumers read the bytes as they were then (as with snapshot=True).
PACK_MIN = 16
PACK_MEAN = 256 << 10
PACK_MAX = 64 << 20


def _packs(entry: "Entry") -> bool:
    table = entry.flat.table
    n = len(table.sizes)
    return n >= PACK_MIN and table.total <= min(PACK_MAX, n * PACK_MEAN) and table.device_types == {"cpu"}


def _register_packed(ag: NixlAgent, entry: "Entry") -> NixlInfo:
    """Copy the object's buffers into one registered block from the agent's pool, laid out as a consumer's landing
    block (:func:`padded_offsets`), and describe each buffer within it."""
    sizes = list(entry.flat.table.sizes)
    offsets, total = padded_offsets(sizes)
    block = ag.blocks.take(total)
    try:
        base = block.addr
        copy_parts([(base + o, a, n) for o, (a, n) in zip(offsets, entry.flat.ranges)])
        info = NixlInfo(ag.name, block.md, "DRAM", PackedDescs(base, sizes, offsets), packed=True)
    except BaseException:
        ag.blocks.give(block)
        raise
    entry.exports["nixl"] = ((), info, block)
    return info


def release(ctx: "Context", entry: "Entry") -> None:
    """The object was freed: it is one user fewer of each storage registration (the last one deregisters), and a
    packed object's block goes back to the pool."""
    known = entry.exports.pop("nixl", None)
    ag: Optional[NixlAgent] = ctx.peek_transport_state("nixl")
    if known is None or ag is None:
        return
    ag.registrations.release_many(list(known[0]))  # never raises
    if len(known) > 2:
        ag.blocks.give(known[2])
