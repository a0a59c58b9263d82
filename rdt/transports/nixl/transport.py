"""NIXL objects: the consumer READs the producer's registered buffers one-sidedly, no group needed.

Export: an explicit "nixl" object is registered at return and its descriptors ride in the metadata; under "auto"
registration waits for the first consumer that asks (a control request answered on the producer's control thread).
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional

import torch

from ..._control import wire as _control
from . import agent as _agent
from .descriptors import NixlInfo, decode_info, encode_info
from .landing import LandingPool
from .export import register, release
from .ranges import read_ranges
from .read import ParkedLimit, read_object
from ..._objects.meta import ObjectMeta
from ..._control.peer import control_request, died, probe, unreachable
from ..._control.wire import err
from ...errors import ObjectFetchError
from ..base import Capabilities, Fetched, Ranges, Served, Site, Transport, Unusable


REQ_PREPARE_NIXL = 3  # payload: obj_id(16); answer: the object's NixlInfo, binary (read.encode_info)



# The cost of one more range and one more byte of a sharded load's range read here (exact runs vs covering reads),
# measured by rdt-bench's sharded-sync calibration on the 2-core reference machine (2026-11-27, quiet).
RANGE_RUN_S = 1.3e-6
RANGE_BYTES_PER_S = 4.4e9

class NixlTransport(Transport):
    capabilities = Capabilities(name="nixl", devices=frozenset({"cpu", "cuda"}), one_sided=True, auto_priority=30,
                                range_run_s=RANGE_RUN_S, range_bytes_per_s=RANGE_BYTES_PER_S)

    def export(self, ctx: Any, entry: Any, chosen: str) -> Optional[NixlInfo]:
        if chosen != "nixl":
            return None  # auto: registered when the first consumer asks
        return register(ctx, entry)

    def available(self) -> bool:
        return _agent.available()

    def unusable(self, ctx: Any, meta: ObjectMeta, site: Site) -> Optional[Unusable]:
        if not self.available():
            return Unusable("NIXL is not installed in this process", ObjectFetchError(
                f"{meta.describe()} needs NIXL, which is not installed in this process", object_id=meta.id_hex,
                hint="pip install 'ray-direct-transport[nixl]'"))
        if self.name in meta.producer.missing:
            return Unusable("NIXL is not installed in the producer")
        if site.cuda_device is None and "cuda" in meta.buffers.device_types:
            # A READ of the producer's VRAM needs UCX's CUDA transports in this process too (a GPU run of
            # 2026-11-27 saw it fail for a consumer with CUDA_VISIBLE_DEVICES=""): the fallback streams the
            # buffers through host memory instead, and they arrive on the CPU, as with ray.get.
            return Unusable("this process has no CUDA device to READ the producer's GPU memory with")
        return None

    def fetch(self, ctx: Any, meta: ObjectMeta, site: Site, deadline: float) -> Fetched:
        info = meta.export("nixl")
        if info is None:
            resp = control_request(ctx, meta, REQ_PREPARE_NIXL, _control.KEY_PROCESS,
                                   meta.producer.process_key, meta.obj_id, _left(deadline))
            info = decode_info(resp)
        device = site.cuda_device if info.mem_type == "VRAM" and site.cuda_device is not None else torch.device("cpu")
        try:
            return Fetched(read_object(ctx, info, device, _left(deadline), site.into, meta.describe()), "nixl")
        except ParkedLimit as e:
            raise ObjectFetchError(f"{meta.describe()} was not fetched: {e}", object_id=meta.id_hex,
                                   hint="their producers are stuck or unreachable: kill them (their READs then fail "
                                        "at once) or wait until they serve again") from e
        except TimeoutError as e:  # other errors (NIXL's own) are named by the consumer core, which probes alike
            _name_the_producer(ctx, meta, "the NIXL READ", e)
            raise

    def read_ranges(self, ctx: Any, meta: ObjectMeta, ranges: Ranges, site: Site,
                    deadline: float) -> Optional[str]:
        info = meta.export("nixl")
        if info is None:
            if not self.available() or self.name in meta.producer.missing:
                return None
            resp = control_request(ctx, meta, REQ_PREPARE_NIXL, _control.KEY_PROCESS,
                                   meta.producer.process_key, meta.obj_id, _left(deadline))
            info = decode_info(resp)
        try:
            return read_ranges(ctx, info, ranges, _left(deadline))
        except (TimeoutError, RuntimeError) as e:
            _name_the_producer(ctx, meta, "the NIXL READ of ranges", e)
            raise

    def handlers(self) -> Dict[int, Served]:
        return {REQ_PREPARE_NIXL: (_serve_prepare, (_control.KEY_PROCESS,))}

    def release(self, ctx: Any, entry: Any) -> None:
        release(ctx, entry)

    def exported(self, ctx: Any) -> int:
        ag = ctx.peek_transport_state(self.name)
        return len(ag.registrations) if ag is not None else 0

    def stats(self, ctx: Any) -> Dict[str, Any]:
        """Consumer side: registered landing blocks lent to fetched tensors and idle for reuse (see ``landing``)."""
        ag = ctx.peek_transport_state(self.name)
        return {"nixl_landing": ag.landing.stats() if ag is not None else LandingPool.empty_stats()}


def _serve_prepare(ctx: Any, _key_id: int, payload: bytes) -> Any:
    """Producer: register the object (once) and describe it for the asking consumer."""
    with ctx.table.exporting(payload[:16]) as entry:
        if entry is None or len(payload) < 16:
            return err(_control.ERR_NOT_FOUND, "object was freed or never existed here")
        info = register(ctx, entry)
        nbytes = entry.nbytes
    ctx.stats.add("nixl", "out", nbytes)
    return _control.RESP_OK, encode_info(info)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 1e-3)


def _name_the_producer(ctx: Any, meta: ObjectMeta, what: str, e: BaseException) -> None:
    """A READ failed: raise ProducerDiedError or an unreachable error when the producer is dead or silent (else
    return, and the caller re-raises ``e``)."""
    state, why = probe(ctx, meta)
    if state == "dead":
        raise died(meta, e) from e
    if state == "silent":
        raise unreachable(meta, what, e, why) from e
