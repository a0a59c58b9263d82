"""What a consumer needs to READ an object from a producer's NIXL agent, and how it travels: in the object's
metadata (pickled as arrays of integers) or in a binary control reply (:func:`encode_info`). NIXL's pickle-based
descriptor serialization is never used.
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass
from itertools import chain
from typing import Any, Dict, Hashable, Iterator, List, Optional, Sequence, Tuple, TypeVar, Union

import torch

from ..receive import padded_offsets

_MEM_CODES = {"DRAM": 0, "VRAM": 1}
_MEM_NAMES = {v: k for k, v in _MEM_CODES.items()}


class PackedDescs(Sequence[Tuple[int, int, int]]):
    """The descriptors of a packed object: its buffers at :func:`padded_offsets` of their sizes from ``base``, on
    device 0. Kept as the sizes, so that a thousand buffers cost no tuples to describe, pickle or read whole."""

    __slots__ = ("base", "sizes", "_offsets")

    def __init__(self, base: int, sizes: List[int], offsets: Optional[List[int]] = None) -> None:
        self.base, self.sizes, self._offsets = base, sizes, offsets

    @property
    def offsets(self) -> List[int]:
        """Where each buffer starts, from ``base``."""
        if self._offsets is None:
            self._offsets = padded_offsets(self.sizes)[0]
        return self._offsets

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        return (self.base + self.offsets[i], self.sizes[i], 0)

    def __iter__(self) -> Iterator[Tuple[int, int, int]]:
        return zip([self.base + o for o in self.offsets], self.sizes, [0] * len(self.sizes))

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, (tuple, list, PackedDescs)) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __reduce__(self) -> Any:
        return (_load_packed, (self.base, array("Q", self.sizes).tobytes()))

    def __repr__(self) -> str:
        return f"PackedDescs(base={self.base:#x}, {len(self.sizes)} buffers)"


def _load_packed(base: int, sizes: bytes) -> PackedDescs:
    a = array("Q")
    a.frombytes(sizes)
    return PackedDescs(base, a.tolist())


@dataclass(frozen=True)
class NixlInfo:
    """What a consumer needs to READ an object: agent name, agent metadata, descriptors, each buffer's memory type.

    ``mem_type`` is "VRAM" if any buffer is (it picks the consumer's device); ``mem_types`` is per buffer
    (defaults to ``mem_type`` for all). NIXL's partial metadata covers one registration, and a registration one
    memory type, so a mixed object has one more metadata blob per further type in ``extra_md``.
    """

    agent: str
    agent_md: bytes
    mem_type: str  # "DRAM" or "VRAM"
    descs: Sequence[Tuple[int, int, int]]  # (address, length, device id) per buffer; PackedDescs when packed
    mem_types: Tuple[str, ...] = ()
    extra_md: Tuple[bytes, ...] = ()
    # The producer packed the buffers into one registered block at the offsets a consumer's landing block uses
    # (``padded_offsets``), starting at descs[0]: a consumer without targets READs it whole, one descriptor.
    packed: bool = False

    def __post_init__(self) -> None:
        if not self.mem_types:
            object.__setattr__(self, "mem_types", (self.mem_type,) * len(self.descs))

    def __reduce__(self) -> Any:
        """Descriptors as one array of integers: a thousand tuples pickle to 60 KB, and cost that in time."""
        descs = self.descs
        cols = descs if isinstance(descs, PackedDescs) else array("Q", chain.from_iterable(descs)).tobytes()
        uniform = self.mem_types.count(self.mem_type) == len(self.mem_types)
        types = b"" if uniform else bytes(_MEM_CODES[t] for t in self.mem_types)  # b"": all are mem_type
        return (_load_info, (self.agent, self.agent_md, self.mem_type, cols, types, self.extra_md, self.packed))


def _load_info(agent: str, agent_md: bytes, mem_type: str, cols: Union[bytes, PackedDescs], types: bytes,
               extra_md: Tuple[bytes, ...], packed: bool) -> NixlInfo:
    if isinstance(cols, PackedDescs):
        descs: Sequence[Tuple[int, int, int]] = cols
    else:
        a = array("Q")
        a.frombytes(cols)
        v = a.tolist()
        descs = tuple(zip(v[0::3], v[1::3], v[2::3]))
    return NixlInfo(agent, agent_md, mem_type, descs, tuple(_MEM_NAMES[c] for c in types), extra_md, packed)


K = TypeVar("K", bound=Hashable)


def group_by_mem_type(types: Sequence[K]) -> List[Tuple[K, List[int]]]:
    """Buffer indices per memory type (or any key, e.g. a (local, remote) pair), in order of first appearance:
    NIXL takes one memory type per registration and per descriptor list."""
    groups: Dict[K, List[int]] = {}
    for i, t in enumerate(types):
        groups.setdefault(t, []).append(i)
    return list(groups.items())


def mem_type_of(buf: torch.Tensor) -> str:
    """NIXL's memory type for one buffer."""
    return "VRAM" if buf.device.type == "cuda" else "DRAM"


def encode_info(info: NixlInfo) -> bytes:
    """Binary form for control replies (no pickle)."""
    name = info.agent.encode()
    out = [struct.pack("!H", len(name)), name, struct.pack("!I", len(info.agent_md)), info.agent_md,
           info.mem_type.encode()[:4].ljust(4, b" "), struct.pack("!I", len(info.descs))]
    out += [struct.pack("!QQI", a, n, d) for a, n, d in info.descs]
    out.append(bytes(_MEM_CODES[t] for t in info.mem_types))
    out.append(struct.pack("!H", len(info.extra_md)))
    out += [struct.pack("!I", len(md)) + md for md in info.extra_md]
    out.append(b"\x01" if info.packed else b"\x00")
    return b"".join(out)


def decode_info(data: bytes) -> NixlInfo:
    """Parse :func:`encode_info`; raises ValueError on malformed input."""
    try:
        off = 0
        (n,) = struct.unpack_from("!H", data, off)
        off += 2
        name = data[off:off + n].decode()
        off += n
        (m,) = struct.unpack_from("!I", data, off)
        off += 4
        md = data[off:off + m]
        off += m
        mem = data[off:off + 4].decode().strip()
        off += 4
        (k,) = struct.unpack_from("!I", data, off)
        off += 4
        descs = []
        for _ in range(k):
            descs.append(struct.unpack_from("!QQI", data, off))
            off += 20
        codes = data[off:off + k]
        off += k
        (n_extra,) = struct.unpack_from("!H", data, off)
        off += 2
        extra = []
        for _ in range(n_extra):
            (x,) = struct.unpack_from("!I", data, off)
            off += 4
            extra.append(data[off:off + x])
            off += x
        (flags,) = struct.unpack_from("!B", data, off)
        off += 1
    except (struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"malformed NIXL info: {e}") from e
    if (mem not in ("DRAM", "VRAM") or len(md) != m or len(codes) != k or any(c not in _MEM_NAMES for c in codes)
            or off > len(data) or flags > 1):
        raise ValueError("malformed NIXL info")
    return NixlInfo(name, md, mem, tuple(descs), tuple(_MEM_NAMES[c] for c in codes), tuple(extra), bool(flags))
