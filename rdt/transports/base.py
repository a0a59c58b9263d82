"""The object layer's transport contract: what a transport declares, and the four things it does.

A transport moves one object's buffers (uint8 byte ranges of the producer's storages, see ``_flatten``) from the
process that produced them to one that asks. It declares :class:`Capabilities`; the consumer core checks them (and
asks :meth:`Transport.unusable`) before it calls :meth:`Transport.fetch`, so a transport may assume that every
buffer is on a device it declared and that a common group / the same node exists where it said it needs one.

The life of an object, as seen by a transport:

1. **export** (producer, at return): attach what consumers need to the object's metadata, a small picklable
   *descriptor* (or nothing: a transport can export lazily, when the first consumer asks).
2. **serve** (producer, on rdt's control thread, never in the actor's task queue): answer the control requests it
   registered in :meth:`Transport.handlers`. The request carries the consumer's remaining time as relative seconds.
3. **fetch** (consumer): land the buffers in this process and name the path that served (``label``: shown by
   ``rdt.stats`` and the benchmark). A transport that declares ``receive_into`` fills the buffers it is given with no
   intermediate copy; the others return their own buffers and the core copies where the caller asked for targets.
4. **release** (producer, when the last reference died): drop whatever export/serve attached to the entry.

Transports import only this module, the shared helpers below the cores and ``rdt_transports``; they never import the
producer or consumer core. A transport that cannot set up where it runs (no NIXL agent, an IPC handle that does not
open, no room for a segment) raises :class:`SetupFailed`, and ``auto`` moves on to the next transport of its chain.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import torch

if TYPE_CHECKING:
    from .._objects.meta import ObjectMeta
    from .._objects.table import Entry

Handler = Callable[[Any, int, bytes], Tuple[Any, ...]]  # (ctx, key id, payload) -> (response type, payload[, stream])
Served = Tuple[Handler, Tuple[int, ...]]  # a handler and the control keys (_control.KEY_*) allowed to call it


class SetupFailed(Exception):
    """The transport cannot be set up in this process or for this object; ``auto`` tries the next one."""


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
        Whatever reads the buffers here or in a handler first calls ``rdt._ready.wait_ready(entry)`` (GPU writes)."""
        return None

    def unusable(self, ctx: Any, meta: "ObjectMeta", site: Site) -> Optional[Unusable]:
        """Consumer: why this process cannot fetch ``meta`` this way (beyond the capabilities), or None."""
        return None

    @abc.abstractmethod
    def fetch(self, ctx: Any, meta: "ObjectMeta", site: Site, deadline: float) -> Fetched:
        """Consumer: the object's buffers in this process; typed rdt errors, TimeoutError or SetupFailed."""

    def handlers(self) -> Dict[int, Served]:
        """Producer: control requests this transport serves (message type -> (handler, allowed key ids)), answered
        on the control server's threads; a request signed with another key is refused before the handler runs."""
        return {}

    def release(self, ctx: Any, entry: "Entry") -> None:
        """Producer: the object was freed; undo what export and serve attached to ``entry``. Never raises."""

    def exported(self, ctx: Any) -> int:
        """Producer: storages this transport keeps exported for live objects (registrations, shares), for stats."""
        return 0


def landing(ctx: Any, site: Site, i: int, nbytes: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """Where buffer ``i`` of a fetch lands: the caller's target when ``rdt.get(into=...)`` gave one on that device
    type, else a fresh (pooled, for CPU) buffer."""
    device = device or torch.device("cpu")
    if i < len(site.into):
        t = site.into[i]
        if t is not None and t.numel() == nbytes and t.device.type == device.type:
            return t
    if device.type == "cpu":
        return ctx.buffers.empty(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


class Targets(Sequence[Optional[torch.Tensor]]):
    """Per buffer of an ``rdt.get(into=...)`` fetch: the caller's tensor its bytes land in, as uint8 bytes, or None
    (it lands elsewhere and is copied in). Each uint8 view is made when first asked for: a transport that reads
    into addresses (shm) makes none, and a model's hundreds of targets cost no tensor each."""

    __slots__ = ("tensors", "complete", "_views")

    def __init__(self, tensors: List[Optional[torch.Tensor]], complete: bool) -> None:
        self.tensors = tensors  # contiguous, each with exactly its buffer's bytes
        self.complete = complete  # every buffer has its target
        self._views: List[Optional[torch.Tensor]] = [None] * len(tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        view = self._views[i]
        if view is None:
            t = self.tensors[i]
            if t is None:
                return None
            view = self._views[i] = t.detach().view(-1).view(torch.uint8)  # the same view every time it is asked
        return view

    def addresses(self) -> List[int]:
        """Each target's address (a complete set only; for readers that take raw pointers)."""
        return list(map(torch.Tensor.data_ptr, self.tensors))  # type: ignore[arg-type]


# Where each buffer of a block starts: every dtype's view of it is aligned (the widest element, complex128, is 16
# bytes; malloc gives the same 16). Tensors whose sizes are multiples of 16 bytes, as a model's are, land back to
# back, so a many-tensor object's leaves are cut from its block in one call (``SpecTable.rebuild``).
ALIGN = 16


class BlockViews(Sequence[torch.Tensor]):
    """Landing buffers that are byte ranges of one block: a sequence of uint8 views, each made only when indexed
    (an object of a thousand tensors then costs one allocation, and its leaves are rebuilt from the block)."""

    __slots__ = ("block", "offsets", "sizes", "dense")

    def __init__(self, block: torch.Tensor, offsets: List[int], sizes: List[int], dense: bool = False) -> None:
        self.block = block
        self.offsets = offsets
        self.sizes = sizes
        self.dense = dense  # the buffers lie back to back from the block's start (every size a multiple of ALIGN)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        o = self.offsets[i]
        return self.block[o:o + self.sizes[i]]

    def addresses(self) -> List[int]:
        """Each buffer's address (for readers that take raw pointers)."""
        base = self.block.data_ptr()
        return [base + o for o in self.offsets]

    def span(self, first: int, last: int) -> torch.Tensor:
        """One view from the start of buffer ``first`` to the end of buffer ``last`` (padding included)."""
        return self.block[self.offsets[first]:self.offsets[last] + self.sizes[last]]


def padded_offsets(sizes: Sequence[int]) -> Tuple[List[int], int]:
    """Where each buffer of a block starts (multiples of :data:`ALIGN`) and the block's size."""
    if not sizes:
        return [], 0
    dense = not any(map(_ALIGN_REM, sizes))  # a model's tensors: the sizes are the steps (C loops, no genexpr)
    ends = list(accumulate(sizes if dense else (-(-n // ALIGN) * ALIGN for n in sizes)))
    return [0] + ends[:-1], ends[-1]


_ALIGN_REM = ALIGN.__rmod__  # n -> n % ALIGN


def block_views(ctx: Any, sizes: List[int], device: Optional[torch.device] = None) -> BlockViews:
    """Fresh landing buffers of ``sizes`` bytes as byte ranges of one block, each at a multiple of ALIGN."""
    device = device or torch.device("cpu")
    offsets, total = padded_offsets(sizes)
    room = max(total, 1)
    block = ctx.buffers.empty(room) if device.type == "cpu" else torch.empty(room, dtype=torch.uint8, device=device)
    return BlockViews(block, offsets, list(sizes), dense=bool(sizes) and total == sum(sizes))


_context_getter: Optional[Callable[[], Any]] = None


def install_context(getter: Callable[[], Any]) -> None:
    """Called once by the core: how a transport's code running inside the producer finds this process's context."""
    global _context_getter
    _context_getter = getter


def context() -> Any:
    """This process's rdt context (for code Ray runs in the producer, e.g. through ``__ray_call__``)."""
    if _context_getter is None:
        raise RuntimeError("rdt's context is not installed in this process (rdt._context was never imported)")
    return _context_getter()


def device_types(meta: "ObjectMeta") -> FrozenSet[str]:
    """The device types of an object's buffers ("cpu", "cuda")."""
    return meta.buffers.device_types
