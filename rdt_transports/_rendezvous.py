"""Rendezvous through Ray's GCS key/value store: no fixed ports, no shared files.

Keys live under ``rdt/<group_uid>/`` in the ``rdt`` namespace, so two incarnations of a group with the same name
never see each other's keys. The GCS is reached through Ray's own authenticated channel, which is why the group
secret can be handed out here.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import List, Optional

import torch.distributed as dist

from .errors import CollectiveTimeoutError, RdtError

_NAMESPACE = "rdt"


def _kv():  # imported lazily so that rdt_transports imports without a Ray worker
    import ray.experimental.internal_kv as kv

    if not kv._internal_kv_initialized():
        raise RdtError(
            "Ray is not initialised in this process, so groups cannot rendezvous.",
            hint="call ray.init() (or run inside a Ray actor) before creating a group",
        )
    return kv


class Rendezvous:
    """Key/value exchange scoped to one group incarnation."""

    def __init__(self, group_uid: str, group_name: str = "") -> None:
        self.prefix = f"rdt/{group_uid}/"
        self.group_name = group_name or group_uid

    def put(self, key: str, value: bytes, overwrite: bool = True) -> bool:
        return bool(_kv()._internal_kv_put(self.prefix + key, value, overwrite, namespace=_NAMESPACE))

    def try_get(self, key: str) -> Optional[bytes]:
        return _kv()._internal_kv_get(self.prefix + key, namespace=_NAMESPACE)

    def get(self, key: str, timeout: float, what: str = "") -> bytes:
        """Poll until ``key`` exists; raise CollectiveTimeoutError naming what was awaited."""
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            value = self.try_get(key)
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                raise CollectiveTimeoutError(
                    f"rendezvous timed out after {timeout:.1f}s waiting for {what or key!r}",
                    group=self.group_name,
                    op="rendezvous",
                    hint="make sure every rank of the group calls init (or that create_collective_group got all "
                    "actors) within the timeout, and that no rank died",
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def delete(self, key: str) -> None:
        _kv()._internal_kv_del(self.prefix + key, namespace=_NAMESPACE)

    def clear(self) -> None:
        _kv()._internal_kv_del(self.prefix, del_by_prefix=True, namespace=_NAMESPACE)

    def keys(self) -> List[bytes]:
        return _kv()._internal_kv_list(self.prefix, namespace=_NAMESPACE)


def name_key(group_name: str) -> str:
    """Key (outside any incarnation) where an actor-initialised group publishes its current incarnation."""
    return f"rdt/name/{group_name}"


def publish_incarnation(group_name: str, record: bytes) -> None:
    _kv()._internal_kv_put(name_key(group_name), record, True, namespace=_NAMESPACE)


def read_incarnation(group_name: str) -> Optional[bytes]:
    return _kv()._internal_kv_get(name_key(group_name), namespace=_NAMESPACE)


def delete_incarnation(group_name: str, record: bytes) -> None:
    """Delete the name record only if it still points at our incarnation."""
    kv = _kv()
    if kv._internal_kv_get(name_key(group_name), namespace=_NAMESPACE) == record:
        kv._internal_kv_del(name_key(group_name), namespace=_NAMESPACE)


class RayKVStore(dist.Store):
    """A torch.distributed Store on top of :class:`Rendezvous`, used for Gloo's connection set-up."""

    def __init__(self, rendezvous: Rendezvous, timeout: float) -> None:
        super().__init__()
        self._rdv = rendezvous
        self._timeout = timeout

    def set(self, key: str, value) -> None:  # type: ignore[override]
        self._rdv.put("store/" + key, value if isinstance(value, bytes) else bytes(value, "utf-8") if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:  # type: ignore[override]
        return self._rdv.get("store/" + key, self._timeout, what=f"gloo store key {key!r}")

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        # Only used by torch for barrier-like counters during set-up; GCS has no atomic add, so emulate with
        # a per-caller key and a sum (safe because each rank adds under its own sub-key).
        import uuid

        self._rdv.put(f"store-add/{key}/{uuid.uuid4().hex}", str(amount).encode())
        total = 0
        for k in self._rdv.keys():
            if k.decode().startswith(self._rdv.prefix + f"store-add/{key}/"):
                total += int(self._rdv.try_get(k.decode()[len(self._rdv.prefix):]) or b"0")
        return total

    def compare_set(self, key: str, expected, desired) -> bytes:  # type: ignore[override]
        cur = self._rdv.try_get("store/" + key)
        exp = expected.encode() if isinstance(expected, str) else bytes(expected)
        des = desired.encode() if isinstance(desired, str) else bytes(desired)
        if (cur is None and not exp) or cur == exp:
            self._rdv.put("store/" + key, des)
            return des
        return cur if cur is not None else exp

    def check(self, keys: List[str]) -> bool:  # type: ignore[override]
        return all(self._rdv.try_get("store/" + k) is not None for k in keys)

    def wait(self, keys: List[str], timeout: Optional[timedelta] = None) -> None:  # type: ignore[override]
        seconds = timeout.total_seconds() if timeout else self._timeout
        for k in keys:
            self._rdv.get("store/" + k, seconds, what=f"gloo store key {k!r}")

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        self._rdv.delete("store/" + key)
        return True

    def num_keys(self) -> int:  # type: ignore[override]
        return len(self._rdv.keys())
