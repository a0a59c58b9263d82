"""Driver-side helpers: groups for collective transports, stats, and per-process configuration."""

from __future__ import annotations

import uuid
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import rdt_transports
from rdt_transports import GroupHandle

from ..errors import CollectiveTimeoutError, InvalidArgumentError, PeerUnavailableError


def create_collective_group(actors: Sequence[Any], backend: str = "gloo", name: Optional[str] = None, *,
                            timeout: float = rdt_transports.DEFAULT_TIMEOUT_S) -> GroupHandle:
    """Put ``actors`` in a collective group so refs between them move over ``backend``; returns its handle."""
    return rdt_transports.create_collective_group(
        actors, backend=backend, group_name=name or f"rdt-{uuid.uuid4().hex[:12]}", timeout=timeout
    )


def destroy_collective_group(group: GroupHandle, *, timeout: float = rdt_transports.DEFAULT_TIMEOUT_S) -> None:
    """Destroy a group made by :func:`create_collective_group` on all its live members."""
    if not isinstance(group, GroupHandle):
        raise InvalidArgumentError(f"expected the handle create_collective_group returned, got {group!r}",
                                   hint="pass the GroupHandle that rdt.create_collective_group returned")
    group.destroy(timeout=timeout)


def _local_stats(_actor: Any = None) -> Dict[str, Any]:
    from .._process.context import get_context
    from .._process.stats import local_stats

    return local_stats(get_context())


def _empty_stats() -> Dict[str, Any]:
    """What a process that never loaded rdt holds: nothing, in the shape this process's stats() has (every key,
    every count zero, no transfers), so that code reading a nested key works for any actor."""

    def zero(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: zero(x) for k, x in v.items()}
        return 0 if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    out = zero(_local_stats())
    out["transfers"], out["paths"] = {}, {}
    return out


def stats(actor: Any = None, *, timeout: float = 30.0) -> Dict[str, Any]:
    """Objects and bytes held, objects freed, transfers in/out per transport: of ``actor``, or of this process.

    ``actor``'s numbers come from its rdt control server (its address and a stats-only key are in the GCS), so
    this never waits for the actor's running method. An actor that never loaded rdt has published nothing and
    has nothing to report: its stats are all zero, and it is not called.
    """
    if actor is None:
        return _local_stats()
    import ray

    if not isinstance(actor, ray.actor.ActorHandle):
        raise InvalidArgumentError(f"stats() takes an actor handle or None, got {type(actor).__name__}",
                                   hint="pass a handle returned by Cls.remote(), or nothing for this process")
    return _remote_stats(actor._actor_id.hex(), timeout)


def _raise_if_dead(actor_id: str) -> None:
    """Ray's ActorDiedError when the GCS says the actor is dead (what an actor call would have raised)."""
    import ray

    try:
        state = ray._private.state.actors(actor_id=actor_id).get("State")
    except Exception:  # noqa: BLE001 - unknown: not proof of death
        return
    if state == "DEAD":
        raise ray.exceptions.ActorDiedError()


def _remote_stats(actor_id: str, timeout: float) -> Dict[str, Any]:
    """Ask the actor's control server for its stats (REQ_STATS, signed with its published stats key)."""
    import json

    import ray.experimental.internal_kv as kv

    from .._control import wire as _control
    from .._process.context import get_context
    from .._process.stats import KV_NAMESPACE, stats_kv_key

    raw = kv._internal_kv_get(stats_kv_key(actor_id), namespace=KV_NAMESPACE)
    if raw is None:
        _raise_if_dead(actor_id)
        return _empty_stats()
    try:
        record = json.loads(raw)
        address, key = str(record["address"]), bytes.fromhex(record["key"])
    except (ValueError, KeyError, TypeError) as e:
        raise PeerUnavailableError(f"actor {actor_id[:12]}'s published control record is malformed: {e}",
                                   hint="restart the actor (it publishes a fresh record when it loads rdt)") from e
    try:
        resp_type, body = get_context().client.request(address, _control.REQ_STATS, _control.KEY_STATS, key, b"",
                                                       timeout)
    except ConnectionRefusedError as e:
        if kv._internal_kv_get(stats_kv_key(actor_id), namespace=KV_NAMESPACE) == raw:
            kv._internal_kv_del(stats_kv_key(actor_id), namespace=KV_NAMESPACE)  # a dead process's record
        _raise_if_dead(actor_id)
        raise PeerUnavailableError(f"actor {actor_id[:12]} (rdt control server {address}) is gone: {e}",
                                   hint="the actor died; restart it") from e
    except TimeoutError as e:
        raise CollectiveTimeoutError(f"actor {actor_id[:12]} did not report its stats within {timeout:.1f}s",
                                     op="stats", hint="the actor's process may be stuck; raise timeout=") from e
    except (OSError, _control.ProtocolError) as e:
        raise PeerUnavailableError(f"asking actor {actor_id[:12]} for its stats failed: {e}", op="stats") from e
    if resp_type != _control.RESP_OK:
        raise PeerUnavailableError(f"actor {actor_id[:12]} refused its stats: {body[2:].decode(errors='replace')}",
                                   op="stats")
    return json.loads(body.decode())


def configure(*, transfer_timeout: Optional[float] = None, inline_threshold: Optional[int] = None,
              pool_bytes: Optional[int] = None, shm_cma: Optional[bool] = None, shm_map: Optional[bool] = None,
              relay: Optional[bool] = None, relay_min_bytes: Optional[int] = None,
              relay_stall_timeout: Optional[float] = None,
              range_costs: Optional[Mapping[str, Tuple[float, float]]] = None) -> None:
    """Change this process's settings (call inside an actor for that actor; env vars set them cluster-wide).

    ``shm_map``: whether this consumer maps a same-node producer's tensors that live in shared memory
    (``model.share_memory()``) and keeps them mapped across syncs, instead of a direct read of each object.

    ``relay``/``relay_min_bytes``: whether consumers of one gloo object are chained (each forwards to the next, so
    the producer sends it about once), and from what size; a consumer and its producer both have to allow it.
    ``relay_stall_timeout``: seconds (times its place in the chain) a chained consumer waits for a chunk from the
    consumer before it, then asks the producer.

    ``range_costs``: ``{transport: (seconds per range, bytes per second)}`` of its range reads, overriding what the
    transport declares; sharded loads made after it read a strided slice as one covering range where that is
    cheaper (``rdt-bench --suites sharded-sync`` measures them)."""
    from .._process.context import get_context

    ctx = get_context()
    changes: Dict[str, Any] = {}
    if transfer_timeout is not None:
        if isinstance(transfer_timeout, bool) or not isinstance(transfer_timeout, (int, float)) \
                or not transfer_timeout > 0:
            raise InvalidArgumentError(f"transfer_timeout must be a number of seconds > 0, got {transfer_timeout!r}",
                                       hint="pass e.g. rdt.configure(transfer_timeout=120.0)")
        changes["transfer_timeout"] = float(transfer_timeout)
    if inline_threshold is not None:
        if isinstance(inline_threshold, bool) or not isinstance(inline_threshold, int) or inline_threshold < 0:
            raise InvalidArgumentError(f"inline_threshold must be an int >= 0 (bytes), got {inline_threshold!r}",
                                       hint="pass e.g. rdt.configure(inline_threshold=0) to never inline")
        changes["inline_threshold"] = int(inline_threshold)
    if pool_bytes is not None:
        if isinstance(pool_bytes, bool) or not isinstance(pool_bytes, int) or pool_bytes < 0:
            raise InvalidArgumentError(f"pool_bytes must be an int >= 0 (bytes), got {pool_bytes!r}",
                                       hint="pass e.g. rdt.configure(pool_bytes=0) to keep no idle memory for reuse")
        changes["pool_bytes"] = int(pool_bytes)
    if shm_cma is not None:
        if not isinstance(shm_cma, bool):
            raise InvalidArgumentError(f"shm_cma must be True or False, got {shm_cma!r}",
                                       hint="pass rdt.configure(shm_cma=False) to move shm objects through segments")
        changes["shm_cma"] = shm_cma
    if shm_map is not None:
        if not isinstance(shm_map, bool):
            raise InvalidArgumentError(f"shm_map must be True or False, got {shm_map!r}",
                                       hint="pass rdt.configure(shm_map=False) to read shared weights directly instead")
        changes["shm_map"] = shm_map
    if relay is not None:
        if not isinstance(relay, bool):
            raise InvalidArgumentError(f"relay must be True or False, got {relay!r}",
                                       hint="pass rdt.configure(relay=False) to serve every consumer from the producer")
        changes["relay"] = relay
    if relay_min_bytes is not None:
        if isinstance(relay_min_bytes, bool) or not isinstance(relay_min_bytes, int) or relay_min_bytes < 0:
            raise InvalidArgumentError(f"relay_min_bytes must be an int >= 0 (bytes), got {relay_min_bytes!r}",
                                       hint="pass e.g. rdt.configure(relay_min_bytes=16 << 20)")
        changes["relay_min_bytes"] = relay_min_bytes
    if relay_stall_timeout is not None:
        if isinstance(relay_stall_timeout, bool) or not isinstance(relay_stall_timeout, (int, float)) \
                or not relay_stall_timeout > 0:
            raise InvalidArgumentError(f"relay_stall_timeout must be a number of seconds > 0, got "
                                       f"{relay_stall_timeout!r}", hint="pass e.g. rdt.configure(relay_stall_timeout=5.0)")
        changes["relay_stall_timeout"] = float(relay_stall_timeout)
    if range_costs is not None:
        ok = isinstance(range_costs, Mapping) and all(
            isinstance(k, str) and isinstance(v, (tuple, list)) and len(v) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in v)
            for k, v in range_costs.items())
        if not ok:
            raise InvalidArgumentError(f"range_costs must map transport names to (seconds per range, bytes per "
                                       f"second), both > 0; got {range_costs!r}",
                                       hint='pass e.g. rdt.configure(range_costs={"nixl": (5e-6, 3e9)})')
        changes["range_costs"] = {k: (float(v[0]), float(v[1])) for k, v in range_costs.items()}
    ctx.configure(ctx.config.updated(**changes))  # the pools take a new pool_bytes at once
