"""Same-node objects: a copy from the producer's shared storages, a direct read of the producer's memory
(``process_vm_readv``), or a shared-memory segment.

Export: where the kernel lets same-node consumers read this process (see ``_cma``), a guard naming the object and
the buffers' addresses, and where the buffers live in shared memory, the files behind them (``_shm_map``);
otherwise, for an explicit "shm" object, a segment written at return. Fetch: a copy from cached mappings of those
files, else a direct read, into the caller's targets or recycled receive buffers; any failed read asks the
producer, which answers authoritatively (a segment written on demand, the object freed, or nothing: the producer
died).
"""

from __future__ import annotations

import logging
import struct
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from .. import _cma, _control, _shm, _shm_map
from .._ready import wait_ready
from .._meta import ObjectMeta
from .._peer import control_request, died, err, freed, producer_alive
from .base import BlockViews, Capabilities, Fetched, Served, Site, Targets, Transport, block_views, landing

logger = logging.getLogger("rdt")


@dataclass(frozen=True)
class ShmDescriptor:
    """Where a same-node consumer finds the bytes: the producer's memory (``cma``) and/or a segment."""

    cma: Optional[_cma.CmaInfo] = None
    segment: Optional[_shm.Segment] = None
    maps: Optional[_shm_map.MapInfo] = None  # where the buffers lie in the producer's shared storages, if they do


class ShmTransport(Transport):
    capabilities = Capabilities(name="shm", devices=frozenset({"cpu"}), one_sided=True, same_node=True,
                                auto_priority=10)

    def export(self, ctx: Any, entry: Any, chosen: str) -> Optional[ShmDescriptor]:
        wait_ready(entry)  # consumers read the producer's memory one-sidedly from here on
        if ctx.cma_readable():
            guard = entry.exports["cma_guard"] = _cma.guard_for(entry.obj_id)
            return ShmDescriptor(cma=_cma.CmaInfo(guard.ctypes.data, tuple(entry.flat.ranges)),
                                 maps=_shm_map.describe(entry.flat.spans))
        if chosen == "shm":
            seg = entry.exports["shm"] = ctx.shm_pool.write(entry.buffers, entry.obj_id)
            return ShmDescriptor(segment=seg)
        return None  # auto: a segment only when a consumer asks

    def fetch(self, ctx: Any, meta: ObjectMeta, site: Site, deadline: float) -> Fetched:
        desc: Optional[ShmDescriptor] = meta.export("shm")
        info = desc.cma if desc is not None else None
        if info is not None and ctx.config.shm_cma and not ctx.cma.denied(meta.producer.pid, meta.producer.started):
            bufs = _landings(ctx, meta, site)
            dests = bufs.addresses() if isinstance(bufs, (BlockViews, Targets)) else [b.data_ptr() for b in bufs]
            try:
                if desc.maps is not None and ctx.config.shm_map and _read_mapped(ctx, meta, desc.maps, info, dests):
                    return Fetched(bufs, "shm-map")
                ctx.cma.read(meta.producer.pid, info, dests, meta.obj_id, meta.producer.started)
                return Fetched(bufs, "shm-direct")
            except _cma.CmaError as e:
                # Refused by the kernel, or the object/process is gone: ask the producer, which gives the
                # authoritative answer (a segment, ObjectFreedError, or ProducerDiedError).
                logger.debug("rdt: direct read of %s failed (%s); asking the producer for a segment", meta.id_hex, e)
        seg = desc.segment if desc is not None else None
        if seg is None:
            resp = control_request(ctx, meta, _control.REQ_PREPARE_SHM, _control.KEY_PROCESS,
                                   meta.producer.process_key, meta.obj_id, max(deadline - time.monotonic(), 1e-3))
            name, _, body = resp.partition(b"\0")
            (n,) = struct.unpack_from("!I", body)
            layout = [struct.unpack_from("!QQ", body, 4 + 16 * i) for i in range(n)]
            return Fetched(_map(ctx, meta, name.decode(), layout), "shm-segment")
        if not _shm.owner_alive(seg.name):  # same node, so the pid in the name is meaningful
            _shm.unlink(seg.name)
            raise died(meta, ProcessLookupError(f"process {meta.producer.pid} is gone"))
        return Fetched(_map(ctx, meta, seg.name, seg.layout), "shm-segment")

    def handlers(self) -> Dict[int, Served]:
        return {_control.REQ_PREPARE_SHM: (_serve_prepare, (_control.KEY_PROCESS,))}

    def release(self, ctx: Any, entry: Any) -> None:
        guard = entry.exports.pop("cma_guard", None)
        if guard is not None:
            _cma.clear(guard)  # first: a direct read that ends after this sees the object gone
        seg = entry.exports.pop("shm", None)
        if seg is not None:
            ctx.shm_pool.release(seg)


def _read_mapped(ctx: Any, meta: ObjectMeta, maps: _shm_map.MapInfo, info: _cma.CmaInfo,
                 dests: Sequence[int]) -> bool:
    """Copy the object from mappings of the producer's shared storages, then check its guard. False when they cannot
    be mapped (the caller reads directly instead); raises CmaError when the object is gone."""
    try:
        # the sizes the metadata carries
        ctx.shm_maps.read(meta.producer.pid, maps, dests, meta.buffers.sizes, started=meta.producer.started)
    except _shm_map.MapError as e:
        logger.debug("rdt: mapping the shared storages of %s failed (%s); reading directly", meta.id_hex, e)
        return False
    ctx.cma.check(meta.producer.pid, info, meta.obj_id)
    return True


def _map(ctx: Any, meta: ObjectMeta, name: str, layout: Any) -> List[torch.Tensor]:
    try:
        return _shm.map_segment(name, layout, meta.obj_id, ctx.unmapper if ctx is not None else None)
    except FileNotFoundError as e:
        if isinstance(e, _shm.SegmentReused) or producer_alive(ctx, meta):
            raise freed(meta) from e
        raise died(meta, e) from e


def _serve_prepare(ctx: Any, _key_id: int, payload: bytes) -> Any:
    """Producer: write the object into a segment (once) and tell the consumer where it is."""
    with ctx.table.exporting(payload[:16]) as entry:
        if entry is None or len(payload) < 16:
            return err(_control.ERR_NOT_FOUND, "object was freed or never existed here")
        wait_ready(entry)
        seg = entry.exports.get("shm")
        if seg is None:
            seg = entry.exports["shm"] = ctx.shm_pool.write([b.cpu() for b in entry.buffers], entry.obj_id)
        nbytes = entry.nbytes
    ctx.stats.add("shm", "out", nbytes)
    body = struct.pack("!I", len(seg.layout)) + b"".join(struct.pack("!QQ", o, n) for o, n in seg.layout)
    return _control.RESP_OK, seg.name.encode() + b"\0" + body


def _landings(ctx: Any, meta: ObjectMeta, site: Site) -> Sequence[torch.Tensor]:
    """Where a direct read lands: the caller's targets (rdt.get into=), else views of one block for all buffers
    (one allocation for an object of many tensors, instead of one per tensor)."""
    sizes = meta.buffers.sizes
    if isinstance(site.into, Targets) and site.into.complete:
        return site.into  # every buffer lands in its target (read at its address: no view made)
    if site.into or len(sizes) < 2:
        return [landing(ctx, site, i, n) for i, n in enumerate(sizes)]
    return block_views(ctx, sizes)
