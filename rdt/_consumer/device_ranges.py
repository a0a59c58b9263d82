"""The range road's device-aware parts (``ranges.fetch_ranges`` calls them where the targets or the object's buffers
are device memory): what a transport is given to copy with torch ops, CPU objects landed in GPU targets through
bounded host staging, and the whole-fetch fallback copied out with torch ops.

* :func:`annotate` adds to a read's :class:`~rdt.transports.Ranges` each range's target index and offset, the
  runs batched into copy descriptors (``rdt._objects.device_runs``, once per plan) and the caller's stream mark.
* :func:`via_host`: a transport that lands ranges in CPU memory only (the shm direct read, gloo ranges) serves GPU
  targets chunk by chunk (NIXL READs a CPU object's ranges straight into GPU targets): each chunk of at most :data:`STAGING` bytes is read into one of two
  host staging buffers, uploaded into one of two device staging buffers and scattered into the targets there, on
  the loader's stream; a host buffer is refilled only once its upload finished. At most 2 x STAGING bytes on each
  side per producer rank read, whatever the load's size. Labelled ``<label>+h2d``.
* :func:`whole`: no transport serves ranges here: the object is fetched whole (on this process's GPU where it is
  a GPU object and this process has one, else on the CPU) and the runs copied into the targets with torch ops.

Every device copy follows the caller's stream mark and is finished on the device before these return
(``rdt._objects.device_order``).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from .resolve import fetch_buffers
from .._objects import device_order, device_runs
from .._objects.meta import ObjectMeta
from ..transports import Ranges, Site

STAGING = 16 << 20  # bytes of one staging buffer (two on the host and two on the device per producer rank read)


def annotate(ranges: Ranges, memo: Dict[str, Any], target: np.ndarray, dst: np.ndarray, used: Any,
             after: Any) -> Ranges:
    """``ranges`` with what device copies need (kept in ``memo``, the plan's, across replays)."""
    cols = memo.get("tgt")
    if cols is None:
        cols = memo["tgt"] = (np.searchsorted(np.asarray(used, np.int64), target).astype(np.int64),
                              np.asarray(dst, np.int64))
    ranges.tgt, ranges.tgt_off = cols
    copies = memo.get("copies")
    if copies is None:
        copies = memo["copies"] = device_runs.batch(ranges.buf, ranges.off, ranges.tgt, ranges.tgt_off, ranges.n)
    ranges.copies, ranges.after, ranges.memo = copies, after, memo
    return ranges


def _staging(memo: Dict[str, Any], size: int, count: int, device: torch.device) -> Dict[str, List[torch.Tensor]]:
    """The host (page-locked where CUDA is up) and device staging buffers of this plan's reads (kept with it)."""
    have = memo.get("staging")
    if have is None or have["device"][0].numel() < size or len(have["device"]) < count:
        pin = device.type == "cuda" and torch.cuda.is_available()
        have = memo["staging"] = {
            "host": [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(count)],
            "device": [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(count)]}
    return have


def via_host(ctx: Any, transport: Any, meta: ObjectMeta, ranges: Ranges, site: Site, deadline: float,
             limit: int = STAGING) -> Optional[str]:
    """Land a CPU object's ranges in device targets through bounded host staging (see the module's docstring);
    None where this transport does not serve ranges into CPU memory here, or the object is not a CPU object."""
    device = ranges.device
    if device.type == "cpu" or meta.buffers.device_types != {"cpu"} or ranges.memo is None:
        return None
    return staged(ctx, transport, meta, ranges, site, deadline, limit, device)


def staged(ctx: Any, transport: Any, meta: ObjectMeta, ranges: Ranges, site: Site, deadline: float, limit: int,
           device: torch.device) -> Optional[str]:
    """:func:`via_host`'s work, with the staging on the other side on ``device`` (CPU CI: the CPU)."""
    memo = ranges.memo if ranges.memo is not None else {}
    key = f"chunks:{limit}"
    chunks = memo.get(key)
    if chunks is None:
        chunks = memo[key] = device_runs.chunks(ranges.buf, ranges.off, ranges.tgt, ranges.tgt_off, ranges.n, limit)
    if not chunks:
        return f"{transport.name}+h2d"
    stage = _staging(memo, max(c.nbytes for c in chunks), min(2, len(chunks)), device)
    streams = device_order.current()
    stream = streams.stream(device)
    streams.wait(stream, ranges.after)
    pending: List[Any] = [None] * len(stage["host"])
    label = None
    for i, c in enumerate(chunks):
        j = i % len(pending)
        host, dev = stage["host"][j], stage["device"][j]
        streams.synchronize(pending[j])  # the upload that last read this host buffer finished
        sub = Ranges(c.src, c.soff, np.uint64(host.data_ptr()) + c.stage.astype(np.uint64), c.n, [host])
        got = transport.read_ranges(ctx, meta, sub, site, deadline)
        if got is None:
            if i == 0:
                return None
            raise RuntimeError(f"{transport.name} served {i} chunk(s) of ranges, then refused the next")
        label = got

        def upload(c: device_runs.Chunk = c, host: torch.Tensor = host, dev: torch.Tensor = dev) -> None:
            dev[:c.nbytes].copy_(host[:c.nbytes], non_blocking=True)
            device_runs.apply(c.scatter, [dev], ranges.targets)

        streams.run(stream, upload)
        pending[j] = streams.done(stream)
    streams.finish(stream)
    return f"{label}+h2d"


def whole(ctx: Any, meta: ObjectMeta, ranges: Ranges, deadline: float) -> str:
    """Fetch the object whole and copy the runs into the targets with torch ops; its label, ``whole:<label>``."""
    fetched, name = fetch_buffers(ctx, meta, timeout=max(deadline - time.monotonic(), 1e-3))
    sources = [fetched.buffers[i] for i in range(len(fetched.buffers))]
    device = ranges.device
    if device.type == "cpu":  # a GPU object into CPU targets: copy on the device the bytes are on
        device = next((b.device for b in sources if b.device.type != "cpu"), device)
    streams = device_order.current()
    stream = streams.stream(device)
    streams.wait(stream, ranges.after)
    streams.run(stream, lambda: device_runs.apply(ranges.copies, sources, ranges.targets))
    streams.finish(stream)
    ctx.stats.add(name, "in", meta.nbytes, path=fetched.label)
    return f"whole:{fetched.label}"


__all__ = ["STAGING", "annotate", "staged", "via_host", "whole"]
