"""The fallback every process can take (the driver, tasks, actors outside a group), and Ray's object store.

Export: an explicit "object_store" object puts its buffers in Ray's object store at return. Otherwise the
consumer asks the producer's control server to stream the buffers (an authenticated header, the raw bytes
straight into the consumer's buffers, an HMAC trailer): answered on the control server's threads, never in the
actor's task queue, so a producer busy in a long method still serves. Each buffer keeps its own device.
"""

from __future__ import annotations

import struct
import time
from typing import Any, Dict, List, Optional, Sequence

import ray
import torch

from .._control import wire as _control
from .._objects.meta import ObjectMeta
from .._objects.stream_ready import wait_ready
from .._control.peer import control_request, died, producer_alive
from .._control.wire import err
from ..errors import ObjectFetchError
from .base import Capabilities, Fetched, Served, Site, Transport
from .receive import landing

MAX_STREAM_S = 3600.0  # cap on the time a consumer may ask the producer to keep streaming one object


REQ_FETCH_BYTES = 5  # payload: obj_id(16) timeout_ms(u32); answer: n(u32) sizes(u64 * n), then the raw bytes


class ObjectStoreTransport(Transport):
    capabilities = Capabilities(name="object_store", devices=frozenset({"cpu", "cuda"}), mixed_devices=True,
                                universal=True, auto_priority=100)

    def export(self, ctx: Any, entry: Any, chosen: str) -> Optional[Any]:
        if chosen != "object_store":
            return None
        wait_ready(entry)
        return ray.put([b.cpu() for b in entry.buffers])

    def fetch(self, ctx: Any, meta: ObjectMeta, site: Site, deadline: float) -> Fetched:
        timeout = max(deadline - time.monotonic(), 1e-3)
        store_ref = meta.export("object_store")
        if store_ref is not None:
            bufs = [b if b.is_contiguous() else b.contiguous() for b in _get(meta, [store_ref], timeout)[0]]
            return Fetched(_to_devices(meta, bufs, site.cuda_device), "object_store")
        return Fetched(_to_devices(meta, _stream(ctx, meta, site, timeout), site.cuda_device), "object_store")

    def handlers(self) -> Dict[int, Served]:
        return {REQ_FETCH_BYTES: (_serve_bytes, (_control.KEY_PROCESS,))}


def buffer_devices(devices: Sequence[str], gpu: Optional[torch.device]) -> List[torch.device]:
    """Where each received buffer goes, from the producer's device strings: CPU buffers stay on the CPU, GPU
    buffers go to ``gpu`` (this process's CUDA device), or to the CPU when this process has none."""
    cpu = torch.device("cpu")
    return [gpu if d.startswith("cuda") and gpu is not None else cpu for d in devices]


def _to_devices(meta: ObjectMeta, bufs: List[torch.Tensor], gpu: Optional[torch.device]) -> List[torch.Tensor]:
    """Move host buffers each to its own device (a mixed CPU/GPU value keeps both kinds)."""
    targets = buffer_devices([b.device for b in meta.buffers], gpu)
    return [b if t.type == "cpu" else b.to(t) for b, t in zip(bufs, targets)]


def _stream(ctx: Any, meta: ObjectMeta, site: Site, timeout: float) -> List[torch.Tensor]:
    """The producer's buffers, streamed by its control server into fresh host buffers here."""
    if meta.producer.actor is None:  # a task's worker may exit or be reused at any time
        raise ObjectFetchError(f"{meta.describe()} was made outside an actor and cannot be served to this process",
                               object_id=meta.id_hex, hint="produce objects inside actors")
    bufs = [landing(ctx, site, i, b.nbytes) for i, b in enumerate(meta.buffers)]
    sizes = [b.nbytes for b in meta.buffers]

    def into(resp_type: int, header: bytes) -> Optional[List[memoryview]]:
        if resp_type != _control.RESP_OK:
            return None
        n = struct.unpack_from("!I", header)[0] if len(header) >= 4 else -1
        got = list(struct.unpack_from(f"!{n}Q", header, 4)) if len(header) == 4 + 8 * max(n, 0) else None
        if got != sizes:
            raise _control.ProtocolError(f"the producer announced buffers of {got} bytes, the object has {sizes}")
        return [memoryview(b.numpy()) for b in bufs]

    payload = meta.obj_id + struct.pack("!I", min(int(timeout * 1000), 0xFFFFFFFF))
    try:
        control_request(ctx, meta, REQ_FETCH_BYTES, _control.KEY_PROCESS, meta.producer.process_key,
                        payload, timeout, alloc=into)
    except _control.ProtocolError as e:  # a bad header or MAC, or the stream cut short
        if not producer_alive(ctx, meta):
            raise died(meta, e) from e
        raise ObjectFetchError(f"fetching {meta.describe()} from its producer failed: {e}",
                               object_id=meta.id_hex) from e
    return bufs


def _serve_bytes(ctx: Any, _key_id: int, payload: bytes) -> Any:
    """Producer: the object's bytes streamed on this connection, until the consumer's own deadline.

    Runs on a control server thread, never in the actor's queue. GPU buffers are copied to host memory here.
    """
    if len(payload) != 20:
        return err(_control.ERR_BAD_REQUEST, "malformed fetch request")
    entry = ctx.table.get(payload[:16])
    if entry is None:
        return err(_control.ERR_NOT_FOUND, "object was freed or never existed here")
    (timeout_ms,) = struct.unpack_from("!I", payload, 16)
    wait_ready(entry)  # .cpu() below copies on this thread's current stream, not the one the producer returned on
    views = [memoryview(b.cpu().numpy()) for b in entry.buffers]
    ctx.stats.add("object_store", "out", entry.nbytes)
    header = struct.pack("!I", len(views)) + b"".join(struct.pack("!Q", v.nbytes) for v in views)
    deadline = time.monotonic() + min(max(timeout_ms / 1000.0, 0.001), MAX_STREAM_S)
    return _control.RESP_OK, header, _control.Stream(views, deadline)


def _get(meta: ObjectMeta, refs: List[Any], timeout: float) -> List[Any]:
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError as e:
        raise TimeoutError(str(e)) from e
    except ray.exceptions.RayActorError as e:
        raise died(meta, e) from e
