"""The object layer's transport registry: name -> lazily imported transport, built in or registered by the user.

Built-in transports load on first use (NIXL, CUDA IPC and the group transports import optional packages). A user's
transport is registered with :func:`register_transport` in every process that produces or consumes its objects (a
module each actor imports, or Ray's ``worker_process_setup_hook``); a process that lacks it gets a typed error naming
the transport.
"""

from __future__ import annotations

import importlib
import threading
from typing import Dict, List, Optional, Sequence, Tuple, Type

from rdt_transports import _lifecycle

from .._control.wire import CORE_MESSAGES, USER_MESSAGES_FROM
from ..errors import InvalidArgumentError, UnsupportedError
from .base import Capabilities, Fetched, Ranges, Served, SetupFailed, Site, Transport, Unusable, device_types
from .receive import BlockViews, Targets, block_views, landing

_BUILTIN: Dict[str, Tuple[str, str]] = {  # in the order error messages list them
    "gloo": ("rdt.transports.group.transport", "GlooTransport"),
    "nccl": ("rdt.transports.group.transport", "NcclTransport"),
    "nixl": ("rdt.transports.nixl.transport", "NixlTransport"),
    "shm": ("rdt.transports.shm.transport", "ShmTransport"),
    "cuda_ipc": ("rdt.transports.cuda_ipc.transport", "CudaIpcTransport"),
    "object_store": ("rdt.transports.object_store", "ObjectStoreTransport"),
    "inline": ("rdt.transports.inline", "InlineTransport"),
    "ucx": ("rdt.transports.group.transport", "UcxTransport"),
}

_lock = threading.Lock()


def _new_lock_after_fork() -> None:
    """A forked child gets a fresh lock: another thread of the parent may have held it (importing a transport)."""
    global _lock
    _lock = threading.Lock()


_lifecycle.at_fork_child(_new_lock_after_fork)
_instances: Dict[str, Transport] = {}
_user: Dict[str, Transport] = {}


def names() -> Tuple[str, ...]:
    """Every transport name known in this process (built-in and registered), plus "auto"."""
    with _lock:
        return tuple(_BUILTIN) + tuple(n for n in _user if n not in _BUILTIN) + ("auto",)


def get(name: str) -> Transport:
    """The transport called ``name`` (imported on first use); a typed error when this process does not know it."""
    with _lock:
        found = _user.get(name) or _instances.get(name)
    if found is not None:
        return found
    spec = _BUILTIN.get(name)
    if spec is None:
        raise UnsupportedError(
            f"transport {name!r} is not registered in this process",
            hint="call rdt.register_transport(...) in every process that produces or consumes its objects (e.g. in "
            "a module each actor imports, or Ray's worker_process_setup_hook)",
        )
    cls: Type[Transport] = getattr(importlib.import_module(spec[0]), spec[1])
    with _lock:
        return _instances.setdefault(name, cls())


def known() -> List[Transport]:
    """Every transport this process knows, built-in (imported now) and registered, in the registry's order."""
    return [get(n) for n in names() if n != "auto"]


def explicit_names() -> Tuple[str, ...]:
    """What ``tensor_method(tensor_transport=...)`` accepts here: every transport that may be named, and "auto"."""
    return tuple(t.name for t in known() if t.capabilities.explicit) + ("auto",)


def served() -> Dict[int, Tuple[str, Served]]:
    """Every control message this process's transports serve: number -> (transport name, (handler, key ids))."""
    return _served(known())


def _served(transports: Sequence[Transport]) -> Dict[int, Tuple[str, Served]]:
    """The control messages ``transports`` serve; two handlers for one number (two transports', or a transport's and
    rdt's control channel's own) are refused, naming both. Transports sharing one handler (the group ones) serve it
    together."""
    out: Dict[int, Tuple[str, Served]] = {}
    for t in transports:
        for msg, handler in t.handlers().items():
            if msg in out and out[msg][1][0] == handler[0]:
                continue
            owner = "rdt's control channel" if msg in CORE_MESSAGES else \
                f"transport {out[msg][0]!r}" if msg in out else None
            if owner is not None:
                raise InvalidArgumentError(
                    f"transport {t.name!r} serves control message {msg}, which {owner} serves already",
                    hint=f"number a transport's own messages from {USER_MESSAGES_FROM} on, apart from every other "
                    "transport's")
            out[msg] = (t.name, handler)
    return out


def loaded() -> List[Transport]:
    """Transports already in use in this process (built-ins imported so far, and every registered one)."""
    with _lock:
        return list(_instances.values()) + [t for n, t in _user.items() if n not in _instances]


def auto_chain() -> List[Transport]:
    """Every transport ``auto`` may pick, in its order (lowest ``auto_priority`` first)."""
    chain = [get(n) for n in _BUILTIN]
    with _lock:
        chain += [t for n, t in _user.items() if n not in _BUILTIN]
    chain = [t for t in chain if t.capabilities.auto_priority is not None]
    return sorted(chain, key=lambda t: t.capabilities.auto_priority)  # type: ignore[arg-type, return-value]


def self_contained() -> List[Transport]:
    """Built-in transports whose descriptor carries the bytes (tried first at return: nothing is then held)."""
    return [t for t in (get(n) for n in _BUILTIN) if t.capabilities.self_contained]


def fallback() -> Transport:
    """The transport every process can use when the object's own does not fit here."""
    return next(t for t in (get(n) for n in _BUILTIN) if t.capabilities.universal)


def register_transport(transport: Transport) -> None:
    """Make a user's transport first class in this process: ``tensor_method`` accepts its name, ``auto`` may pick it.

    Register it in every process that produces or consumes its objects, before they are made.
    """
    if not isinstance(transport, Transport):
        raise InvalidArgumentError(f"register_transport takes a Transport instance, got {transport!r}",
                                   hint="subclass rdt.transports.Transport and pass an instance")
    caps = getattr(type(transport), "capabilities", None)
    if not isinstance(caps, Capabilities) or not caps.name or not isinstance(caps.name, str):
        raise InvalidArgumentError(f"{type(transport).__name__} declares no capabilities",
                                   hint="set the class attribute capabilities = rdt.transports.Capabilities(...)")
    if caps.name in _BUILTIN or caps.name == "auto":
        raise InvalidArgumentError(f"transport name {caps.name!r} is taken by a built-in transport",
                                   hint="give your transport another name")
    _served([t for t in known() if t.name != caps.name] + [transport])  # refuses a control message served twice
    with _lock:
        _user[caps.name] = transport


def unregister_transport(name: str) -> Optional[Transport]:
    """Forget a registered transport (objects made with it can no longer be fetched here)."""
    with _lock:
        return _user.pop(name, None)


__all__ = ["BlockViews", "block_views", "Capabilities", "Fetched", "Ranges", "SetupFailed", "Site", "Targets", "Transport",
           "Unusable", "auto_chain", "device_types", "landing", "fallback", "get", "loaded", "names",
           "register_transport", "self_contained", "unregister_transport"]
