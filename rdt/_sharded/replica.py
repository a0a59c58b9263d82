"""Fan-out between replicas. A loader that landed a version offers its targets (read live, no copy) as a
:class:`Replica`; loaders with the same wants (the data-parallel replicas of an engine rank) load from it instead of
from the trainer ranks, so each slice crosses a trainer's link once however many replicas want it. The sharing
loader fences that version before its next load lands a byte, as a trainer fences before an in-place update."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .._producer.produce import check_transport
from ..errors import InvalidArgumentError
from .layout import Region, box_of
from . import delta as _delta
from .publish import Manifest, ParamInfo, Shards, _dtype_name, publish_changes, publish_local

OFFERED_CHANGES = 4  # versions of changes a sharer keeps for its replicas


class Replica:
    """The version one loader holds, offered to loaders with the same wants: ``other.load(replica)``. Small and
    picklable like :class:`Shards`; holding it keeps the offer alive in the sharing process (until its next load
    fences it: a load after that raises VersionGoneError)."""

    def __init__(self, shards: Shards, signature: bytes) -> None:
        self.shards = shards
        self.signature = signature  # of the wants: a loader with other wants is refused before any byte moves
        self.manifest = Manifest([shards])

    @property
    def version(self) -> int:
        """The version of the trainer's weights the replica holds."""
        return self.shards.version

    def __reduce__(self) -> Any:
        return (Replica, (self.shards, self.signature))

    def __repr__(self) -> str:
        return f"Replica(version={self.version}, {len(self.shards.params)} targets, {self.shards.source})"


def signature(wants: Sequence[Any]) -> bytes:
    """What must agree between a replica and a loader reading it: every want's regions, dim, shape and dtype."""
    text = repr([(w.regions, w.dim, tuple(w.target.shape), str(w.target.dtype)) for w in wants])
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def key(index: int, name: str) -> str:
    """The name a target is offered under (its position keeps names unique)."""
    return f"{index}:{name}"


def offer(wants: Sequence[Any], version: int, transport: str, stream: bytes, who: str,
          changes: Optional[Tuple[int, Dict[int, Optional[List[np.ndarray]]]]] = None,
          offered: "Optional[OrderedDict[int, Any]]" = None) -> Replica:
    """Publish ``wants``' targets as they are (no copy) as ``version`` of this loader's stream. ``changes`` (the
    version held before and, per want, the element positions the last load wrote; None: unknown) are offered too,
    so that a replica holding that version of this stream loads them alone; ``offered`` keeps the newest
    OFFERED_CHANGES of them (a replica further behind applies each)."""
    transport = check_transport(transport)
    tensors = {key(i, w.name): w.target for i, w in enumerate(wants)}
    params = tuple(ParamInfo(k, _dtype_name(t.dtype), tuple(t.shape), box_of((0,) * t.dim(), t.shape))
                   for k, t in tensors.items())
    shards = publish_local(tensors, params, rank=0, version=version, transport=transport, timeout=None,
                           keep_versions=0, stream=("replica", stream), source=f"replica {who}")
    if offered is not None:
        if changes is None or shards.meta is None:
            offered.clear()
        else:
            base, written = changes
            empty = np.zeros(0, np.int64)
            positions = [None if written.get(i, ()) is None else np.unique(np.concatenate(written[i]))
                         if written.get(i) else empty for i in range(len(wants))]
            enc = _delta.encode_positions([w.target for w in wants], positions)
            offered[version] = publish_changes(enc, base, version, stream, 0, transport, None, OFFERED_CHANGES,
                                               ("replica-delta", stream), f"changes offered by replica {who}")
            while len(offered) > OFFERED_CHANGES:
                offered.popitem(last=False)
        shards.lineage = stream
        shards.deltas = tuple(offered.values())
    return Replica(shards, signature(wants))


def mirror(wants: Sequence[Any], replica: Replica) -> List[Tuple[str, torch.Tensor, Region]]:
    """(name, target, region) of the wants that read ``replica``: each target whole from the same target of the
    sharing loader. Refused before any byte moves when this loader's wants differ from the replica's."""
    check(signature(wants), len(wants), replica)
    return [(w.name, w.target, Region(key(i, w.name))) for i, w in enumerate(wants)]


def check(sig: bytes, count: int, replica: Any) -> None:
    """Refuse a replica whose loader's wants differ from this loader's (``sig``, ``count``)."""
    if not isinstance(replica, Replica):
        raise InvalidArgumentError(f"expected an rdt.Replica, got {type(replica).__name__}",
                                   hint="pass what loader.share() returned in the replica that loaded first")
    if sig != replica.signature or count != len(replica.shards.params):
        raise InvalidArgumentError(
            f"this loader's {count} wants differ from those of {replica!r} (regions, dims, shapes or dtypes)",
            hint="load a replica only from a loader with the same want() calls in the same order (the same engine "
                 "rank of another data-parallel replica); load the manifest otherwise")
