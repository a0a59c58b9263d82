"""Same-node objects: a copy from the producer's shared storages, a direct read of the producer's memory
(``process_vm_readv``), or a shared-memory segment.

Export: where the kernel lets same-node consumers read this process (see ``cma``), a guard naming the object and
the buffers' addresses, and where the buffers live in shared memory, the files behind them (``shared_maps``);
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

from . import cma as _cma, ranges as _ranges, segments as _shm, shared_maps as _shm_map
from .state import ShmState, state
from ..._control import wire as _control
from ..._objects.stream_ready import wait_ready
from ..._objects.meta import ObjectMeta
from ..._control.peer import control_request, died, freed, producer_alive
from ..._control.wire import err
from ..base import Capabilities, Fetched, Ranges, Served, Site, Transport
from ..receive import BlockViews, Targets, block_views, landing

logger = logging.getLogger("rdt")


REQ_PREPARE_SHM = 2  # payload: obj_id(16); answer: the segment's name, NUL, n(u32) and n (offset, size) u64 pairs


@dataclass(frozen=True)
class ShmDescriptor:
    """Where a same-node consumer finds the bytes: the producer's memory (``cma``) and/or a segment."""

    cma: Optional[_cma.CmaInfo] = None
    segment: Optional[_shm.Segment] = None
    maps: Optional[_shm_map.MapInfo] = None  # where the buffers lie in the producer's shared storages, if they do



# The cost of one more range and one more byte of a sharded load's range read here (exact runs vs covering reads),
# measured by rdt-bench's sharded-sync calibration on the 2-core reference machine (2026-11-27, quiet).
RANGE_RUN_S = 0.7e-6
RANGE_BYTES_PER_S = 8e9

class ShmTransport(Transport):
    capabilities = Capabilities(name="shm", devices=frozenset({"cpu"}), one_sided=True, same_node=True,
                                auto_priority=10, range_run_s=RANGE_RUN_S, range_bytes_per_s=RANGE_BYTES_PER_S)

    def export(self, ctx: Any, entry: Any, chosen: str) -> Optional[ShmDescriptor]:
        wait_ready(entry)  # consumers read the producer's memory one-sidedly from here on
        if state(ctx).readable(ctx.config):
            guard = entry.exports["cma_guard"] = _cma.guard_for(entry.obj_id)
            return ShmDescriptor(cma=_cma.CmaInfo(guard.ctypes.data, tuple(entry.flat.ranges)),
                                 maps=_shm_map.describe(entry.flat.spans))
        if chosen == "shm":
            seg = entry.exports["shm"] = state(ctx).pool.write(entry.buffers, entry.obj_id)
            return ShmDescriptor(segment=seg)
        return None  # auto: a segment only when a consumer asks

    def fetch(self, ctx: Any, meta: ObjectMeta, site: Site, deadline: float) -> Fetched:
        desc: Optional[ShmDescriptor] = meta.export("shm")
        info = desc.cma if desc is not None else None
        producer = meta.producer
        if info is not None and ctx.config.shm_cma and not state(ctx).cma.denied(producer.pid, producer.started):
            shm = state(ctx)
            bufs = _landings(ctx, meta, site)
            dests = bufs.addresses() if isinstance(bufs, (BlockViews, Targets)) else [b.data_ptr() for b in bufs]
            try:
                if desc.maps is not None and ctx.config.shm_map and _read_mapped(shm, meta, desc.maps, info, dests):
                    return Fetched(bufs, "shm-map")
                shm.cma.read(meta.producer.pid, info, dests, meta.obj_id, meta.producer.started)
                return Fetched(bufs, "shm-direct")
            except _cma.CmaError as e:
                # Refused by the kernel, or the object/process is gone: ask the producer, which gives the
                # authoritative answer (a segment, ObjectFreedError, or ProducerDiedError).
                logger.debug("rdt: direct read of %s failed (%s); asking the producer for a segment", meta.id_hex, e)
        seg = desc.segment if desc is not None else None
        if seg is None:
            resp = control_request(ctx, meta, REQ_PREPARE_SHM, _control.KEY_PROCESS,
                                   meta.producer.process_key, meta.obj_id, max(deadline - time.monotonic(), 1e-3))
            name, _, body = resp.partition(b"\0")
            (n,) = struct.unpack_from("!I", body)
            layout = [struct.unpack_from("!QQ", body, 4 + 16 * i) for i in range(n)]
            return Fetched(_map(ctx, meta, name.decode(), layout), "shm-segment")
        if not _shm.owner_alive(seg.name):  # same node, so the pid in the name is meaningful
            _shm.unlink(seg.name)
            raise died(meta, ProcessLookupError(f"process {meta.producer.pid} is gone"))
        return Fetched(_map(ctx, meta, seg.name, seg.layout), "shm-segment")

    def read_ranges(self, ctx: Any, meta: ObjectMeta, ranges: Ranges, site: Site,
                    deadline: float) -> Optional[str]:
        if ranges.device.type != "cpu":  # addresses in device memory: the road stages through host memory
            return None
        return _ranges.read_ranges(ctx, meta, ranges)

    def start(self, ctx: Any) -> None:
        state(ctx)  # unlinks dead processes' segments now; exit unlinks ours

    def stats(self, ctx: Any) -> Dict[str, Any]:
        return state(ctx).stats()

    def handlers(self) -> Dict[int, Served]:
        return {REQ_PREPARE_SHM: (_serve_prepare, (_control.KEY_PROCESS,))}

    def release(self, ctx: Any, entry: Any) -> None:
        guard = entry.exports.pop("cma_guard", None)
        if guard is not None:
            _cma.clear(guard)  # first: a direct read that ends after this sees the object gone
        seg = entry.exports.pop("shm", None)
        if seg is not None:
            state(ctx).pool.release(seg)


def _read_mapped(shm: ShmState, meta: ObjectMeta, maps: _shm_map.MapInfo, info: _cma.CmaInfo,
                 dests: Sequence[int]) -> bool:
    """Copy the object from mappings of the producer's shared storages, then check its guard. False when they cannot
    be mapped (the caller reads directly instead); raises CmaError when the object is gone."""
    try:
        # the sizes the metadata carries
        shm.maps.read(meta.producer.pid, maps, dests, meta.buffers.sizes, started=meta.producer.started)
    except _shm_map.MapError as e:
        logger.debug("rdt: mapping the shared storages of %s failed (%s); reading directly", meta.id_hex, e)
        return False
    shm.cma.check(meta.producer.pid, info, meta.obj_id)
    return True


def _map(ctx: Any, meta: ObjectMeta, name: str, layout: Any) -> List[torch.Tensor]:
    try:
        return _shm.map_segment(name, layout, meta.obj_id, state(ctx).unmapper if ctx is not None else None)
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
            seg = entry.exports["shm"] = state(ctx).pool.write([b.cpu() for b in entry.buffers], entry.obj_id)
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
