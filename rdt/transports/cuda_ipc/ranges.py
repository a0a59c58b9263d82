"""Byte ranges of a CUDA IPC object copied straight out of the producer's GPU memory: sharded weight sync's path on
one node.

The consumer keeps each producer storage it opened (:class:`Mappings`, per process) across reads while that storage
lives: weights published every step are the same storages, so a replayed load opens nothing (a whole fetch opens
and closes the mapping at every copy). The producer shares a storage once for its life and numbers the share
(``IpcBuffer.share_id``): a read that finds another number at the same place knows the storage it had opened died,
closes that mapping and opens the new one. Mappings unused for :data:`IDLE_S` are closed (a mapping kept open holds
the producer's freed block in torch's limbo), at most :data:`MAX_OPEN` are kept. The open itself is
``shares.open_storage`` (the one device call; tests give CPU tensors).

The runs are copied with the road's copy descriptors (``Ranges.copies``: one strided copy per strided group, the
large runs one copy each, the small ones one gather per pair), all queued at once on the loader's stream of the
targets' device after the caller's stream mark, then waited for: the read is reported done (and the producer's
fence can return) only once every copy reading the producer's memory finished on the device. Into CPU targets the
runs are gathered on the producer's GPU into a staging buffer of at most :data:`STAGING` bytes, downloaded and
scattered on the host, chunk by chunk.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import shares
from ..._objects import device_order, device_runs
from ..base import Ranges, TransportState

IDLE_S = 30.0  # a mapping not used this long is closed
MAX_OPEN = 1024  # mappings kept open, least recently used closed first
STAGING = 16 << 20  # bytes a chunk into CPU targets stages on each side

Key = Tuple[bytes, str, bytes, int]  # producer process, GPU, allocation handle, storage offset in it


@dataclass
class _Mapped:
    tensor: torch.Tensor  # uint8, the producer's whole storage
    share_id: int
    nbytes: int
    used: float


class Mappings(TransportState):
    """The producer storages this consumer opened, kept across reads while they live (see the module docstring)."""

    def __init__(self, opener: Callable[[shares.IpcBuffer, int], torch.Tensor] = shares.open_storage,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._open = opener
        self._clock = clock
        self._lock = threading.Lock()
        self._maps: "OrderedDict[Key, _Mapped]" = OrderedDict()
        self.counters = {"opened": 0, "reused": 0, "closed": 0}

    def storages(self, producer: bytes, info: shares.CudaIpcInfo, used: Sequence[int],
                 visible: Dict[str, int]) -> Tuple[List[Optional[torch.Tensor]], bool]:
        """Per buffer of ``info`` (those in ``used``; None for the others) a uint8 view of it in its opened storage,
        and whether any storage was opened now (its open made the current stream wait for the producer's event)."""
        out: List[Optional[torch.Tensor]] = [None] * len(info.buffers)
        fresh = False
        for i in used:
            b = info.buffers[i]
            storage, opened = self._storage(producer, b, visible[b.device_uuid])
            fresh = fresh or opened
            out[i] = storage[b.buffer_offset:b.buffer_offset + b.nbytes]
        return out, fresh

    def _storage(self, producer: bytes, b: shares.IpcBuffer, index: int) -> Tuple[torch.Tensor, bool]:
        key = (producer, b.device_uuid, b.handle, b.storage_offset)
        now = self._clock()
        with self._lock:
            m = self._maps.get(key)
            if m is not None and m.share_id == b.share_id and m.nbytes == b.storage_nbytes:
                m.used = now
                self._maps.move_to_end(key)
                self.counters["reused"] += 1
                return m.tensor, False
            if m is not None:  # the storage it mapped died; another one took its place
                del self._maps[key]
                self.counters["closed"] += 1
        tensor = self._open(b, index)
        with self._lock:
            self._maps[key] = _Mapped(tensor, b.share_id, b.storage_nbytes, now)
            self._maps.move_to_end(key)
            self.counters["opened"] += 1
            while len(self._maps) > MAX_OPEN:
                self._maps.popitem(last=False)
                self.counters["closed"] += 1
        return tensor, True

    def trim(self) -> None:
        cutoff = self._clock() - IDLE_S
        with self._lock:
            for key in [k for k, m in self._maps.items() if m.used < cutoff]:
                del self._maps[key]
                self.counters["closed"] += 1

    def close(self) -> None:
        with self._lock:
            self.counters["closed"] += len(self._maps)
            self._maps.clear()

    def snapshot(self) -> Dict[str, int]:
        with self._lock:
            return dict(self.counters, open=len(self._maps))


EMPTY_STATS: Dict[str, int] = {"opened": 0, "reused": 0, "closed": 0, "open": 0}


def mappings(ctx: Any) -> Mappings:
    return ctx.transport_state("cuda_ipc-mappings", Mappings)


def read_ranges(ctx: Any, meta: Any, ranges: Ranges) -> Optional[str]:
    """"cuda_ipc" once every range landed in the (GPU) targets and the copies finished on the device;
    "cuda_ipc+d2h" into CPU targets; None without the road's copy descriptors (a read of CPU memory)."""
    info: Optional[shares.CudaIpcInfo] = meta.export("cuda_ipc")
    copies: Optional[device_runs.Copies] = ranges.copies
    if info is None or copies is None:
        return None
    used = copies.sources()
    if not used:
        return "cuda_ipc"
    sources, fresh = mappings(ctx).storages(meta.producer.instance, info, used, shares.visible_devices())
    src_device = sources[used[0]].device  # type: ignore[union-attr]
    streams = device_order.current()
    opened = streams.mark(src_device) if fresh else None  # the open's wait for the producer's IPC event
    targets = list(ranges.targets)
    if ranges.device.type != "cpu":
        stream = streams.stream(ranges.device)
        streams.wait(stream, ranges.after)
        streams.wait(stream, opened)
        streams.run(stream, lambda: device_runs.apply(copies, sources, targets))  # type: ignore[arg-type]
        streams.finish(stream)
        return "cuda_ipc"
    _download(ranges, sources, targets, src_device, streams, opened)
    return "cuda_ipc+d2h"


def _download(ranges: Ranges, sources: List[Optional[torch.Tensor]], targets: List[torch.Tensor],
              device: torch.device, streams: device_order.Streams, opened: Any) -> None:
    """Into CPU targets: per chunk, gather on the GPU into a staging buffer, download it, scatter on the host."""
    memo = ranges.memo if ranges.memo is not None else {}
    chunks = memo.get("cuda_ipc:chunks")
    if chunks is None:
        chunks = memo["cuda_ipc:chunks"] = device_runs.chunks(ranges.buf, ranges.off, ranges.tgt, ranges.tgt_off,
                                                              ranges.n, STAGING)
    if not chunks:
        return
    size = max(c.nbytes for c in chunks)
    stage = memo.get("cuda_ipc:staging")
    if stage is None or stage[0].numel() < size or stage[0].device != device:
        pin = device.type == "cuda" and torch.cuda.is_available()
        stage = memo["cuda_ipc:staging"] = (torch.empty(size, dtype=torch.uint8, device=device),
                                            torch.empty(size, dtype=torch.uint8, pin_memory=pin))
    dev, host = stage
    stream = streams.stream(device)
    streams.wait(stream, opened)
    for c in chunks:

        def download(c: device_runs.Chunk = c) -> None:
            device_runs.apply(c.gather, sources, [dev])  # type: ignore[arg-type]
            host[:c.nbytes].copy_(dev[:c.nbytes], non_blocking=True)

        streams.run(stream, download)
        streams.finish(stream)
        device_runs.apply(c.scatter, [host], targets)


__all__ = ["IDLE_S", "MAX_OPEN", "Mappings", "mappings", "read_ranges"]
