"""Backend registry: name -> lazily imported class, so optional packages load only when a backend is chosen."""

from __future__ import annotations

import importlib
from typing import Dict, Tuple, Type

from ..errors import BackendUnavailableError, InvalidArgumentError
from .base import Backend, BackendConfig, NativeCollectives, Work

_BUILTIN: Dict[str, Tuple[str, str]] = {
    "gloo": ("rdt_transports.backends.gloo", "GlooBackend"),
    "nixl": ("rdt_transports.backends.nixl", "NixlBackend"),
    "ucx": ("rdt_transports.backends.ucx", "UcxBackend"),
    "nccl": ("rdt_transports.backends.nccl", "NcclBackend"),
    "tcp": ("rdt_transports.backends.tcp", "TcpBackend"),
}


def backend_names() -> Tuple[str, ...]:
    return tuple(_BUILTIN)


def backend_class(name: str) -> Type[Backend]:
    """The class for backend ``name``; typed errors for unknown names and missing packages."""
    if not isinstance(name, str) or name.lower() not in _BUILTIN:
        raise InvalidArgumentError(
            f"unknown backend {name!r}", hint="use one of " + ", ".join(repr(n) for n in _BUILTIN)
        )
    module, cls = _BUILTIN[name.lower()]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise BackendUnavailableError(
            f"backend {name!r} cannot be imported: {e}",
            hint=f"install its extra: pip install 'ray-direct-transport[{name}]'",
        ) from e
    return getattr(mod, cls)


__all__ = ["Backend", "BackendConfig", "NativeCollectives", "Work", "backend_class", "backend_names"]
