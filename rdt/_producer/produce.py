"""The producer role: keep a returned value's tensors in this process and return the metadata that stands for it.

Flatten the value, ask the chosen transport (or, for "auto", every transport of the chain) to export, record the
object in the table with a lifetime token, and build the :class:`ObjectMeta`. Transports are reached only through
the registry: this module names none of them.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any, List, Optional, Tuple

from .._objects import stream_ready as _ready
from .. import transports
from .._objects.flatten import Flattened, flatten
from .._objects.meta import ObjectMeta
from .._ray.hooks import add_out_of_scope_callback  # a private Ray API, checked when rdt is imported
from .._objects.table import Entry
from ..errors import InvalidArgumentError, UnsupportedError

logger = logging.getLogger("rdt")


def check_transport(transport: Any) -> str:
    """A transport name this process knows and that may be named (built in, or registered by the user)."""
    name = transport.lower() if isinstance(transport, str) else None
    known = transports.explicit_names()
    if name not in known:
        raise InvalidArgumentError(
            f"unknown tensor_transport {transport!r}", hint="use one of " + ", ".join(repr(t) for t in known)
            + " (or register yours with rdt.register_transport in every process that makes or reads its objects)"
        )
    return name


def check_timeout(timeout: Optional[float]) -> Optional[float]:
    """A producer-side timeout: a positive number of seconds, or None for the consumer's transfer_timeout."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise InvalidArgumentError(f"timeout must be a positive number of seconds, got {timeout!r}",
                                   hint="pass e.g. timeout=30.0, or None for the consumer's transfer_timeout")
    return None if timeout is None else float(timeout)


def produce(ctx: Any, value: Any, transport: str, *, snapshot: bool = False, timeout: Optional[float] = None,
            ipc_map: bool = False) -> Any:
    """Keep ``value``'s tensors here and return the metadata that stands for it (``value`` itself if it has none)."""
    flat = flatten(value)
    if not flat.specs:
        return value  # nothing to keep out of band
    if snapshot:  # before anything reads an address: every export describes the copies
        flat = flat.cloned()
    chosen = None if transport == "auto" else transports.get(transport)
    if chosen is not None:
        check_devices(flat, chosen.capabilities)
    info = ctx.producer_info()
    entry = Entry(secrets.token_bytes(16), flat, transport)
    # Once per object, on the streams current at return: every export and serve waits on it before reading bytes.
    needs_event = flat.table.device_types & ctx.stream_discipline.device_types
    entry.ready = _ready.record(ctx.stream_discipline, flat.buffers) if needs_event else None
    if ipc_map:
        entry.options["ipc_map"] = True
    for carrier in transports.self_contained():
        desc = carrier.export(ctx, entry, transport)
        if desc is not None:
            # Nothing is held here; a weak entry lets the producer get its very own leaves back. No actor handle
            # inside: such an object is never served through the actor, and pickling a handle costs ~0.1 ms on
            # each side of every round trip.
            ctx.table.add_weak(entry.obj_id, flat.leaves)
            return ObjectMeta(entry.obj_id, transport, ctx.inline_producer(info), flat.skeleton, flat.specs,
                              flat.table, (), None, ((carrier.name, desc),), timeout)
    exports = _export(ctx, entry, transport, chosen)
    ctx.table.add(entry)
    token = ctx.tokens().take()
    if not add_out_of_scope_callback(token, lambda _id, oid=entry.obj_id: ctx.on_out_of_scope(oid)):
        logger.warning("rdt: could not watch the lifetime of %s; it will be freed at exit", entry.obj_id.hex())
    return ObjectMeta(entry.obj_id, transport, info, flat.skeleton, flat.specs, flat.table,
                      tuple(ctx.groups()), token, exports, timeout)


def _export(ctx: Any, entry: Entry, transport: str, chosen: Optional[transports.Transport]
            ) -> Tuple[Tuple[str, Any], ...]:
    """(name, descriptor) from the chosen transport, or from every transport of auto's chain that fits."""
    if chosen is not None:
        desc = chosen.export(ctx, entry, transport)
        return () if desc is None else ((chosen.name, desc),)
    devices = entry.flat.table.device_types
    out: List[Tuple[str, Any]] = []
    for t in transports.auto_chain():
        if not t.capabilities.carries(devices):
            continue
        try:
            desc = t.export(ctx, entry, transport)
        except Exception as e:  # noqa: BLE001 - under auto an export is an extra path, never a reason to fail
            logger.debug("rdt: transport %s did not export %s: %s", t.name, entry.obj_id.hex(), e)
            continue
        if desc is not None:
            out.append((t.name, desc))
    return tuple(out)


def check_devices(flat: Flattened, caps: transports.Capabilities) -> None:
    """Refuse at return an object the transport cannot carry (a device it does not move, or mixed devices)."""
    devices = flat.table.device_types
    if caps.carries(devices):
        return
    if len(devices) > 1 and devices <= caps.devices:
        raise UnsupportedError(
            f"transport {caps.name!r} moves one device type per object, but the value holds {sorted(devices)} "
            "tensors", hint="return the CPU and GPU parts from separate methods, or use tensor_transport='auto'")
    others = ", ".join(repr(t) for t in _transports_for(devices)) or "'auto'"
    raise UnsupportedError(
        f"transport {caps.name!r} moves {'/'.join(_NAMES.get(d, d) for d in sorted(caps.devices))} tensors only, "
        f"but the value holds "
        f"{sorted(devices)} tensors",
        hint=f"use tensor_transport={others} for these tensors, or move them (.cpu() / .cuda())",
    )


_NAMES = {"cpu": "CPU", "cuda": "CUDA"}


def _transports_for(devices: frozenset) -> List[str]:
    names = [n for n in transports.names() if n != "auto"]
    return [n for n in names if transports.get(n).capabilities.explicit
            and transports.get(n).capabilities.carries(devices)]
