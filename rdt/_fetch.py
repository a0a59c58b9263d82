"""The consumer role: turn an ObjectMeta back into the producer's value, by the best path available.

Paths: the producer itself (the very same tensors, no copy); bytes inlined in the metadata (small objects);
shared memory (same node); the group's backend (Gloo/NCCL; the producer posts sends when asked over the control
channel); NIXL READ; and the producer's bytes streamed over its control channel (the fallback for processes
outside a group, e.g. the driver; the path keeps the name "object_store"). Within one task, the same object
passed twice is fetched once.
"""

from __future__ import annotations

import logging
import os
import struct
import sys
import threading
import time
import weakref
from concurrent.futures import wait as futures_wait
from typing import Any, Dict, List, Optional, Sequence, Tuple

import ray
import torch

from rdt_transports._context import get_context as get_transport_context
from rdt_transports.errors import CollectiveTimeoutError, CommunicationError, UnsupportedError
from rdt_transports.group import TAG_OBJECT, make_tag

from . import _cma, _control, _cuda_ipc, _nixl_objects, _shm
from ._flatten import leaf_from_buffer, unflatten
from ._meta import GroupRef, ObjectMeta
from .errors import (
    NoCollectiveGroupError,
    ObjectFetchError,
    ObjectFreedError,
    ProducerDiedError,
    TransferTimeoutError,
)


logger = logging.getLogger("rdt")


def resolve(ctx: Any, meta: ObjectMeta) -> Any:
    """Rebuild the value ``meta`` stands for in this process."""
    if ctx.is_me(meta.producer):
        entry = ctx.table.get(meta.obj_id)
        if entry is not None:
            return unflatten(meta.skeleton, entry.flat.leaves)
        leaves = ctx.table.get_weak(meta.obj_id) if meta.inline is not None else None
        if leaves is not None:
            return unflatten(meta.skeleton, leaves)
        if meta.inline is None:
            raise ObjectFreedError(f"{meta.describe()} was already freed in its producer", object_id=meta.id_hex,
                                   hint="keep a reference to the ObjectRef until every consumer has run")
    task_id = _task_id()
    key = (task_id, meta.obj_id)
    if task_id is not None:
        cached = ctx.fetch_cache.get(key)
        if cached is not None:
            leaves = [r() for r in cached]
            if all(x is not None for x in leaves):
                return unflatten(meta.skeleton, leaves)
    start = time.monotonic()
    buffers, path = fetch_buffers(ctx, meta)
    elapsed = time.monotonic() - start
    ctx.stats.add(path, "in", meta.nbytes, elapsed)
    logger.debug("rdt: fetched object=%s producer=%s transport=%s bytes=%d in %.4fs", meta.id_hex,
                 meta.producer.actor_id[:12], path, meta.nbytes, elapsed)
    leaves = [leaf_from_buffer(s, buffers) for s in meta.specs]
    if path == "cuda_ipc" and meta.cuda_ipc is not None and meta.cuda_ipc.map:
        _cuda_ipc.keep_alive(leaves, meta.token)  # mapped views keep the producer's memory alive
    if task_id is not None and len(meta.specs):
        _remember(ctx, key, leaves)
    return unflatten(meta.skeleton, leaves)


def _task_id() -> Optional[str]:
    from ._ray_hooks import worker_mode  # a private Ray API, checked when rdt is imported
    if worker_mode() != ray.WORKER_MODE:  # the driver has no task (and Ray would log a warning for asking)
        return None
    try:
        return ray.get_runtime_context().get_task_id()
    except Exception:
        return None


def _remember(ctx: Any, key: Tuple[Any, bytes], leaves: List[Any]) -> None:
    """Weakly remember what a task received so the same ref in the same task maps to the same tensors."""
    def drop(_ref: Any, key: Tuple[Any, bytes] = key) -> None:
        ctx.fetch_cache.pop(key, None)

    try:
        ctx.fetch_cache[key] = [weakref.ref(x, drop) for x in leaves]
    except TypeError:  # a leaf kind without weakref support: just don't cache
        pass


def _in_actor() -> bool:
    try:
        return ray.get_runtime_context().get_actor_id() is not None
    except Exception:
        return False


def _called_by_ray_get() -> bool:
    """Whether Ray is deserializing this value for ``ray.get`` (True) rather than for a task's arguments.

    A private Ray detail, kept here alone: ``ray.get`` reaches ``Worker.deserialize_objects`` from
    ``Worker.get_objects`` (both in ray/_private/worker.py); task arguments reach it from Ray's Cython task loop
    (or the event loop, for async actors). ``await ref`` in an async actor arrives from Cython too and counts as
    an argument. tests/test_control_plane.py::test_ray_deserialization_probe_still_tells_get_from_task_arguments
    fails when Ray changes this.
    """
    frame = sys._getframe(1)
    for _ in range(64):  # bounded: the value is at most a few dozen frames below Ray's entry point
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "deserialize_objects" and code.co_filename.endswith(_RAY_WORKER_FILE):
            caller = frame.f_back
            return (caller is not None and caller.f_code.co_name == "get_objects"
                    and caller.f_code.co_filename.endswith(_RAY_WORKER_FILE))
        frame = frame.f_back
    return False


_RAY_WORKER_FILE = os.path.join("ray", "_private", "worker.py")


def _node_id() -> str:
    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:
        return ""


def _common_group(meta: ObjectMeta, backends: Tuple[str, ...]) -> Optional[Tuple[Any, GroupRef]]:
    mine = {g.uid: g for g in get_transport_context().groups() if g is not None}
    for ref in meta.groups:
        g = mine.get(ref.uid)
        if g is not None and ref.backend in backends and g.state.value == "healthy":
            return g, ref
    return None


def _is_cuda(meta: ObjectMeta) -> bool:
    return bool(meta.buffers) and all(b.device.startswith("cuda") for b in meta.buffers)


def _consumer_device(meta: ObjectMeta) -> torch.device:
    """Where received buffers go: GPU objects onto this process's current CUDA device when it has one, else CPU."""
    if any(b.device.startswith("cuda") for b in meta.buffers):
        dev = _cuda_ipc.target_device()
        if dev is not None:
            return dev
    return torch.device("cpu")


def buffer_devices(devices: Sequence[str], gpu: Optional[torch.device]) -> List[torch.device]:
    """Where each received buffer goes, from the producer's device strings: CPU buffers stay on the CPU, GPU
    buffers go to ``gpu`` (this process's CUDA device), or to the CPU when this process has none."""
    cpu = torch.device("cpu")
    return [gpu if d.startswith("cuda") and gpu is not None else cpu for d in devices]


def _to_buffer_devices(meta: ObjectMeta, bufs: List[torch.Tensor]) -> List[torch.Tensor]:
    """Move host buffers each to its own device (a mixed CPU/GPU value keeps both kinds)."""
    devices = [b.device for b in meta.buffers]
    gpu = _cuda_ipc.target_device() if any(d.startswith("cuda") for d in devices) else None
    return [b if t.type == "cpu" else b.to(t) for b, t in zip(bufs, buffer_devices(devices, gpu))]


def choose_path(meta: ObjectMeta) -> str:
    """For transport 'auto'.

    CPU objects: same node -> shm, group peer -> its backend, NIXL, else the object store.
    Mixed CPU/GPU objects: the object store path (the producer's control server), which keeps each buffer's device.
    GPU objects: same node and the producer's GPU visible -> CUDA IPC, NIXL, a common nccl group, else the object
    store (through host memory).
    """
    same_node = meta.producer.node_id == _node_id()
    if _is_cuda(meta):
        if same_node and _cuda_ipc.can_open(getattr(meta, "cuda_ipc", None)):
            return "cuda_ipc"
        if meta.producer.nixl and _nixl_objects.available():
            return "nixl"
        if _common_group(meta, ("nccl",)) is not None:
            return "nccl"
        return "object_store"
    cpu = all(b.device == "cpu" for b in meta.buffers)
    if not cpu:  # CPU and GPU buffers: only the control server's stream carries each to its own device
        return "object_store"
    if same_node:
        return "shm"
    common = _common_group(meta, ("gloo", "nccl", "ucx"))
    if common is not None:
        return common[1].backend
    if meta.producer.nixl and _nixl_objects.available():
        return "nixl"
    return "object_store"


def fetch_buffers(ctx: Any, meta: ObjectMeta) -> Tuple[List[torch.Tensor], str]:
    """The object's buffers as fresh uint8 tensors in this process, and the path used."""
    if meta.inline is not None:
        return [torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)
                for b in meta.inline], "inline"
    timeout = meta.timeout or ctx.config.transfer_timeout
    path = meta.transport if meta.transport != "auto" else choose_path(meta)
    if path == "shm" and meta.producer.node_id != _node_id():
        path = "object_store"  # shared memory cannot cross nodes
    if path == "cuda_ipc":
        path = _check_cuda_ipc(meta)
    try:
        if path == "cuda_ipc":
            return _cuda_ipc.fetch(meta.cuda_ipc), "cuda_ipc"
        if path == "shm":
            return _fetch_shm(ctx, meta, timeout), "shm"
        if path in ("gloo", "nccl", "ucx"):
            common = _common_group(meta, (path,))
            if common is None:
                if _in_actor() and not _called_by_ray_get():
                    raise NoCollectiveGroupError(
                        f"{meta.describe()} uses transport {path!r} but this actor shares no healthy {path} group "
                        f"with its producer (actor {meta.producer.actor_id[:12]})",
                        object_id=meta.id_hex,
                        hint=f"call rdt.create_collective_group([producer, consumer, ...], backend={path!r}) from "
                        "the driver before passing the ref, or use tensor_transport='auto'",
                    )
                return _fetch_object_store(ctx, meta, timeout), "object_store"
            return _fetch_group(ctx, meta, common[0], common[1], timeout), path
        if path == "nixl":
            return _fetch_nixl(ctx, meta, timeout), "nixl"
        if path == "object_store" and meta.store_ref is not None:
            return _to_buffer_devices(meta, _get(meta, [meta.store_ref], timeout)[0]), "object_store"
        return _fetch_object_store(ctx, meta, timeout), "object_store"
    except (ObjectFetchError, ObjectFreedError, NoCollectiveGroupError, UnsupportedError):
        raise
    except TimeoutError as e:
        raise TransferTimeoutError(
            f"fetching {meta.describe()} over {path} did not finish within {timeout:.1f}s: {e}",
            object_id=meta.id_hex,
            hint="the producer may be dead or stuck; raise rdt.configure(transfer_timeout=...) for huge objects",
        ) from e
    except Exception as e:  # anything a transport library raised (NIXL, Gloo, sockets)
        if not _producer_alive(ctx, meta):
            raise _died(meta, e) from e
        raise ObjectFetchError(f"fetching {meta.describe()} over {path} failed: {type(e).__name__}: {e}",
                               object_id=meta.id_hex) from e


def _check_cuda_ipc(meta: ObjectMeta) -> str:
    """'cuda_ipc' when this process can open the object's handles; the object store for non-actors (the driver);
    otherwise a clear error before anything moves."""
    info = getattr(meta, "cuda_ipc", None)
    why = None
    if meta.producer.node_id != _node_id():
        why = "the producer is on another node (CUDA IPC works within one node)"
    elif info is None:
        why = "the producer exported no CUDA IPC handles"
    elif _cuda_ipc.target_device() is None and not info.map:
        why = "this process has no CUDA device"
    elif not _cuda_ipc.can_open(info):
        why = f"the producer's GPU ({', '.join(info.uuids())}) is not visible in this process"
    if why is None:
        return "cuda_ipc"
    if not _in_actor():
        return "object_store"  # the driver (or a task): through host memory
    raise UnsupportedError(
        f"{meta.describe()} uses transport 'cuda_ipc' but {why}", object_id=meta.id_hex,
        hint="give both actors the same GPU (e.g. num_gpus=0.5 each) on one node, or use tensor_transport='nccl', "
        "'nixl' or 'auto'",
    )


def _producer_alive(ctx: Any, meta: ObjectMeta, ping_timeout: float = 2.0) -> bool:
    """False only on proof of death: the pid is gone (same node) or nothing listens on its control port.

    A ping that times out means stuck or slow, not dead (a stopped process answers nothing but is alive).
    """
    if meta.producer.node_id == _node_id() and not _shm.pid_alive(meta.producer.pid):
        return False
    try:
        ctx.client.request(meta.producer.control_address, _control.REQ_PING, _control.KEY_PROCESS,
                           meta.producer.process_key, b"", ping_timeout)
        return True
    except ConnectionRefusedError:
        return False
    except Exception:
        return True


def _died(meta: ObjectMeta, cause: BaseException) -> ProducerDiedError:
    return ProducerDiedError(
        f"the producer of {meta.describe()} (actor {meta.producer.actor_id[:12] or 'driver'}, pid "
        f"{meta.producer.pid}) is unreachable: {cause}",
        object_id=meta.id_hex,
        hint="the producer died; its objects are lost. Re-run the producing method on a live actor",
    )


def _control_request(ctx: Any, meta: ObjectMeta, msg: int, key_id: int, key: bytes, payload: bytes,
                     timeout: float, alloc: Optional[_control.Alloc] = None) -> bytes:
    try:
        resp_type, resp = ctx.client.request(meta.producer.control_address, msg, key_id, key, payload, timeout,
                                             alloc)
    except (ConnectionError, OSError) as e:
        if isinstance(e, TimeoutError):
            raise
        if isinstance(e, ConnectionRefusedError) or not _producer_alive(ctx, meta):
            raise _died(meta, e) from e
        # Alive but it dropped the request: e.g. it left the group whose secret signed it.
        raise ObjectFetchError(
            f"the producer of {meta.describe()} is alive but refused the request ({e})", object_id=meta.id_hex,
            hint="the producer may have left the group the object was made in; re-create the group or use "
            "tensor_transport='auto'",
        ) from e
    if resp_type == _control.RESP_OK:
        return resp
    code = struct.unpack_from("!H", resp)[0] if len(resp) >= 2 else 0
    text = resp[2:].decode(errors="replace")
    if code == _control.ERR_NOT_FOUND:
        raise ObjectFreedError(f"{meta.describe()} is gone from its producer: {text}", object_id=meta.id_hex,
                               hint="keep a reference to the ObjectRef until every consumer has run")
    raise ObjectFetchError(f"the producer refused to serve {meta.describe()}: {text}", object_id=meta.id_hex)


def _fetch_shm(ctx: Any, meta: ObjectMeta, timeout: float) -> List[torch.Tensor]:
    info = getattr(meta, "cma", None)
    if info is not None and ctx.config.shm_cma and not ctx.cma.denied(meta.producer.pid):
        bufs = [ctx.buffers.empty(b.nbytes) for b in meta.buffers]
        try:
            ctx.cma.read(meta.producer.pid, info, [b.data_ptr() for b in bufs], meta.obj_id)
            return bufs
        except _cma.CmaError as e:
            # Refused by the kernel, or the object/process is gone: ask the producer, which gives the
            # authoritative answer (a segment, ObjectFreedError, or ProducerDiedError).
            logger.debug("rdt: direct read of %s failed (%s); asking the producer for a segment", meta.id_hex, e)
    seg = meta.shm
    if seg is None:
        resp = _control_request(ctx, meta, _control.REQ_PREPARE_SHM, _control.KEY_PROCESS,
                                meta.producer.process_key, meta.obj_id, timeout)
        name, _, body = resp.partition(b"\0")
        (n,) = struct.unpack_from("!I", body)
        layout = [struct.unpack_from("!QQ", body, 4 + 16 * i) for i in range(n)]
        return _map_shm(ctx, meta, name.decode(), layout)
    if not _shm.owner_alive(seg.name):  # same node, so the pid in the name is meaningful
        _shm.unlink(seg.name)
        raise _died(meta, ProcessLookupError(f"process {meta.producer.pid} is gone"))
    return _map_shm(ctx, meta, seg.name, seg.layout)


def _map_shm(ctx: Any, meta: ObjectMeta, name: str, layout: Any) -> List[torch.Tensor]:
    try:
        return _shm.map_segment(name, layout, meta.obj_id, ctx.unmapper)
    except FileNotFoundError as e:
        if isinstance(e, _shm.SegmentReused) or _producer_alive(ctx, meta):
            raise ObjectFreedError(f"{meta.describe()} was freed before it was fetched", object_id=meta.id_hex,
                                   hint="keep a reference to the ObjectRef until every consumer has run") from e
        raise _died(meta, e) from e


_ordered_locks: Dict[Tuple[str, int], threading.Lock] = {}
_ordered_guard = threading.Lock()


def _fetch_group(ctx: Any, meta: ObjectMeta, group: Any, ref: GroupRef, timeout: float) -> List[torch.Tensor]:
    if group.backend_name != "nccl":
        return _fetch_group_unordered(ctx, meta, group, ref, timeout)
    # NCCL matches a direction's sends and receives in issue order, not by tag: one fetch at a time per
    # producer, so the producer posts its sends in the order this process posts its receives.
    with _ordered_guard:
        lock = _ordered_locks.setdefault((group.uid, ref.rank), threading.Lock())
    if not lock.acquire(timeout=timeout):
        raise TimeoutError(f"waited {timeout:.1f}s for an earlier NCCL fetch from the same producer")
    try:
        return _fetch_group_unordered(ctx, meta, group, ref, timeout)
    finally:
        lock.release()


def _fetch_group_unordered(ctx: Any, meta: ObjectMeta, group: Any, ref: GroupRef,
                           timeout: float) -> List[torch.Tensor]:
    n = len(meta.buffers)
    tag_base = ctx.next_tags(group.uid, n + 1)  # one per buffer, and one for the "receives posted" message
    deadline = time.monotonic() + timeout
    # The producer waits as long as we do: our time left, as relative milliseconds (clocks differ across hosts).
    wait_ms = min(max(int(timeout * 1000), 1), 0xFFFFFFFF)
    payload = meta.obj_id + bytes.fromhex(group.uid) + struct.pack("!III", group.rank, tag_base, wait_ms)
    _control_request(ctx, meta, _control.REQ_FETCH_GROUP, _control.KEY_GROUP, group.backend.config.secret,
                     payload, timeout)
    device = _consumer_device(meta)
    bufs = [ctx.buffers.empty(b.nbytes) if device.type == "cpu"
            else torch.empty(b.nbytes, dtype=torch.uint8, device=device) for b in meta.buffers]
    try:
        works = [group.backend.irecv(buf, ref.rank, make_tag(TAG_OBJECT, tag_base + i)) for i, buf in enumerate(bufs)]
        if _control.waits_for_go(group.backend_name, meta.nbytes):  # the producer sends once our receives are posted
            works.append(group.backend.isend(torch.ones(1, dtype=torch.uint8), ref.rank,
                                             make_tag(TAG_OBJECT, tag_base + n)))
        _wait_watching_producer(ctx, meta, works, deadline)
    except CollectiveTimeoutError as e:
        group._mark_errored(e)
        raise TimeoutError(str(e)) from e
    except CommunicationError as e:
        group._mark_errored(e)
        if not _producer_alive(ctx, meta):
            raise _died(meta, e) from e
        raise ObjectFetchError(f"receiving {meta.describe()} over group {group.name!r} failed: {e}",
                               object_id=meta.id_hex) from e
    return bufs


def _wait_watching_producer(ctx: Any, meta: ObjectMeta, works: List[Any], deadline: float) -> None:
    """Wait for posted receives while checking, every half second, that the producer still lives.

    A two-sided receive does not notice a sender that dies mid-message (TCP may stay half-open), so without
    this the consumer would sit out the whole transfer timeout.
    """
    def wait_all() -> None:
        for w in works:
            w.wait(max(deadline - time.monotonic(), 1e-3))

    future = ctx.waiters.submit(wait_all)
    while not futures_wait([future], timeout=0.5).done:
        if not _producer_alive(ctx, meta, ping_timeout=0.5):
            raise _died(meta, ConnectionError("the producer died during the transfer"))
    future.result()


def _fetch_nixl(ctx: Any, meta: ObjectMeta, timeout: float) -> List[torch.Tensor]:
    if not _nixl_objects.available():
        raise ObjectFetchError(f"{meta.describe()} needs NIXL, which is not installed in this process",
                               object_id=meta.id_hex, hint="pip install 'rdt[nixl]'")
    info = meta.nixl
    if info is None:
        resp = _control_request(ctx, meta, _control.REQ_PREPARE_NIXL, _control.KEY_PROCESS,
                                meta.producer.process_key, meta.obj_id, timeout)
        info = _nixl_objects.decode_info(resp)
    try:
        device = _consumer_device(meta) if info.mem_type == "VRAM" else torch.device("cpu")
        return _nixl_objects.fetch(ctx, info, device, timeout)
    except TimeoutError:
        if not _producer_alive(ctx, meta):
            raise _died(meta, TimeoutError("NIXL READ timed out")) from None
        raise
    except RuntimeError as e:
        if not _producer_alive(ctx, meta):
            raise _died(meta, e) from e
        raise ObjectFetchError(f"NIXL READ of {meta.describe()} failed: {e}", object_id=meta.id_hex) from e


def _get(meta: ObjectMeta, refs: List[Any], timeout: float) -> List[Any]:
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError as e:
        raise TimeoutError(str(e)) from e
    except ray.exceptions.RayActorError as e:
        raise _died(meta, e) from e


def _fetch_object_store(ctx: Any, meta: ObjectMeta, timeout: float) -> List[torch.Tensor]:
    """The fallback path (the driver, tasks, actors outside a group): the producer's control server streams the
    bytes (REQ_FETCH_BYTES), answered on its control thread, never in the actor's queue."""
    if meta.producer.actor is None:  # a task's worker may exit or be reused at any time
        raise ObjectFetchError(f"{meta.describe()} was made outside an actor and cannot be served to this process",
                               object_id=meta.id_hex, hint="produce objects inside actors")
    bufs = [ctx.buffers.empty(b.nbytes) for b in meta.buffers]
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
        _control_request(ctx, meta, _control.REQ_FETCH_BYTES, _control.KEY_PROCESS, meta.producer.process_key,
                         payload, timeout, alloc=into)
    except _control.ProtocolError as e:  # a bad header or MAC, or the stream cut short
        if not _producer_alive(ctx, meta):
            raise _died(meta, e) from e
        raise ObjectFetchError(f"fetching {meta.describe()} from its producer failed: {e}",
                               object_id=meta.id_hex) from e
    return _to_buffer_devices(meta, bufs)  # GPU buffers onto this process's GPU if it has one
