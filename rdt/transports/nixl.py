"""NIXL objects: the consumer READs the producer's registered buffers one-sidedly, no group needed.

Export: an explicit "nixl" object is registered at return and its descriptors ride in the metadata; under "auto"
registration waits for the first consumer that asks (a control request answered on the producer's control thread).
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional

import torch

from .. import _control, _nixl_objects
from .._meta import ObjectMeta
from .._peer import control_request, died, err, probe, unreachable
from ..errors import ObjectFetchError
from .base import Capabilities, Fetched, Served, Site, Transport, Unusable


class NixlTransport(Transport):
    capabilities = Capabilities(name="nixl", devices=frozenset({"cpu", "cuda"}), one_sided=True, auto_priority=30)

    def export(self, ctx: Any, entry: Any, chosen: str) -> Optional[_nixl_objects.NixlInfo]:
        if chosen != "nixl":
            return None  # auto: registered when the first consumer asks
        return _nixl_objects.register(ctx, entry)

    def unusable(self, ctx: Any, meta: ObjectMeta, site: Site) -> Optional[Unusable]:
        if not _nixl_objects.available():
            return Unusable("NIXL is not installed in this process", ObjectFetchError(
                f"{meta.describe()} needs NIXL, which is not installed in this process", object_id=meta.id_hex,
                hint="pip install 'ray-direct-transport[nixl]'"))
        if not meta.producer.nixl:
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
            resp = control_request(ctx, meta, _control.REQ_PREPARE_NIXL, _control.KEY_PROCESS,
                                   meta.producer.process_key, meta.obj_id, _left(deadline))
            info = _nixl_objects.decode_info(resp)
        device = site.cuda_device if info.mem_type == "VRAM" and site.cuda_device is not None else torch.device("cpu")
        try:
            return Fetched(_nixl_objects.fetch(ctx, info, device, _left(deadline), site.into, meta.describe()), "nixl")
        except _nixl_objects.ParkedLimit as e:
            raise ObjectFetchError(f"{meta.describe()} was not fetched: {e}", object_id=meta.id_hex,
                                   hint="their producers are stuck or unreachable: kill them (their READs then fail "
                                        "at once) or wait until they serve again") from e
        except TimeoutError as e:  # other errors (NIXL's own) are named by the consumer core, which probes alike
            state, why = probe(ctx, meta)
            if state == "dead":
                raise died(meta, e) from e
            if state == "silent":
                raise unreachable(meta, "the NIXL READ", e, why) from e
            raise

    def handlers(self) -> Dict[int, Served]:
        return {_control.REQ_PREPARE_NIXL: (_serve_prepare, (_control.KEY_PROCESS,))}

    def release(self, ctx: Any, entry: Any) -> None:
        _nixl_objects.release(ctx, entry)

    def exported(self, ctx: Any) -> int:
        return len(ctx.nixl.registrations) if ctx.nixl is not None else 0


def _serve_prepare(ctx: Any, _key_id: int, payload: bytes) -> Any:
    """Producer: register the object (once) and describe it for the asking consumer."""
    with ctx.table.exporting(payload[:16]) as entry:
        if entry is None or len(payload) < 16:
            return err(_control.ERR_NOT_FOUND, "object was freed or never existed here")
        info = _nixl_objects.register(ctx, entry)
        nbytes = entry.nbytes
    ctx.stats.add("nixl", "out", nbytes)
    return _control.RESP_OK, _nixl_objects.encode_info(info)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 1e-3)
