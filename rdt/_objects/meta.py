"""What an rdt ObjectRef's value really is: metadata. Unpickling it in a consumer fetches the tensors.

``ObjectMeta.__reduce__`` makes Ray's deserializer call :func:`_rebuild` in whichever process receives the value
(a consumer actor's argument, the driver's ``ray.get``), which hands it to the unpickler the consumer installs
(``rdt._consumer.unpickle``). That is how consumers need no decorator and no class
option: the fetch happens while Ray deserializes the task's arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, FrozenSet, Optional, Tuple

from .specs import BufferTable, SpecTable


@dataclass(frozen=True)
class ProducerInfo:
    """How to reach the process that holds the object."""

    instance: bytes  # random per process context: "is this me?"
    pid: int
    node_id: str
    control_address: str  # host:port of the producer's control server
    process_key: bytes  # authenticates control requests about this producer's objects
    actor: Any  # the producer's ActorHandle (object-store fallback), or None
    actor_id: str
    missing: FrozenSet[str] = frozenset()  # transports that cannot work in the producer (NIXL not installed)
    started: Optional[int] = None  # the producer's start time: with the pid, names the process for good (_proc)


@dataclass(frozen=True)
class GroupRef:
    """A collective group the producer belongs to."""

    uid: str
    name: str
    backend: str
    rank: int


@dataclass(frozen=True)
class ObjectMeta:
    """The ref's value: where the tensors are and how to rebuild the user's value around them."""

    obj_id: bytes
    transport: str  # what the producer asked for: a transport's name or "auto"
    producer: ProducerInfo
    skeleton: bytes
    specs: SpecTable  # a sequence of TensorSpec (any sequence given is turned into the table)
    buffers: BufferTable  # a sequence of BufferSpec (likewise)
    groups: Tuple[GroupRef, ...]
    token: Any  # ObjectRef owned by the producer; keeps the object alive while any holder exists
    exports: Tuple[Tuple[str, Any], ...] = ()  # (transport name, descriptor) for each transport that exported
    timeout: Optional[float] = None  # producer-chosen transfer timeout

    def __post_init__(self) -> None:
        object.__setattr__(self, "specs", SpecTable.of(self.specs))
        object.__setattr__(self, "buffers", BufferTable.of(self.buffers))

    def export(self, name: str) -> Optional[Any]:
        """The descriptor transport ``name`` attached at return time, or None."""
        for n, desc in self.exports:
            if n == name:
                return desc
        return None

    @property
    def id_hex(self) -> str:
        return self.obj_id.hex()

    @property
    def nbytes(self) -> int:
        return self.buffers.total

    def __reduce__(self) -> Any:
        return (_rebuild, (self.__dict__.copy(),))

    def describe(self) -> str:
        return f"rdt object {self.id_hex[:16]} ({len(self.specs)} tensors, {self.nbytes} bytes, {self.transport})"


def _rebuild(state: dict) -> Any:
    """Runs in the receiving process during deserialization: hands the metadata to the consumer's unpickler."""
    meta = ObjectMeta.__new__(ObjectMeta)
    object.__setattr__(meta, "__dict__", state)
    return _unpickler(meta)


def _not_installed(meta: ObjectMeta) -> Any:
    raise RuntimeError(f"{meta.describe()} arrived before rdt's consumer was installed (import rdt first)")


_unpickler: Callable[[ObjectMeta], Any] = _not_installed


def install_unpickler(unpickler: Callable[[ObjectMeta], Any]) -> None:
    """Called once by the consumer (when rdt is imported): what turns an arriving ObjectMeta into its value."""
    global _unpickler
    _unpickler = unpickler
