"""The producer's side: ``rdt.put_shards`` publishes this rank's local shards with their global layout, and the
driver gathers every rank's :class:`Shards` into a :class:`Manifest` (no central server: it is a list)."""

from __future__ import annotations

import hashlib
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import ray
import torch
import torch.distributed as dist

from .._objects.dtensor import is_dtensor, local_layout
from .._objects.meta import ObjectMeta
from .._process.context import State, get_context
from .._producer.produce import check_timeout, check_transport, produce
from ..errors import InvalidArgumentError, ProducerDiedError, TransferTimeoutError
from . import delta as _delta
from .devices import shards_device
from .layout import Box, Layout, box_of, intersect, volume


@dataclass(frozen=True)
class ParamInfo:
    """One published parameter: its dtype, global shape and the box this rank holds."""

    name: str
    dtype: str
    global_shape: Tuple[int, ...]
    box: Box


class Shards:
    """What one producer rank published for one version: its parameters' layouts and the rdt object holding the
    local shards. Small and picklable; pickling it anywhere never fetches the tensors (they move only when a
    :class:`~rdt.WeightLoader` pulls the ranges it needs). Holding it keeps the shards alive in the producer.
    ``kept_bytes``: the bytes of the copy this publication keeps (``keep_versions``), 0 when it reads the live
    weights."""

    def __init__(self, rank: int, version: int, params: Tuple[ParamInfo, ...], meta: Any,
                 kept_bytes: int = 0, source: str = "", layout_key: Optional[bytes] = None,
                 lineage: Optional[bytes] = None, deltas: Tuple[Any, ...] = ()) -> None:
        self.rank = rank
        # delta=True: the stream's token (a loader that landed a version of it may load the next one as changes)
        # and the changes of its newest versions, oldest first, the last one leading to this version
        self.lineage = lineage
        self.deltas: Tuple[_delta.Delta, ...] = tuple(deltas)
        self.source = source or f"producer rank {rank}"  # how errors name where the bytes come from
        self.version = version
        self.params = params
        self.meta = meta  # ObjectMeta of {name: local shard}, or None when there was nothing to hold
        self.kept_bytes = kept_bytes
        # A digest of every parameter's name, dtype, global shape and box: made where the shards are published and
        # carried along (a consumer deserializes hundreds of parameters every step).
        self.layout_key = layout_key or hashlib.blake2b(repr(params).encode(), digest_size=16).digest()

    def fence(self, *, timeout: float = 60.0) -> None:
        """In the producer, before updating the published weights in place: no new reader of this version is let
        in, and this waits until the readers in flight are done; from then on a reader gets VersionGoneError.
        A kept copy (``keep_versions``) is not fenced. FenceTimeoutError names the readers still in flight after
        ``timeout`` (the version is gone all the same: they fail rather than return bytes of the update)."""
        seconds = check_timeout(timeout)
        if self.meta is None:
            return
        ctx = get_context()
        if not ctx.is_me(self.meta.producer):
            raise InvalidArgumentError(
                f"{self!r} was published by another process (pid {self.meta.producer.pid}); a fence runs where the "
                "weights are", hint="call shards.fence() in the trainer actor that called rdt.put_shards")
        _newest().drop(self)
        ctx.versions.fence(self.meta.obj_id, self.rank, self.version, 60.0 if seconds is None else seconds)

    def __reduce__(self) -> Any:
        meta = None if self.meta is None else self.meta.__dict__.copy()
        return (_load_shards, (self.rank, self.version, self.params, meta, self.kept_bytes, self.source,
                               self.layout_key, self.lineage, self.deltas))

    def __repr__(self) -> str:
        return f"Shards(rank={self.rank}, version={self.version}, {len(self.params)} params)"


def _load_shards(rank: int, version: int, params: Tuple[ParamInfo, ...], meta_state: Optional[dict],
                 kept_bytes: int = 0, source: str = "", layout_key: Optional[bytes] = None,
                 lineage: Optional[bytes] = None, deltas: Tuple[Any, ...] = ()) -> Shards:
    """Unpickle without handing the metadata to rdt's consumer (which would fetch the shards whole)."""
    meta = None
    if meta_state is not None:
        meta = ObjectMeta.__new__(ObjectMeta)
        object.__setattr__(meta, "__dict__", meta_state)
    return Shards(rank, version, params, meta, kept_bytes, source, layout_key, lineage, deltas)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _plain_layout(name: str, t: torch.Tensor, layout: Any) -> Tuple[torch.Tensor, Tuple[int, ...], Tuple[int, ...]]:
    if not isinstance(layout, Layout):
        raise InvalidArgumentError(
            f"parameter {name!r} is a plain tensor without a layout (got {type(layout).__name__})",
            hint=f"pass layouts={{{name!r}: rdt.Layout(global_shape, start)}} (rdt.Layout.whole(t.shape) for a "
            "tensor every rank holds whole), or publish a DTensor")
    shape = tuple(int(s) for s in layout.global_shape)
    start = tuple(int(s) for s in layout.start) if layout.start is not None else (0,) * len(shape)
    if len(shape) != t.dim() or len(start) != t.dim():
        raise InvalidArgumentError(f"parameter {name!r}: layout {layout} has {len(shape)} dimensions, the tensor "
                                   f"{t.dim()}", hint="give the global shape and start with one entry per dimension")
    if any(s < 0 or s + n > g for s, n, g in zip(start, t.shape, shape)):
        raise InvalidArgumentError(f"parameter {name!r}: a {tuple(t.shape)} shard at {start} does not fit the "
                                   f"global shape {shape}", hint="check the layout's start and global shape")
    return t, shape, start


def put_shards(state: Mapping[str, Any], *, version: int, layouts: Optional[Mapping[str, Layout]] = None,
               rank: Optional[int] = None, tensor_transport: str = "auto",
               timeout: Optional[float] = None, keep_versions: int = 0, delta: bool = False,
               delta_versions: int = 4) -> Shards:
    """Inside an actor: publish this rank's local shards of ``state`` ({name: DTensor or plain tensor}) as
    ``version``. A DTensor's layout is read from its placements (``Shard(d)``, ``Replicate``, uneven last shards;
    ``Partial`` is refused, ``_StridedShard`` unless this rank's shard is proven to be one box); a plain tensor
    needs ``layouts[name]``. The shards are CPU tensors, or CUDA tensors of one device. Returns the
    :class:`Shards` the driver gathers into a :class:`Manifest`. A non-contiguous local shard is published as a
    contiguous copy.

    By default the publication reads the live weights: call ``shards.fence()`` before updating them in place
    (publishing another version of the same parameters from this rank without one makes the older version gone).
    ``keep_versions=N`` publishes a copy instead and keeps the copies of this rank's newest N such versions
    readable while the weights change (N x the shard, ``Shards.kept_bytes``).

    ``delta=True`` also publishes what changed since this rank's last publication of the same parameters (compared
    bitwise with a copy of the bytes it published then, kept here: 1 x the shard), so that a loader that landed that
    version reads only the changes in its slices; the changes of the newest ``delta_versions`` versions are kept
    (a loader further behind applies each in turn). The full shards are published as without it (live, or a copy
    with ``keep_versions``). The first publication of a stream, or one after a publication without ``delta``, has
    no changes to offer. A changed layout or dtype since the last publication is refused (publish once without
    ``delta`` to start again). See docs/weight-sync.md, "Deltas"."""
    transport = check_transport(tensor_transport)
    seconds = check_timeout(timeout)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise InvalidArgumentError(f"version must be an int >= 0, got {version!r}", hint="pass version=step")
    if isinstance(keep_versions, bool) or not isinstance(keep_versions, int) or keep_versions < 0:
        raise InvalidArgumentError(f"keep_versions must be an int >= 0, got {keep_versions!r}",
                                   hint="pass keep_versions=2 to keep copies of the newest two versions")
    if not isinstance(delta, bool):
        raise InvalidArgumentError(f"delta must be True or False, got {delta!r}", hint="pass delta=True")
    if isinstance(delta_versions, bool) or not isinstance(delta_versions, int) or not 1 <= delta_versions <= 64:
        raise InvalidArgumentError(f"delta_versions must be an int in [1, 64], got {delta_versions!r}",
                                   hint="pass delta_versions=4 to keep the changes of the newest four versions")
    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        raise InvalidArgumentError("put_shards takes a mapping of parameter names to tensors",
                                   hint="pass model.state_dict() or {name: tensor}")
    layouts = dict(layouts or {})
    unknown = sorted(set(layouts) - set(state))
    if unknown:
        raise InvalidArgumentError(f"layouts name parameters not in the state: {unknown[:5]}",
                                   hint="give a layout for each plain tensor you publish")
    locals_: Dict[str, torch.Tensor] = {}
    params: List[ParamInfo] = []
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise InvalidArgumentError(f"parameter {name!r} is a {type(value).__name__}, not a tensor",
                                       hint="publish tensors only")
        if is_dtensor(value):
            local, shape, start = local_layout(name, value)
        else:
            local, shape, start = _plain_layout(name, value, layouts.get(name))
        local = local.detach()
        locals_[name] = local if local.is_contiguous() else local.contiguous()
        params.append(ParamInfo(name, _dtype_name(local.dtype), shape, box_of(start, local.shape)))
    device = shards_device(locals_, transport)  # CPU or one CUDA device, moved by the transport
    if delta and device is not None and device.type != "cpu":
        raise InvalidArgumentError(f"delta=True publishes CPU shards for now, and these are on {device}",
                                   hint="publish without delta=True (loads are then full), or publish CPU shards")
    rank = _rank(rank)
    stream = (rank, tuple(p.name for p in params))
    streams = _streams()
    previous = streams.get(stream) if delta else None
    if previous is not None:
        _check_same_layout(previous, tuple(params), version)  # before a byte moves
    shards = publish_local(locals_, tuple(params), rank=rank, version=version, transport=transport, timeout=seconds,
                           keep_versions=keep_versions, stream=stream)
    if delta:
        _publish_delta(streams, stream, previous, shards, [locals_[p.name] for p in params], transport, seconds,
                       delta_versions)
    else:
        streams.drop(stream)  # a publication without delta ends the stream's changes
        get_context().versions.set_base(stream, 0)
    if shards.meta is not None:
        _newest().put(stream, shards)
    return shards


def _check_same_layout(previous: "_delta.Stream", params: Tuple[ParamInfo, ...], version: int) -> None:
    """delta=True: the parameters keep their dtype, global shape and box, and versions go forward."""
    for old, new in zip(previous.params, params):
        if old.dtype != new.dtype:
            raise InvalidArgumentError(
                f"delta=True: parameter {new.name!r} is {new.dtype} now, it was {old.dtype} in version "
                f"{previous.version}; changes between dtypes mean nothing, nothing was published",
                hint="publish this version without delta=True (a full publication), then deltas again")
        if old != new:
            raise InvalidArgumentError(
                f"delta=True: parameter {new.name!r} changed its layout since version {previous.version} (global "
                f"shape {old.global_shape} -> {new.global_shape}, this rank's box {list(old.box)} -> "
                f"{list(new.box)}); nothing was published",
                hint="publish this version without delta=True (a full publication), then deltas again")
    if version < previous.version:
        raise InvalidArgumentError(f"delta=True: version {version} is older than version {previous.version} this "
                                   "rank published last; nothing was published",
                                   hint="versions of a delta stream go forward (pass version=step)")


def _publish_delta(streams: "_delta.Streams", stream: Any, previous: Optional["_delta.Stream"], shards: Shards,
                   tensors: List[torch.Tensor], transport: str, timeout: Optional[float], keep: int) -> None:
    """Encode what changed since the stream's last publication, publish it (kept for ``keep`` versions) and carry
    the chain in ``shards``; the first publication of a stream keeps its base copy only."""
    versions = get_context().versions
    if previous is None:
        previous = _delta.Stream(_delta.new_lineage(), shards.params, shards.version, [t.clone() for t in tensors])
        for gone in streams.put(stream, previous):  # the stats count only the base copies still held
            versions.set_base(gone, 0)
        versions.set_base(stream, previous.base_bytes)
        shards.lineage = previous.lineage
        return
    if shards.version == previous.version:  # the same version again (e.g. over another transport): its changes
        shards.lineage, shards.deltas = previous.lineage, tuple(previous.kept.values())
        return
    try:  # the base copy is brought to these bytes as they are compared: a failure ends the stream
        enc = _delta.encode(tensors, previous.base, update=True)
        delta = publish_changes(enc, previous.version, shards.version, previous.lineage, shards.rank, transport,
                                timeout, keep, ("delta", stream), f"changes of producer rank {shards.rank}")
    except BaseException:
        streams.drop(stream)
        versions.set_base(stream, 0)
        raise
    previous.version = shards.version
    previous.kept[shards.version] = delta
    while len(previous.kept) > keep:
        previous.kept.popitem(last=False)
    shards.lineage = previous.lineage
    shards.deltas = tuple(previous.kept.values())


def publish_changes(enc: "_delta.Encoded", base: int, version: int, lineage: bytes, rank: int, transport: str,
                    timeout: Optional[float], keep: int, stream: Any, source: str) -> "_delta.Delta":
    """Publish encoded changes (their records: one rdt object, kept for ``keep`` versions of ``stream`` and never
    copied again) as the :class:`~rdt._sharded.delta.Delta` from ``base`` to ``version``."""
    meta = None
    nbytes = 0
    if enc.records is not None:
        nbytes = enc.records.numel()
        meta = _publish({"records": enc.records}, transport, timeout, False)
        if meta is not None:
            get_context().versions.publish(meta.obj_id, stream, rank, version, max(meta.nbytes, 1), keep,
                                           changes=True)
    return _delta.Delta(base, version, lineage, meta, *enc.columns, nbytes=nbytes)


def publish_local(tensors: Dict[str, torch.Tensor], params: Tuple[ParamInfo, ...], *, rank: int, version: int,
                  transport: str, timeout: Optional[float], keep_versions: int, stream: Any,
                  source: str = "") -> Shards:
    """Keep ``tensors`` here as one rdt object and record the publication (its version, in ``stream``) with this
    process's version table, so that readers register with it and a fence waits for them."""
    meta = _publish(tensors, transport, timeout, keep_versions > 0)
    kept = meta.nbytes if meta is not None and keep_versions else 0
    if meta is not None:
        get_context().versions.publish(meta.obj_id, stream, rank, version, kept, keep_versions)
    return Shards(rank, version, params, meta, kept, source)


def _publish(tensors: Dict[str, torch.Tensor], transport: str, timeout: Optional[float], copy: bool) -> Any:
    try:
        in_actor = ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 - not connected: not in an actor
        in_actor = False
    if not in_actor:
        raise InvalidArgumentError("rdt.put_shards must be called inside an actor (the shards stay in it)",
                                   hint="call it in the trainer actor's method and return the Shards it gives")
    out = produce(get_context(), tensors, transport, snapshot=copy, timeout=timeout)
    return out if isinstance(out, ObjectMeta) else None


def _rank(rank: Optional[int]) -> int:
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise InvalidArgumentError(f"rank must be an int >= 0, got {rank!r}", hint="pass rank=dist.get_rank()")
        return rank
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    raise InvalidArgumentError("put_shards needs rank= (no torch.distributed process group here to read it from)",
                               hint="pass rank=<this trainer's rank>")


class _Newest(State):
    """This process's newest publication per stream (rank and parameter names) that the process still holds (the
    trainer keeps its Shards to fence them): what ``Manifest.newest`` hands out. Weak: it never keeps a publication
    alive; a fenced one is dropped. Bounded; held by the process context (none in a forked child)."""

    MAX_STREAMS = 1024

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_stream: "OrderedDict[Any, weakref.ref]" = OrderedDict()

    def put(self, stream: Any, shards: Shards) -> None:
        with self._lock:
            self._by_stream[stream] = weakref.ref(shards)
            self._by_stream.move_to_end(stream)
            while len(self._by_stream) > self.MAX_STREAMS:
                self._by_stream.popitem(last=False)

    def drop(self, shards: Shards) -> None:
        with self._lock:
            for stream in [k for k, v in self._by_stream.items() if v() is shards or v() is None]:
                del self._by_stream[stream]

    def all(self) -> List[Shards]:
        with self._lock:
            held = [(k, v()) for k, v in self._by_stream.items()]
            for k, _ in (kv for kv in held if kv[1] is None):
                del self._by_stream[k]
        return [s for _, s in held if s is not None]

    def close(self) -> None:
        with self._lock:
            self._by_stream.clear()


class _Checked(State):
    """The manifest layouts this process found consistent (bounded, least recently used out first): a consumer
    that deserializes the manifest of every version checks an unchanged layout once."""

    MAX = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: "OrderedDict[Any, None]" = OrderedDict()

    def has(self, key: Any) -> bool:
        with self._lock:
            if key in self._keys:
                self._keys.move_to_end(key)
                return True
            return False

    def add(self, key: Any) -> None:
        with self._lock:
            self._keys[key] = None
            while len(self._keys) > self.MAX:
                self._keys.popitem(last=False)

    def close(self) -> None:
        with self._lock:
            self._keys.clear()


def _checked() -> _Checked:
    return get_context().transport_state("sharded-checked", _Checked)


def _newest() -> _Newest:
    return get_context().transport_state("sharded-newest", _Newest)


def _streams() -> "_delta.Streams":
    return get_context().transport_state("sharded-delta", _delta.Streams)


def _newest_here(_actor: Any) -> List[Shards]:
    """Run in a producer actor through Ray: its newest publications (one per stream)."""
    return _newest().all()


class Manifest:
    """Every producer rank's :class:`Shards` of one version: what the driver hands to consumers. Checked when made:
    one version, one rank per publication, each parameter's dtype and global shape agreeing, and its boxes either
    equal (replicas) or disjoint and covering it whole."""

    def __init__(self, shards: Sequence[Shards]) -> None:
        shards = list(shards)
        if not shards or not all(isinstance(s, Shards) for s in shards):
            raise InvalidArgumentError("a Manifest is made of the Shards every producer rank published",
                                       hint="rdt.Manifest(ray.get([t.publish.remote(step) for t in trainers]))")
        versions = sorted({s.version for s in shards})
        if len(versions) > 1:
            by = {v: [s.rank for s in shards if s.version == v] for v in versions}
            raise InvalidArgumentError(f"the manifest mixes versions: {by} (version: ranks)",
                                       hint="gather the Shards of one version from every rank")
        ranks = [s.rank for s in shards]
        if len(set(ranks)) != len(ranks):
            raise InvalidArgumentError(f"two publications claim the same rank: {sorted(ranks)}",
                                       hint="give each producer rank its own rank=")
        self.shards = sorted(shards, key=lambda s: s.rank)
        self.version = versions[0]
        self.layout_key = tuple((s.rank, s.layout_key) for s in self.shards)
        self.holders: Dict[str, List[Tuple[Shards, ParamInfo]]] = {}
        for s in self.shards:
            for p in s.params:
                self.holders.setdefault(p.name, []).append((s, p))
        checked = _checked()
        if not checked.has(self.layout_key):  # the check depends on the layout alone: once per layout here
            for name, held in self.holders.items():
                _check_cover(name, held)
            checked.add(self.layout_key)

    @staticmethod
    def newest(producers: Sequence[Any], *, timeout: float = 30.0) -> "Manifest":
        """The manifest of the newest version that every producer actor (trainer rank) has published and still holds
        (as it does to fence it), asked of the actors through Ray: for a consumer that pulls the newest weights when
        it is ready rather than the version the driver hands it. While the ranks disagree (one has published version N + 1, another not yet) it asks
        again, until ``timeout``: then TransferTimeoutError names each rank's newest version."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise InvalidArgumentError(f"timeout must be a number of seconds > 0, got {timeout!r}",
                                       hint="pass e.g. timeout=30.0")
        actors = list(producers)
        if not actors:
            raise InvalidArgumentError("Manifest.newest needs the producer actors", hint="pass the trainer actors")
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = ray.get([a.__ray_call__.remote(_newest_here) for a in actors],  # each ask: >= 1 s
                              timeout=max(deadline - time.monotonic(), 1.0))
            except ray.exceptions.GetTimeoutError as e:
                raise TransferTimeoutError(f"the producer actors did not say their newest version within {timeout}s",
                                           hint="a trainer rank may be stuck in a long method (its calls run one "
                                                "at a time); raise timeout=") from e
            except ray.exceptions.RayActorError as e:
                raise ProducerDiedError(f"a producer actor died while asked for its newest version: {e}",
                                        hint="restart the trainer rank and publish again") from e
            newest = [max((s.version for s in mine), default=None) for mine in got]
            if None not in newest and len(set(newest)) == 1:
                return Manifest([s for mine in got for s in mine if s.version == newest[0]])
            if time.monotonic() >= deadline:
                raise TransferTimeoutError(
                    "the producer actors' newest versions disagree: "
                    + ", ".join(f"actor {i}: {'none published' if v is None else v}" for i, v in enumerate(newest)),
                    hint="every rank publishes each version (rdt.put_shards); raise timeout= to wait for the slow "
                         "ones, or load the manifest the driver gathers")
            time.sleep(0.05)

    def __reduce__(self) -> Any:
        return (Manifest, (self.shards,))

    def __repr__(self) -> str:
        return f"Manifest(version={self.version}, ranks={[s.rank for s in self.shards]}, {len(self.holders)} params)"


def _check_cover(name: str, held: List[Tuple[Shards, ParamInfo]]) -> None:
    """One dtype and global shape; distinct boxes disjoint and covering the whole parameter."""
    first = held[0][1]
    for s, p in held[1:]:
        if (p.dtype, p.global_shape) != (first.dtype, first.global_shape):
            raise InvalidArgumentError(
                f"parameter {name!r}: rank {held[0][0].rank} publishes {first.dtype} {first.global_shape}, rank "
                f"{s.rank} {p.dtype} {p.global_shape}", hint="every rank must publish the same global parameter")
    boxes: Dict[Box, int] = {}
    for s, p in held:
        boxes.setdefault(p.box, s.rank)
    distinct = list(boxes.items())
    for i, (a, ra) in enumerate(distinct):
        for b, rb in distinct[i + 1:]:
            if intersect(a, b) is not None:
                raise InvalidArgumentError(
                    f"parameter {name!r}: the shards of rank {ra} {list(a)} and rank {rb} {list(b)} overlap without "
                    "being equal", hint="shards must be disjoint (or identical replicas); check the layouts")
    whole = 1
    for n in first.global_shape:
        whole *= n
    if sum(volume(b) for b in boxes) != whole:
        raise InvalidArgumentError(
            f"parameter {name!r}: the ranks' shards cover {sum(volume(b) for b in boxes)} of its {whole} elements "
            f"(global shape {first.global_shape})", hint="every element must be published by some rank; a rank is "
            "missing from the manifest or a layout is wrong")
