"""The object layer's transport contract: what a transport declares, and the four things it does.

A transport moves one object's buffers (uint8 byte ranges of the producer's storages, see
``rdt._objects.flatten``) from the process that produced them to one that asks. It declares :class:`Capabilities`;
the consumer core checks them (and asks :meth:`Transport.unusable`) before it calls :meth:`Transport.fetch`, so a
transport may assume that every buffer is on a device it declared and that a common group / the same node exists
where it said it needs one.

The life of an object, as seen by a transport:

1. **export** (producer, at return): attach what consumers need to the object's metadata, a small picklable
   *descriptor* (or nothing: a transport can export lazily, when the first consumer asks).
2. **serve** (producer, on rdt's control thread, never in the actor's task queue): answer the control requests it
   registered in :meth:`Transport.handlers`. The request carries the consumer's remaining time as relative seconds.
3. **fetch** (consumer): land the buffers in this process and name the path that served (``label``: shown by
   ``rdt.stats`` and the benchmark). A transport that declares ``receive_into`` fills the buffers it is given with no
   intermediate copy; the others return their own buffers and the core copies where the caller asked for targets.
4. **release** (producer, when the last reference died): drop whatever export/serve attached to the entry.

What a transport keeps per process (an agent, pools, a chain table) is a :class:`TransportState` the context holds
under the transport's name; the context trims it periodically and shuts it down through its hooks.

A transport imports only this module and the landing helpers beside it (``receive``, ``recv_buffers``,
``storage_cache``, ``busy_targets``), the object model (``rdt._objects``), the control channel (``rdt._control``), the Ray seam
(``rdt._ray``), ``rdt.errors`` and ``rdt_transports``: never the process context (it sees it through
:class:`Context`), a role, the API, the registry or another transport (tests/test_layering.py holds this). A
transport that cannot set up where it runs (no NIXL agent, an IPC handle that does not open, no room for a segment)
raises :class:`SetupFailed`, and ``auto`` moves on to the next transport of its chain.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from concurrent.futures import ThreadPoolExecutor
from typing import (TYPE_CHECKING, Any, Callable, ClassVar, Dict, FrozenSet, Mapping, Optional, Protocol, Sequence,
                    Tuple)

import torch

if TYPE_CHECKING:
    from .._objects.meta import ObjectMeta
    from .._objects.table import Entry

Handler = Callable[[Any, int, bytes], Tuple[Any, ...]]  # (ctx, key id, payload) -> (response type, payload[, stream])
Served = Tuple[Handler, Tuple[int, ...]]  # a handler and the control keys (_control.KEY_*) allowed to call it


class SetupFailed(Exception):
    """The transport cannot be set up in this process or for this object; ``auto`` tries the next one."""


class Context(Protocol):
    """What a transport may use of this process's rdt context (``ctx`` in every call of the contract)."""

    config: Any  # the RdtConfig this process fetches and produces with (rdt.configure changes it)
    instance: bytes  # random per process context: names this process's agents and objects
    process_key: bytes  # signs control requests about this process's objects
    table: Any  # the ObjectTable: objects this process produced and holds (get(obj_id) -> Entry or None)
    stats: Any  # transfer counters per transport: add(transport, direction, nbytes[, seconds, path])
    client: Any  # the ControlClient requests to other processes go through
    buffers: Any  # the BufferPool of CPU receive buffers (see receive.landing)
    waiters: ThreadPoolExecutor  # waits on a fetch's receives
    send_waiters: ThreadPoolExecutor  # waits on a producer's posted sends
    busy_targets: Any  # the BusyTargets: into= target bytes a failed transfer may still write (see busy_targets)

    def transport_state(self, name: str, factory: Callable[[], Any]) -> Any:
        """Transport ``name``'s per-process state, made by ``factory`` on first use."""

    def peek_transport_state(self, name: str) -> Any:
        """Transport ``name``'s per-process state if it was made (never makes it)."""

    def next_tags(self, group_uid: str, n: int) -> int:
        """The first of ``n`` consecutive object tags of a group, unique in this process."""


class TransportState:
    """What a transport keeps per process, held by the context under the transport's name and made on first use
    (:meth:`Context.transport_state`). The context calls the hooks below, transport by transport in the registry's
    order; each must return quickly and never raise."""

    def trim(self) -> None:
        """Every few seconds (the context's reaper): drop what waited too long for reuse."""

    def stop(self) -> None:
        """At shutdown, before the object table is cleared: stop serving (answer requests held open)."""

    def close(self) -> None:
        """At shutdown, after the object table was cleared (every object released): free everything else."""

    def configure(self, config: Any) -> None:
        """``rdt.configure`` changed this process's settings (``config``: the new RdtConfig)."""


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do; checked by the cores before it is called."""

    name: str
    devices: FrozenSet[str]  # device types of buffers it carries ("cpu", "cuda")
    one_sided: bool = False  # a fetch needs nothing from the producer's Python (it may be busy or stopped)
    group_backend: Optional[str] = None  # needs a healthy group of this rdt_transports backend with the producer
    same_node: bool = False  # producer and consumer must share a node
    receive_into: bool = False  # fills caller-given buffers without an intermediate copy
    mixed_devices: bool = False  # one object's buffers may sit on different device types
    serves_from_holder: bool = False  # a consumer that holds the bytes can serve later consumers (relay)
    self_contained: bool = False  # the descriptor carries the bytes: nothing is held in the producer
    universal: bool = False  # reaches the producer from any process: where other transports do not fit
    can_map: bool = False  # can hand consumers views of the producer's memory (tensor_method(ipc_map=True))
    auto_priority: Optional[int] = None  # place in auto's chain (lower first); None: never chosen by auto
    explicit: bool = True  # may be named in tensor_method(tensor_transport=...)
    # What one more range and one more byte cost this transport's read_ranges (sharded loads read a strided set of
    # runs as one covering range where that is cheaper); measured by rdt-bench's sharded-sync calibration. None:
    # exact runs always.
    range_run_s: Optional[float] = None
    range_bytes_per_s: Optional[float] = None

    def carries(self, devices: FrozenSet[str]) -> bool:
        """Whether an object whose buffers are on ``devices`` (device types) fits this transport."""
        if not devices:
            return True
        if len(devices) > 1 and not self.mixed_devices:
            return False
        return devices <= self.devices


@dataclass(frozen=True)
class Site:
    """Where a consumer stands relative to an object's producer; built once per fetch by the consumer core."""

    same_node: bool
    in_actor: bool
    task_argument: bool  # resolving a task's argument (not an explicit get): some refusals are errors there
    groups: Mapping[str, Any] = field(default_factory=dict)  # healthy common groups by backend name
    cuda_device: Optional[torch.device] = None  # this process's current CUDA device, if any
    # rdt.get(into=...): per buffer, the uint8 bytes of the target it lands in, or None (a receive_into transport
    # fills these instead of allocating; see landing() and Targets)
    into: Sequence[Optional[torch.Tensor]] = ()


@dataclass(frozen=True)
class Unusable:
    """Why a transport cannot serve a fetch here: ``error`` set means refuse (raise it), else fall back."""

    reason: str
    error: Optional[BaseException] = None


@dataclass
class Fetched:
    """What a fetch produced: one buffer per BufferSpec (in this process) and the path that served it."""

    buffers: Sequence[torch.Tensor]  # a list, or BlockViews when they are byte ranges of one fresh block
    label: str
    keepalive: Optional[Any] = None  # held by each buffer's storage (e.g. the token behind mapped producer memory)


class Transport(abc.ABC):
    """One way to move an object's buffers. Subclasses set ``capabilities`` and implement :meth:`fetch`."""

    capabilities: ClassVar[Capabilities]

    @property
    def name(self) -> str:
        return self.capabilities.name

    def export(self, ctx: Any, entry: "Entry", chosen: str) -> Optional[Any]:
        """Producer, at return (``chosen`` is this transport or "auto"): the descriptor, or None for lazy export.
        Whatever reads the buffers here or in a handler first calls
        ``rdt._objects.stream_ready.wait_ready(entry)`` (GPU writes)."""
        return None

    def unusable(self, ctx: Any, meta: "ObjectMeta", site: Site) -> Optional[Unusable]:
        """Consumer: why this process cannot fetch ``meta`` this way (beyond the capabilities), or None."""
        return None

    @abc.abstractmethod
    def fetch(self, ctx: Any, meta: "ObjectMeta", site: Site, deadline: float) -> Fetched:
        """Consumer: the object's buffers in this process; typed rdt errors, TimeoutError or SetupFailed."""

    def read_ranges(self, ctx: Any, meta: "ObjectMeta", ranges: "Ranges", site: Site,
                    deadline: float) -> Optional[str]:
        """Consumer: copy byte ranges of the object's buffers straight to local addresses (sharded weight sync);
        the label of the path that served, or None where this transport cannot serve ranges here (the road then
        tries the next transport, and at last fetches the buffers whole and copies the ranges out). Called, as
        :meth:`fetch`, only where the capabilities fit ``site``. Typed rdt errors, TimeoutError, as :meth:`fetch`."""
        return None

    def handlers(self) -> Dict[int, Served]:
        """Producer: control requests this transport serves (message type -> (handler, allowed key ids)), answered
        on the control server's threads; a request signed with another key is refused before the handler runs."""
        return {}

    def release(self, ctx: Any, entry: "Entry") -> None:
        """Producer: the object was freed; undo what export and serve attached to ``entry``. Never raises."""

    def exported(self, ctx: Any) -> int:
        """Producer: storages this transport keeps exported for live objects (registrations, shares), for stats."""
        return 0

    def available(self) -> bool:
        """Whether this transport can work in this process at all (its packages import): a producer names those
        that cannot in its metadata (``ProducerInfo.missing``), so that consumers do not ask it."""
        return True

    def start(self, ctx: Any) -> None:
        """When this process's context starts (built-in transports): make the state that must exist from then on."""

    def stats(self, ctx: Any) -> Dict[str, Any]:
        """Entries this transport adds to ``rdt.stats()`` (its state's counters; present even before it is used)."""
        return {}


@dataclass
class Ranges:
    """Byte ranges to read from one object: per range the buffer, the offset in it, the local address it lands at
    and its length (equal-length int64 numpy arrays; ``dst`` as uint64), and the local tensors those addresses lie
    in (kept alive by the caller, registered by a transport that needs to; all on one device, :attr:`device`).

    Where the targets or the object's buffers are device memory, the road also gives, per range, the index of its
    target in ``targets`` and the byte offset in it (``tgt``, ``tgt_off``: device copies are made with torch ops, not
    by address), the ranges batched into copy descriptors (``copies``: ``rdt._objects.device_runs.Copies``, made
    once per plan), the caller's stream at the load's start (``after``: device writes follow it; see
    ``rdt._objects.device_order``) and ``memo``, a dict kept with the plan while these ranges stay the same, where a
    transport may keep what it derives from them. A transport that writes device memory returns only once its
    writes finished on the device."""

    buf: Any
    off: Any
    dst: Any
    n: Any
    targets: Sequence[torch.Tensor] = ()
    tgt: Any = None
    tgt_off: Any = None
    copies: Any = None
    after: Any = None
    memo: Optional[Dict[str, Any]] = None

    @property
    def device(self) -> torch.device:
        """The targets' device (the CPU when there are none)."""
        return self.targets[0].device if len(self.targets) else torch.device("cpu")


def device_types(meta: "ObjectMeta") -> FrozenSet[str]:
    """The device types of an object's buffers ("cpu", "cuda")."""
    return meta.buffers.device_types
