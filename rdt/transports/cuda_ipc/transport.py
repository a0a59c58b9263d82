"""CUDA IPC objects: a consumer on the producer's node opens the producer's GPU memory (see ``shares``).

Export: handles for every buffer, at return ("cuda_ipc"; under "auto" when every buffer is on a GPU, never a
reason to fail the return). Fetch: copy into this process's GPU, or map (``ipc_map=True``) and keep the producer's
object alive for as long as a mapped leaf lives.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

from . import ranges as _ranges, shares as _cuda_ipc
from ..._objects.meta import ObjectMeta
from ..._objects.stream_ready import wait_ready
from ...errors import UnsupportedError
from ..base import Capabilities, Fetched, Ranges, Site, Transport, Unusable

logger = logging.getLogger("rdt")


class CudaIpcTransport(Transport):
    capabilities = Capabilities(name="cuda_ipc", devices=frozenset({"cuda"}), one_sided=True, same_node=True,
                                can_map=True, auto_priority=5)

    def export(self, ctx: Any, entry: Any, chosen: str) -> Optional[_cuda_ipc.CudaIpcInfo]:
        ipc_map = bool(entry.options.get("ipc_map"))
        cache = ctx.transport_state(self.name, _cuda_ipc.new_share_cache)
        if chosen == "cuda_ipc":
            return _cuda_ipc.export(entry, cache, ipc_map, wait_ready)
        try:  # auto: an extra path, never a reason to fail the return
            return _cuda_ipc.export(entry, cache, ipc_map, wait_ready)
        except Exception as e:  # noqa: BLE001
            logger.debug("rdt: no CUDA IPC export for %s: %s", entry.obj_id.hex(), e)
            return None

    def unusable(self, ctx: Any, meta: ObjectMeta, site: Site) -> Optional[Unusable]:
        info: Optional[_cuda_ipc.CudaIpcInfo] = meta.export("cuda_ipc")
        why = None
        if not site.same_node:
            why = "the producer is on another node (CUDA IPC works within one node)"
        elif info is None:
            why = "the producer exported no CUDA IPC handles"
        elif site.cuda_device is None and not info.map:
            why = "this process has no CUDA device"
        elif not _cuda_ipc.can_open(info):
            why = f"the producer's GPU ({', '.join(info.uuids())}) is not visible in this process"
        if why is None:
            return None
        if not site.in_actor:
            return Unusable(why)  # the driver (or a task): through host memory
        return Unusable(why, UnsupportedError(
            f"{meta.describe()} uses transport 'cuda_ipc' but {why}", object_id=meta.id_hex,
            hint="give both actors the same GPU (e.g. num_gpus=0.5 each) on one node, or use tensor_transport="
            "'nccl', 'nixl' or 'auto'",
        ))

    def fetch(self, ctx: Any, meta: ObjectMeta, site: Site, deadline: float) -> Fetched:
        info = meta.export("cuda_ipc")
        bufs = _cuda_ipc.open_object(info)
        return Fetched(bufs, "cuda_ipc-map" if info.map else "cuda_ipc",
                       keepalive=meta.token if info.map else None)

    def read_ranges(self, ctx: Any, meta: ObjectMeta, ranges: Ranges, site: Site,
                    deadline: float) -> Optional[str]:
        """Sharded loads: the runs copied out of the producer's storages, opened once and kept while they live, on
        the loader's stream, finished on the device before this returns (see ``ranges``)."""
        return _ranges.read_ranges(ctx, meta, ranges)

    def stats(self, ctx: Any) -> Dict[str, Any]:
        """Consumer side: producer storages opened for range reads, reused across reads, closed, open now."""
        maps = ctx.peek_transport_state("cuda_ipc-mappings")
        return {"cuda_ipc_ranges": maps.snapshot() if maps is not None else dict(_ranges.EMPTY_STATS)}

    def exported(self, ctx: Any) -> int:
        cache = ctx.peek_transport_state(self.name)
        return cache.exported() if cache is not None else 0

    def release(self, ctx: Any, entry: Any) -> None:
        if "cuda_ipc" in entry.exports:
            _cuda_ipc.release(entry, ctx.transport_state(self.name, _cuda_ipc.new_share_cache))
