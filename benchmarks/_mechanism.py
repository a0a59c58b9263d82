"""What actually served a case: mechanism labels, read at run time from inside the benchmark's actors, and which
labels may be compared as like for like.

A label names the data path (``gloo``, ``shm-allreduce``, ``cma``, ``inline``, ``object_store (fallback)``...); its
*class* is the family of mechanisms that move bytes the same way (loopback TCP through Gloo, same-node shared
memory, Ray's object store...). Two rows are compared as like for like only when their classes are equal; anything
else is reported as a cross-mechanism comparison. This module imports neither Ray nor torch (``--compare`` uses it).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Iterable, Mapping, Optional

# label (or its prefix before "-p2p/" or " (") -> class
_CLASSES: Mapping[str, str] = {
    "gloo": "gloo", "ray-rdt": "gloo", "nixl": "nixl", "ucx": "ucx", "nccl": "nccl",
    "shm-allreduce": "shm", "cma": "shm", "shm-map": "shm", "shm-segment": "shm", "shm": "shm",
    "inline": "inline", "object_store": "object_store", "cuda_ipc": "cuda_ipc", "shm-direct": "shm",
}
UNKNOWN = "?"


def mechanism_class(label: Optional[str]) -> str:
    """The family of ``label`` ('gloo-p2p/ring' -> 'gloo', 'cma' -> 'shm', 'object_store (fallback)' ->
    'object_store'); the label itself when unknown, '?' when missing."""
    if not label:
        return UNKNOWN
    base = label.split(" (", 1)[0].split("-p2p/", 1)[0].removeprefix("whole:")  # whole:<path>: fetched by <path>
    if base.startswith("ray-rdt"):
        base = "ray-rdt"
    return _CLASSES.get(base, base)


def comparable(a: Optional[str], b: Optional[str]) -> bool:
    """Whether rows served by ``a`` and ``b`` measure the same kind of data path (same class, both known)."""
    ca, cb = mechanism_class(a), mechanism_class(b)
    return ca == cb and ca != UNKNOWN


def describe_pair(a: Optional[str], b: Optional[str]) -> str:
    """'gloo vs gloo' or 'shm-allreduce vs gloo (cross-mechanism)'."""
    text = f"{a or UNKNOWN} vs {b or UNKNOWN}"
    return text if comparable(a, b) else text + " (cross-mechanism)"


# ---------------------------------------------------------------------- collectives (run inside an actor)
def rdt_collective_mechanism(group_name: str, op: str, nbytes: int, algorithm: str) -> str:
    """In a group member: the path rdt_transports takes for ``op`` of ``nbytes`` in ``group_name``.

    p2p: the backend's name, with the transport it chose where it tells ('ucx (shm/cma)', 'ucx (tcp)'), per size
    where that differs ('nixl (rdt cma x2)': rdt copied the bytes itself).
    allreduce: 'shm-allreduce' when the Gloo backend's same-node shared-memory allreduce is set up (and the size
    is at or above its threshold), the backend's name for another native allreduce, and '<backend>-p2p/<algorithm>'
    for an algorithm over point to point (``auto`` resolved as the group resolves it).
    """
    import rdt_transports as rt

    group = rt.get_group(group_name)
    backend = group.backend_name
    if op == "p2p":
        by_size = getattr(group.backend, "p2p_label", None)  # nixl: 'rdt cma x2' for large same-node messages
        transports = getattr(group.backend, "transports", None)  # ucx: what UCX chose, e.g. 'ucx (shm/cma)'
        chosen = by_size(nbytes) if callable(by_size) else transports() if callable(transports) else ""
        return f"{backend} ({chosen})" if chosen else backend
    algo = algorithm
    if algo == "auto":
        resolve = getattr(group, "_algorithm", None)
        try:
            algo = resolve(op, "auto", nbytes) if resolve is not None else "auto"
        except Exception:  # noqa: BLE001 - an unknown resolution is reported as such, not guessed
            algo = "auto"
    if algo != "native":
        return f"{backend}-p2p/{algo}"
    native = group.backend.native()
    shm = getattr(native, "shm", None)
    threshold = getattr(sys.modules.get(type(native).__module__), "SHM_MIN_BYTES", 1)
    return "shm-allreduce" if shm is not None and nbytes >= threshold else backend


# ---------------------------------------------------------------------- objects
def transfers_in(stats: Mapping[str, Any]) -> Dict[str, int]:
    """rdt.stats() -> fetches served per path ('inline', 'shm', 'gloo', 'nixl', 'object_store', ...)."""
    return {k: int(v.get("in", 0)) for k, v in (stats.get("transfers") or {}).items()}


def segments_written(stats: Mapping[str, Any]) -> int:
    """rdt.stats() of a producer -> shm segments written so far (pool hits + misses)."""
    pool = stats.get("shm_pool") or {}
    return int(pool.get("hits", 0)) + int(pool.get("misses", 0))


def object_mechanism(requested: str, consumer_before: Mapping[str, Any], consumer_after: Mapping[str, Any],
                     producer_before: Mapping[str, Any], producer_after: Mapping[str, Any]) -> str:
    """The path(s) that served an rdt object case, from the consumer's and producer's rdt.stats() around it.

    The consumer's per-path fetch counters say which path served it; a 'shm' fetch is 'shm-segment' when the
    producer wrote segments meanwhile, 'shm-map' when every one was copied from mappings of the producer's shared
    storages, and 'cma' (a direct read of the producer's memory) otherwise; an
    'object_store' fetch for a transport that is not the object store is 'object_store (fallback)'. Several
    paths in one case are joined with '+', most used first.
    """
    before, after = transfers_in(consumer_before), transfers_in(consumer_after)
    used = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    used = {k: n for k, n in used.items() if n > 0}
    if not used:
        return UNKNOWN
    segs = segments_written(producer_after) - segments_written(producer_before)
    mapped = paths_in(consumer_after).get("shm-map", 0) - paths_in(consumer_before).get("shm-map", 0)
    labels = []
    for path, n in sorted(used.items(), key=lambda kv: -kv[1]):
        labels.append(_object_label(path, requested, segs, mapped >= n))
    return "+".join(labels)


def paths_in(stats: Mapping[str, Any]) -> Dict[str, int]:
    """rdt.stats() -> fetches by the exact path that served them ('shm-map', 'shm-direct', 'shm-segment', ...)."""
    return {k: int(v) for k, v in (stats.get("paths") or {}).items()}


def _object_label(path: str, requested: str, segments: int, mapped: bool = False) -> str:
    if path == "shm":
        if mapped:
            return "shm-map"  # copied from mappings of the producer's shared storages
        return "shm-segment" if segments > 0 else "cma"
    if path == "object_store" and requested != "object_store":
        return "object_store (fallback)"
    return path


def mechanisms_of(rows: Iterable[Mapping[str, Any]]) -> str:
    """The distinct mechanisms of some rows, in order ('inline+gloo' style joins kept), joined with ', '."""
    seen: Dict[str, None] = {}
    for r in rows:
        seen.setdefault(str(r.get("mechanism") or UNKNOWN), None)
    return ", ".join(seen)
