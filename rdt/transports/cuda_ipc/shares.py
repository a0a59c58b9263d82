"""CUDA IPC for the object layer: a consumer on the producer's node opens the producer's GPU memory directly.

Mechanism (torch's own CUDA IPC, the one ``torch.multiprocessing`` uses):

* Producer, at return time (transport ``"cuda_ipc"``, or ``"auto"`` when every buffer is on a GPU):
  ``UntypedStorage._share_cuda_()`` on each buffer's storage. It gives the ``cudaIpcMemHandle`` of the caching
  allocator block, the storage's offset in that block, an IPC event recorded on the producer's current stream
  (so the consumer waits for the producer's pending kernels), and a slot in a shared-memory reference
  counter. These values, the buffer's byte range and the GPU's UUID make up a :class:`CudaIpcInfo`. It
  travels inside the object's metadata (:attr:`ObjectMeta.cuda_ipc`), so no control round trip is needed.
* Consumer: ``UntypedStorage._new_shared_cuda()`` opens the handle on the local device index with that UUID,
  which can differ from the producer's index (Ray gives each actor its own ``CUDA_VISIBLE_DEVICES``). torch
  caches opened handles per process and makes the current stream wait on the producer's event. Then:

  - default (copy): a fresh buffer on the consumer's current CUDA device (or ``device=``) is filled on a
    dedicated stream. That stream is synchronised and the mapping dropped before returning, so the result
    does not depend on the producer afterwards. Same GPU: a device-local copy. Another GPU: a peer copy.
  - ``ipc_map=True`` (``@rdt.tensor_method(tensor_transport="cuda_ipc", ipc_map=True)``): no copy. The
    leaves are views of the producer's memory. Treat them as read-only: writes land in the producer's tensor.
    The storage of each mapped buffer holds the object's lifetime token, so the producer keeps the memory while
    any tensor on it lives: the leaves, views derived from them, numpy and cupy leaves.

* Lifetime: torch counts one pending "message" per ``_share_cuda_`` call (with a reference slot and an
  inter-process event each, kept until the storage dies) and keeps a freed block in limbo until that count drops
  to zero. So a storage is shared once for its whole life, however many objects use it (weights returned every
  step, each step's object freed before the next return, share one export), through the process's
  :class:`ShareCache`, like NIXL registrations. While an object uses the storage the cache holds it; after the
  last one is freed it holds it only weakly, and the storage's death queues the share for settling (a finalizer
  that only enqueues; the next cache call settles it). A share is reused only for the very storage it was made
  for, never for a new allocation at the same address. Blocks are not parked in limbo once settled, and the
  number of shares is bounded by the live storages that were ever returned (at most ``max_idle`` idle ones).

Limits: same node only. The producer's GPU must be visible to the consumer (by UUID); otherwise ``auto`` picks
another path and an explicit ``"cuda_ipc"`` fails with a fix. Memory that did not come from torch's caching
allocator (for example a cupy array) cannot be exported as-is: it is copied once into torch memory at
export. None of this can run without CUDA; tests/test_gpu.py covers it on GPU machines.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from rdt_transports import _lifecycle

from ..receive import target_device
from ..storage_cache import StorageCache

logger = logging.getLogger("rdt")


@dataclass(frozen=True)
class IpcBuffer:
    """One exported buffer: torch's IPC share of its storage plus where the buffer sits in that storage."""

    device_uuid: str  # physical GPU, stable across CUDA_VISIBLE_DEVICES renumbering
    device_index: int  # the producer's own index (informational)
    handle: bytes  # cudaIpcMemHandle of the allocation (torch's encoding)
    storage_nbytes: int
    storage_offset: int  # of the storage inside the allocation, bytes
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: Optional[bytes]
    event_sync_required: bool
    buffer_offset: int  # of the buffer inside the storage, bytes
    nbytes: int
    # This share's number in the producer: a storage is shared once for its life, so a consumer that keeps the
    # storage opened across reads (sharded loads) knows by a new number that the storage it opened died.
    share_id: int = 0


@dataclass(frozen=True)
class CudaIpcInfo:
    """What a consumer needs to open an object's GPU buffers; rides in ObjectMeta.cuda_ipc."""

    buffers: Tuple[IpcBuffer, ...]
    map: bool = False  # map read-only instead of copying (tensor_method(..., ipc_map=True))

    def uuids(self) -> Tuple[str, ...]:
        return tuple(sorted({b.device_uuid for b in self.buffers}))


# ------------------------------------------------------------------------------------------------ devices
_uuid_cache: Optional[Dict[str, int]] = None
_uuid_lock = threading.Lock()


def _new_uuid_lock_after_fork() -> None:
    """A forked child gets a fresh lock (another thread of the parent may have held it)."""
    global _uuid_lock
    _uuid_lock = threading.Lock()


_lifecycle.at_fork_child(_new_uuid_lock_after_fork)


def _device_uuid(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else f"{props.name}#{props.pci_bus_id if hasattr(props, 'pci_bus_id') else index}"


def visible_devices() -> Dict[str, int]:
    """UUID -> local device index for every GPU this process sees ({} without CUDA); cached."""
    global _uuid_cache
    if _uuid_cache is None:
        with _uuid_lock:
            if _uuid_cache is None:
                found: Dict[str, int] = {}
                try:
                    if torch.cuda.is_available():
                        for i in range(torch.cuda.device_count()):
                            found[_device_uuid(i)] = i
                except Exception:  # noqa: BLE001 - a broken driver means "no GPU" here
                    found = {}
                _uuid_cache = found
    return _uuid_cache


def can_open(info: Optional[CudaIpcInfo]) -> bool:
    """Whether this process can open every buffer of ``info`` (same node is checked by the caller)."""
    if info is None or not info.buffers:
        return False
    visible = visible_devices()
    return all(b.device_uuid in visible for b in info.buffers)


# ------------------------------------------------------------------------------------------------ producer
ShareKey = Tuple[int, int, int]  # (device index, storage address, storage bytes)


class ShareCache(StorageCache[ShareKey, Tuple[Any, ...]]):
    """One CUDA IPC share per storage for the storage's life, however many objects (or returns of the same weights)
    use it.

    torch adds a reference slot and an inter-process event for every ``_share_cuda_`` call and keeps them until the
    storage dies, so sharing again at every return of weights returned each step grows both without bound (and past
    torch's event cap every export synchronises). Here a storage is shared on its first use and the share is kept
    while the storage lives (``keep_while_alive``; see ``rdt.transports.storage_cache``): settled once the storage
    has died, or when more than ``max_idle`` storages no live object uses are kept (oldest first).
    ``share``/``settle`` are injected (torch's in production) so the bookkeeping is tested without CUDA.
    """

    def __init__(self, share: Callable[[Any], Tuple[Any, ...]], settle: Callable[[Tuple[Any, ...]], None],
                 max_idle: int = 4096) -> None:
        super().__init__(lambda _key, storage: share(storage), settle, keep_while_alive=True, max_idle=max_idle)

    def exported(self) -> int:
        """Shares not settled yet: those live objects use and those kept for storages still alive."""
        self.sweep()
        return len(self) + self.idle()


_share_ids = itertools.count(1)


def _share_storage(storage: Any) -> Tuple[Any, ...]:
    """torch's share of ``storage``, with this share's number appended (see ``IpcBuffer.share_id``)."""
    return tuple(storage._share_cuda_()) + (next(_share_ids),)


def _settle_share(share: Tuple[Any, ...]) -> None:
    """Settle torch's per-share counter so the block is not kept in limbo after the object is freed."""
    dev, _handle, _size, _offset, rc_handle, rc_offset = share[:6]
    torch.UntypedStorage._release_ipc_counter(rc_handle, rc_offset, device=dev)


def new_share_cache() -> ShareCache:
    """A process's cache of CUDA IPC shares (kept by the context; a forked child starts with a new one)."""
    return ShareCache(_share_storage, _settle_share)


def _key(buf: torch.Tensor) -> ShareKey:
    storage = buf.untyped_storage()
    return buf.get_device(), storage.data_ptr(), storage.nbytes()


def _describe(buf: torch.Tensor, share: Tuple[Any, ...]) -> IpcBuffer:
    (_dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = share[:8]
    index = buf.get_device()
    return IpcBuffer(_device_uuid(index), index, bytes(handle), int(size), int(offset), bytes(rc_handle),
                     int(rc_offset), None if ev_handle is None else bytes(ev_handle), bool(ev_sync),
                     buf.storage_offset() * buf.element_size(), buf.numel() * buf.element_size(),
                     int(share[8]) if len(share) > 8 else 0)


def export(entry: Any, cache: ShareCache, ipc_map: bool = False,
           wait_ready: Callable[[Any], None] = lambda _entry: None) -> CudaIpcInfo:
    """Describe every buffer of ``entry`` (all CUDA) through ``cache``; the keys it used are kept on the entry so
    :func:`release` returns them when the object is freed.

    A fresh share carries an IPC event torch records on the stream current now (at return), which the consumer
    waits on; a reused share carries the event of its first export, which does not cover this object's pending
    writes. So where a share was reused, ``wait_ready(entry)`` (``rdt._objects.stream_ready.wait_ready``) blocks
    until they are done.
    """
    items: List[IpcBuffer] = []
    keys: List[ShareKey] = []
    reused = False
    bufs = entry.flat.buffers
    try:
        for i, buf in enumerate(bufs):
            try:
                share, fresh = cache.take(_key(buf), buf.untyped_storage())
            except RuntimeError as e:  # not caching-allocator memory (e.g. a cupy array): share a torch copy
                logger.debug("rdt: buffer %d cannot be shared in place (%s); sharing a copy", i, e)
                bufs[i] = buf = buf.clone()
                share, fresh = cache.take(_key(buf), buf.untyped_storage())
            reused = reused or not fresh
            keys.append(_key(buf))
            items.append(_describe(buf, share))
        if reused:
            wait_ready(entry)
    except BaseException:
        for key in keys:
            cache.release(key)
        raise
    info = CudaIpcInfo(tuple(items), bool(ipc_map))
    entry.exports["cuda_ipc"] = (info, tuple(keys))
    return info


def release(entry: Any, cache: ShareCache) -> None:
    """Producer side, when the object is freed: its storages' shares lose a user (the last settles them)."""
    known = entry.exports.pop("cuda_ipc", None)
    if known is not None:
        for key in known[1]:
            cache.release(key)


# ------------------------------------------------------------------------------------------------ consumer
def _open(b: IpcBuffer, index: int) -> torch.Tensor:
    """The producer's buffer as a uint8 tensor on local device ``index`` (a mapping, no copy)."""
    return open_storage(b, index)[b.buffer_offset:b.buffer_offset + b.nbytes]


def open_storage(b: IpcBuffer, index: int) -> torch.Tensor:
    """The producer's whole storage of buffer ``b`` as a uint8 tensor on local device ``index`` (a mapping, no
    copy): the one device call of a consumer, behind which everything is tested on CPU. The open makes the current
    stream of that device wait for the producer's IPC event (torch)."""
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        index, b.handle, b.storage_nbytes, b.storage_offset, b.ref_counter_handle, b.ref_counter_offset,
        b.event_handle, b.event_sync_required,
    )
    t = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
    t.set_(storage, 0, (b.storage_nbytes,), (1,))
    return t


def open_object(info: CudaIpcInfo, device: Optional[torch.device] = None,
          map_only: Optional[bool] = None) -> List[torch.Tensor]:
    """Open (and by default copy) every buffer; raises RuntimeError when a handle cannot be opened."""
    from ...errors import UnsupportedError

    visible = visible_devices()
    missing = [b.device_uuid for b in info.buffers if b.device_uuid not in visible]
    if missing:
        raise UnsupportedError(
            f"CUDA IPC needs the producer's GPU ({missing[0]}) to be visible in this process, and it is not",
            hint="share the GPU between the actors (e.g. num_gpus=0.5 each), or use tensor_transport='nccl', "
            "'nixl' or 'auto'",
        )
    do_map = info.map if map_only is None else map_only
    mapped = [_open(b, visible[b.device_uuid]) for b in info.buffers]
    if do_map:
        return mapped  # the consumer core hangs the object's lifetime token on their storages (Fetched.keepalive)
    target = device if device is not None else target_device()
    if target is None:
        raise UnsupportedError("CUDA IPC needs a CUDA device in the consumer",
                               hint="run the consumer with a GPU, or use tensor_transport='auto'")
    out: List[torch.Tensor] = []
    stream = torch.cuda.Stream(device=target)
    stream.wait_stream(torch.cuda.current_stream(target))  # the fresh blocks below come from that stream's pool
    for src in mapped:
        # The open made the source device's current stream wait on the producer's IPC event; follow it.
        stream.wait_stream(torch.cuda.current_stream(src.device))
        dst = torch.empty(src.numel(), dtype=torch.uint8, device=target)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        out.append(dst)
    stream.synchronize()  # done reading the producer's memory before the mapping is dropped
    del mapped
    return out
