"""One trainer rank's part of a sharded load, run on a reading thread: its registration, then either a full read of
its runs or, when the targets hold an older version of its stream, the changes since (``delta``), checked when
asked; and the ends of registrations after a failure."""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .._consumer import jobs
from .._consumer.ranges import Landed, RangeRead, fetch_ranges, itemsize, readers, sources
from ..errors import ChecksumMismatchError, GroupDestroyedError, ObjectFreedError, VersionGoneError
from . import delta as _delta, register, verify as _verify
from .plan import Plan
from .publish import Shards


def register_all(ctx: Any, sources: List[Shards], deadline: float, optional: Sequence[int] = ()) -> List[Optional[bytes]]:
    """Register a read with every source at once (a version gone or a rank dead fails here, before any byte moves);
    per source the reader's token, None for an ``optional`` one that refused (its version gone: the caller reads
    otherwise). After any other failure, or a caller that stops waiting, every registration made, or made later,
    is ended, so that no fence waits for it."""
    made: Dict[int, bytes] = {}
    lock = threading.Lock()
    gave_up = threading.Event()
    maybe = set(optional)

    def one(i: int) -> None:
        try:
            token = register.begin(ctx, sources[i], deadline)
        except (VersionGoneError, ObjectFreedError):
            if i in maybe:
                return
            raise
        with lock:
            if not gave_up.is_set():
                made[i] = token
                return
        register.end_quietly(ctx, sources[i], token)

    try:
        results = jobs.run_all(readers(ctx), [jobs.Job(ctx, functools.partial(one, i), (), "a registration")
                                              for i in range(len(sources))], deadline)
        raise_first([r for r in results if isinstance(r, BaseException)])
    except BaseException as e:
        with lock:
            gave_up.set()
            begun = [(sources[i], t) for i, t in made.items()]
        if isinstance(e, Exception):
            end_all(ctx, begun)
        else:  # an interrupt: leave at once, the ends run behind
            readers(ctx).submit(end_all, ctx, begun)
        raise
    return [made.get(i) for i in range(len(sources))]


def end_all(ctx: Any, begun: List[Tuple[Shards, bytes]]) -> None:
    """End registrations after a failure (bounded: half a second in all)."""
    by = time.monotonic() + 0.5
    for shards, token in begun:
        register.end_quietly(ctx, shards, token, max(by - time.monotonic(), 1e-3))


@dataclass
class RankRead:
    """What one rank's read did: what landed, bytes checked and the check's seconds, whether the version held;
    for a delta load the versions of changes applied, the elements they wrote and the wanted elements, the
    positions written per target (None: all of them), and why verify reloaded it in full."""

    landed: Landed
    checked: int
    seconds: float
    held: bool
    delta: Optional[int] = None
    changed: int = 0
    elements: int = 0
    changes: Optional[Dict[int, Optional[np.ndarray]]] = None
    repaired: str = ""


def read_rank(ctx: Any, shards: Shards, rr: RangeRead, reader: bytes, keep: List[torch.Tensor], addrs: Any,
               names: Optional[List[str]], deadline: float, after: Any = None) -> RankRead:
    """(a reading thread) Land one rank's runs, check them when asked, end the registration. A failure ends the
    registration and names the rank. The registration ends only once the road returned, which for device copies is
    once they finished on the device (``device_order``): the producer's fence, which waits for it, cannot race a
    copy still reading."""
    try:
        landed = fetch_ranges(ctx, shards.meta, rr, keep, addrs, deadline, after)
        checked, seconds = 0, 0.0
        if names is not None and landed.label != "whole:inline":  # inline: the bytes are the manifest's own
            t0 = time.monotonic()
            checked = _verify.check(ctx, shards, rr.runs, landed, keep, names, deadline)
            seconds = time.monotonic() - t0
    except BaseException as e:
        register.end_quietly(ctx, shards, reader)
        named = register.named(shards, e)
        if named is e:
            raise
        raise named from e
    return RankRead(landed, checked, seconds, register.end(ctx, shards, reader, max(deadline, time.monotonic() + 1.0)))


def delta_rank(ctx: Any, shards: Shards, rr: RangeRead, reader: bytes, dreg: List[Tuple[Shards, bytes]],
                chain: List[_delta.Delta], dread: _delta.DeltaRead, keep: List[torch.Tensor], addrs: Any,
                names: Optional[List[str]], deadline: float) -> RankRead:
    """(a reading thread) Land one rank's changes since the version the targets hold: each delta's records that
    its runs meet, scattered into the targets in order, and the parameters read whole from the full publication.
    With ``names`` (verify), every target byte of the rank is then checked against the producer's current slices;
    a mismatch (a target changed behind the loader's back) is repaired by a full read of the rank's runs, checked
    again. Ends every registration; a failure names the rank."""
    try:
        sizes = itemsizes(shards)
        moved = written = 0
        label = ""
        written_at: Dict[int, Optional[List[np.ndarray]]] = {}  # per target: positions written (None: all)
        stage = np.array([dread.staging.data_ptr()], np.uint64)
        for spans in dread.spans:
            got = fetch_ranges(ctx, spans.delta.meta, RangeRead(spans.runs), [dread.staging], stage, deadline)
            moved += got.moved
            label = label or got.label
            parts: Dict[int, List[np.ndarray]] = {}
            written += _delta.apply(dread, spans, keep, sizes, parts)
            for t, ps in parts.items():
                if written_at.get(t, []) is not None:
                    written_at.setdefault(t, []).extend(ps)
        whole = _delta.whole_runs(rr.runs, dread)
        if whole is not None:
            got = fetch_ranges(ctx, shards.meta, RangeRead(whole), keep, addrs, deadline)
            moved += got.moved
            label = label or got.label
            for t in np.unique(whole.target).tolist():
                written_at[t] = None
        changes: Optional[Dict[int, Optional[np.ndarray]]] = {
            t: None if ps is None else np.concatenate(ps) for t, ps in written_at.items()}
        buf, off = sources(rr, shards.meta)
        landed = Landed(label or "delta", moved, 0, buf, off)
        checked, seconds, repaired = 0, 0.0, ""
        if names is not None:
            t0 = time.monotonic()
            try:
                checked = _verify.check(ctx, shards, rr.runs, landed, keep, names, deadline)
            except ChecksumMismatchError as e:  # a target changed behind the loader's back: load the rank in full
                repaired = e.message
                full = fetch_ranges(ctx, shards.meta, rr, keep, addrs, deadline)
                landed = Landed(full.label, moved + full.moved, full.covered, buf, off)
                changes = None
                checked = _verify.check(ctx, shards, rr.runs, landed, keep, names, deadline)
            seconds = time.monotonic() - t0
        wanted = sum(lr.wanted for lr in dread.leaves.values())
        changed = _delta.changed_estimate(chain, dread, written)
    except BaseException as e:
        end_all(ctx, [(shards, reader)] + dreg)
        named = register.named(shards, e)
        if named is e:
            raise
        raise named from e
    held = register.end(ctx, shards, reader, max(deadline, time.monotonic() + 1.0))
    for d, token in dreg:
        held = register.end(ctx, d, token, max(deadline, time.monotonic() + 1.0)) and held
    return RankRead(landed, checked, seconds, held, None if repaired else len(chain), changed, wanted, changes,
                 repaired)


def chains(kind: str, lineage: Dict[Tuple[str, int], Tuple[bytes, int]], plan: Plan,
            by_rank: Dict[int, Shards]) -> Dict[int, List[_delta.Delta]]:
    """Per rank whose stream the targets hold an older version of, with every change since still kept: the
    changes to apply, oldest first."""
    out: Dict[int, List[_delta.Delta]] = {}
    for rank, _ in plan.reads:
        held = lineage.get((kind, rank))
        s = by_rank[rank]
        if held is None or s.lineage is None or held[0] != s.lineage or not s.deltas or held[1] >= s.version:
            continue
        ds = list(s.deltas)
        first = next((i for i, d in enumerate(ds) if d.base == held[1]), None)
        if first is None:
            continue
        chain = ds[first:]
        if chain[-1].version == s.version and all(a.version == b.base for a, b in zip(chain, chain[1:])) and \
                all(len(d.kinds) == len(s.params) for d in chain):
            out[rank] = chain
    return out


def delta_shards(shards: Shards, d: _delta.Delta) -> Shards:
    """The records object of one delta, as a registration sees it (its version, named after the rank)."""
    return Shards(shards.rank, d.version, (), d.meta,
                  source=f"{shards.source} (its changes from version {d.base} to {d.version})")


def itemsizes(shards: Shards) -> List[int]:
    """Bytes per element of each of the rank's parameters."""
    return [itemsize(p.dtype) for p in shards.params]


def raise_first(errors: List[BaseException]) -> None:
    """Raise a rank's own failure first: a group aborted by a sibling's timeout is its consequence."""
    if errors:
        raise next((e for e in errors if not isinstance(e, GroupDestroyedError)), errors[0])


def merge_changes(changes: Dict[int, Optional[List[np.ndarray]]],
                  got: Optional[Dict[int, Optional[np.ndarray]]]) -> Optional[Dict[int, Optional[List[np.ndarray]]]]:
    """Fold one rank's written positions per target into the load's (None: a rank loaded in full, so the load is
    not made of changes; a target's None: every element of it)."""
    if got is None:
        return None
    for t, pos in got.items():
        if pos is None or changes.get(t, []) is None:
            changes[t] = None
        else:
            changes.setdefault(t, []).append(pos)
    return changes
